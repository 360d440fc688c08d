"""A compiled tensor-parallel decoder layer (``fullgraph=True``, forward and backward, gloo TP 2) computes
the eager model's loss and every gradient (fp32, 1e-5 relative). See tests/parallel/compile_cases.py; run in the 2-rank
launch shared with other files (tests/parallel/tp2_model_cases.py)."""

from __future__ import annotations

import pytest

from tests.parallel import compile_cases
from tests.parallel.tp2_model_cases import section

TOL = 1e-5


@pytest.fixture(scope="module")
def reports(tp2_model_results):
    return section(tp2_model_results, "compile")


def test_every_layout_compiles_without_graph_break_and_matches_eager(reports):
    for rank_reports in reports:
        assert len(rank_reports) == len(compile_cases.CASES)
        bad = [(r["case"], r["loss_rel"], r["grad_rel"]) for r in rank_reports if r["loss_rel"] > TOL or r["grad_rel"] > TOL]
        assert not bad, bad
        assert all(r["same_names"] for r in rank_reports)
