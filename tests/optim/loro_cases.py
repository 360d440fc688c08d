"""LORO cases run inside launched process groups (tests/distributed.py); imported by the children.

Each rank trains the single-process reference itself, once for all its cases (same seed, same batches, same optimizer
with no TP group), so every comparison is local. ``EXACT_EVERY + 1`` steps: lazy steps, one exact step, a lazy step
from reset moments.

Adam's ``eps`` is ``1e-2``: Adam moves every weight whose gradient is not zero by about ``lr`` whatever the
gradient's size, so with a small ``eps`` a gradient at the level of fp32 summation-order noise (two GEMM orders: TP
sums partial products) flips a whole step (measured here: 1e-4 relative after one step at ``eps`` 1e-5). With ``eps``
above the gradients the directions are proportional to the moments, and noise stays noise (all weights within 2e-6).
Adam's arithmetic itself is checked bitwise on one process (tests/optim/test_loro.py).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, CommCounter, ParallelConfig
from boost_hf.optim.loro import loro_optimizer
from boost_hf.optim.low_rank_retraction import PRODUCTS
from boost_hf.parallel.sharding import gather_full, shard_spec_of

SEED = 1234
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, rank=16, max_position_embeddings=64, bottleneck="svd")
BATCH, SEQ, LR, EXACT_EVERY = 4, 8, 1e-2, 2
STEPS = EXACT_EVERY + 1


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=gen) for _ in range(STEPS)]


def optimizer_of(model):
    return loro_optimizer(model, lr=LR, eps=1e-2, weight_decay=0.01, exact_every=EXACT_EVERY)


def train(model, dp_rank: int = 0, dp_size: int = 1, dp_group=None) -> list[dict]:
    """``STEPS`` LORO steps on this DP rank's share of each batch, gradients averaged over ``dp_group``; the
    collectives each optimizer step issued."""
    optimizer = optimizer_of(model)
    counts = []
    for ids in batches():
        ids = ids.chunk(dp_size)[dp_rank]  # no ignored targets: the mean of the shares' losses is the batch's
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        if dp_group is not None:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp_group)
                p.grad /= dp_size
        with CommCounter() as step:
            optimizer.step()
        counts.append(step.counts())
    return counts


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.double()).abs().max() / b.detach().double().abs().max().clamp_min(1e-12))


@functools.cache
def reference_parameters() -> dict[str, torch.Tensor]:
    """The single-process LORO run's parameters after ``STEPS`` steps: the same for every case, trained once per rank."""
    torch.manual_seed(SEED)
    reference = BoostLlamaForCausalLM(BoostLlamaConfig(**TINY))
    train(reference)
    return {n: p.detach() for n, p in reference.named_parameters()}


def parity_case(case: dict) -> dict:
    config = BoostLlamaConfig(**TINY)
    expected = reference_parameters()

    tp_size = case["tp_size"]
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=ParallelConfig(tp_size=tp_size, **case["parallel"]))
    state = model.plan.state
    counts = train(model, state.dp_rank, state.dp_size, state.dp_group)
    params = {n: gather_full(p.detach(), shard_spec_of(p), state.tp_group) for n, p in model.named_parameters()}
    factors = {n: rel(p, expected[n]) for n, p in params.items() if n.endswith((".A", ".B"))}
    others = {n: rel(p, expected[n]) for n, p in params.items() if not n.endswith((".A", ".B"))}
    products = PRODUCTS * config.rank**2 * 7 * config.num_hidden_layers
    return {
        "case": case,
        "factor_rel": max(factors.values()),
        "worst_factor": max(factors, key=factors.get),
        "other_rel": max(others.values()),
        "step_counts": counts,
        "expected_exact_counts": {"all_reduce": {"calls": 1, "elements": products}},
    }


def vanilla_refused() -> str:
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(BoostLlamaConfig(**TINY), parallel_config=ParallelConfig(tp_size=2, tp_style="vanilla"))
    try:
        optimizer_of(model)
    except ValueError as error:
        return str(error)
    return ""


def all_cases(world: int) -> list[dict]:
    layouts = [{"tp_style": "btp", "rmsnorm": norm, "group_linears": grouped} for norm in ("online", "sync") for grouped in (True, False)]
    cases = [{"tp_size": world, "parallel": layout} for layout in layouts]
    if world == 4:  # tp 2 x dp 2
        cases += [{"tp_size": 2, "parallel": layouts[0]}, {"tp_size": 2, "parallel": layouts[3]}]
    return cases


def everything(world: int) -> dict:
    return {"parity": [parity_case(case) for case in all_cases(world)], "vanilla": vanilla_refused()}
