"""``boost-hf plan``: the search, its memory model and its output (nothing is built or run)."""

from __future__ import annotations

import json
import re

import pytest

from boost_hf import BoostLlamaConfig
from boost_hf.cli import main
from boost_hf.perf.hardware import get_hardware
from boost_hf.perf.memory import GIB
from boost_hf.perf.planner import Cluster, plan

JSON_KEYS = {"tp", "pp", "dp", "pp_schedule", "pp_microbatches", "sequence_parallel", "activation_checkpointing", "zero1",
             "precision", "memory_gb_per_gpu", "fits", "step_s", "command"}


def test_json_for_30b_on_32_h100(tmp_path, capsys):
    """cola-30b on 4 nodes of 8 H100: layouts that fit, best first, each with its memory and the multi-node command;
    the search evaluates a bounded number of layouts (3084 when written; ``plan --json`` takes seconds)."""
    config_path = tmp_path / "accelerate.yaml"
    assert main(["plan", "--preset", "cola-30b", "--gpus", "32", "--gpu", "h100", "--accelerate-config", str(config_path),
                 "--json", "--top", "4"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert all(JSON_KEYS <= set(layout) for layout in listed)
    layouts = [layout for layout in listed if layout["fits"]]
    assert len(layouts) == 4 and listed[:4] == layouts  # the fitting ones first
    assert all(layout["memory_gb_per_gpu"] <= 80 for layout in layouts)
    for never in listed[4:]:  # the best of a tp x pp that fits nowhere: what it needs
        assert never["memory_gb_per_gpu"] > 80 and never["step_s"] is None and never["command"] is None and never["reason"]
    assert [layout["step_s"] for layout in layouts] == sorted(layout["step_s"] for layout in layouts)
    for layout in layouts:
        assert layout["tp"] * layout["pp"] * layout["dp"] == 32 and layout["tp"] <= 8
        assert sum(v for k, v in layout["memory_breakdown_gb"].items() if k != "total") == pytest.approx(layout["memory_gb_per_gpu"], abs=0.05)
        command = layout["command"].split()
        assert command[command.index("--num_machines") + 1] == "4" and "$NODE_RANK" in command
        assert command[command.index("--tp_size") + 1] == str(layout["tp"])
    assert "num_machines: 4" in config_path.read_text()

    cluster = Cluster(32, get_hardware("h100"), 80 * GIB)
    result = plan(BoostLlamaConfig.from_preset("cola-30b"), cluster, seq_len=4096, global_batch=512,
                  precisions=("autocast", "bf16_params"))
    assert result.tried == 3084 and round(result.ranked[0].step_s, 4) == layouts[0]["step_s"]


def test_13b_on_8_a100_shows_the_papers_layout(tmp_path, capsys):
    """The paper's tp 4 x pp 2 is either picked or listed with what makes it slower."""
    assert main(["plan", "--preset", "cola-13b", "--gpus", "8", "--gpu", "a100-nvswitch", "--global-batch", "64",
                 "--accelerate-config", str(tmp_path / "a.yaml")]) == 0
    out = capsys.readouterr().out
    winner = out.splitlines()[4]
    papers = [line for line in out.splitlines() if line.strip().startswith("tp 4, pp 2")]
    assert winner.startswith(" 1  tp 4, pp 2") or (papers and "%" in papers[0] and "ms" in papers[0]), out


def test_nothing_fits_says_the_memory_needed(tmp_path, capsys):
    """cola-7b on one 24 GiB GPU: nothing fits; the smallest layout's need is printed, and ``--json`` lists it with
    ``fits`` false and the reason."""
    argv = ["plan", "--preset", "cola-7b", "--gpus", "1", "--gpu", "a100", "--gpu-memory-gb", "24",
            "--accelerate-config", str(tmp_path / "a.yaml")]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "nothing fits in 24 GiB per GPU. The smallest needs" in out
    assert main([*argv, "--json"]) == 1
    (smallest,) = json.loads(capsys.readouterr().out)
    assert smallest["fits"] is False and smallest["memory_gb_per_gpu"] > 24 and "needs" in smallest["reason"]
    assert not (tmp_path / "a.yaml").exists()


def test_a_given_setting_is_kept(tmp_path, capsys):
    assert main(["plan", "--preset", "cola-7b", "--gpus", "8", "--gpu", "a100-nvswitch", "--tp_size", "4",
                 "--activation_checkpointing", "lowrank", "--zero1", "false", "--precision_policy", "autocast", "--json",
                 "--accelerate-config", str(tmp_path / "a.yaml")]) == 0
    layouts = json.loads(capsys.readouterr().out)
    assert {(x["tp"], x["activation_checkpointing"], x["zero1"], x["precision"]) for x in layouts} == {(4, "lowrank", False, "autocast")}


def test_bf16_gradient_reduction_halves_the_dp_bytes(tmp_path, capsys):
    """``--grad_reduce_dtype bf16`` (bf16_params only): the DP all-reduce moves 2 bytes per gradient element, which
    the estimator times and the command passes on; other policies refuse it."""
    from boost_hf.perf.estimator import estimate_layout
    from boost_hf.perf.workload import Workload
    from boost_hf.perf.memory import precision_bytes

    assert precision_bytes("bf16_params", "bf16").reduce == 2 and precision_bytes("bf16_params").reduce == 4
    with pytest.raises(ValueError, match="needs the bf16_params precision policy"):
        precision_bytes("autocast", "bf16")
    config, hardware = BoostLlamaConfig.from_preset("cola-7b"), get_hardware("a100")

    def dp_seconds(reduce):  # across nodes (tp 4 x dp 8 > 4 per node): the all-reduce is exposed
        workload = Workload(tp=4, micro_batch=1, num_micro_batches=1, dp_size=8, precision="bf16_params",
                            grad_reduce_dtype=reduce)
        return estimate_layout(config, "btp", workload, hardware).breakdown_s["dp_comm"]

    assert 0 < dp_seconds("bf16") < dp_seconds("fp32")
    assert main(["plan", "--preset", "cola-7b", "--gpus", "16", "--gpu", "a100", "--precision_policy", "bf16_params",
                 "--grad-reduce-dtype", "bf16", "--json", "--top", "2", "--accelerate-config", str(tmp_path / "a.yaml")]) == 0
    best = json.loads(capsys.readouterr().out)[0]
    assert best["grad_reduce_dtype"] == ("bf16" if best["dp"] > 1 else None)
    assert ("--grad_reduce_dtype bf16" in best["command"]) == (best["dp"] > 1)


@pytest.mark.parametrize("arguments, message", [
    (["--gpus", "3", "--gpus-per-node", "2"], r"3 GPUs do not fill nodes of 2 evenly: .* \(--gpus 2 or 4\), or 1 GPU on each "
                                              r"of 3 nodes \(--gpus-per-node 1\)"),
    (["--gpus", "12", "--gpus-per-node", "8"], r"\(--gpus 8 or 16\), or 6 GPUs on each of 2 nodes \(--gpus-per-node 6\)"),
    (["--gpus", "8", "--seq", "0"], r"--seq-len must be positive, got 0"),
    (["--gpus", "8", "--global-batch", "0"], r"--global-batch must be positive, got 0"),
    (["--gpus", "8", "--global-batch", "-4"], r"--global-batch must be positive, got -4"),
    (["--gpus", "0"], r"--gpus must be positive, got 0"),
    (["--gpus", "8", "--gpus-per-node", "0"], r"--gpus-per-node must be positive, got 0"),
    (["--gpus", "8", "--tp_size", "0"], r"--tp-size must be positive, got 0"),
    (["--gpus", "8", "--pp_size", "-1"], r"--pp-size must be positive, got -1"),
    (["--gpus", "8", "--pp_microbatches", "0"], r"--pp-microbatches must be positive, got 0"),
    (["--gpus", "8", "--top", "0"], r"--top must be positive, got 0"),
])
def test_a_plan_that_cannot_launch_or_sizes_nothing_is_refused(tmp_path, capsys, arguments, message):
    """No command accelerate cannot launch as printed (an uneven count of processes per node), no size of zero read as
    the default: each refused with the fix, exit 2, no accelerate config written."""
    with pytest.raises(SystemExit) as stopped:
        main(["plan", "--preset", "cola-1b", "--accelerate-config", str(tmp_path / "a.yaml"), *arguments])
    assert stopped.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "a.yaml").exists()
