"""Smoke test: every benchmark script runs end to end in --quick mode and writes its results.

No timing is asserted; the scripts run in subprocesses (as ``make bench`` runs them), writing to a
temporary folder so the committed results are untouched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.timeout(600)
def test_run_all_quick(tmp_path):
    completed = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    for stem in ("comm_per_layer", "step_time", "memory", "data_parallel_memory", "rank_cost", "pipeline"):
        text = (tmp_path / f"{stem}.md").read_text()
        assert "QUICK MODE" in text and "machine:" in text
        assert (tmp_path / f"{stem}.png").exists()
    assert "All measured counts equal the formula: **yes**" in (tmp_path / "comm_per_layer.md").read_text()
    assert "**NO**" not in (tmp_path / "memory.md").read_text()
    assert "**NO**" not in (tmp_path / "rank_cost.md").read_text()
    assert "**NO**" not in (tmp_path / "data_parallel_memory.md").read_text()  # static bytes = the memory model's
    run_all = (tmp_path / "run_all.md").read_text()
    assert "FAILED" not in run_all
    if "CUDA is not available" in completed.stdout:
        assert not (tmp_path / "gpu_throughput.md").exists()
