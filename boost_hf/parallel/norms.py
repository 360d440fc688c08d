"""RMSNorm on a sharded residual stream (BOOST.md section 3), as modules adopted by the block norms.

RMSNorm needs ``sum_j x_j^2`` over all ``d`` features; under BTP each rank holds ``d/p`` of them.

* :class:`OnlineRMSNorm` — the **online RMSNorm**. The per-shard scale cancels through the next
  row-parallel GEMM, ``A_i (g_i x_i / rms) = (A_i g_i) x_i / rms``, so the norm does no work of its own:
  it hands its input and ``gamma`` (:class:`OnlineNormInput`) to the projection group, whose fused down
  projection (:mod:`boost_hf.parallel.fused`) folds ``gamma`` into the A's, writes ``sum(x_i^2)`` as one
  more column of the partial A output (ONE all-reduce carries both) and scales the reduced latents by
  ``1 / rms``. Exact.
* :class:`SyncRMSNorm` — all-reduce the ``[..., 1]`` partial sums of squares first (one extra
  latency-bound collective of N scalars, all-reduced again in backward), then normalise. Exact; in the
  residual's dtype, statistics in fp32.
* :class:`LocalRMSNorm` — APPROXIMATE: normalises each shard by its own statistics only (a group norm
  with ``p`` groups; the model changes with ``tp_size``). Offered for comparison, never the default.
* :class:`GatheredRMSNorm` — the final norm under BTP: all-gather the residual to full ``d``, then norm.
* :class:`FusedRMSNorm` — the norms of a whole (replicated) residual stream (Megatron, vanilla, the final norm):
  the same function as the single-device norm in one kernel forward and two backward
  (:mod:`boost_hf.parallel.rmsnorm_op`), in the residual's dtype: fp32 under autocast, bf16 with bf16
  parameters (bf16 in, bf16 out, statistics in fp32).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .modules import shard_repr, statistics_dtype
from .primitives import all_reduce_sum, all_reduce_sum_, gather_from_tp
from .rmsnorm_op import FUSED_DTYPES, rms_norm, rms_norm_weight_backward



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


class _SyncRMSNorm(torch.autograd.Function):
    """``(x, weight, group, hidden_size, eps) -> weight * (x * rstd)`` with ``rstd`` from the all-reduced sums of
    squares; see :class:`SyncRMSNorm`. ``x`` and ``weight`` of one dtype; no full-width copy in another dtype."""

    @staticmethod
    def forward(ctx, x, weight, group, hidden_size, eps):
        with torch.autocast(x.device.type, enabled=False):
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=statistics_dtype(x))  # [..., 1]: one read of x
            rstd = all_reduce_sum_(norm.mul_(norm), group).div_(hidden_size).add_(eps).rsqrt_()
            # x * rstd computed in fp32 and rounded once to x's dtype, then times weight (the module's roundings)
            y = torch.mul(x, rstd, out=torch.empty_like(x)).mul_(weight)
        ctx.save_for_backward(x, weight, rstd)
        ctx.group, ctx.hidden_size = group, hidden_size
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        grad_x = grad_weight = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[1]:
                grad_weight = rms_norm_weight_backward(grad, x, rstd, weight)  # sum over rows of grad * x * rstd
            if ctx.needs_input_grad[0]:
                # y = w x r, r = (S/d + eps)^(-1/2), S = sum over all ranks of x^2:
                # dx = r (g w - x r^2 D / d), D = sum over all ranks of (g w x)
                grad_x = grad * weight
                dot = torch.sum(grad_x * x, dim=-1, keepdim=True, dtype=statistics_dtype(x))
                coefficient = all_reduce_sum_(dot, ctx.group).mul_(rstd.square()).div_(-ctx.hidden_size)
                grad_x = grad_x.addcmul_(x, coefficient).mul_(rstd)
        return grad_x, grad_weight, None, None, None


class SyncRMSNorm(ShardedRMSNorm):
    """Exact RMSNorm of ``x: [..., d/p]``: all-reduce of the ``[..., 1]`` fp32 sums of squares (forward; the
    ``[..., 1]`` sums of ``grad * weight * x`` in backward), then ``weight * x / sqrt(S/d + eps)``. In ``x``'s dtype
    (bf16 in, bf16 out), statistics in fp32, read from ``x`` without a full-width fp32 copy; under
    ``torch.compile`` (or for ``x`` and ``weight`` of different dtypes) the same arithmetic as plain ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype and not torch.compiler.is_compiling():
            return _SyncRMSNorm.apply(x, self.weight, self.group, self.hidden_size, self.variance_epsilon)
        xf = x.to(torch.float32)
        total = all_reduce_sum(xf.pow(2).sum(-1, keepdim=True), self.group)
        return self.weight * (xf * torch.rsqrt(total / self.hidden_size + self.variance_epsilon)).to(x.dtype)


# x's dtype -> the weight dtypes that ``weight * normed`` promotes to it (the fused op then reads the weight in x's dtype)
_NARROWER_WEIGHTS = {torch.float32: (torch.bfloat16, torch.float16), torch.bfloat16: (), torch.float16: ()}


class FusedRMSNorm:
    """``BoostLlamaRMSNorm`` of a full-width ``x: [..., d]`` run by the fused RMSNorm ops
    (:mod:`boost_hf.parallel.rmsnorm_op`) in ``x``'s dtype (fp32 under autocast, bf16 with bf16 parameters: bf16 in,
    bf16 out, statistics in fp32). A ``weight`` of lower precision than ``x`` (bf16 weight, fp32 residual) is read in
    ``x``'s dtype, as the module's product promotes it. Under ``torch.compile`` (inductor fuses the plain ops with
    their neighbours) and for a ``weight`` wider than ``x``, the module's own arithmetic. No communication."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, self.weight)

    def normalize(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The norm of ``x`` scaled by ``weight`` (``self.weight`` or a tensor standing for it)."""
        if x.dtype in FUSED_DTYPES and weight.dtype in (x.dtype, *_NARROWER_WEIGHTS[x.dtype]) and not torch.compiler.is_compiling():
            return rms_norm(x, weight.to(x.dtype), self.variance_epsilon)
        xf = x.to(torch.float32)
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype)


class LocalRMSNorm(ShardedRMSNorm, FusedRMSNorm):
    """APPROXIMATE: the ordinary RMSNorm of the ``[..., d/p]`` shard by its own statistics (fused as
    :class:`FusedRMSNorm`)."""


class GatheredRMSNorm(FusedRMSNorm):
    """``x: [..., d/p]`` -> all-gather -> RMSNorm over the full ``[..., d]`` (replicated ``weight``)."""

    group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(gather_from_tp(x, -1, self.group))


RMSNORM_MODES = {"online": OnlineRMSNorm, "sync": SyncRMSNorm, "local": LocalRMSNorm}

__all__ = ["OnlineNormInput", "FusedRMSNorm", "OnlineRMSNorm", "SyncRMSNorm", "LocalRMSNorm", "GatheredRMSNorm", "RMSNORM_MODES"]
