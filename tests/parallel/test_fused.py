"""The fused hot path (:mod:`boost_hf.parallel.fused`): exact gradients (fp64 gradcheck), equal to the
plain-op reference it replaces (fp32 and bf16 autocast), gradient slots that never change a result, and
weights read as one tensor whether they are stored together or apart; BTP's batched B GEMMs, whose consumers (RoPE,
the gated product) write their gradients into one buffer."""

import pytest
import torch

from boost_hf.parallel.fused import (
    STATISTICS_WIDTH,
    _down_reference,
    _scale_reference,
    batched_latent_linear,
    column_linear,
    down_projection,
    gated_product,
    latent_linear,
    scale_latents,
    split_latent,
    stacked_weight,
    weight_views,
)
from boost_hf.parallel.shared_storage import joined_rows, share_storage
from boost_hf.perf.op_counter import OpCounter
from ..tolerances import ONE_OPERATOR, assert_scaled_close

HIDDEN, EPS = 16, 1e-6


def _inputs(dtype, d_in=12, rank=4, count=3):
    torch.manual_seed(0)
    x = torch.randn(2, 3, d_in, dtype=dtype, requires_grad=True)
    gamma = (1 + 0.1 * torch.randn(d_in, dtype=dtype)).requires_grad_()
    factors = [torch.randn(rank, d_in, dtype=dtype, requires_grad=True) for _ in range(count)]
    return x, gamma, factors


def _normed(x, gamma, *factors, grouped):
    return scale_latents(down_projection(x, factors, gamma=gamma, statistics=True, grouped=grouped), HIDDEN, EPS)


def _normed_reference(x, gamma, *factors, grouped):
    return _scale_reference(HIDDEN, EPS, _down_reference(x, gamma, True, grouped, factors))


@pytest.mark.parametrize("grouped", [True, False])
def test_online_norm_projection_gradients_are_exact(grouped):
    x, gamma, factors = _inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda *t: _normed(*t, grouped=grouped), (x, gamma, *factors))


@pytest.mark.parametrize("grouped", [True, False])
def test_plain_down_projection_gradients_are_exact(grouped):
    x, _, factors = _inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda x, *f: down_projection(x, f, grouped=grouped), (x, *factors))


def test_online_norm_projection_is_rmsnorm_then_a():
    """``scale(reduce(down(x)))`` on one rank is ``A (gamma * x / rms(x))``: what the single-device model computes."""
    x, gamma, factors = _inputs(torch.float64, d_in=HIDDEN)
    (latents,) = _normed(x, gamma, *factors, grouped=True)
    normed = gamma * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    torch.testing.assert_close(latents, normed @ torch.cat(factors).T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("autocast", [False, True])
def test_fused_equals_reference(autocast):
    x, gamma, factors = _inputs(torch.float32)
    leaves = [x, gamma, *factors]
    twins = [t.detach().clone().requires_grad_() for t in leaves]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        fused = _normed(*leaves, grouped=True)[0]
        reference = _normed_reference(*twins, grouped=True)[0]
    assert fused.dtype == reference.dtype == (torch.bfloat16 if autocast else torch.float32)
    grad = torch.randn_like(fused)
    fused.backward(grad)
    reference.backward(grad)
    # bf16: one rounding of the output either way, gradients through bf16 GEMMs
    if autocast:
        torch.testing.assert_close(fused.float(), reference.float(), rtol=2e-2, atol=2e-2)
        for a, b in zip(leaves, twins):
            torch.testing.assert_close(a.grad, b.grad, rtol=2e-2, atol=2e-2)
        return
    assert_scaled_close(fused, reference, ONE_OPERATOR, "output")
    for name, a, b in zip(("x", "gamma", *(f"factor {i}" for i in range(len(factors)))), leaves, twins):
        assert_scaled_close(a.grad, b.grad, ONE_OPERATOR, name)


def test_statistics_ride_in_aligned_columns():
    x, gamma, factors = _inputs(torch.float32)
    (buffer,) = down_projection(x, factors, gamma=gamma, statistics=True)
    width = sum(a.shape[0] for a in factors)
    assert buffer.shape == (*x.shape[:-1], width + STATISTICS_WIDTH)
    assert (buffer.shape[-1] * buffer.element_size()) % 16 == 0
    torch.testing.assert_close(buffer[..., width], x.detach().pow(2).sum(-1))


def test_split_latent_gradients_written_in_place_and_exact():
    torch.manual_seed(0)
    latent = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(5, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]

    def outputs(latent, *weights):
        return tuple(latent_linear(part, w) for part, w in zip(split_latent(latent * 1.0, 3), weights))

    assert torch.autograd.gradcheck(outputs, (latent, *weights))


def test_split_latent_falls_back_when_a_hook_replaces_a_gradient():
    torch.manual_seed(0)
    latent = torch.randn(2, 3, 12, requires_grad=True)
    weights = [torch.randn(5, 4) for _ in range(3)]
    parts = split_latent(latent * 1.0, 3)
    parts[1].register_hook(lambda g: 2 * g)
    sum(latent_linear(p, w).sum() for p, w in zip(parts, weights)).backward()
    expected = torch.cat([torch.ones(2, 3, 5) @ w for w in weights], dim=-1)
    expected[..., 4:8] *= 2
    torch.testing.assert_close(latent.grad, expected)


# ------------------------------------------------------------------------- weights stored together
def _stored(count=3, rows=(5, 3, 3), cols=4, dtype=torch.float64, together=True):
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(r, cols, dtype=dtype)) for r in rows[:count]]
    if together:
        share_storage(params)
    return params


