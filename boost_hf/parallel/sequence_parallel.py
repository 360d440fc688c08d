"""Megatron-LM's sequence parallelism (``ParallelConfig(sequence_parallel=True)``, ``tp_style="megatron"``).

Each rank holds the residual stream of ``N/p`` of the micro-batch's ``N = B S`` tokens (rows
``[i N/p, (i+1) N/p)`` of the flattened ``[N, d]``, viewed as ``[B, S/p, d]``; see
:mod:`~boost_hf.parallel.primitives`); the norms and residual adds run on those tokens only. Around the
tensor-parallel GEMMs (:mod:`boost_hf.parallel.layouts.megatron`):

* before the column-parallel q/k/v and gate/up: all-gather of the token shards (backward: reduce-scatter);
* after the row-parallel o and down: reduce-scatter over tokens instead of the all-reduce (backward:
  all-gather); a row-parallel bias is added to the shard.

Outside the layers: the vocab-parallel embedding all-reduces its lookup as without sequence parallelism and
the first layer keeps its token shard (backward: all-gather of the gradient); the final norm runs on the
shard, then all-gathers the tokens, so ``last_hidden_state`` is the full ``[B, S, d]`` and the
vocab-parallel head (which then skips its own input copy) and loss are fed as without sequence parallelism.

Replicated parameters that act on a token shard (the norms' ``weight``, row-parallel biases) see only this
rank's tokens: their gradient is all-reduced in backward (:func:`~boost_hf.parallel.primitives.copy_to_tp`
on the parameter), so every rank holds the single-device gradient.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from .modules import shard_parameter
from .norms import FusedRMSNorm
from .primitives import all_reduce_gradient, copy_to_tp, gather_tokens, split_tokens


def check_sequence_length(seq_len: int, tp_size: int) -> None:
    """Raise ``ValueError`` unless ``seq_len`` tokens split evenly over ``tp_size`` ranks."""
    if seq_len % tp_size != 0:
        raise ValueError(
            f"sequence_parallel=True shards each sequence over tp_size={tp_size} ranks, but the sequence has "
            f"{seq_len} tokens: pad it to a multiple of {tp_size} (e.g. {-(-seq_len // tp_size) * tp_size}), or "
            "use sequence_parallel=False (e.g. for generation, one token per step)."
        )


def replicated_on_shard(param: torch.Tensor | None, group) -> torch.Tensor | None:
    """``param`` for use on this rank's tokens: identity forward; its gradient all-reduced in backward."""
    return None if param is None else copy_to_tp(param, group)


class TokenShardedRMSNorm(FusedRMSNorm):
    """A block norm on this rank's tokens ``[B, S/p, d]`` (full ``d``, replicated ``weight: [d]``); backward
    all-reduces the ``[d]`` weight gradient."""

    group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, replicated_on_shard(self.weight, self.group))


class TokenGatheringRMSNorm(TokenShardedRMSNorm):
    """The final norm: ``[B, S/p, d]`` -> norm -> all-gather of the tokens -> ``[B, S, d]`` (backward:
    reduce-scatter of the gradient, which the vocab-parallel head computed from its vocabulary slice)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_tokens(super().forward(x), self.group)


def reduce_gradients_over_tokens(module: nn.Module, names: list[str], plan) -> None:
    """Parameters ``names`` of ``module`` (dotted, e.g. ``latent_norm.weight``), replicated, act on this rank's
    tokens inside code that reads them as attributes (LaX's crossing under BTP's latent sequence parallelism):
    each becomes a replicated shard whose gradient a hook all-reduces over the group in backward."""
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        param = shard_parameter(module.get_submodule(prefix), leaf, None, plan)
        param.register_hook(partial(all_reduce_gradient, group=plan.group))


def enter_token_shard(hidden_states: torch.Tensor, group) -> torch.Tensor:
    """The first layer's input ``[B, S, d]`` (replicated) -> this rank's ``[B, S/p, d]``; backward all-gather."""
    return split_tokens(hidden_states, group)


__all__ = ["check_sequence_length", "replicated_on_shard", "reduce_gradients_over_tokens", "TokenShardedRMSNorm", "TokenGatheringRMSNorm", "enter_token_shard"]
