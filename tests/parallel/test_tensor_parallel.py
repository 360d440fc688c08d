"""Every tensor-parallel layout computes the single-device model's function (CPU, gloo, TP 2 and 4).

One process group per TP size runs all cases (tests/parallel/tp_cases.py); this module asserts on
what each rank reported. fp32 tolerances: 1e-5 relative.
"""

from __future__ import annotations

import json

import pytest

from boost_hf import ParallelConfig
from boost_hf.perf.comm_formula import model_communication
from tests.distributed import launch
from tests.parallel import tp_cases

TOL = 1e-5


@pytest.fixture(scope="module", params=[2, 4], ids=lambda p: f"tp{p}")
def reports(request):
    world = request.param
    return world, launch(tp_cases.everything, world, world, timeout=1500)


def _cases(reports):
    world, per_rank = reports
    return [(rank, c) for rank, r in enumerate(per_rank) for c in r["parity"]]


def test_every_case_ran(reports):
    world, per_rank = reports
    assert all(len(r["parity"]) == len(tp_cases.all_cases(world)) for r in per_rank)


def test_sharded_init_is_a_slice_of_the_single_device_model(reports):
    bad = [c["case"] for _, c in _cases(reports) if not c["init_exact"] or not c["same_names"]]
    assert not bad, bad


def test_loss_matches_single_device_and_is_the_same_on_every_rank(reports):
    bad = [(c["case"], c["loss_rel"]) for _, c in _cases(reports) if c["loss_rel"] > TOL or not c["loss_same_on_ranks"]]
    assert not bad, bad


def test_every_gradient_matches_single_device(reports):
    bad = [(c["case"], c["worst_grad"], c["grad_rel"]) for _, c in _cases(reports) if c["grad_rel"] > TOL]
    assert not bad, bad


def test_parameters_after_one_optimizer_step_match(reports):
    bad = [(c["case"], c["param_rel"]) for _, c in _cases(reports) if c["param_rel"] > TOL]
    assert not bad, bad


def test_counted_communication_equals_the_formula(reports):
    bad = [
        (json.dumps(c["case"]), c["fwd"], c["expected_fwd"], c["bwd"], c["expected_bwd"])
        for _, c in _cases(reports)
        if not (c["fwd_matches"] and c["bwd_matches"] and c["layer_fwd_matches"])
    ]
    assert not bad, bad


def test_lowrank_checkpointing_recompute_issues_no_collective_under_online_btp(reports):
    world, _ = reports
    checked = 0
    for _, c in _cases(reports):
        p = c["case"]["parallel"]
        if (p.get("tp_style") == "btp" and p.get("rmsnorm", "online") == "online" and p.get("activation_checkpointing") == "lowrank"
                and not p.get("sequence_parallel")):  # latent sequence parallelism re-gathers its latents
            config = tp_cases.tiny_config(**c["case"]["model"])
            plain = ParallelConfig(tp_size=world, **{**p, "activation_checkpointing": "none"})
            without = model_communication(config, plain, tp_cases.BATCH * tp_cases.SEQ).backward.to_dict()
            assert c["bwd"] == without
            checked += 1
    assert checked >= 3


def test_checkpointing_saves_only_latents_and_residual(reports):
    cases = [c for _, c in _cases(reports) if "expected_saved_bytes" in c]
    assert cases
    bad = [(c["case"], c["saved_bytes"], c["expected_saved_bytes"]) for c in cases if c["saved_bytes"] != c["expected_saved_bytes"]]
    assert not bad, bad
    # and low-rank checkpointing keeps far less than no checkpointing
    none = {json.dumps({**c["case"], "parallel": {**c["case"]["parallel"], "activation_checkpointing": "lowrank"}}): c["saved_bytes"]
            for _, c in _cases(reports) if c["case"]["parallel"].get("activation_checkpointing") == "none"}
    for c in cases:
        key = json.dumps(c["case"])
        if key in none:
            assert c["saved_bytes"] < none[key] / 2, (c["case"], c["saved_bytes"], none[key])


@pytest.mark.parametrize("bottleneck", ["cola", "tensor_train"])
def test_save_at_tp_world_load_at_other_tp_sizes(reports, bottleneck):
    world, per_rank = reports
    key = "round_trip" if bottleneck == "cola" else "tensor_train_round_trip"
    for r in per_rank:
        assert set(r[key]) >= {"tp1-btp", "tp2-btp", f"tp{world}-btp", "tp2-vanilla", "plain"}
        assert max(r[key].values()) <= 1e-5, r[key]


def test_bad_configurations_raise_clear_errors_on_every_rank(reports):
    world, per_rank = reports
    expected_words = {
        "heads": "num_attention_heads",
        "kv_heads": "num_key_value_heads",
        "megatron_lowrank": "tp_style='megatron'",
        "btp_full_rank": "low-rank model",
        "tp_not_dividing_world": "does not divide the world size",
        "tied_btp": "tie_word_embeddings",
        "tt_modes_btp": "down_proj's input modes are [9, 8]",
    }
    for r in per_rank:
        for name, word in expected_words.items():
            assert r["bad"][name] is not None and word in r["bad"][name], (name, r["bad"][name])


def test_sequence_parallel_cases_ran_and_keep_the_residual_on_a_token_shard(reports):
    """Megatron with sequence parallelism: its cases are among the parity cases above, and with full
    checkpointing a layer keeps only its ``[B, S/p, d]`` token shard (``N d / p``)."""
    world, _ = reports
    sp = [c for _, c in _cases(reports) if c["case"]["parallel"].get("sequence_parallel")]
    assert len(sp) == len(tp_cases.sequence_parallel_cases()) * world
    full = [c for c in sp if c["case"]["parallel"].get("activation_checkpointing") == "full" and c["case"]["parallel"]["tp_style"] == "megatron"]
    assert full and all(c["saved_bytes"] == 4 * tp_cases.BATCH * tp_cases.SEQ * tp_cases.TINY["hidden_size"] // world for c in full)


def test_sequence_parallel_refuses_a_sequence_not_divisible_by_tp_size_on_every_rank(reports):
    world, per_rank = reports
    for r in per_rank:
        message = r["sequence_length_not_divisible"]
        assert message is not None and f"{world + 1} tokens" in message and "sequence_parallel=False" in message, message


def test_hooks_on_single_device_modules_fire_after_parallelize(reports):
    """Hooks registered before ``parallelize`` fire on every projection, attention and MLP; the sliced model
    computes the single-device logits, from ``input_ids`` and from ``inputs_embeds``; hidden states are
    returned for every layer."""
    for r in (per_rank for per_rank in reports[1]):
        for name, case in r["hugging_face"].items():
            assert case["hooked"] and case["hook_calls"] == 2 * 9 * 3, (name, case)  # 2 layers x 9 modules x 3 forwards
            assert case["logits_rel"] <= TOL and case["inputs_embeds_rel"] <= TOL, (name, case)
            assert case["hidden_states"] == tp_cases.TINY["num_hidden_layers"] + 1, (name, case)
            assert case["cached_generate_equal"], (name, case)


def test_gather_full_many_returns_the_full_tensors(reports):
    """One all-gather per dtype for many shards (fp32, bf16, dims 0 and 1, a replicated tensor): what the parity
    cases gather parameters and gradients with."""
    assert all(r["gather_many"] for r in reports[1])
