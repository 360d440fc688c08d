"""Megatron-LM's sequence parallelism (``ParallelConfig(sequence_parallel=True)``, ``tp_style="megatron"``).

Each rank holds the residual stream of ``N/p`` of the micro-batch's ``N = B S`` tokens (rows
``[i N/p, (i+1) N/p)`` of the flattened ``[N, d]``, viewed as ``[B, S/p, d]``; see
:mod:`~boost_hf.parallel.primitives`); the norms and residual adds run on those tokens only. Around the
tensor-parallel GEMMs (:mod:`boost_hf.parallel.layouts.megatron`):

* the column-parallel q/k/v and gate/up read the token shard and gather it themselves
  (:func:`gathered_linear`, Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``): all-gather of
  the shards, the GEMM on all ``N`` tokens, and only the ``[N/p, d]`` shard kept for backward, which
  all-gathers it again for the weight gradient and reduce-scatters the input gradient over tokens;
* after the row-parallel o and down: reduce-scatter over tokens instead of the all-reduce (backward:
  all-gather); a row-parallel bias is added to the shard.

Outside the layers: the vocab-parallel embedding all-reduces its lookup as without sequence parallelism and
the first layer keeps its token shard (backward: all-gather of the gradient); the final norm runs on the
shard, then all-gathers the tokens, so ``last_hidden_state`` is the full ``[B, S, d]`` and the
vocab-parallel head (which then skips its own input copy) and loss are fed as without sequence parallelism.

Replicated parameters that act on a token shard (the norms' ``weight``, row-parallel biases, LaX's gate and latent
norm under BTP's latent sequence parallelism) see only this rank's tokens: each is read through
:func:`replicated_on_shard` where it is used (:func:`~boost_hf.parallel.primitives.copy_to_tp`: identity forward,
all-reduce of its gradient in backward), so every rank holds the single-device gradient. The reduction is part of the
forward graph, never a hook on the parameter: FSDP2 replaces the parameters (a hook on the original never fires),
``torch.compile`` and activation checkpointing see it like any other operation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .fused import column_input_gradient, column_linear, column_outputs, column_slots, column_weight_gradients
from .modules import adopt
from .norms import FusedRMSNorm
from .primitives import (
    as_tokens,
    copy_to_tp,
    gather_tokens,
    group_size,
    split_tokens,
    start_all_gather_rows,
    start_reduce_scatter_rows,
    token_rows,
)


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


class TokenShardedLatentCrossing:
    """LaX's crossing on this rank's tokens (BTP's latent sequence parallelism; an adopted mixin of the LaX
    projection): the gate's replicated parameters (``[r, r]`` and ``[r]``, or ``[a, a]`` and ``[b, b]``) are read
    through :func:`replicated_on_shard` where the crossing uses them (identity forward; backward: one all-reduce of
    each one's gradient over TP), so every rank holds the single-device gradient whatever stands for the parameter
    when the forward runs (FSDP2's gathered tensor, compile's graph input)."""

    group = None

    def crossing_parameters(self) -> tuple[torch.Tensor, ...]:
        return tuple(replicated_on_shard(param, self.group) for param in super().crossing_parameters())


class TokenShardedLayerNorm:
    """LaX's latent LayerNorm on this rank's tokens ``[B, S/p, r]`` (replicated ``weight``, ``bias``: ``[r]``),
    both read through :func:`replicated_on_shard` (backward: one all-reduce of each one's gradient over TP)."""

    group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, replicated_on_shard(self.weight, self.group),
                            replicated_on_shard(self.bias, self.group), self.eps)


def cross_on_token_shard(projection: nn.Module, group) -> None:
    """Make LaX ``projection``'s crossing run on this rank's tokens (:class:`TokenShardedLatentCrossing`, its latent
    norm :class:`TokenShardedLayerNorm`). Raises ``TypeError`` for a LaX class that reads its gate other than through
    ``crossing_parameters`` (the remote code of a folder saved before it had it): its gradients would miss the TP sum."""
    if not hasattr(projection, "crossing_parameters"):
        raise TypeError(
            f"{type(projection).__name__} reads its LaX gate without crossing_parameters(), so its crossing cannot run on "
            "a token shard: load the model with boost-hf's own class (without trust_remote_code), or sequence_parallel=False."
        )
    adopt(projection, TokenShardedLatentCrossing, group=group)
    if projection.latent_norm is not None:
        adopt(projection.latent_norm, TokenShardedLayerNorm, group=group)


class _GatheredLinear(torch.autograd.Function):
    """``(x, group, grouped, slots, *weights) -> outputs``; see :func:`gathered_linear`."""

    @staticmethod
    def forward(ctx, x, group, grouped, slots, *weights):
        with torch.autocast(x.device.type, enabled=False):
            full = start_all_gather_rows(token_rows(x), group)()
            outputs = column_outputs(full, weights, (x.shape[0], full.shape[0] // x.shape[0]), grouped)
        ctx.save_for_backward(x, *weights)  # the token shard, not the gathered tokens
        ctx.group, ctx.slots = group, slots
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        needs_x, needs_weights = ctx.needs_input_grad[0], ctx.needs_input_grad[4:]
        grads = [token_rows(grad) for grad in grads]  # [N, w_i]
        grad_x, grad_weights = None, [None] * len(weights)
        with torch.autocast(x.device.type, enabled=False):
            # the re-gather runs while the input-gradient GEMMs run, the reduce-scatter of the input gradient
            # while the weight-gradient GEMMs run
            gathering = start_all_gather_rows(token_rows(x), ctx.group) if any(needs_weights) else None
            if needs_x:
                scattering = start_reduce_scatter_rows(column_input_gradient(grads, weights), ctx.group)
            if gathering is not None:
                grad_weights = column_weight_gradients(grads, gathering(), ctx.slots, needs_weights)
            if needs_x:
                grad_x = as_tokens(scattering(), x.shape[0])
        return grad_x, None, None, None, *grad_weights


def gathered_linear(x: torch.Tensor, weights, group, *, grouped: bool = False) -> tuple[torch.Tensor, ...]:
    """Column-parallel GEMMs on the gathered tokens that keep only this rank's token shard for backward
    (Megatron-LM's column-parallel linear under sequence parallelism).

    ``x``: this rank's tokens ``[B, S/p, d]`` in the compute dtype; ``weights``: ``[w_i, d]`` each (this rank's
    columns, in the compute dtype; ``grouped``: the group's :func:`~boost_hf.parallel.fused.weight_views`, run as
    one GEMM whose output's column blocks are returned). Returns ``[B, S, w_i]`` for each weight,
    ``x_full @ W_i^T``. Forward: all-gather of the token shards (``N d`` elements), the GEMM(s); saved: ``x``
    (``N d / p``) and the weights. Backward: all-gather of ``x`` again (``N d``) for the weight gradients,
    started before the input-gradient GEMMs (``sum_i g_i W_i``, ``[N, d]``) and awaited after them; the input
    gradient reduce-scattered over tokens (``N d``), started before the weight-gradient GEMMs (``g_i^T x_full``,
    written into the rows of the stacked weights' gradient buffer when grouped) and awaited after them: the
    outputs' gradients are never concatenated (:func:`~boost_hf.parallel.fused.column_linear`). In eager the
    collectives are asynchronous (gloo and NCCL run them beside the GEMMs); under ``torch.compile`` they are the
    functional collectives, and the same pattern is written as plain ops: :func:`~boost_hf.parallel.primitives.gather_tokens`
    under selective activation checkpointing that makes the partitioner recompute the gather in backward (which
    it would otherwise keep), then :func:`~boost_hf.parallel.fused.column_linear`; inductor schedules the
    collectives. Without a gradient for any weight (frozen) nothing is re-gathered (eager). With a group of size
    1: :func:`~boost_hf.parallel.fused.column_linear` on ``x``, nothing communicated."""
    weights = tuple(weights)
    if group_size(group) == 1:
        return column_linear(x, weights, grouped=grouped)
    if torch.compiler.is_compiling():
        full = checkpoint(gather_tokens, x, group, use_reentrant=False, context_fn=_gathers_recomputed)
        return column_linear(full, weights, grouped=grouped)
    return _GatheredLinear.apply(x, group, grouped, column_slots(weights), *weights)


def _recompute_gathers(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in (torch.ops._c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.wait_tensor.default):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def _gathers_recomputed():
    """Selective checkpointing contexts under which the functional all-gather (and its wait) are recomputed."""
    return create_selective_checkpoint_contexts(_recompute_gathers)


def enter_token_shard(hidden_states: torch.Tensor, group) -> torch.Tensor:
    """The first layer's input ``[B, S, d]`` (replicated) -> this rank's ``[B, S/p, d]``; backward all-gather."""
    return split_tokens(hidden_states, group)


__all__ = ["check_sequence_length", "gathered_linear", "replicated_on_shard", "cross_on_token_shard", "TokenShardedLatentCrossing", "TokenShardedLayerNorm",
           "TokenShardedRMSNorm", "TokenGatheringRMSNorm", "enter_token_shard"]