@pytest.mark.parametrize("together", [True, False])
def test_weight_views_gradients_are_exact(together):
    """B GEMMs of a group on one cast of their weights, gradients written into one buffer: exact either way."""
    torch.manual_seed(0)
    latent = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    weights = _stored(rows=(5, 3, 3), together=together)

    def outputs(latent, *weights):
        parts = split_latent(latent * 1.0, 3)
        return tuple(latent_linear(part, w) for part, w in zip(parts, weight_views(weights, torch.float64)))

    assert torch.autograd.gradcheck(outputs, (latent, *weights))


def test_weight_views_gradients_land_in_one_buffer():
    latent = torch.randn(2, 3, 12, requires_grad=True)
    weights = _stored(rows=(5, 3, 3), dtype=torch.float32)
    views = weight_views(weights, torch.float32)
    assert all(v.data_ptr() == w.data_ptr() for v, w in zip(views, weights))  # fp32, stored together: no copy
    sum(latent_linear(part, w).sum() for part, w in zip(split_latent(latent * 1.0, 3), views)).backward()
    assert joined_rows([w.grad for w in weights]) is not None


def test_weight_views_fall_back_when_a_hook_replaces_a_gradient():
    latent = torch.randn(2, 3, 12)
    weights = _stored(rows=(5, 3, 3), dtype=torch.float32)
    views = weight_views(weights, torch.float32)
    views[2].register_hook(lambda g: 3 * g)
    sum(latent_linear(part, w).sum() for part, w in zip(latent.chunk(3, dim=-1), views)).backward()
    for i, (w, part) in enumerate(zip(weights, latent.chunk(3, dim=-1))):
        expected = torch.ones(*part.shape[:-1], w.shape[0]).reshape(-1, w.shape[0]).t() @ part.reshape(-1, 4)
        torch.testing.assert_close(w.grad, expected * (3 if i == 2 else 1))


@pytest.mark.parametrize("together", [True, False])
def test_stacked_weight_is_the_parameters_themselves_or_their_concatenation(together):
    weights = _stored(rows=(5, 3, 3), dtype=torch.float32, together=together)
    stacked = stacked_weight(weights, torch.float32)
    assert torch.equal(stacked, torch.cat(weights))
    assert (stacked.data_ptr() == weights[0].data_ptr()) == together  # fp32 and stored together: no copy
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert stacked_weight(weights, torch.bfloat16).dtype == torch.bfloat16
    weights64 = _stored(rows=(5, 3, 3), together=together)
    x = torch.randn(4, 11, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda *w: stacked_weight(w, torch.float64) @ x, tuple(weights64))


