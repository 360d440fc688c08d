"""Loading keeps the weights in every layout: ``from_pretrained(dir, parallel_config=...)`` at TP 1 and 2, every
style, every activation-checkpointing mode, computes the logits of the saved (perturbed, i.e. not freshly
initialised) model, like a plain ``from_pretrained``. Run in the 2-rank launch shared with other files
(tests/parallel/tp2_model_cases.py)."""

from __future__ import annotations

import pytest

from tests.parallel import load_cases
from tests.parallel.tp2_model_cases import section

TOL = 1e-5


@pytest.fixture(scope="module")
def results(tp2_model_results):
    return section(tp2_model_results, "load")


def test_every_layout_loads_the_saved_weights(results):
    for per_rank in results:
        expected_cases = sum(1 + 2 * len(styles) * len(load_cases.CHECKPOINTING) for _, styles in load_cases.MODELS)
        assert len(per_rank) == expected_cases
        loaded = {name: value for name, value in per_rank.items() if not isinstance(value, str)}
        wrong = {name: value for name, value in loaded.items() if value > TOL}
        assert not wrong, wrong
        for tp in (1, 2):
            for style in ("btp", "vanilla"):
                for checkpointing in load_cases.CHECKPOINTING:
                    assert f"{{'bottleneck': 'cola'}}-tp{tp}-{style}-{checkpointing}" in loaded


def test_only_layouts_that_cannot_hold_the_model_are_refused(results):
    refused = {name: value for name, value in results[0].items() if isinstance(value, str)}
    assert sorted(refused) == ["{'bottleneck': None}-tp1-megatron-lowrank", "{'bottleneck': None}-tp2-megatron-lowrank"]
    assert all("activation_checkpointing='lowrank' cuts at r-dim latents and needs a low-rank model" in v for v in refused.values())
