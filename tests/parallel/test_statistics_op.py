"""The online norm's sums of squares and its gamma's gradient as one kernel each (:mod:`boost_hf.parallel.statistics_op`):
the arithmetic they replace (fp64, fp32, bf16), written where asked, one counted op each, and one Triton kernel each as
inductor generates it for CUDA (counted on the CPU: ``tests/generated_kernels.py``)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from boost_hf.parallel.statistics_op import _cast_sum_of_squares_into, _column_dots, _sum_of_squares_into, column_dots, squares_into
from boost_hf.perf.op_counter import OpCounter
from ..tolerances import ONE_OPERATOR, assert_scaled_close


def _x(dtype, rows=6, width=20):
    torch.manual_seed(0)
    return (torch.randn(rows, width, dtype=torch.float64) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sums_of_squares_into_a_column_of_another_tensor(dtype):
    """Summed in fp32 (fp64 for fp64) and rounded once into the column; the rest of the buffer untouched."""
    x = _x(dtype)
    buffer = torch.full((6, 9), 7.0, dtype=dtype)
    assert squares_into(x, buffer[:, 4:5], dtype) is x
    expected = x.to(torch.float64 if dtype == torch.float64 else torch.float32).square().sum(-1, keepdim=True).to(dtype)
    assert torch.equal(buffer[:, 4:5], expected)
    assert (buffer[:, :4] == 7).all() and (buffer[:, 5:] == 7).all()


def test_cast_and_its_sums_of_squares_in_one_op():
    """Under autocast: the input cast to the compute dtype, and the sums of squares of the cast values."""
    x = _x(torch.float32)
    buffer = torch.zeros(6, 3, dtype=torch.bfloat16)
    cast = squares_into(x, buffer[:, 1:2], torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, x.to(torch.bfloat16))
    assert torch.equal(buffer[:, 1:2], cast.float().square().sum(-1, keepdim=True).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_column_dots_are_the_sums_of_the_row_products(dtype):
    a, b = _x(dtype, rows=30), _x(dtype, rows=30).flip(0)
    got = column_dots(a, b, dtype)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    assert got.dtype == dtype
    assert_scaled_close(got.to(wide), (a.to(wide) * b.to(wide)).sum(0).to(dtype).to(wide), ONE_OPERATOR, "column dots")


def test_each_is_one_counted_op():
    with FakeTensorMode():
        x, buffer, a = torch.empty(8, 16, dtype=torch.bfloat16), torch.empty(8, 24, dtype=torch.bfloat16), torch.empty(32, 16)
        with OpCounter() as ops:
            squares_into(x, buffer[:, 16:17], torch.bfloat16)
            squares_into(x.float(), buffer[:, 16:17], torch.bfloat16)
            column_dots(a, a, torch.float32)
    assert ops.ops_by_op == {"sum_of_squares_into": 1, "cast_sum_of_squares_into": 1, "column_dots": 1, "_to_copy": 1}


@pytest.mark.parametrize("op", ["sum_of_squares_into", "cast_sum_of_squares_into", "column_dots"])
def test_custom_ops_pass_opcheck(op):
    x, buffer = _x(torch.float32), torch.zeros(6, 3)
    args = {"sum_of_squares_into": (x, buffer[:, 1:2]), "cast_sum_of_squares_into": (x, torch.bfloat16, buffer.bfloat16()[:, 1:2]),
            "column_dots": (x, x, torch.float32)}[op]
    torch.library.opcheck(getattr(torch.ops.boost_hf, op).default, args)


@pytest.mark.parametrize("function", [_sum_of_squares_into, _cast_sum_of_squares_into, _column_dots])
def test_each_is_one_generated_kernel(function):
    """What CUDA runs (the arithmetic compiled by inductor) is one Triton kernel; bf16 as training runs it, at 7B TP4
    widths (dynamic shapes: the kernel serves any)."""
    pytest.importorskip("triton")
    from ..generated_kernels import generated_triton_kernels

    x, buffer = torch.randn(64, 1024, dtype=torch.bfloat16), torch.empty(64, 3072 + 8, dtype=torch.bfloat16)
    args = {_sum_of_squares_into: (x, buffer[:, 3072:3073]), _cast_sum_of_squares_into: (x.float(), torch.bfloat16, buffer[:, 3072:3073]),
            _column_dots: (torch.randn(3072, 1024, dtype=torch.bfloat16), torch.randn(3072, 1024, dtype=torch.bfloat16), torch.bfloat16)}[function]
    kernels = generated_triton_kernels(function, *args)
    assert len(kernels) == 1, kernels


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_each_is_one_cuda_kernel():
    """What the counters count as one op is one CUDA kernel (after the first call, which compiles)."""
    x, buffer = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16), torch.empty(2048, 3080, device="cuda", dtype=torch.bfloat16)
    a, wide = torch.randn(3072, 1024, device="cuda", dtype=torch.bfloat16), x.float()
    for op in (lambda: squares_into(x, buffer[:, 3072:3073], torch.bfloat16), lambda: squares_into(wide, buffer[:, 3072:3073], torch.bfloat16),
               lambda: column_dots(a, a, torch.bfloat16)):
        op()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            op()
            torch.cuda.synchronize()
        kernels = [e.name for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        assert len(kernels) == 1, kernels
