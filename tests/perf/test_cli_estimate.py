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


def test_invalid_layout_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--preset", "cola-1b", "--tp", "2"])  # d_ff 5461 cannot be split in two
    assert exit_info.value.code == 2
    assert "intermediate_size" in capsys.readouterr().err


def test_subcommand_registry():
    assert "estimate" in SUBCOMMANDS
    with pytest.raises(SystemExit):
        main([])
