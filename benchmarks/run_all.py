"""Run every benchmark in turn (``make bench``): each writes its Markdown (and PNG) under the results folder.

    python benchmarks/run_all.py            # the CPU suite, ~10 min on an idle 2-core machine
    python benchmarks/run_all.py --quick    # smoke test, tiny shapes
    python benchmarks/run_all.py --only step_time memory

``gpu_throughput.py`` runs too and exits at once (writing nothing) where CUDA is absent. The run time
of each script is written to ``run_all.md``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = ("comm_per_layer", "step_time", "memory", "data_parallel_memory", "rank_cost", "op_count", "pipeline", "gpu_throughput")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="pass --quick to every script")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="results folder (default: benchmarks/results)")
    parser.add_argument("--only", nargs="+", choices=SCRIPTS, default=list(SCRIPTS), help="run only these scripts")
    args = parser.parse_args()
    started = time.perf_counter()
    durations, failed = {}, []
    for name in args.only:
        command = [sys.executable, str(HERE / f"{name}.py"), "--out", str(args.out)] + (["--quick"] if args.quick else [])
        print(f"== {name}: {' '.join(command[1:])}", flush=True)
        t = time.perf_counter()
        code = subprocess.call(command)
        durations[name] = time.perf_counter() - t
        print(f"== {name}: exit {code}, {durations[name]:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    total = time.perf_counter() - started
    sys.path.insert(0, str(HERE))
    from common import machine_line

    lines = [
        "# Benchmark suite run times",
        "",
        f"- machine: {machine_line()}",
        f"- command: `python benchmarks/run_all.py{' --quick' if args.quick else ''}`",
        "",
        "| script | seconds | status |",
        "|---|---|---|",
        *[f"| {n} | {d:.0f} | {'FAILED' if n in failed else 'ok'} |" for n, d in durations.items()],
        f"| **total** | **{total:.0f}** | |",
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "run_all.md").write_text("\n".join(lines))
    print(f"run_all: {total:.0f} s{'; FAILED: ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