@pytest.mark.parametrize("together", [True, False])
def test_online_norm_projection_exact_with_factors_stored_apart_or_together(together):
    x, gamma, _ = _inputs(torch.float64)
    factors = _stored(rows=(4, 4, 4), cols=12, together=together)
    assert torch.autograd.gradcheck(lambda *t: _normed(*t, grouped=True), (x, gamma, *factors))


@pytest.mark.parametrize("views", [False, True])
def test_weight_modified_in_place_before_backward_is_an_error(views):
    """The stacked fp32 weight is the parameters' storage: changing any of them between forward and backward
    raises, as it would for a GEMM on each weight."""
    weights = _stored(rows=(5, 3, 3), dtype=torch.float32)
    latent = torch.randn(2, 3, 12)
    if views:
        out = sum(latent_linear(p, w).sum() for p, w in zip(latent.chunk(3, -1), weight_views(weights, torch.float32)))
    else:
        out = (torch.randn(7, 4) @ stacked_weight(weights, torch.float32).t()).sum()
    with torch.no_grad():
        weights[2].mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_split_latent_slice_without_gradient_gets_zeros():
    latent = torch.randn(2, 3, 12, requires_grad=True)
    weights = [torch.randn(5, 4) for _ in range(3)]
    parts = split_latent(latent * 1.0, 3)
    (latent_linear(parts[0], weights[0]).sum() + (parts[2] * 2).sum()).backward()  # parts[1] unused
    expected = torch.cat([torch.ones(2, 3, 5) @ weights[0], torch.zeros(2, 3, 4), torch.full((2, 3, 4), 2.0)], dim=-1)
    torch.testing.assert_close(latent.grad, expected)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("together", [True, False])
