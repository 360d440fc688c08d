"""fp32 comparisons that hold on any machine: errors relative to the scale of the tensor compared, against bounds
derived from what fp32 rounding of the computation allows.

Two computations of the same function in fp32 (ours and a reference, one layout and another, grouped and separate
GEMMs) round differently, and the order of their sums depends on the CPU's vector width, the thread count and the
library version. An elementwise tolerance on elements near zero therefore passes on one machine and fails on
another (``make test`` runs the exactness tests a second time with another CPU capability and thread count to prove
that none does). Every fp32 comparison here is

    scaled_error(actual, expected) = max |actual - expected| / max |expected|      (computed in float64)

against :func:`fp32_rounding`: each rounding of an fp32 operation errs by at most half an ulp (``eps / 2`` relative,
``eps = 2^-23``), and the roundings that reach one output are of random sign, so they add like a random walk: after
``n`` of them the error is ~``sqrt(n) * eps / 2`` of the result's scale. The bound is six such standard deviations
(three ``eps``), so that the largest error over a whole tensor of a few thousand elements stays inside it. ``n`` is
written beside each bound as the computation's count: chained operations times the terms of their reductions.
"""

from __future__ import annotations

import math

import torch

FP32_EPS = torch.finfo(torch.float32).eps  # 2^-23 = 1.19e-7
FP64_EPS = torch.finfo(torch.float64).eps  # 2^-52 = 2.2e-16


def fp32_rounding(roundings: int) -> float:
    """What fp32 rounding allows, relative to a result's scale, for a result that ``roundings`` fp32 roundings reach,
    computed in another order: ``3 * sqrt(roundings) * eps``."""
    return 3 * math.sqrt(roundings) * FP32_EPS


# The tests' tiny model (tests/conftest.py TINY): 2 blocks, d = 32, d_ff = 64, vocab 96. A block's forward chains ~10
# reductions (norm, q/k/v, scores, softmax, weighted values, o, norm, gate/up, down; a bottleneck adds its A and B), the
# longest of 64 terms: 2 x 10 x 64 roundings reach a logit; backward runs the chain once more for a gradient.
TINY_FORWARD = fp32_rounding(2 * 10 * 64)  # 1.28e-5
TINY_BACKWARD = fp32_rounding(2 * 2 * 10 * 64)  # 1.81e-5
# One projection or one fused operator: a single chain of at most 4 reductions of <= 64 terms.
ONE_OPERATOR = fp32_rounding(4 * 64)  # 5.7e-6
# float64 computations in another order: the same count at float64's epsilon is ~1e-14; 1e-12 leaves room for any.
FP64 = 1e-12


def scaled_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|`` in float64 (``max |actual|`` when ``expected`` is all zero)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    difference = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = expected.abs().max().item() if expected.numel() else 0.0
    return difference / scale if scale > 0 else difference


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, bound: float, msg: str = "") -> None:
    """``scaled_error(actual, expected) <= bound``, the error and the bound in the message."""
    error = scaled_error(actual, expected)
    assert error <= bound, f"{msg}: error {error:.3g} of the tensor's scale > bound {bound:.3g}"


__all__ = ["FP32_EPS", "FP64_EPS", "FP64", "ONE_OPERATOR", "TINY_BACKWARD", "TINY_FORWARD", "assert_scaled_close",
           "fp32_rounding", "scaled_error"]
