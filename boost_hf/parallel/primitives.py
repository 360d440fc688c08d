"""Tensor-parallel communication primitives: small autograd Functions with an explicit process group.

The one place where boost-hf calls ``torch.distributed`` collectives on activations. In eager mode each
all-reduce runs in place on a tensor nothing else holds (no copy) and reports to
:mod:`boost_hf.parallel.comm_counter`; under ``torch.compile`` the primitives use the functional
collectives (``torch.distributed._functional_collectives``), which dynamo traces without a graph break
(inductor re-inplaces them; compiled regions are not counted). With a group of size 1 (or ``None``) every
primitive is the identity and communicates nothing.

======================  ======================  =========================  =============================
primitive               forward                 backward                   used for
======================  ======================  =========================  =============================
``copy_to_tp``          identity                all-reduce                 input of a column-parallel GEMM
``reduce_from_tp``      all-reduce              identity                   output of a row-parallel GEMM
``all_reduce_sum``      all-reduce              all-reduce                 a sum consumed differently on
                                                                           each rank (sync RMSNorm stats)
``gather_from_tp``      all-gather along dim    keep own slice             full-width tensor from shards
``split_to_tp``         keep own slice          all-gather along dim       shard of a replicated tensor
``gather_tokens``       all-gather of token     reduce-scatter over        sequence parallelism: input of
                        shards                  tokens                     a column-parallel GEMM / B
``reduce_scatter_       reduce-scatter over     all-gather of token        sequence parallelism: output
tokens``                tokens                  shards                     of a row-parallel GEMM / A
``split_tokens``        keep own token shard    all-gather of token        entering sequence parallelism
                                                shards
======================  ======================  =========================  =============================

``start_all_gather_rows`` and ``start_reduce_scatter_rows`` (no autograd) start a collective and return a
``wait``: for the backward of an autograd Function that overlaps it with a GEMM
(:func:`~boost_hf.parallel.sequence_parallel.gathered_linear`).

Sequence parallelism shards the ``N = B S`` tokens of activations ``[B, S, ...]``: rank ``i`` holds rows
``[i N/p, (i+1) N/p)`` of the flattened ``[N, ...]``, viewed as ``[B, S/p, ...]`` (every op on the shard is
per token, so which tokens share a row does not matter). The collectives then run on contiguous blocks of
dim 0, without a copy, as Megatron-LM's on its sequence-first layout. A reduce-scatter is counted with the
size of its *full input* (the tensor an all-reduce would have reduced), an all-gather with its full output.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .comm_counter import record_collective

ProcessGroup = dist.ProcessGroup
# torch >= 2.13 names it all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce_(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over ``group``. Eager: in place on ``x`` (no copy); under ``torch.compile``: the
    functional collective, which dynamo traces and inductor re-inplaces."""
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, "sum", group)
    record_collective("all_reduce", x, group)
    dist.all_reduce(x, group=group)
    return x


