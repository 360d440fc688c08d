"""``boost-hf estimate``."""

from __future__ import annotations

import json

import pytest

from boost_hf.cli import SUBCOMMANDS, main


def test_table(capsys):
    assert main(["estimate", "--preset", "cola-7b", "--tp", "4", "--micro-batch", "4", "--seq", "4096", "--gpu", "a100"]) == 0
    out = capsys.readouterr().out
    for text in ("megatron", "vanilla", "btp", "step time (s)", "comm per layer fwd (GiB)", "btp speed-up", "assumptions"):
        assert text in out


def test_json_and_overrides(capsys):
    main(["estimate", "--preset", "cola-7b", "--tp", "4", "--json"])
    base = json.loads(capsys.readouterr().out)
    main(["estimate", "--preset", "cola-7b", "--tp", "4", "--json", "--peak-tflops", "624", "--efficiency", "0.7",
          "--bandwidth-gbps", "100", "--latency-us", "30"])
    fast = json.loads(capsys.readouterr().out)
    assert set(base["layouts"]) == {"megatron", "vanilla", "btp"}
    assert base["layouts"]["btp"]["collectives_per_layer_fwd"] == 4
    assert base["assumptions"]["preset"] == "cola-7b"
    assert fast["assumptions"]["hardware"]["peak_tflops"] == 624
    assert fast["assumptions"]["hardware"]["link_gbps"] == 100
    assert fast["assumptions"]["efficiency"]["gemm_max"] == 0.7
    assert fast["layouts"]["btp"]["breakdown_s"]["gemm"] < base["layouts"]["btp"]["breakdown_s"]["gemm"]
    assert fast["layouts"]["btp"]["breakdown_s"]["tp_comm"] > base["layouts"]["btp"]["breakdown_s"]["tp_comm"]


def test_pipeline_schedule_and_micro_batch_advice(capsys):
    argv = ["estimate", "--preset", "cola-13b", "--tp", "4", "--pp", "2", "--micro-batch", "1", "--checkpointing", "lowrank"]
    assert main([*argv, "--pp_schedule", "interleaved-1f1b", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    for text in ("interleaved-1f1b with 2 stage(s) per rank", "pipeline bubble (% of step)", "P2P per boundary each way (MiB)",
                 "peak activations/stage (GiB)", "micro-batches (btp, interleaved-1f1b, 8 sequences", "recommended: --microbatches"):
        assert text in out
    main([*argv, "--pp-schedule", "1f1b", "--num-micro-batches", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    advice = out["micro_batch_options"]
    assert advice["layout"] == "btp" and [o["num_micro_batches"] for o in advice["options"]] == [2, 4, 8]
    assert advice["recommended"] in (2, 4, 8)
    assert out["layouts"]["btp"]["p2p_bytes_per_boundary"] == 4096 * 5120 // 4 * 2
    assert len(out["layouts"]["btp"]["peak_activation_bytes"]) == 2
    assert out["assumptions"]["workload"]["pp_schedule"] == "1f1b"


def test_too_few_sequences_for_any_split_still_estimates(capsys):
    assert main(["estimate", "--preset", "cola-13b", "--tp", "4", "--pp", "4", "--micro-batch", "1", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "step time (s)" in out and "would refuse this: 1F1B needs at least as many micro-batches as stages (4)" in out
    assert "no split of 2 sequences per pipeline replica suits 1f1b at pp 4" in out


def test_unmodelled_schedule_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--preset", "cola-13b", "--pp", "2", "--stages-per-rank", "2"])  # 1f1b: one stage per rank
    assert exit_info.value.code == 2
    assert "runs one stage per rank" in capsys.readouterr().err


def test_invalid_layout_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--preset", "cola-1b", "--tp", "2"])  # d_ff 5461 cannot be split in two
    assert exit_info.value.code == 2
    assert "intermediate_size" in capsys.readouterr().err


def test_subcommand_registry():
    assert "estimate" in SUBCOMMANDS
    with pytest.raises(SystemExit):
        main([])


def test_sequence_parallel_flag(capsys):
    argv = ["estimate", "--preset", "cola-7b", "--tp", "4", "--micro-batch", "2", "--gpu", "h100", "--json"]
    main(argv)
    plain = json.loads(capsys.readouterr().out)
    main([*argv, "--sequence_parallel"])
    sp = json.loads(capsys.readouterr().out)
    assert sp["assumptions"]["workload"]["sequence_parallel"] is True
    for layout in ("megatron", "btp"):
        assert sp["layouts"][layout]["sequence_parallel"] is True
        assert sp["layouts"][layout]["collectives_per_layer_fwd"] == 2 * plain["layouts"][layout]["collectives_per_layer_fwd"]
        assert sp["layouts"][layout]["step_time_s"] < plain["layouts"][layout]["step_time_s"]
    assert sp["layouts"]["vanilla"]["sequence_parallel"] is False
    main([*argv[:-1], "--sequence-parallel", "--checkpointing", "lowrank"])
    out = capsys.readouterr().out
    assert "sequence_parallel=True" in out and "kept per layer (MiB)" in out and "vanilla has none" in out
    with pytest.raises(SystemExit):
        main([*argv, "--sequence_parallel", "--seq", "4098"])
    assert "pad it to a multiple of 4" in capsys.readouterr().err
