"""``boost-hf estimate --measured``: a measured per-layer time replaces the modelled compute, communication
stays modelled, and a measurement of another workload is refused."""

import json
import subprocess
import sys

import pytest

from boost_hf import BoostLlamaConfig
from boost_hf.perf.estimator import estimate
from boost_hf.perf.measured import MeasuredLayer, MeasuredRun, measured_layer_seconds
from boost_hf.perf.workload import Workload

WORKLOAD = Workload(tp=4, micro_batch=2, seq_len=4096)
BTP_MS, MEGATRON_MS, BTP_SP_MS, MEGATRON_SP_MS = 4.0, 10.0, 3.5, 8.0


@pytest.fixture
def measured(tmp_path):
    run = MeasuredRun("NVIDIA H100 80GB HBM3 (cuda)", 4, 2, 4096, "none", (
        MeasuredLayer("cola-7b", "btp", "online", True, eager_ms=BTP_MS, compiled_ms=3.0),
        MeasuredLayer("cola-7b", "btp", "sync", True, eager_ms=99.0),
        MeasuredLayer("llama-7b", "megatron", "online", True, eager_ms=MEGATRON_MS),
        MeasuredLayer("llama-7b", "megatron", "online", True, True, eager_ms=MEGATRON_SP_MS),
        MeasuredLayer("cola-7b", "btp", "online", True, True, eager_ms=BTP_SP_MS),
    ))
    path = tmp_path / "runs" / "measured.json"  # save creates the folder
    run.save(path)
    return path


def test_measured_time_replaces_modelled_compute_and_keeps_communication(measured):
    config = BoostLlamaConfig.from_preset("cola-7b")
    run = MeasuredRun.load(measured)
    seconds = {layout: measured_layer_seconds(run, preset, WORKLOAD.parallel(layout), 2, 4096)
               for layout, preset in (("btp", "cola-7b"), ("megatron", "llama-7b"))}
    assert seconds == {"btp": BTP_MS / 1e3, "megatron": MEGATRON_MS / 1e3}
    modelled = estimate(config, WORKLOAD, "h100", layouts=("megatron", "btp"))
    with_measured = estimate(config, WORKLOAD, "h100", layouts=("megatron", "btp"), measured_layer_s=seconds)
    for layout, ms in (("btp", BTP_MS), ("megatron", MEGATRON_MS)):
        got, model = with_measured.layouts[layout].breakdown_s, modelled.layouts[layout].breakdown_s
        assert got["measured"] == pytest.approx(config.num_hidden_layers * ms / 1e3)
        assert got["attention"] == got["memory"] == 0.0
        assert got["gemm"] < model["gemm"]  # only the LM head's GEMM stays modelled
        assert got["tp_comm"] == pytest.approx(model["tp_comm"])
        assert got["optimizer"] < model["optimizer"]  # the layers' AdamW step is inside the measured time
        assert modelled.layouts[layout].breakdown_s["measured"] == 0.0
    assert with_measured.ratio("megatron", "btp") != modelled.ratio("megatron", "btp")


@pytest.mark.parametrize("change, message", [
    (dict(tp=2), "tp=4"),
    (dict(micro_batch=1), "micro_batch=2"),
    (dict(seq_len=2048), "seq=4096"),
    (dict(activation_checkpointing="lowrank"), "activation_checkpointing='none'"),
    (dict(group_linears=False), "no cola-7b btp layer"),
])
def test_another_workload_is_refused(measured, change, message):
    workload = Workload(**{"tp": 4, "micro_batch": 2, "seq_len": 4096, **change})
    with pytest.raises(ValueError, match=message):
        measured_layer_seconds(MeasuredRun.load(measured), "cola-7b", workload.parallel("btp"), workload.micro_batch, workload.seq_len)


def test_missing_mode_and_missing_file_are_named(measured, tmp_path):
    run = MeasuredRun.load(measured)
    with pytest.raises(ValueError, match="no compiled time"):
        measured_layer_seconds(run, "llama-7b", WORKLOAD.parallel("megatron"), 2, 4096, "compiled")
    assert measured_layer_seconds(run, "cola-7b", WORKLOAD.parallel("btp"), 2, 4096, "compiled") == 3.0 / 1e3
    with pytest.raises(FileNotFoundError, match="rank_cost.py --json"):
        MeasuredRun.load(tmp_path / "absent.json")


def test_cli_uses_the_measured_file(measured):
    args = [sys.executable, "-m", "boost_hf.cli", "estimate", "--preset", "cola-7b", "--tp", "4", "--micro-batch", "2",
            "--seq", "4096", "--layouts", "megatron", "btp", "--gpu", "h100", "--measured", str(measured), "--json"]
    out = json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)
    assert out["assumptions"]["measured"]["device"] == "NVIDIA H100 80GB HBM3 (cuda)"
    assert out["layouts"]["btp"]["breakdown_s"]["measured"] == pytest.approx(32 * BTP_MS / 1e3)
    refused = subprocess.run(args[:-3] + ["--measured", str(measured), "--seq", "2048"], capture_output=True, text=True)
    assert refused.returncode != 0 and "seq=4096" in refused.stderr


def test_sequence_parallel_layers_are_told_apart(measured, tmp_path):
    """A layer measured with sequence parallelism times only an SP workload, and a file written before the
    field existed reads as measured without it."""
    run = MeasuredRun.load(measured)
    sp = Workload(tp=4, micro_batch=2, seq_len=4096, sequence_parallel=True)
    for layout, preset, ms in (("btp", "cola-7b", BTP_SP_MS), ("megatron", "llama-7b", MEGATRON_SP_MS)):
        assert measured_layer_seconds(run, preset, sp.parallel(layout), 2, 4096) == ms / 1e3
    without = MeasuredRun(run.device, 4, 2, 4096, "none", run.layers[:1])
    with pytest.raises(ValueError, match="no cola-7b btp layer"):
        measured_layer_seconds(without, "cola-7b", sp.parallel("btp"), 2, 4096)
    old = json.loads(measured.read_text())
    for layer in old["layers"]:
        del layer["sequence_parallel"]
    old["layers"] = old["layers"][:1]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert MeasuredRun.load(tmp_path / "old.json").layers[0].sequence_parallel is False
