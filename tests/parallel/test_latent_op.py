"""The online norm's latent scale fused with the latent activation (:mod:`boost_hf.parallel.latent_op`): exact
gradients (fp64 gradcheck), the function of the unfused path it replaces (scale, then the projection's latent
function), bf16 within bf16 rounding of fp32, one counted op each way, the compiled implementation (what CUDA runs)
equal to the eager one, and the BTP groups that use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from boost_hf.parallel.fused import STATISTICS_WIDTH, _scale_reference
from boost_hf.parallel.latent_op import _backward, _compiled, _forward, scale_activate
from boost_hf.perf.op_counter import OpCounter
from ..tolerances import ONE_OPERATOR, assert_scaled_close

HIDDEN, EPS, WIDTH = 48, 1e-6, 12
U = 2.0 ** -8  # bf16 rounding, relative (see tests/parallel/test_bf16_norms.py)
# the kernels on this machine's devices (`make gpu-check` runs the CUDA ones: the compiled implementation)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))]


def _buffer(dtype, rows=(2, 5)):
    """A reduced down-projection buffer ``[z | S | padding]`` with a positive sum of squares."""
    torch.manual_seed(0)
    z = torch.randn(*rows, WIDTH, dtype=torch.float64) * 3
    squares = torch.rand(*rows, 1, dtype=torch.float64) * HIDDEN * 4 + 1
    padding = torch.zeros(*rows, STATISTICS_WIDTH - 1, dtype=torch.float64)
    return torch.cat([z, squares, padding], dim=-1).to(dtype)


def _unfused(buffer, activation):
    """What the group ran before: the scale (:func:`~boost_hf.parallel.fused.scale_latents`' arithmetic), then the
    latent function."""
    (latent,) = _scale_reference(HIDDEN, EPS, (buffer,))
    return F.silu(latent) if activation == "silu" else latent


@pytest.mark.parametrize("activation", ["identity", "silu"])
def test_gradients_are_exact(activation):
    buffer = _buffer(torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda b: scale_activate(b, WIDTH, HIDDEN, EPS, activation), (buffer,))


@pytest.mark.parametrize("activation", ["identity", "silu"])
@pytest.mark.parametrize("device", DEVICES)
def test_equals_the_scale_then_the_latent_function(activation, device):
    """fp32: the forward bit for bit on the CPU (within fp32 rounding on CUDA, where inductor may fuse differently),
    the buffer's gradient (latents and statistics column) within fp32 rounding; the unused statistics columns
    (alignment only) get zeros."""
    buffer = _buffer(torch.float32).to(device).requires_grad_()
    twin = buffer.detach().clone().requires_grad_()
    fused, unfused = scale_activate(buffer, WIDTH, HIDDEN, EPS, activation), _unfused(twin, activation)
    if device == "cpu":
        assert torch.equal(fused, unfused)
    assert_scaled_close(fused, unfused, ONE_OPERATOR, "forward")
    grad = torch.randn_like(fused)
    (got,), (expected,) = torch.autograd.grad(fused, buffer, grad), torch.autograd.grad(unfused, twin, grad)
    assert_scaled_close(got[..., :WIDTH + 1], expected[..., :WIDTH + 1], ONE_OPERATOR, "gradient")
    assert not got[..., WIDTH + 1:].any()


@pytest.mark.parametrize("activation", ["identity", "silu"])
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_is_within_bf16_rounding_of_fp32(activation, device):
    """Computed in fp32 and rounded once: the output within ``U`` of the fp32 function of the same bf16 buffer; the
    gradient's latent columns within ``U`` of the fp32 gradient, its statistics column within ``U`` of the sum of the
    magnitudes of its terms (one rounding of ``grad``'s product is not involved: ``grad`` is read as it is)."""
    buffer = _buffer(torch.bfloat16)
    grad = torch.randn(*buffer.shape[:-1], WIDTH).to(torch.bfloat16)
    leaf = buffer.to(device).requires_grad_()
    out = scale_activate(leaf, WIDTH, HIDDEN, EPS, activation)
    (got,) = torch.autograd.grad(out, leaf, grad.to(device))
    assert out.dtype == got.dtype == torch.bfloat16
    out, got = out.cpu(), got.cpu()
    upcast = buffer.float().requires_grad_()
    reference = _forward(upcast, WIDTH, HIDDEN, EPS, activation)
    (expected,) = torch.autograd.grad(reference, upcast, grad.float())
    assert ((out.float() - reference).abs() <= U * reference.abs() * (1 + 1e-5) + 1e-30).all()
    latent_columns = (got.float() - expected)[..., :WIDTH].abs()
    assert (latent_columns <= U * expected[..., :WIDTH].abs() * (1 + 1e-4) + 1e-6).all()
    inverse_rms = torch.rsqrt(buffer[..., WIDTH:WIDTH + 1].float() / HIDDEN + EPS)
    terms = (grad.float().abs() * buffer[..., :WIDTH].float().abs()).sum(-1, keepdim=True) * inverse_rms.pow(3) / (2 * HIDDEN)
    assert ((got.float() - expected)[..., WIDTH:WIDTH + 1].abs() <= U * (expected[..., WIDTH:WIDTH + 1].abs() + terms)).all()


@pytest.mark.parametrize("op", ["scale_activate", "scale_activate_backward"])
def test_custom_ops_pass_opcheck(op):
    buffer = _buffer(torch.float32)
    args = {
        "scale_activate": (buffer.clone().requires_grad_(), WIDTH, HIDDEN, EPS, "silu"),
        "scale_activate_backward": (torch.randn(*buffer.shape[:-1], WIDTH), buffer, HIDDEN, EPS, "silu", torch.zeros_like(buffer)),
    }[op]
    torch.library.opcheck(getattr(torch.ops.boost_hf, op).default, args)


def test_counted_as_one_op_each_way():
    """Forward: the buffer read, the latents written; backward: the gradient and the buffer read, the buffer's
    gradient written (an argument the op writes in place, counted once)."""
    with FakeTensorMode():
        buffer = torch.empty(4, 8, WIDTH + STATISTICS_WIDTH, dtype=torch.bfloat16, requires_grad=True)
        with OpCounter() as forward:
            out = scale_activate(buffer, WIDTH, HIDDEN, EPS, "silu")
        with OpCounter() as backward:
            out.backward(torch.empty_like(out))
    assert forward.ops_by_op == {"scale_activate": 1}
    assert forward.bytes_by_op == {"scale_activate": 2 * (buffer.numel() + out.numel())}
    assert backward.ops_by_op == {"scale_activate_backward": 1}
    assert backward.bytes_by_op == {"scale_activate_backward": 2 * (out.numel() + 2 * buffer.numel())}


@pytest.mark.parametrize("activation", ["identity", "silu"])
def test_the_compiled_implementation_equals_the_eager_one(activation):
    """What CUDA runs (the arithmetic compiled by inductor), here compiled for the CPU: the same function."""
    buffer = _buffer(torch.float32)
    out = _compiled(_forward)(buffer, WIDTH, HIDDEN, EPS, activation)
    assert_scaled_close(out, _forward(buffer, WIDTH, HIDDEN, EPS, activation), ONE_OPERATOR, "forward")
    grad = torch.randn_like(out)
    got, expected = torch.full_like(buffer, float("nan")), torch.full_like(buffer, float("nan"))
    _compiled(_backward)(grad, buffer, HIDDEN, EPS, activation, got)
    _backward(grad, buffer, HIDDEN, EPS, activation, expected)
    assert_scaled_close(got, expected, ONE_OPERATOR, "gradient")
    assert expected[..., :WIDTH + 1].abs().min() > 0 and not expected[..., WIDTH + 1:].any()  # every column written


@pytest.mark.parametrize("activation", ["identity", "silu"])
def test_each_op_is_one_generated_kernel(activation):
    """What CUDA runs (the arithmetic compiled by inductor) is one Triton kernel each way, as inductor generates it on
    this machine (``tests/generated_kernels.py``: on the CPU, no GPU needed), at 7B TP4's q/k/v width in bf16. Before
    the backward was written over the buffer's whole width it generated 2 (a row-sum reduction, then a pointwise kernel
    for the scaled gradients and the statistics column: the first GPU run's 2 CUDA kernels, on torch 2.11)."""
    pytest.importorskip("triton")
    from ..generated_kernels import generated_triton_kernels

    rows, width = 64, 3072
    buffer = torch.randn(rows, width + STATISTICS_WIDTH, dtype=torch.bfloat16).abs_()
    grad = torch.randn(rows, width, dtype=torch.bfloat16)
    forward = generated_triton_kernels(_forward, buffer, width, HIDDEN, EPS, activation)
    backward = generated_triton_kernels(_backward, grad, buffer, HIDDEN, EPS, activation, torch.empty_like(buffer))
    assert len(forward) == 1 and len(backward) == 1, (forward, backward)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("activation", ["identity", "silu"])
def test_each_op_is_one_generated_kernel_on_cuda(activation):
    """What the counters count as one op is one CUDA kernel (after the first call, which compiles): forward, and
    backward (the row sums, the scaled gradients and the zeroed columns in one pass)."""
    rows, width = 2048, 3072
    buffer = torch.randn(rows, width + STATISTICS_WIDTH, device="cuda", dtype=torch.bfloat16).abs_()
    grad = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    grad_buffer = torch.empty_like(buffer)
    forward = lambda: torch.ops.boost_hf.scale_activate(buffer, width, HIDDEN, EPS, activation)  # noqa: E731
    backward = lambda: torch.ops.boost_hf.scale_activate_backward(grad, buffer, HIDDEN, EPS, activation, grad_buffer)  # noqa: E731
    for op in (forward, backward):
        op()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            op()
            torch.cuda.synchronize()
        kernels = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        assert len(kernels) == 1, kernels


@pytest.mark.parametrize("variant, fused", [("cola", True), ("svd", True), ("lax-dense", False)])
def test_btp_groups_with_the_online_norm_run_it(make_config, variant, fused):
    """Under BTP at tp 2 (fake process group), q/k/v and gate/up run the fused scale when their latent function is
    SiLU (CoLA) or none (SVD); LaX crosses its latents in between and keeps the separate scale."""
    from boost_hf import BoostLlamaForCausalLM, ParallelConfig
    from boost_hf.perf.rank_cost import fake_process_group

    with fake_process_group(2):
        model = BoostLlamaForCausalLM(make_config(variant), parallel_config=ParallelConfig(tp_size=2, tp_style="btp"))
        with FakeTensorMode(allow_non_fake_inputs=True), OpCounter() as ops:
            ids = torch.zeros(2, 8, dtype=torch.long)
            model(ids, labels=ids, use_cache=False).loss.backward()
    layers = model.config.num_hidden_layers
    expected = {"scale_activate": 2 * layers, "scale_activate_backward": 2 * layers} if fused else {}
    assert {op: n for op, n in ops.ops_by_op.items() if op.startswith("scale_activate")} == expected


def _compiling_to(monkeypatch, error: BaseException):
    """``torch.compile`` (as the latent op calls it) returns a function that raises ``error``."""
    import boost_hf.parallel.latent_op as latent_op

    def failing(*args):
        raise error

    monkeypatch.setattr(latent_op.torch, "compile", lambda function, **kwargs: failing)


def test_only_a_compiler_that_cannot_run_falls_back_to_the_eager_ops_and_says_which(monkeypatch):
    """No Triton (or a failed inductor compile): the eager arithmetic, named; out of memory or a shape error in the
    kernel: raised, never hidden behind a change of kernel."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import TritonMissing

    buffer = _buffer(torch.float32)

    def forward(*args):  # a function of its own: _compiled caches per function
        return _forward(*args)

    _compiling_to(monkeypatch, TritonMissing(None))
    with pytest.warns(UserWarning, match=r"kernel of forward could not be compiled by inductor \(TritonMissing: Cannot find "
                                         r"a working triton.*forward falls back to its eager arithmetic \(.*\.forward"):
        out = _compiled(forward)(buffer, WIDTH, HIDDEN, EPS, "silu")
    torch.testing.assert_close(out, _forward(buffer, WIDTH, HIDDEN, EPS, "silu"))
    with pytest.warns(UserWarning, match=r"boost_hf::scale_activate falls back to its eager arithmetic \(boost_hf\.parallel"
                                         r"\.latent_op\._forward"):
        _compiled.__wrapped__(_forward)(buffer, WIDTH, HIDDEN, EPS, "silu")
    failed_compile = BackendCompilerFailed(lambda: None, RuntimeError("C++ compiler failed"), None)
    for error in (torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("The size of tensor a (8) must match"),
                  BackendCompilerFailed(lambda: None, torch.OutOfMemoryError("CUDA out of memory"), None)):
        _compiling_to(monkeypatch, error)
        with pytest.raises(type(error)):
            _compiled.__wrapped__(forward)(buffer, WIDTH, HIDDEN, EPS, "silu")
    _compiling_to(monkeypatch, failed_compile)
    with pytest.warns(UserWarning, match="BackendCompilerFailed"):
        _compiled.__wrapped__(forward)(buffer, WIDTH, HIDDEN, EPS, "silu")
