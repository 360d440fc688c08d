"""RMSNorm on a replicated or a sharded residual stream (BOOST.md section 3).

RMSNorm needs ``sum_j x_j^2`` over all ``d`` features; under BTP each rank holds ``d/p`` of them.

* :func:`rms_norm` — the ordinary norm of a full-width (replicated) ``[..., d]`` tensor.
* :func:`online_rms_norm_local` — the **online RMSNorm**: normalise the shard by its own statistics,
  ``xh = x / rms_local * gamma``; the caller multiplies the next row-parallel GEMM's partial output
  by ``rms_local`` and appends ``sum_local(x^2)`` as one extra column, so that ONE all-reduce carries
  both; :func:`online_rms_norm_inverse` then gives the global ``1/sqrt(S/d + eps)`` to scale by. Exact.
* :func:`sync_rms_norm` — all-reduce the ``[..., 1]`` partial sums of squares first (one extra
  latency-bound collective of N scalars, all-reduced again in backward), then normalise. Exact.
* :func:`local_rms_norm` — APPROXIMATE: normalises each shard by its own statistics only (a group
  norm with ``p`` groups; the model changes with ``tp_size``). Offered for comparison, never default.
"""

from __future__ import annotations

import torch

from .primitives import ProcessGroup, all_reduce_sum


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, statistics in fp32 (as LlamaRMSNorm)."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


local_rms_norm = rms_norm  # on a [..., d/p] shard: normalises by the shard's own statistics (approximate)


def online_rms_norm_local(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local half of the online RMSNorm on a shard ``x: [..., d/p]``.

    Returns ``(xh, rms_local, sumsq)``: ``xh = weight * x / rms_local`` (``[..., d/p]``, x's dtype),
    ``rms_local = sqrt(sum_local(x^2)/(d/p) + eps)`` and ``sumsq = sum_local(x^2)``, both ``[..., 1]`` fp32.
    No communication.
    """
    xf = x.to(torch.float32)
    sumsq = xf.pow(2).sum(-1, keepdim=True)
    rms_local = torch.sqrt(sumsq / x.shape[-1] + eps)
    return weight * (xf / rms_local).to(x.dtype), rms_local, sumsq


def online_rms_norm_inverse(sumsq: torch.Tensor, hidden_size: int, eps: float) -> torch.Tensor:
    """``1 / sqrt(S / d + eps)`` (fp32, ``[..., 1]``) from the all-reduced sum of squares ``S``; the caller
    multiplies the all-reduced GEMM output ``H`` by it. No communication."""
    return torch.rsqrt(sumsq.to(torch.float32) / hidden_size + eps)


def sync_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, hidden_size: int, group: ProcessGroup | None) -> torch.Tensor:
    """Exact RMSNorm of a shard ``x: [..., d/p]``: all-reduce of the ``[..., 1]`` fp32 sums of squares
    (forward and backward), then ``weight * x / sqrt(S/d + eps)``."""
    xf = x.to(torch.float32)
    total = all_reduce_sum(xf.pow(2).sum(-1, keepdim=True), group)
    return weight * (xf * torch.rsqrt(total / hidden_size + eps)).to(x.dtype)


__all__ = ["rms_norm", "local_rms_norm", "online_rms_norm_local", "online_rms_norm_inverse", "sync_rms_norm"]
