"""``make gpu-check`` (``benchmarks/gpu_check.py``) on a machine without CUDA: it says so and exits 0, writing
nothing, without ``datasets`` or ``deepspeed`` (the lent GPU machine has neither); with ``--device cpu`` every part's
code path runs at tiny shapes (each measurement in a process of its own, eager and compiled, its rows naming model,
implementation and layout apart, MFU in both conventions); its training-step cases cover every architecture in every
layout (and sequence parallelism) that the layouts accept; its plan fits two commands of a lent GPU's 15 minutes.
The CUDA readings need a GPU (``make gpu-check`` there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from boost_hf import BoostLlamaConfig, ParallelConfig
from boost_hf.parallel.layouts import LAYOUTS

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_check  # noqa: E402

# run as the lent machine has it: neither datasets nor deepspeed importable
ABSENT = ("datasets", "deepspeed", "evaluate", "gensim")
RUN_WITHOUT = ("import sys, runpy; sys.modules.update(dict.fromkeys({absent})); sys.argv = ['gpu_check.py', *{argv}]; "
               "runpy.run_path('benchmarks/gpu_check.py', run_name='__main__')")


# The three tests that run a part end to end on the CPU (about 10 min together, compiling) run in the minimum leg, whose
# stack (torch 2.11, transformers 5.17) is the lent GPU machine's; the pinned leg's torch compiles every layout in
# tests/parallel/test_compile.py. The other tests of this file run in both legs.
ON_THE_GPU_MACHINES_STACK = pytest.mark.skipif(
    not os.environ.get("BOOST_HF_MINIMUM_VERSIONS"),
    reason="runs in make test's minimum leg: the lent GPU machine's stack (make test-min)")


def _run(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess:
    code = RUN_WITHOUT.format(absent=ABSENT, argv=[*argv, "--out", str(tmp_path / "gpu")])
    # the timeout guards against a hang only (the training-step part takes ~5 min on 2 idle cores, more under load)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=2400)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path of a machine without CUDA")
def test_without_a_cuda_device_it_says_so_and_exits_0(tmp_path):
    completed = _run(tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "gpu-check: no CUDA device found" in completed.stdout
    assert not (tmp_path / "gpu").exists()


def test_lists_its_cases_without_datasets_or_deepspeed(tmp_path):
    completed = _run("--list", tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    assert [line.split(":")[0] for line in lines if not line.startswith("measure ")] == [case.name for case in gpu_check.cases()]
    assert [line for line in lines if line.startswith("measure ")] == [
        f"measure {part}: {spec.name}" for part in gpu_check.PARTS for spec in gpu_check.measurements(part)]


def test_the_plan_fits_a_lent_gpu_with_the_release_shapes_first():
    """Commands 1 and 2 fit one lent machine's 15 minutes with its start (~1.5 min) at their budget and grace, each
    predicted (on an H200) within its budget; the parts in order of value, the release's 7B TP4 micro-batch 4 and 13B
    TP4 micro-batch 1 first; ``make gpu-check`` runs the commands in order; each writes at most 7 files (the lent
    machine brings back 8)."""
    assert gpu_check.PARTS == tuple(p for parts in gpu_check.COMMANDS.values() for p in parts)
    assert 90 + 2 * (gpu_check.COMMAND_BUDGET_S + gpu_check.GRACE_S) <= 15 * 60
    for parts in gpu_check.COMMANDS.values():
        assert sum(gpu_check.PREDICTED_S[p] for p in parts) <= gpu_check.COMMAND_BUDGET_S
        files = {f"{gpu_check.FILES[p]}.md" for p in parts} | {"gpu_check.md", "gpu_check.json", "gpu_check.log"}
        assert len(files | ({"gpu_layer.json"} if "layer" in parts else set())) <= 7
    first, second = (gpu_check.measurements(part) for part in gpu_check.COMMANDS[1][:2])
    assert {(s.model, s.micro_batch, s.seq, s.fields["tp_size"]) for s in first} == {("llama-7b", 4, 4096, 4), ("cola-7b", 4, 4096, 4)}
    assert {(s.model, s.micro_batch, s.fields["tp_size"]) for s in second} == {("llama-13b", 1, 4), ("cola-13b", 1, 4)}
    make = (REPO / "Makefile").read_text()
    assert make.index("gpu_check.py --command 1") < make.index("gpu_check.py --command 2") < make.index("gpu_check.py --command 3")


def test_mfu_is_counted_in_both_conventions():
    """Causal attention at half (this repository's convention) and whole (torchtitan's): the same linear FLOPs, the
    attention term doubled; a rank's layer is a quarter of the layer's model FLOPs."""
    from boost_hf import BoostLlamaConfig
    from boost_hf.perf.flops import attention_flops_per_token, linear_flops_per_token

    layer = gpu_check.measurements("layer")[2]
    flops = gpu_check.model_flops(layer, small=False)
    config = BoostLlamaConfig.from_preset("cola-7b")
    tokens = 4 * 4096
    assert flops["causal at half"] == 3 * tokens * (linear_flops_per_token(config) + attention_flops_per_token(config, 4096)) / 4
    assert flops["torchtitan"] - flops["causal at half"] == 3 * tokens * attention_flops_per_token(config, 4096) / 4
    assert gpu_check.spread([1.0, 2.0, 3.0, 4.0, 100.0])["median"] == 3.0


def _table_rows(text: str, header: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header}"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


@ON_THE_GPU_MACHINES_STACK
def test_one_ranks_layer_measured_eager_and_compiled_each_layout_in_its_process(tmp_path):
    """``layer`` on the CPU: every layout's row eager and compiled, model, implementation and layout in columns of their
    own, both MFU conventions named, the comparisons named, and ``gpu_layer.json`` for ``boost-hf estimate --measured``."""
    from boost_hf.perf.measured import MeasuredRun

    completed = _run("--device", "cpu", "--only", "layer", tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = (tmp_path / "gpu" / "gpu_layer.md").read_text()
    header = "model | implementation | layout | activation checkpointing | mode |"
    assert header in report and "MFU (causal at half) | MFU (torchtitan)" in report
    rows = _table_rows(report, "model")
    assert [(r[0].split(" ")[0], r[2], r[4]) for r in rows] == [
        (s.model, s.layout, mode) for s in gpu_check.measurements("layer") for mode in ("eager", "compiled")]
    assert all(len(r) == 12 for r in rows), rows  # model, implementation, layout, checkpointing, mode, 3 times, 2 MFU, GiB, GPU
    assert "the layout's own gain, same CoLA-7B" in report and "model and layout together" in report
    run = MeasuredRun.load(tmp_path / "gpu" / "gpu_layer.json")
    assert [(layer.preset, layer.tp_style) for layer in run.layers] == [("llama-7b", "megatron"), ("cola-7b", "vanilla"), ("cola-7b", "btp")]
    assert all(layer.eager_ms and layer.compiled_ms for layer in run.layers)


@ON_THE_GPU_MACHINES_STACK
def test_the_other_measuring_parts_and_the_kernel_counts_run_on_the_cpu(tmp_path):
    """``throughput`` (transformers' LlamaForCausalLM beside boost-hf's models), ``layer-sp`` (the reduce-scatter it ran
    said), ``layer-13b``, ``layer-ckpt`` (none / low-rank / full), eager only here, and ``kernels``: each writes its
    file with no failed row."""
    parts = ("throughput", "layer-sp", "layer-13b", "layer-ckpt", "kernels")
    completed = _run("--device", "cpu", "--only", *parts, "--modes", "eager", "--budget-s", "1500", tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    out = tmp_path / "gpu"
    throughput = (out / "gpu_throughput.md").read_text()
    assert "transformers `LlamaForCausalLM`" in throughput and "tokens/s" in throughput
    assert "reduce-scatter: the fake backend's own" in (out / "gpu_layer_sp.md").read_text()
    ckpt = _table_rows((out / "gpu_layer_ckpt.md").read_text(), "model")
    assert {r[3] for r in ckpt} == {"lowrank", "full"}
    kernels = _table_rows((out / "gpu_kernels.md").read_text(), "model")
    assert [r[1] for r in kernels] == ["megatron", "megatron + SP", "vanilla", "btp", "btp + latent SP"]
    for part in parts:
        assert "**done**" in (out / f"{gpu_check.FILES[part]}.md").read_text(), part


def test_cases_cover_every_architecture_in_every_layout_that_holds_it():
    """Derived from the layouts' own checks: each architecture at tp 1, and at tp 4 in every layout, with and without
    sequence parallelism, that ``ParallelConfig.check_model`` accepts; each family has a layout."""
    expected = set()
    for architecture in ("llama", "svd", "cola", "lax"):
        expected.add((architecture, 1, None, False))
        config = BoostLlamaConfig.from_preset(f"{architecture}-60m")
        for style in LAYOUTS:
            for sequence_parallel in (False, True):
                try:
                    ParallelConfig(tp_size=4, tp_style=style, sequence_parallel=sequence_parallel).check_model(config)
                except ValueError:
                    continue
                expected.add((architecture, 4, style, sequence_parallel))
    got = {(c.architecture, c.tp, c.fields.get("tp_style"), bool(c.fields.get("sequence_parallel"))) for c in gpu_check.cases()}
    assert got == expected
    assert {style for _, tp, style, _ in got if tp == 4} == set(LAYOUTS)
    assert {(a, s) for a, tp, s, sp in got if sp} == {("llama", "megatron"), *((a, "btp") for a in ("svd", "cola", "lax"))}


@ON_THE_GPU_MACHINES_STACK
def test_every_training_step_case_passes_on_the_cpu(tmp_path):
    """The training-step part on this machine's CPU, without datasets or deepspeed: every case, both precisions, eager
    and compiled, passes its checks (bf16 GEMM operands, finite loss and gradients, compiled loss = eager's)."""
    # a budget far beyond the part's (this test checks every case; the budget's own test is below): compiling on a CPU
    # takes ~6 min on 2 cores, more than the 360 s a GPU's command is given
    completed = _run("--device", "cpu", "--only", "steps", "--budget-s", "2000", tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = (tmp_path / "gpu" / "gpu_steps.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) == 2 * len(gpu_check.cases())
    assert all(row.rstrip(" |").endswith("ok") for row in rows), report


def test_a_budget_stops_a_part_between_its_cases_and_keeps_what_it_measured(tmp_path, monkeypatch):
    """A budget shorter than the part: the part stops between its cases when the next (as long as the last) would pass
    its deadline, with the cases it checked written and the part called incomplete; the summary then says incomplete and
    the run fails (not every check ran). Counted on a clock of the test's own (each case takes 100 s of it), so the
    outcome does not depend on this machine's speed or load; the real cases run in the test above."""
    from types import SimpleNamespace

    clock = {"now": 1_000.0}
    monkeypatch.setattr(gpu_check.time, "time", lambda: clock["now"])

    def check_case(case, precision, seq, batch, device):
        clock["now"] += 100.0
        return [case.name, precision, "ok"], []

    monkeypatch.setattr(gpu_check, "check_case", check_case)
    args = SimpleNamespace(out=tmp_path, device="cpu", cases=None)
    total = 2 * len(gpu_check.step_cases(args))
    assert total >= 4
    status = gpu_check.part_steps(args, deadline=clock["now"] + 350.0)  # room for 3 cases of 100 s, not a 4th
    assert status == gpu_check.INCOMPLETE
    report = (tmp_path / "gpu_steps.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) == 3 and all(row.rstrip(" |").endswith("ok") for row in rows), report
    assert f"incomplete: stopped at the budget (3 of {total} checked)** after" in report
    passed = gpu_check.write_summary(tmp_path, {"steps": {"status": gpu_check.STATUS[status], "seconds": 300}}, "cpu")
    assert not passed and f"| `gpu_steps.md` | {gpu_check.PREDICTED_S['steps']} | 300 | incomplete (budget) |" in (tmp_path / "gpu_check.md").read_text()


def test_two_runs_gather_into_one_summary(tmp_path):
    """A lent machine's commands (one --out folder each) become one summary and one set of part files."""
    runs = []
    for i, parts in gpu_check.COMMANDS.items():
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        (folder / "gpu_check.log").write_text(f"log {i}\n")
        for part in parts:
            (folder / f"{gpu_check.FILES[part]}.md").write_text(f"# {part}\n")
        rows = {part: {"status": "ok", "seconds": 10 + i} for part in parts}
        (folder / "gpu_check.json").write_text(json.dumps({"device": "**NVIDIA H200**", "parts": rows, "results": {parts[0]: {"x": i}}}))
        runs.append(str(folder))
    completed = _run("--gather", *runs, tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = tmp_path / "gpu"
    assert sorted(p.name for p in out.iterdir()) == sorted(["gpu_check.json", "gpu_check.log", "gpu_check.md",
                                                           *(f"{gpu_check.FILES[p]}.md" for p in gpu_check.PARTS)])
    assert set(json.loads((out / "gpu_check.json").read_text())["results"]) == {parts[0] for parts in gpu_check.COMMANDS.values()}
    summary = (out / "gpu_check.md").read_text()
    assert "**NVIDIA H200**" in summary and f"gathered from {len(gpu_check.COMMANDS)} runs" in summary
    assert [line.split("|")[1].strip() for line in summary.splitlines() if line.startswith("| ") and "file" not in line] == list(gpu_check.PARTS)
    assert (out / "gpu_check.log").read_text() == "log 1\nlog 2\nlog 3\n"
