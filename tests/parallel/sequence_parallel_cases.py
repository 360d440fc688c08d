"""Megatron with sequence parallelism when a column group cannot gather for its projections (run inside a launched
process group by tests/parallel/test_sequence_parallel.py).

A projection with a forward pre-hook, or replaced by another module, runs its own GEMM on the gathered tokens
(the group falls back from :func:`~boost_hf.parallel.sequence_parallel.gathered_linear`); plain projections are
called with the token shard as their input. Each case: loss and every gradient against the single-device model
with the same change, and what the projections' forward hooks saw.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from boost_hf import BoostLlamaForCausalLM, ParallelConfig
from tests.parallel.tp_cases import SEED, SEQ, rel, tiny_config, train_step


def _record_shapes(seen: dict, name: str, module, args, out) -> None:  # a hook's return value would replace the output
    seen.setdefault(name, [list(args[0].shape), list(out.shape)])


def _double_input(module, args):
    return (2 * args[0],)


def _change(model, change: str) -> None:
    attention = model.model.layers[1].self_attn
    if change == "pre_hook":
        attention.k_proj.register_forward_pre_hook(_double_input)
    elif change == "replaced":
        replacement = nn.Linear(attention.k_proj.in_features, attention.k_proj.out_features, bias=False)
        replacement.weight = attention.k_proj.weight  # this rank's columns under TP
        attention.k_proj = replacement


def _case(change: str, group_linears: bool) -> dict:
    config = tiny_config(bottleneck=None, attention_bias=True, mlp_bias=True)
    torch.manual_seed(SEED)
    reference = BoostLlamaForCausalLM(config)
    _change(reference, change)
    ref_loss, ref_grads, _, _, _ = train_step(reference)
    parallel = ParallelConfig(tp_size=dist.get_world_size(), tp_style="megatron", sequence_parallel=True, group_linears=group_linears)
    torch.manual_seed(SEED)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    _change(model, change)
    seen = {}
    for name in ("q_proj", "k_proj", "gate_proj"):
        module = model.model.layers[1].get_submodule(("mlp." if name == "gate_proj" else "self_attn.") + name)
        module.register_forward_hook(partial(_record_shapes, seen, name))
    loss, grads, _, _, _ = train_step(model)
    return {
        "change": change,
        "group_linears": group_linears,
        "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
        "grad_rel": max(rel(grads[n], ref_grads[n]) for n in ref_grads),
        "seen": seen,
    }


def fallback_cases() -> list[dict]:
    return [_case(change, group_linears) for change in ("none", "pre_hook", "replaced") for group_linears in (True, False)]


__all__ = ["fallback_cases", "SEQ"]
