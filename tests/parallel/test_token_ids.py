"""Out-of-range token ids raise when the model is called directly, in every layout at TP 1 and 2 (megatron and
vanilla at TP 2 used to embed an id >= vocab_size as zeros, silently). Run in the 2-rank launch shared with other
files (tests/parallel/tp2_model_cases.py)."""

from __future__ import annotations

import pytest

from tests.parallel import token_id_cases
from tests.parallel.tp2_model_cases import section


@pytest.fixture(scope="module")
def results(tp2_model_results):
    return section(tp2_model_results, "token_ids")


def test_out_of_range_token_ids_raise_in_every_layout_at_every_tp_size(results):
    for per_rank in results:
        assert len(per_rank) == len(token_id_cases.LAYOUTS) * 2 * 2
        for case, outcome in per_rank.items():
            assert outcome.startswith("RuntimeError: token ids must be in [0, vocab_size=128)"), (case, outcome)
