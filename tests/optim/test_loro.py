"""LORO on one process against references written here: a lazy step is AdamW with the factors' rate scaled; an
exact step is the dense rank-r truncated SVD of ``W - lr P_T(G)`` (float64, 1e-10) with balanced factors; the
moments restart after it; the schedule restarts with a warm-up; models LORO cannot train are refused."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from transformers import get_scheduler

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
from boost_hf.optim.loro import RESTART_FLOOR, LoroAdamW, check_loro_model, factor_pairs, loro_optimizer, restart_schedule_at_exact_steps
from boost_hf.optim.low_rank_retraction import FactorPair, retract

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rank=8, max_position_embeddings=32)
LR, SCALE, WEIGHT_DECAY = 0.02, 0.25, 0.1


def svd_model() -> BoostLlamaForCausalLM:
    torch.manual_seed(0)
    return BoostLlamaForCausalLM(BoostLlamaConfig(bottleneck="svd", **TINY)).double()


def backward(model, seed: int) -> None:
    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()


def reference_adamw(model) -> torch.optim.AdamW:
    """torch's AdamW with LORO's groups: the factors at ``LR x SCALE``."""
    factors = {p for pair in factor_pairs(model) for p in pair}
    return torch.optim.AdamW(
        [{"params": [p for p in model.parameters() if p not in factors]},
         {"params": [p for pair in factor_pairs(model) for p in pair], "lr": LR * SCALE}],
        lr=LR, weight_decay=WEIGHT_DECAY, foreach=False,
    )


def loro(model, exact_every: int) -> LoroAdamW:
    return loro_optimizer(model, lr=LR, weight_decay=WEIGHT_DECAY, exact_every=exact_every, lr_scale=SCALE)


def pinv(x):
    return torch.linalg.pinv(x)


def dense_exact_step(B, A, direction_B, direction_A, lr, weight_decay):
    """The textbook step on the dense ``W = B A``: the gradient seen through ``A``'s direction (``B^T G = D_A``)
    inside the column space of ``B``, through ``B``'s (``G A^T = D_B``) outside it, projected onto the tangent space
    ``P_U X + (I - P_U) Y P_V``, and the rank-r truncated SVD of the decayed, stepped ``W``."""
    m, r = B.shape
    P_U, P_V = B @ pinv(B), pinv(A) @ A
    tangent = P_U @ pinv(B).T @ direction_A + (torch.eye(m, dtype=B.dtype) - P_U) @ direction_B @ pinv(A).T @ P_V
    U, S, Vh = torch.linalg.svd((1 - lr * weight_decay) * B @ A - lr * tangent)
    return U[:, :r] @ torch.diag(S[:r]) @ Vh[:r], S[:r]


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_a_lazy_step_is_adamw_with_the_factors_rate_scaled():
    model, reference = svd_model(), svd_model()
    optimizer, adamw = loro(model, exact_every=3), reference_adamw(reference)
    for seed in (1, 2):  # two lazy steps: moments carried
        backward(model, seed), backward(reference, seed)
        optimizer.step(), adamw.step()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), name


def test_exact_step_matches_dense_reference():
    """Exact step 2 of a model: ``B A`` of every projection equals :func:`dense_exact_step` on the factors and Adam
    directions before it (1e-10, float64), the new factors are balanced (``B^T B = A A^T = S``, diagonal), the
    other parameters took AdamW's step, and every moment restarted."""
    model, reference = svd_model(), svd_model()
    optimizer, adamw = loro(model, exact_every=2), reference_adamw(reference)
    backward(model, 1), backward(reference, 1)
    optimizer.step(), adamw.step()
    backward(model, 2), backward(reference, 2)
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    probe_model, probe = copy.deepcopy((reference, adamw))
    for p, q in zip(reference.parameters(), probe_model.parameters()):
        q.grad = p.grad.clone()  # deepcopy leaves a Parameter's gradient behind
    for group in probe.param_groups:
        group["lr"], group["weight_decay"] = 1.0, 0.0
    probe.step()
    directions = {n: before[n] - p.detach() for n, p in probe_model.named_parameters()}
    adamw.step()
    optimizer.step()

    params, stepped = dict(model.named_parameters()), dict(reference.named_parameters())
    names = [n[: -len(".A")] for n in params if n.endswith(".A")]
    assert len(names) == 7 * TINY["num_hidden_layers"]
    for name in names:
        B0, A0 = before[f"{name}.B"], before[f"{name}.A"]
        expected, singular = dense_exact_step(B0, A0, directions[f"{name}.B"], directions[f"{name}.A"], LR, WEIGHT_DECAY)
        B, A = params[f"{name}.B"].detach(), params[f"{name}.A"].detach()
        assert rel(B @ A, expected) < 1e-10, name
        assert rel(B.T @ B, torch.diag(singular)) < 1e-10 and rel(A @ A.T, torch.diag(singular)) < 1e-10, name
    for n, p in params.items():
        if not n.endswith((".A", ".B")):
            assert torch.equal(p, stepped[n]), n
    assert all(float(v.abs().max()) == 0 for state in optimizer.state.values() for v in state.values())

    # the step after: AdamW from fresh moments (the factors at the scaled rate), from the retracted weights
    restarted = copy.deepcopy(model)
    fresh = reference_adamw(restarted)
    backward(model, 3), backward(restarted, 3)
    optimizer.step(), fresh.step()
    for (n, p), q in zip(model.named_parameters(), restarted.parameters()):
        assert torch.equal(p, q), n


