"""LORO under bottleneck-aware TP (2 and 4; online/sync norm, grouped/ungrouped) and tp 2 x dp 2 (gloo, CPU): the
weights after ``K + 1`` steps equal the single-process LORO run (fp32, 1e-5), and the exact step communicates one
all-reduce of the ``6 r^2`` products per projection, never a factor. One process group per world size runs every
case (tests/optim/loro_cases.py)."""

from __future__ import annotations

import pytest

from tests.distributed import launch
from tests.optim import loro_cases

TOL = 1e-5


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"world{p}")
def reports(request):
    world = request.param
    return world, launch(loro_cases.everything, world, world, timeout=900)


def _cases(reports):
    _, per_rank = reports
    return [c for r in per_rank for c in r["parity"]]


def test_every_case_ran(reports):
    world, per_rank = reports
    assert all(len(r["parity"]) == len(loro_cases.all_cases(world)) for r in per_rank)


def test_weights_after_an_exact_step_and_a_lazy_step_equal_one_process(reports):
    bad = [(c["case"], c["worst_factor"], c["factor_rel"], c["other_rel"]) for c in _cases(reports)
           if c["factor_rel"] > TOL or c["other_rel"] > TOL]
    assert not bad, bad


def test_only_the_exact_step_communicates_one_all_reduce_of_the_products(reports):
    for c in _cases(reports):
        counts = c["step_counts"]
        exact = loro_cases.EXACT_EVERY - 1
        assert counts[exact] == c["expected_exact_counts"], c["case"]
        assert all(not counts[i] for i in range(len(counts)) if i != exact), c["case"]


def test_vanilla_layout_is_refused_with_the_fix(reports):
    _, per_rank = reports
    for r in per_rank:
        assert "tp_style='vanilla' splits the rank" in r["vanilla"] and "--tp_style btp" in r["vanilla"]
