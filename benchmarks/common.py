"""What every benchmark script shares: the benchmark shapes, the machine's name, result files,
interleaved timing, barrier-wrapped collective timing and peak-RSS / saved-tensor probes.

The scripts run as ``python benchmarks/<name>.py`` (this folder is then on ``sys.path``); the
functions they hand to :func:`boost_hf.perf.launcher.launch` live in importable modules, so the
spawned ranks find them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
MIB = 2**20


# ---------------------------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class BenchShape:
    """A model shape (``BoostLlamaConfig`` fields, r = d/4, 2 layers, a small vocabulary so the LM head, the
    same in every layout, does not hide the decoder layers) and the micro-batch it is timed on."""

    name: str
    model: dict
    batch: int
    seq: int
    why: str

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        m = self.model
        return (
            f"d={m['hidden_size']}, {m['num_attention_heads']} heads, d_ff={m['intermediate_size']}, r={m['rank']}, "
            f"{m['num_hidden_layers']} layers, vocab {m['vocab_size']}; micro-batch {self.batch} x seq {self.seq} = {self.tokens} tokens, fp32"
        )


SHAPES = {
    "compute-bound": BenchShape(
        "compute-bound",
        dict(hidden_size=1024, intermediate_size=2736, num_attention_heads=16, rank=256, num_hidden_layers=2, vocab_size=4096),
        batch=4, seq=128,
        why="a 350M-class block: GEMMs dominate, and on this CPU communication is ~10x cheaper relative to compute than on GPUs",
    ),
    "comm-balanced": BenchShape(
        "comm-balanced",
        dict(hidden_size=128, intermediate_size=344, num_attention_heads=4, rank=32, num_hidden_layers=2, vocab_size=512),
        batch=64, seq=64,
        why="narrow enough that its collective time per unit of GEMM time on this CPU is of the order of a 3B model's at TP2 on A100s (see the balance table)",
    ),
}
QUICK = BenchShape(
    "quick",
    dict(hidden_size=256, intermediate_size=688, num_attention_heads=4, rank=64, num_hidden_layers=2, vocab_size=512),
    batch=1, seq=64, why="smoke test",
)


# ---------------------------------------------------------------------------------------------- machine
def cpu_model() -> str:
    """The CPU's ``model name`` from ``/proc/cpuinfo`` (or ``platform.processor()``)."""
    from boost_hf.perf.rank_cost import device_name

    return device_name("cpu")


def memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return float("nan")


