"""Pipeline parallelism (x TP x DP) computes the single-process model's training steps (CPU, gloo, 4 processes).

One process group runs every case (tests/parallel/pp_cases.py); this module asserts on what each rank
reported. fp32 tolerances as in the TP suite: 1e-5 relative, each gradient and parameter by its largest
element-wise difference over its largest element; two AdamW steps with ``eps=1e-3`` (see
``pp_cases.optimizer_of``: with 1e-6, fp32 rounding differences of 4e-8 between two summation orders of a
gradient became 5e-5 differences of the parameter).
"""

from __future__ import annotations

import pytest

from tests.distributed import launch
from tests.parallel import pp_cases

TOL = 1e-5


@pytest.fixture(scope="module")
def reports():
    return launch(pp_cases.everything, 4, timeout=3000)


def _cases(reports):
    return [(rank, c) for rank, r in enumerate(reports) for c in r["parity"]]


def test_every_case_ran(reports):
    expected = len(pp_cases.pp2_tp2_cases() + pp_cases.other_cases())
    assert all(len(r["parity"]) == expected for r in reports)


def test_parameter_names_are_canonical_and_every_parameter_is_held(reports):
    bad = [c["case"] for _, c in _cases(reports) if not c["names_canonical"]]
    assert not bad, bad


def test_loss_and_grad_norm_match_single_process_and_are_the_same_on_every_rank(reports):
    bad = [(c["case"], c["loss_rel"], c["norm_rel"]) for _, c in _cases(reports)
           if c["loss_rel"] > TOL or c["norm_rel"] > TOL or not c["same_on_ranks"]]
    assert not bad, bad


def test_every_gradient_matches_single_process(reports):
    bad = [(c["case"], c["worst_grad"], c["grad_rel"]) for _, c in _cases(reports) if c["grad_rel"] > TOL]
    assert not bad, bad


def test_parameters_after_two_clipped_adamw_steps_match(reports):
    bad = [(c["case"], c["param_rel"]) for _, c in _cases(reports) if c["param_rel"] > TOL]
    assert not bad, bad


def test_counted_point_to_point_traffic_equals_the_formula(reports):
    """Tensors and elements each rank sent across stage boundaries in a step, the second (activations forward,
    gradients backward) equal ``stage_boundary_communication`` (LaX's latents: a 1/p token share per TP rank)."""
    bad = [(c["case"], rank, c["p2p"]) for rank, c in _cases(reports) if c["p2p"]["counted"] != c["p2p"]["formula"]]
    assert not bad, bad


def test_counted_all_gathers_over_tp_equal_the_formula(reports):
    """The all-gathers over TP (btp and vanilla) of a step, the second: the boundary's (LaX's shared latents) plus the
    layers' and the last stage's, as the formula counts them."""
    counted = [(c["case"], rank, c["tp_all_gather"]) for rank, c in _cases(reports) if c["tp_all_gather"]["formula"] is not None]
    assert any(case["model"].get("bottleneck") == "lax" and case["parallel"].get("tp_size", 1) > 1 for case, _, _ in counted)
    bad = [entry for entry in counted if entry[2]["counted"] != entry[2]["formula"]]
    assert not bad, bad


def test_lax_latents_cross_stage_boundaries(reports):
    """LaX cases (their layers > 0 read the previous layer's latents, across the stage cut too) are among the
    exact ones, at PP2 x TP2, PP4 and interleaved."""
    lax = {str(c["case"]["parallel"]) for _, c in _cases(reports) if c["case"]["model"].get("bottleneck") == "lax"}
    assert len(lax) >= 8


def test_checkpoint_is_canonical_and_loads_at_pp_x_tp(reports):
    for r in reports:
        trip = r["round_trip"]
        assert trip["plain_rel"] == 0.0 and trip["loaded_rel"] == 0.0 and trip["same_names"], trip
        assert trip["eval_loss_rel"] <= TOL, trip


def test_bad_configurations_raise_clear_errors_on_every_rank(reports):
    expected_words = {
        "pp_not_dividing_world": "does not divide the world size",
        "more_stages_than_layers": "more than the model's 4 decoder layers",
        "layer_split": "add up to num_hidden_layers",
        "too_few_microbatches": "pp_microbatches >= 2",
        "tied": "tie_word_embeddings=False",
        "unknown_schedule": "Unknown pp_schedule",
        "zero_bubble": "re-entrant torch.utils.checkpoint",
        "microbatches_not_dividing_batch": "multiple of 3",
    }
    for r in reports:
        for name, words in expected_words.items():
            assert r["bad"][name] is not None and words in r["bad"][name], (name, r["bad"][name])
