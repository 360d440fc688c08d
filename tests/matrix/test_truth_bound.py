"""The matrix's judgement against a float64 truth (``test_matrix.truth_problems``), on made-up gradients: rounding of
the one-process run's size passes; a doubled reduction fails at LaX's highest bf16 floor, a missing one (half the
gradient) where the floor is below a sixth."""

from __future__ import annotations

import torch

from .test_matrix import TRUTH_FACTOR, truth_problems

GENERATOR = torch.Generator().manual_seed(0)
TRUTH = {name: torch.randn(shape, generator=GENERATOR, dtype=torch.float64) for name, shape in
         (("a", (16, 64)), ("b", (64,)), ("c", (4, 4)))}


def off_by(floor: float) -> dict:
    """A run ``floor`` of each tensor's scale from :data:`TRUTH` (its largest error; random signs elsewhere)."""
    run = {}
    for name, t in TRUTH.items():
        noise = torch.rand(t.shape, generator=GENERATOR, dtype=torch.float64) * 2 - 1
        run[name] = t + floor * t.abs().max() * noise / noise.abs().max()
    return run


def test_rounding_of_the_one_process_size_passes():
    assert truth_problems(off_by(0.9 * TRUTH_FACTOR * 0.1), off_by(0.1), TRUTH, "truth-00") == []


def test_a_doubled_reduction_fails_at_lax_floor():
    reference = off_by(0.28)  # the largest one-process bf16 floor measured (c017)
    problems = truth_problems({**reference, "b": 2 * TRUTH["b"]}, reference, TRUTH, "truth-00")
    assert problems and "from the float64 truth (truth-00; worst b)" in problems[0], problems


def test_a_missing_reduction_fails_below_a_sixth():
    reference = off_by(0.15)
    problems = truth_problems({**reference, "b": TRUTH["b"] / 2}, reference, TRUTH, "truth-00")
    assert problems and "worst b" in problems[0], problems


def test_no_truth_recorded_is_a_problem():
    assert truth_problems(off_by(0.1), off_by(0.1), {}, "truth-07") == ["the float64 truth truth-07 recorded no gradients"]
