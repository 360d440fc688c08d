"""RMSNorm on a sharded residual stream (BOOST.md section 3), as modules adopted by the block norms.

RMSNorm needs ``sum_j x_j^2`` over all ``d`` features; under BTP each rank holds ``d/p`` of them.

* :class:`OnlineRMSNorm` — the **online RMSNorm**. The per-shard scale cancels through the next
  row-parallel GEMM, ``A_i (g_i x_i / rms) = (A_i g_i) x_i / rms``, so the norm does no work of its own:
  it hands its input and ``gamma`` (:class:`OnlineNormInput`) to the projection group, whose fused down
  projection (:mod:`boost_hf.parallel.fused`) folds ``gamma`` into the A's, writes ``sum(x_i^2)`` as one
  more column of the partial A output (ONE all-reduce carries both) and scales the reduced latents by
  ``1 / rms``. Exact.
* :class:`SyncRMSNorm` — all-reduce the ``[..., 1]`` partial sums of squares first (one extra
  latency-bound collective of N scalars, all-reduced again in backward), then normalise. Exact.
* :class:`LocalRMSNorm` — APPROXIMATE: normalises each shard by its own statistics only (a group norm
  with ``p`` groups; the model changes with ``tp_size``). Offered for comparison, never the default.
* :class:`GatheredRMSNorm` — the final norm under BTP: all-gather the residual to full ``d``, then norm.
* :class:`FusedRMSNorm` — the norms of a whole (replicated) residual stream (Megatron, vanilla, the final norm):
  the same function as the single-device norm in one kernel forward and two backward
  (:mod:`boost_hf.parallel.rmsnorm_op`) when the residual and ``gamma`` are fp32 (autocast training).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .modules import shard_repr
from .primitives import all_reduce_sum, gather_from_tp
from .rmsnorm_op import rms_norm


class OnlineNormInput(NamedTuple):
    """What the online norm hands the next projection group: its input ``hidden: [..., d/p]`` and
    ``weight`` (``gamma: [d/p]``); the group applies both (and the statistics) in its fused A GEMM."""

    hidden: torch.Tensor
    weight: torch.Tensor


class ShardedRMSNorm:
    """A block norm whose ``weight: [d/p]`` is this rank's slice; ``hidden_size`` is the full ``d``."""

    group = None
    hidden_size = None

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {shard_repr(self.weight)}"


class OnlineRMSNorm(ShardedRMSNorm):
    """``x: [..., d/p] -> OnlineNormInput(x, weight)``; no work and no communication here."""

    def forward(self, x: torch.Tensor) -> OnlineNormInput:
        return OnlineNormInput(x, self.weight)


class SyncRMSNorm(ShardedRMSNorm):
    """Exact RMSNorm of ``x: [..., d/p]``: all-reduce of the ``[..., 1]`` fp32 sums of squares (forward
    and backward), then ``weight * x / sqrt(S/d + eps)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        total = all_reduce_sum(xf.pow(2).sum(-1, keepdim=True), self.group)
        return self.weight * (xf * torch.rsqrt(total / self.hidden_size + self.variance_epsilon)).to(x.dtype)


class LocalRMSNorm(ShardedRMSNorm):
    """APPROXIMATE: the ordinary RMSNorm of the ``[..., d/p]`` shard by its own statistics."""


class FusedRMSNorm:
    """``BoostLlamaRMSNorm`` of a full-width ``x: [..., d]`` run by the fused RMSNorm ops when ``x`` and
    ``weight`` are fp32 (there the arithmetic is the same); otherwise, and under ``torch.compile`` (inductor
    fuses the plain ops with their neighbours), the module's own arithmetic. No communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` scaled by ``weight`` (``self.weight`` or a tensor standing for it)."""
        if x.dtype == weight.dtype == torch.float32 and not torch.compiler.is_compiling():
            return rms_norm(x, weight, self.variance_epsilon)
        xf = x.to(torch.float32)
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


class GatheredRMSNorm(FusedRMSNorm):
    """``x: [..., d/p]`` -> all-gather -> RMSNorm over the full ``[..., d]`` (replicated ``weight``)."""

    group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(gather_from_tp(x, -1, self.group))


RMSNORM_MODES = {"online": OnlineRMSNorm, "sync": SyncRMSNorm, "local": LocalRMSNorm}

__all__ = ["OnlineNormInput", "FusedRMSNorm", "OnlineRMSNorm", "SyncRMSNorm", "LocalRMSNorm", "GatheredRMSNorm", "RMSNORM_MODES"]
