"""``make gpu-check`` (``benchmarks/gpu_check.py``) on a machine without CUDA: it says so and exits 0, writing
nothing, without ``datasets`` or ``deepspeed`` (the lent GPU machine has neither); its training-step cases cover
every architecture in every layout (and sequence parallelism) that the layouts accept. The CUDA parts run only on a
GPU (``make gpu-check`` there)."""

from __future__ import annotations

import json
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


def _run(*argv: str, tmp_path: Path) -> subprocess.CompletedProcess:
    code = RUN_WITHOUT.format(absent=ABSENT, argv=[*argv, "--out", str(tmp_path / "gpu")])
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path of a machine without CUDA")
def test_without_a_cuda_device_it_says_so_and_exits_0(tmp_path):
    completed = _run(tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "gpu-check: no CUDA device found" in completed.stdout
    assert not (tmp_path / "gpu").exists()


def test_lists_its_cases_without_datasets_or_deepspeed(tmp_path):
    completed = _run("--list", tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert [line.split(":")[0] for line in completed.stdout.splitlines()] == [case.name for case in gpu_check.cases()]


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


def test_every_training_step_case_passes_on_the_cpu(tmp_path):
    """The training-step part on this machine's CPU, without datasets or deepspeed: every case, both precisions, eager
    and compiled, passes its checks (bf16 GEMM operands, finite loss and gradients, compiled loss = eager's)."""
    completed = _run("--device", "cpu", "--only", "steps", tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = (tmp_path / "gpu" / "gpu_steps.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert len(rows) == 2 * len(gpu_check.cases())
    assert all(row.rstrip(" |").endswith("ok") for row in rows), report


def test_a_budget_stops_a_part_between_its_cases_and_keeps_what_it_measured(tmp_path):
    """``--budget-s`` shorter than the part: the part stops (at the latest ``GRACE_S`` after its share) with the cases it
    checked written, the summary calls it incomplete, and the run exits non-zero (not every check ran)."""
    import time

    started = time.monotonic()
    budget = gpu_check.MIN_PART_S + 10
    completed = _run("--device", "cpu", "--only", "steps", "--budget-s", str(budget), tmp_path=tmp_path)
    assert time.monotonic() - started < budget + gpu_check.GRACE_S + 60  # the share, the grace, start-up
    assert completed.returncode == 1, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "steps: starting with" in completed.stdout
    summary = (tmp_path / "gpu" / "gpu_check.md").read_text()
    assert "| steps | `gpu_steps.md` |" in summary and "incomplete" in summary
    report = (tmp_path / "gpu" / "gpu_steps.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert 1 <= len(rows) < 2 * len(gpu_check.cases()) and all(row.rstrip(" |").endswith("ok") for row in rows), report


def test_two_runs_gather_into_one_summary(tmp_path):
    """A lent machine's two commands (two --out folders) become one summary and one set of part files."""
    runs = []
    for i, parts in enumerate((("layer", "throughput"), ("steps", "norms"))):
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        (folder / "gpu_check.log").write_text(f"log {i}\n")
        for part in parts:
            (folder / f"gpu_{part}.md").write_text(f"# {part}\n")
        rows = {part: {"status": "ok", "seconds": 10 + i} for part in parts}
        (folder / "gpu_check.json").write_text(json.dumps({"device": "**NVIDIA H200**", "parts": rows}))
        runs.append(str(folder))
    completed = _run("--gather", *runs, tmp_path=tmp_path)
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = tmp_path / "gpu"
    assert sorted(p.name for p in out.iterdir()) == sorted(["gpu_check.json", "gpu_check.log", "gpu_check.md",
                                                           *(f"gpu_{p}.md" for p in gpu_check.PARTS)])
    summary = (out / "gpu_check.md").read_text()
    assert "**NVIDIA H200**" in summary and "gathered from 2 runs" in summary
    assert [line.split("|")[1].strip() for line in summary.splitlines() if line.startswith("| ") and "file" not in line] == list(gpu_check.PARTS)
    assert (out / "gpu_check.log").read_text() == "log 0\nlog 1\n"