def machine_line() -> str:
    """One line naming the machine: CPU model, logical cores, memory, torch (and CUDA and the GPU where there is one)
    and Python versions."""
    device = f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "CPU"
    return (
        f"{cpu_model()}, {os.cpu_count()} logical cores, {memory_gib():.0f} GiB RAM; torch {torch.__version__} ({device}), "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all cores busy (any process) over ``seconds``, from ``/proc/stat``; NaN where absent."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        idle = values[3] + values[4]  # idle + iowait
        return sum(values), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except OSError:
        return float("nan")
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


_BACKGROUND: dict[str, float] = {}


def wait_for_quiet(max_wait_s: float, threshold: float = 0.25) -> None:
    """Before a timing run: wait up to ``max_wait_s`` for the cores to be less than ``threshold`` busy
    (other processes share this machine); note how busy they were when the benchmark started."""
    waited, busy = 0.0, cpu_busy()
    while busy >= threshold and waited < max_wait_s:
        busy = cpu_busy(2.0)
        waited += 2.0
    _BACKGROUND.update(busy=busy, waited=waited)


def background_line() -> str:
    if not _BACKGROUND:
        return "unknown"
    line = f"{100 * _BACKGROUND['busy']:.0f}% of the cores busy with other processes when it started"
    if _BACKGROUND["waited"]:
        line += f" (after waiting {_BACKGROUND['waited']:.0f} s for a quieter machine)"
    if _BACKGROUND["busy"] >= 0.25:
        line += "; **other processes competed for the cores: timings are noisier and slower than on an idle machine**"
    return line


# ---------------------------------------------------------------------------------------------- output
def base_parser(description: str, *, timed: bool = False) -> argparse.ArgumentParser:
    """Arguments every script has; ``timed`` scripts also wait for a quiet machine first (``--wait-quiet``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions (smoke test, ~15 s)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"folder for the Markdown/PNG results (default: {RESULTS})")
    parser.add_argument("--wait-quiet", type=float, default=60.0 if timed else 0.0,
                        help="seconds to wait at most for other processes to leave the cores idle (default: 60 for timing scripts)")
    return parser


def parse(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, float]:
    """Parse the arguments, wait (``--wait-quiet``) for a quiet machine, and start the clock."""
    args = parser.parse_args()
    wait_for_quiet(0.0 if args.quick else args.wait_quiet)
    return args, time.perf_counter()


def write_result(out: Path, stem: str, title: str, body: list[str], *, quick: bool, started: float) -> Path:
    """Write ``<out>/<stem>.md``: title, machine, command, run time, then ``body`` lines."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.md"
    header = [
        f"# {title}",
        "",
        f"- machine: {machine_line()}",
        f"- command: `python {' '.join(_relative(a) for a in sys.argv)}`"
        + (" (QUICK MODE: smoke-test shapes, not results)" if quick else ""),
        f"- generated: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, run time {time.perf_counter() - started:.0f} s; "
        f"{background_line()}",
        "",
    ]
    path.write_text("\n".join(header + body).rstrip() + "\n")
    print(f"wrote {path}")
    return path


def _relative(arg: str) -> str:
    """A command-line argument with paths inside the repository written relative to its root."""
    root = RESULTS.parent.parent
    return os.path.relpath(arg, root) if arg.startswith(str(root)) else arg


def table(headers: list[str], rows: list[list]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def save_figure(fig, out: Path, stem: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    print(f"wrote {out / f'{stem}.png'}")
    return f"![{stem}]({stem}.png)"


# ---------------------------------------------------------------------------------------------- timing
def time_interleaved(steps: dict, *, warmup: int, reps: int, sync=None) -> dict[str, dict]:
    """Run ``steps`` (name -> zero-argument callable) round-robin ``warmup + reps`` times, rotating the
    starting variant each round so no variant always follows the same one; return per variant the
    median, min and max wall time (s) of the ``reps`` rounds after the warm-up, and the times of each round
    (``times[i]`` of two variants were measured seconds apart: a paired comparison).

    ``sync()`` (e.g. a barrier, so that every rank starts a step together) runs before each timed call.
    """
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for round_ in range(warmup + reps):
        start = round_ % len(names)
        for name in names[start:] + names[:start]:
            if sync is not None:
                sync()
            t = time.perf_counter()
            steps[name]()
            elapsed = time.perf_counter() - t
            if round_ >= warmup:
                times[name].append(elapsed)
    return {n: {"median": statistics.median(v), "min": min(v), "max": max(v), "times": v} for n, v in times.items()}


def paired_median_difference(a: list[float], b: list[float]) -> float:
    """Median over rounds of ``a[i] - b[i]`` (two variants timed in the same interleaved round)."""
    return statistics.median(x - y for x, y in zip(a, b))


def ratio(a: float, b: float) -> str:
    """``a / b`` as ``"1.23x"``."""
    return f"{a / b:.2f}x" if b else "-"


def training_step(model, optimizer, input_ids) -> None:
    """Forward with labels (no KV cache, as the Trainer trains), backward, AdamW step, gradients dropped."""
    model(input_ids, labels=input_ids, use_cache=False).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class CollectiveTimer:
    """Barrier-wrapped timing of every collective boost-hf issues (a profile, not a benchmark: the barriers
    add one latency per collective).

    Before each all-reduce / all-gather the ranks meet at a barrier: the time spent there is ``wait_s``
    (this rank arrived early: load imbalance, plus one barrier latency); the collective after it is
    ``comm_s`` (transfer + reduction, all ranks starting together). The collectives are found by
    wrapping the ``torch.distributed`` functions and the alias ``boost_hf.parallel.primitives`` binds
    for its all-gather (boost-hf has no timing hook of its own).
    """

    DIST_NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single")

    def __init__(self):
        self.wait_s = self.comm_s = 0.0
        self.calls = self.bytes = 0
        self._originals: list[tuple[object, str, object]] = []

    def __enter__(self) -> "CollectiveTimer":
        import torch.distributed as dist

        from boost_hf.parallel import primitives

        targets = [(dist, name) for name in self.DIST_NAMES] + [(primitives, "_all_gather_into")]
        for module, name in targets:
            original = getattr(module, name, None)
            if original is not None:
                self._originals.append((module, name, original))
                setattr(module, name, self._wrap(original, dist))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals.clear()

    def _wrap(self, original, dist):
        def timed(tensor, *args, **kwargs):
            t0 = time.perf_counter()
            dist.barrier(group=kwargs.get("group"))
            t1 = time.perf_counter()
            result = original(tensor, *args, **kwargs)
            t2 = time.perf_counter()
            self.wait_s += t1 - t0
            self.comm_s += t2 - t1
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return result

        return timed


# ---------------------------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    """Current resident set size of this process."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident set size since the process started or since the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (``VmHWM``) to the current RSS; False where not supported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextmanager
def returned_to_os_on_free():
    """Make freed tensors leave the RSS at once in processes spawned inside (glibc: fixed mmap threshold,
    so every allocation above 64 KiB is its own mapping, unmapped on free), so that the peak RSS of a
    step minus the RSS before it is the step's own memory."""
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved


# ---------------------------------------------------------------------------------------------- models
def bench_config(shape: dict, bottleneck: str | None, seq: int):
    """A ``BoostLlamaConfig`` of ``shape`` (its fields) with ``bottleneck`` (None: full rank)."""
    from boost_hf import BoostLlamaConfig

    return BoostLlamaConfig(bottleneck=bottleneck, max_position_embeddings=max(seq, 64), **shape)