def start_all_gather_rows(x: torch.Tensor, group: ProcessGroup) -> Callable[[], torch.Tensor]:
    """Start concatenating every rank's ``x: [n, ...]`` along dim 0 (all-gather of ``p`` blocks into a new
    ``[p n, ...]``); returns ``wait``, which finishes it and returns the gathered tensor. No autograd: for
    autograd Functions that overlap the collective with compute (eager: gloo/NCCL ``async_op``; under
    ``torch.compile`` the functional collective, which waits where the result is first read)."""
    p = dist.get_world_size(group)
    x = x.contiguous()
    if torch.compiler.is_compiling():
        out = funcol.all_gather_tensor(x, 0, group)
        return lambda: out
    out = torch.empty((p * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    record_collective("all_gather", out, group)
    work = _all_gather_into(out, x, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return out

    return wait


def start_reduce_scatter_rows(x: torch.Tensor, group: ProcessGroup) -> Callable[[], torch.Tensor]:
    """Start summing ``x: [n, ...]`` over ``group`` keeping this rank's rows ``[rank n/p, (rank+1) n/p)`` (a new
    tensor); returns ``wait``, which finishes it and returns them. No autograd; overlappable as
    :func:`start_all_gather_rows`."""
    p = dist.get_world_size(group)
    x = x.contiguous()
    if torch.compiler.is_compiling():
        out = funcol.reduce_scatter_tensor(x, "sum", 0, group)
        return lambda: out
    out = torch.empty((x.shape[0] // p, *x.shape[1:]), dtype=x.dtype, device=x.device)
    record_collective("reduce_scatter", x, group)
    work = _reduce_scatter_into(out, x, group=group, async_op=True)

    def wait() -> torch.Tensor:
        work.wait()
        return out

    return wait


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (a new tensor ``p`` times larger)."""
    out = start_all_gather_rows(x, group)()
    if dim % x.dim() != 0:
        out = torch.cat(out.chunk(dist.get_world_size(group), dim=0), dim=dim)
    return out


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``x: [n, ...]`` over ``group`` and keep this rank's rows ``[rank n/p, (rank+1) n/p)`` (a new tensor)."""
    return start_reduce_scatter_rows(x, group)()


def _own_slice(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[dim] % p != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the tensor-parallel size {p}")
    return x.chunk(p, dim=dim)[rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """In place on its input in eager (the input is a fresh GEMM or lookup output that nothing saved)."""

    @staticmethod
    def forward(ctx, x, group):
        if torch.compiler.is_compiling() or not x.is_contiguous():
            return _all_reduce_(x.contiguous(), group)
        ctx.mark_dirty(x)
        return _all_reduce_(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if torch.compiler.is_compiling() or not x.is_contiguous():
            return _all_reduce_(x.contiguous(), group)
        ctx.mark_dirty(x)
        return _all_reduce_(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce_(grad.contiguous().clone(), ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.dim, ctx.group), None, None


class _SplitToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _own_slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def token_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, ...]`` -> ``[B S, ...]`` (a view of a contiguous ``x``)."""
    return x.reshape(-1, *x.shape[2:])


def as_tokens(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """``rows: [n, ...]`` viewed as ``[batch, n / batch, ...]``."""
    return rows.view(batch, -1, *rows.shape[1:])


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return as_tokens(_all_gather(token_rows(x), 0, group), x.shape[0])

    @staticmethod
    def backward(ctx, grad):
        return as_tokens(_reduce_scatter(token_rows(grad), ctx.group), grad.shape[0]), None


class _ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return as_tokens(_reduce_scatter(token_rows(x), group), x.shape[0])

    @staticmethod
    def backward(ctx, grad):
        return as_tokens(_all_gather(token_rows(grad), 0, ctx.group), grad.shape[0]), None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Identity forward; all-reduce of ``x.grad`` (same shape as ``x``) backward."""
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce (sum) of ``x`` forward; identity backward."""
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def all_reduce_sum(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce (sum) forward and backward: for a sum that each rank consumes differently."""
    return x if group_size(group) == 1 else _AllReduceSum.apply(x, group)


def gather_from_tp(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Concatenate the ranks' ``x`` along ``dim`` (output ``p`` times larger); backward keeps own slice."""
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, dim % x.dim(), group)


def split_to_tp(x: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous ``1/p`` slice of a replicated ``x`` along ``dim``; backward all-gathers."""
    return x if group_size(group) == 1 else _SplitToTP.apply(x, dim % x.dim(), group)


def gather_tokens(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``[B, S/p, ...]`` token shards -> the full ``[B, S, ...]`` (all-gather of the ``N/p``-token shards)
    forward; backward reduce-scatter of the gradient over tokens (each rank's consumer computed a partial
    gradient)."""
    return x if group_size(group) == 1 else _GatherTokens.apply(x, group)


def reduce_scatter_tokens(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Partial sums ``[B, S, ...]`` -> this rank's reduced token shard ``[B, S/p, ...]`` (reduce-scatter over
    tokens) forward; backward all-gather of the gradient over tokens."""
    return x if group_size(group) == 1 else _ReduceScatterTokens.apply(x, group)


def split_tokens(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's token shard ``[B, S/p, ...]`` of a replicated ``[B, S, ...]``; backward all-gathers."""
    return x if group_size(group) == 1 else as_tokens(split_to_tp(token_rows(x), 0, group), x.shape[0])


def all_reduce_sum_(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce (sum), no autograd, in place in eager: inside autograd Functions that own their backward."""
    return x if group_size(group) == 1 else _all_reduce_(x, group)


def all_reduce_max_(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce (max), no autograd, in place in eager: for numerically-stabilising constants."""
    if group_size(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return funcol.all_reduce(x, "max", group)
    record_collective("all_reduce", x, group)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "all_reduce_sum",
    "gather_from_tp",
    "split_to_tp",
    "gather_tokens",
    "reduce_scatter_tokens",
    "split_tokens",
    "all_reduce_sum_",
    "all_reduce_max_",
    "start_all_gather_rows",
    "start_reduce_scatter_rows",
    "token_rows",
    "as_tokens",
    "group_size",
    "group_rank",
]
