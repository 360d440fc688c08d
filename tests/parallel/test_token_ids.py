"""Out-of-range token ids and labels raise the same ``ValueError`` when the model is called directly, in every layout
at TP 1 and 2 and through the pipeline at PP 2 (megatron and vanilla at TP 2 used to embed an id >= vocab_size as
zeros, and the vocab-parallel loss counted a label 300 or -5 as valid, silently; at PP 2 an id gave torch's "index out
of range in self" inside the pipeline engine's error). Run in the 2-rank launch shared with other files
(tests/parallel/tp2_model_cases.py)."""

from __future__ import annotations

import pytest

from tests.parallel import token_id_cases
from tests.parallel.tp2_model_cases import section

EXPECTED = {
    "too_large": "ValueError: token id 128 in input_ids is outside the model's vocabulary [0, 128): the data was tokenized "
                 "with another tokenizer, or vocab_size is too small.",
    "negative": "ValueError: token id -1 in input_ids is outside the model's vocabulary [0, 128)",
    "label_too_large": "ValueError: token id 300 in labels is neither in the model's vocabulary [0, 128) nor the ignore "
                       "index -100: the data was tokenized with another tokenizer, or vocab_size is too small.",
    "label_negative": "ValueError: token id -5 in labels is neither in the model's vocabulary [0, 128) nor the ignore index -100",
    "label_ignored": "no error",
}


@pytest.fixture(scope="module")
def results(tp2_model_results):
    return section(tp2_model_results, "token_ids")


def test_out_of_range_token_ids_and_labels_raise_the_same_error_in_every_layout(results):
    for per_rank in results:
        assert len(per_rank) == (len(token_id_cases.LAYOUTS) * 2 + 1) * len(EXPECTED)
        for case, outcome in per_rank.items():
            assert outcome.startswith(EXPECTED[case.split("-", 2)[-1]]), (case, outcome)