def test_column_linear_gradients_are_exact(grouped, together):
    """q/k/v-style GEMMs sharing one input, on the group's weight views: exact, grouped or not, stored together or apart."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    weights = _stored(rows=(5, 3, 3), together=together)

    def outputs(x, *weights):
        views = weight_views(weights, torch.float64) if grouped else weights
        return tuple(out * 1.0 for out in column_linear(x, views, grouped=grouped))

    assert torch.autograd.gradcheck(outputs, (x, *weights))


def test_grouped_column_linear_runs_one_gemm_and_never_concatenates_the_output_gradients():
    x = torch.randn(2, 3, 4, requires_grad=True)
    weights = _stored(rows=(5, 3, 3), dtype=torch.float32)
    outputs = column_linear(x, weight_views(weights, torch.float32), grouped=True)
    assert [o.shape for o in outputs] == [(2, 3, 5), (2, 3, 3), (2, 3, 3)]
    assert outputs[0]._base is not None and all(o._base is outputs[0]._base for o in outputs)  # one GEMM's column blocks
    for out, w in zip(outputs, weights):
        torch.testing.assert_close(out, x @ w.t())
    loss = sum((out * (i + 2)).sum() for i, out in enumerate(outputs))
    with OpCounter() as backward:
        loss.backward()
    assert backward.ops_by_op["cat"] == 0, backward.ops_by_op
    assert joined_rows([w.grad for w in weights]) is not None  # written into the rows of one buffer
    for i, w in enumerate(weights):
        torch.testing.assert_close(w.grad, (i + 2) * torch.ones(6, w.shape[0]).t() @ x.detach().reshape(6, 4))
    expected = sum((i + 2) * torch.ones(2, 3, w.shape[0]) @ w.detach() for i, w in enumerate(weights))
    torch.testing.assert_close(x.grad, expected)


def _batched(latent, weights, dtype=torch.float64):
    return batched_latent_linear(latent * 1.0, weight_views(weights, dtype))


@pytest.mark.parametrize("together", [True, False])
def test_batched_latent_linear_gradients_are_exact(together):
    """The B's of a group as one batched GEMM: exact, with its outputs' gradients written into its buffer by the
    gated product and RoPE or copied in (anything else), the weights stored together or apart."""
    from boost_hf.parallel.rotary import apply_rotary

    torch.manual_seed(0)
    latent = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    weights = _stored(rows=(8, 8, 8), together=together)
    cos, sin = torch.randn(1, 5, 4, dtype=torch.float64), torch.randn(1, 5, 4, dtype=torch.float64)
    silu = torch.nn.SiLU()

    def attention_like(latent, *weights):
        q, k, v = _batched(latent, weights)
        q4, k4 = apply_rotary(q.view(2, 5, 2, 4), k.view(2, 5, 2, 4), cos, sin, slots=(q._stacked_slot, k._stacked_slot))
        return q4 * 1.0, k4 * 1.0, v * 1.0

    def mlp_like(latent, *weights):
        gate, up, other = _batched(latent, weights)
        return gated_product(gate, up, silu), gated_product(gate, up, None), other * 1.0

    assert torch.autograd.gradcheck(attention_like, (latent, *weights))
    assert torch.autograd.gradcheck(mlp_like, (latent, *weights))


def test_batched_latent_linear_is_one_gemm_each_way_and_stacks_nothing():
    """Forward: one ``bmm`` whose outputs are blocks of one tensor; RoPE rotates q and k in one pass; backward: one
    ``bmm`` for the latent's gradient and one for the weights' (into the rows of weight_views' buffer), q's and k's
    gradients written into the buffer by RoPE's backward, v's copied in (its one copy); no cat or stack."""
    from boost_hf.parallel.rotary import apply_rotary

    torch.manual_seed(0)
    latent = torch.randn(2, 5, 12, requires_grad=True)
    weights = _stored(rows=(8, 8, 8), dtype=torch.float32)
    cos, sin = torch.randn(1, 5, 4), torch.randn(1, 5, 4)
    with OpCounter() as forward:
        q, k, v = batched_latent_linear(latent * 1.0, weight_views(weights, torch.float32))
        q4, k4 = apply_rotary(q.view(2, 5, 2, 4), k.view(2, 5, 2, 4), cos, sin, slots=(q._stacked_slot, k._stacked_slot))
    assert q._base is not None and k._base is q._base and v._base is q._base
    assert forward.gemm_flops == 2 * 10 * 12 * 8 and forward.ops_by_op["mul"] == 2 and forward.ops_by_op["addcmul_"] == 2
    loss = (q4 * 2).sum() + (k4 * 3).sum() + (v * 4).sum()
    with OpCounter() as backward:
        loss.backward()
    assert backward.ops_by_op["cat"] == backward.ops_by_op["stack"] == 0, backward.ops_by_op
    assert backward.ops_by_op["copy_"] == 1, backward.ops_by_op  # v's gradient, from outside the buffer
    assert backward.ops_by_op["mul"] == 3 + 2 + 1, backward.ops_by_op  # the loss's 3, RoPE's 2 (into the buffer), `* 1.0`
    assert backward.gemm_flops == 2 * forward.gemm_flops  # the two bmm (no other GEMM)
    assert joined_rows([w.grad for w in weights]) is not None
    reference = latent.detach().clone().requires_grad_()
    references = [w.detach().clone().requires_grad_() for w in weights]
    rq, rk, rv = (torch.nn.functional.linear(part, w) for part, w in zip(reference.split(4, -1), references))
    rq4, rk4 = apply_rotary(rq.view(2, 5, 2, 4), rk.view(2, 5, 2, 4), cos, sin)
    ((rq4 * 2).sum() + (rk4 * 3).sum() + (rv * 4).sum()).backward()
    for got, expected in ((q4, rq4), (k4, rk4), (v, rv), (latent.grad, reference.grad),
                          *((w.grad, r.grad) for w, r in zip(weights, references))):
        assert_scaled_close(got, expected, ONE_OPERATOR, "batched B")


def test_batched_latent_linear_falls_back_when_a_hook_replaces_a_gradient():
    latent = torch.randn(2, 3, 8, requires_grad=True)
    weights = _stored(rows=(5, 5), dtype=torch.float32)
    gate, up = batched_latent_linear(latent * 1.0, weight_views(weights, torch.float32))
    up.register_hook(lambda g: 3 * g)
    gated_product(gate, up, None).sum().backward()
    reference = latent.detach().clone().requires_grad_()
    rgate, rup = (torch.nn.functional.linear(part, w.detach()) for part, w in zip(reference.split(4, -1), weights))
    rup.register_hook(lambda g: 3 * g)
    (rgate * rup).sum().backward()
    assert_scaled_close(latent.grad, reference.grad, ONE_OPERATOR, "latent gradient")
