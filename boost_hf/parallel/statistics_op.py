"""The online norm's sums of squares, and its ``gamma``'s gradient, as one kernel each (``torch.library`` custom ops).

Under BTP with the online RMSNorm (:mod:`boost_hf.parallel.fused`) the grouped A GEMM writes its partial latents into
a buffer whose statistics column holds each row's sum of squares of the GEMM's input, and ``gamma`` is folded into the
A's. Written as eager ops, the sums are two passes (the norm, then its square; under autocast a third, the input's cast
to the compute dtype) and ``gamma``'s gradient two (the product with the A's, then its sum over their rows), each
writing a tensor the next reads. Here:

==================================================  ================================================================
op                                                  reads -> writes
==================================================  ================================================================
``boost_hf::sum_of_squares_into``                   ``x [N, d] -> column [N, 1]`` (written in place)
``boost_hf::cast_sum_of_squares_into``              ``x [N, d] -> x in dtype [N, d], column [N, 1]``
``boost_hf::column_dots``                           ``a, b [R, d] -> sum_i a_ic b_ic [d]``
==================================================  ================================================================

Sums in fp32 (fp64 for fp64 inputs) whatever the inputs' dtype, rounded once to the output's; the squares are of
the values the GEMM reads (``x`` cast to the compute dtype). ``column`` is a column of another tensor (the GEMM's
output buffer: a strided view). On CUDA each op is that arithmetic compiled by inductor
(:func:`~boost_hf.parallel.generated_kernel.compiled`: one generated kernel), elsewhere the same arithmetic as
eager ops. Under ``torch.compile`` of the model the callers use plain ops instead. No communication.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .generated_kernel import KERNEL_NAMES, compiled
from .modules import statistics_dtype


def _sum_of_squares_into(x: Tensor, column: Tensor) -> None:
    column.copy_(x.to(statistics_dtype(x)).square().sum(-1, keepdim=True))


def _cast_sum_of_squares_into(x: Tensor, dtype: torch.dtype, column: Tensor) -> Tensor:
    cast = x.to(dtype)
    column.copy_(cast.to(statistics_dtype(cast)).square().sum(-1, keepdim=True))
    return cast


def _column_dots(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    wide = statistics_dtype(a if a.dtype == torch.float64 else b)
    return (a.to(wide) * b.to(wide)).sum(0).to(dtype)


@torch.library.custom_op("boost_hf::sum_of_squares_into", mutates_args=("column",))
def _sum_of_squares_op(x: Tensor, column: Tensor) -> None:
    _sum_of_squares_into(x, column)


@_sum_of_squares_op.register_kernel("cuda")
def _(x: Tensor, column: Tensor) -> None:
    compiled(_sum_of_squares_into)(x, column)


@_sum_of_squares_op.register_fake
def _(x: Tensor, column: Tensor) -> None:
    return None


@torch.library.custom_op("boost_hf::cast_sum_of_squares_into", mutates_args=("column",))
def _cast_sum_of_squares_op(x: Tensor, dtype: torch.dtype, column: Tensor) -> Tensor:
    return _cast_sum_of_squares_into(x, dtype, column)


@_cast_sum_of_squares_op.register_kernel("cuda")
def _(x: Tensor, dtype: torch.dtype, column: Tensor) -> Tensor:
    return compiled(_cast_sum_of_squares_into)(x, dtype, column)


@_cast_sum_of_squares_op.register_fake
def _(x: Tensor, dtype: torch.dtype, column: Tensor) -> Tensor:
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


@torch.library.custom_op("boost_hf::column_dots", mutates_args=())
def _column_dots_op(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    return _column_dots(a, b, dtype)


@_column_dots_op.register_kernel("cuda")
def _(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    return compiled(_column_dots)(a, b, dtype)


@_column_dots_op.register_fake
def _(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    return a.new_empty(a.shape[1:], dtype=dtype)


KERNEL_NAMES.update({
    _sum_of_squares_into: "boost_hf::sum_of_squares_into",
    _cast_sum_of_squares_into: "boost_hf::cast_sum_of_squares_into",
    _column_dots: "boost_hf::column_dots",
})


def squares_into(x: Tensor, column: Tensor, dtype: torch.dtype) -> Tensor:
    """``x [N, d]`` in ``dtype`` (``x`` itself when it has it), and ``sum_j x_j^2`` of it written into ``column [N, 1]``
    (any strides), summed in fp32: one kernel. No autograd."""
    if x.dtype == dtype:
        _sum_of_squares_op(x, column)
        return x
    return _cast_sum_of_squares_op(x, dtype, column)


def column_dots(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``sum_i a_ic b_ic`` (``a, b: [R, d]`` -> ``[d]`` in ``dtype``), summed in fp32: one kernel. No autograd."""
    return _column_dots_op(a, b, dtype)


__all__ = ["column_dots", "squares_into"]
