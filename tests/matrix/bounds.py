"""The exactness matrix's bounds, derived in ``test_matrix.py``'s docstring: how far a run may be from one process's
(each relative to the tensor's scale, :func:`tests.tolerances.scaled_error`) in fp32 and in bf16, and the optimizer
settings the parameter bound assumes (``factors.RUN``: 3 steps, learning rate 1e-2, AdamW's epsilon 1, clipping 0.5).
Shared by ``test_matrix.py`` and ``random_cli.py``."""

from __future__ import annotations

import math

from tests.tolerances import fp32_rounding

BF16_UNIT = 2.0 ** -8
FORWARD = fp32_rounding(4 * 10 * 128)  # 2.6e-5
BACKWARD = fp32_rounding(2 * 4 * 10 * 128)  # 3.6e-5
BF16_FORWARD = 3 * math.sqrt(4 * 10) * BF16_UNIT  # 7.4e-2
BF16_BACKWARD = 3 * math.sqrt(2 * 4 * 10 + 2) * BF16_UNIT  # 0.11
STEPS, LEARNING_RATE, ADAM_EPSILON, CLIP = 3, 1e-2, 1.0, 0.5
PARAMETER_ROUNDING = fp32_rounding(STEPS * 8)  # the optimizer's own element-wise operations, 8 per step
# A layout at most doubles the roundings that reach a gradient (each TP rank's partial sum rounded before the sum is, each
# micro-batch's gradient before the accumulation): sqrt(2) farther from the truth; and the largest error over the model's
# tensors of two runs of one rounding count differs by up to 2x (measured in benchmarks/results/matrix_rounding_floor.md,
# parallel over one-process: 0.56-1.70 in fp32, 0.91-1.55 in bf16 but c016's). sqrt(2) x 2, rounded up:
TRUTH_FACTOR = 3


def bounds(case: dict) -> tuple[float, float]:
    """(loss bound, gradient bound) of ``case``'s precision."""
    return (FORWARD, BACKWARD) if case["precision_policy"] == "fp32" else (BF16_FORWARD, BF16_BACKWARD)


def parameter_bound(grad_bound: float, largest_gradient: float, scale: float) -> float:
    """How far a parameter of largest element ``scale`` may be after :data:`STEPS` AdamW steps, relative to ``scale``,
    when its gradients are within ``grad_bound`` of their scale and its largest clipped gradient element is
    ``largest_gradient`` (``test_matrix.py``'s docstring)."""
    return PARAMETER_ROUNDING + STEPS * LEARNING_RATE * 2 * grad_bound * largest_gradient / (ADAM_EPSILON * scale)


__all__ = ["ADAM_EPSILON", "BACKWARD", "BF16_BACKWARD", "BF16_FORWARD", "BF16_UNIT", "CLIP", "FORWARD", "LEARNING_RATE",
           "PARAMETER_ROUNDING", "STEPS", "TRUTH_FACTOR", "bounds", "parameter_bound"]