def test_retraction_along_a_true_gradient_is_the_textbook_projected_step():
    """Directions of a true gradient ``G`` of ``W`` (``D_B = G A^T``, ``D_A = B^T G``): the step is the truncated SVD
    of ``W - lr (P_U G + G P_V - P_U G P_V)``."""
    generator = torch.Generator().manual_seed(5)
    B, A, G = (torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in ((30, 6), (6, 20), (30, 20)))
    P_U, P_V = B @ pinv(B), pinv(A) @ A
    U, S, Vh = torch.linalg.svd(B @ A - 0.3 * (P_U @ G + G @ P_V - P_U @ G @ P_V))
    pair = FactorPair(B.clone(), A.clone(), G @ A.T, B.T @ G, lr=0.3)
    retract([pair])
    assert rel(pair.B @ pair.A, U[:, :6] @ torch.diag(S[:6]) @ Vh[:6]) < 1e-10


def test_retraction_of_a_zero_direction_rebalances_without_changing_w():
    generator = torch.Generator().manual_seed(3)
    B, A = torch.randn(20, 5, generator=generator, dtype=torch.float64), torch.randn(5, 12, generator=generator, dtype=torch.float64)
    B[:, 4] = 0  # rank-deficient factor
    W = B @ A
    pair = FactorPair(B.clone(), A.clone(), torch.zeros_like(B), torch.zeros_like(A), lr=0.1)
    retract([pair])
    assert rel(pair.B @ pair.A, W) < 1e-12
    gram_B, gram_A = pair.B.T @ pair.B, pair.A @ pair.A.T
    assert rel(gram_B, gram_A) < 1e-12 and rel(gram_B, torch.diag(torch.diagonal(gram_B))) < 1e-12
    assert float(gram_B[4, 4]) < 1e-20  # the fifth singular value of W is 0


def test_schedule_restarts_with_a_warmup_after_each_exact_step():
    model = svd_model()
    optimizer = loro(model, exact_every=10)
    schedule = get_scheduler("cosine_with_min_lr", optimizer, num_warmup_steps=5, num_training_steps=50,
                             scheduler_specific_kwargs={"min_lr_rate": 0.1})
    original = list(schedule.lr_lambdas)
    restart_schedule_at_exact_steps(schedule, every=10, warmup_steps=4)
    m, restarted = original[0], schedule.lr_lambdas[0]
    for step in range(50):
        period, position = divmod(step, 10)
        if period and position < 4:
            expected = RESTART_FLOOR + position / 4 * (m(10 * period) - RESTART_FLOOR)
        else:
            expected = m(step)
        assert restarted(step) == pytest.approx(expected, rel=1e-12), step
    assert restarted(20) == pytest.approx(RESTART_FLOOR) and restarted(24) == m(24)
    # the trainer saves the schedule and loads it with weights_only=True: the wrappers are not in its state
    buffer = io.BytesIO()
    torch.save(schedule.state_dict(), buffer)
    buffer.seek(0)
    schedule.load_state_dict(torch.load(buffer, weights_only=True))


@pytest.mark.parametrize("bottleneck", [None, "cola", "lax", "tt"])
def test_loro_refuses_models_with_something_between_the_factors(bottleneck):
    config = BoostLlamaConfig(bottleneck=bottleneck, **TINY)
    with pytest.raises(ValueError, match="bottleneck='svd'|full rank|tensor train") as error:
        check_loro_model(config)
    assert "--lowrank_optimizer adamw" in str(error.value)
    if bottleneck == "cola":
        assert "activation" in str(error.value) and "changes this function" in str(error.value)
    if bottleneck == "tt":
        assert "cores" in str(error.value)


def test_a_reloaded_state_continues_the_same_run():
    """Its state dict (moments, place in the period) loaded into a new optimizer: the next steps, an exact step among
    them, are those of the uninterrupted optimizer."""
    model, restored_model = svd_model(), svd_model()
    optimizer = loro(model, exact_every=3)
    for seed in (1, 2):
        backward(model, seed), backward(restored_model, seed)
        optimizer.step()
    restored_model.load_state_dict(model.state_dict())
    restored = loro(restored_model, exact_every=3)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    assert restored.steps_in_period == 2
    for seed in (3, 4):  # the exact step, then a lazy one
        backward(model, seed), backward(restored_model, seed)
        optimizer.step(), restored.step()
    for (name, p), q in zip(model.named_parameters(), restored_model.parameters()):
        assert torch.equal(p, q), name
