"""Pipeline parallelism on CPU (gloo): step time and measured bubble at pp 1 / 2 / 4, 1F1B and interleaved 1F1B,
next to the estimator's bubble (:func:`boost_hf.perf.pipeline.ideal_bubble_fraction`).

One small CoLA model (8 decoder layers, so every stage at pp 4 with 2 stages per rank holds one layer), a fixed
micro-batch, and ``m`` micro-batches per step: a step is the schedule's forward and backward of ``m`` micro-batches
(no optimizer: it is outside the pipeline). All variants of one pp size are built in one process group (``pp``
gloo ranks, tp 1, dp 1, one thread each) and timed round-robin (``common.time_interleaved``), the pp 1 reference
with them (the whole model on rank 0, the same micro-batches one after the other, while the other ranks wait): so
the reference sees the same background load as the pipelines. A barrier starts and ends every step, so a step's
time is the whole pipeline's.

The bubble is measured per rank: the wall time this rank's stages spend computing (inside the engine's
``forward_one_chunk`` / ``backward_one_chunk`` and the loss) is its busy time; ``idle = 1 - busy / step``, averaged
over the ranks. Idle time is the schedule's bubble plus waiting for the point-to-point transfers and for slower
stages (the first holds the embedding, the last the head and loss). A second reading needs no instrumentation:
``1 - m T1 / (p T_p)``, with ``T1`` the time of one micro-batch through the whole model at pp 1, the share of the
step a perfect split of pp 1's work would not need.

    python benchmarks/pipeline.py            # pp 2 and 4 (4 ranks on 2 cores oversubscribe): ~2 min
    python benchmarks/pipeline.py --quick    # pp 2, fewer rounds (smoke test)
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from common import base_parser, parse, save_figure, table, time_interleaved, write_result

MODEL = dict(hidden_size=128, intermediate_size=344, num_attention_heads=4, rank=32, num_hidden_layers=8, vocab_size=512)
MICRO_BATCH, SEQ = 2, 64
SINGLE = "pp 1"
SCHEDULES = {"1f1b": 1, "interleaved-1f1b": 2}  # name -> stages per rank


class BusyClock:
    """Wall time spent inside the engine's compute (stage forward, backward, loss) on this rank, by wrapping
    those methods of ``torch.distributed.pipelining`` (sends and receives are waited for outside them)."""

    seconds = 0.0

    @classmethod
    def install(cls) -> None:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
        from torch.distributed.pipelining.stage import _PipelineStageBase

        for owner, name in ((_PipelineStageBase, "forward_one_chunk"), (_PipelineStageBase, "backward_one_chunk"),
                            (_PipelineSchedule, "_compute_loss")):
            setattr(owner, name, cls._timed(getattr(owner, name)))

    @classmethod
    def _timed(cls, method):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                cls.seconds += time.perf_counter() - start

        return timed


def _config():
    from boost_hf import BoostLlamaConfig

    return BoostLlamaConfig(bottleneck="cola", tie_word_embeddings=False, max_position_embeddings=SEQ, **MODEL)


def _batch(m: int) -> torch.Tensor:
    return torch.randint(0, MODEL["vocab_size"], (m * MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _pipelined_step(model, ids, busy: list) -> None:
    import torch.distributed as dist

    BusyClock.seconds = 0.0
    model.pipeline.train_step(ids, ids)
    busy.append(BusyClock.seconds)
    model.zero_grad(set_to_none=True)
    dist.barrier()


def _single_step(model, ids, m: int) -> None:
    """pp 1 on rank 0 (the others wait): the same micro-batches one after the other (gradient accumulation)."""
    import torch.distributed as dist

    if model is not None:
        for chunk in ids.chunk(m):
            model(chunk, labels=chunk, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
    dist.barrier()


def worker(spec: dict) -> dict:
    """On every rank of a ``pp``-rank group: build every (schedule, m) variant and the pp 1 reference of each m,
    time them interleaved; per variant this rank's median step time and median idle fraction."""
    import torch.distributed as dist

    from boost_hf import BoostLlamaForCausalLM, ParallelConfig

    pp = dist.get_world_size()
    steps, busy = {}, {}
    BusyClock.install()
    single = BoostLlamaForCausalLM(_config()).train() if dist.get_rank() == 0 else None
    for m in sorted({m for _, m in spec["variants"]}):
        steps[f"{SINGLE} m={m}"] = partial(_single_step, single, _batch(m), m)
    for schedule, m in spec["variants"]:
        torch.manual_seed(0)
        name = f"{schedule} m={m}"
        parallel = ParallelConfig(pp_size=pp, pp_schedule=schedule, pp_microbatches=m, pp_stages_per_rank=SCHEDULES[schedule])
        model = BoostLlamaForCausalLM(_config(), parallel_config=parallel).train()
        busy[name] = []
        steps[name] = partial(_pipelined_step, model, _batch(m), busy[name])
    timing = time_interleaved(steps, warmup=spec["warmup"], reps=spec["reps"], sync=dist.barrier)
    result = {}
    for name, measured in timing.items():
        entry = {"median": measured["median"], "min": measured["min"]}
        if name in busy:
            rounds = busy[name][spec["warmup"]:]
            entry["idle"] = statistics.median(1 - b / t for b, t in zip(rounds, measured["times"]))
        result[name] = entry
    return result


def variants(pp: int, micro_batches: list[int]) -> list[tuple[str, int]]:
    """(schedule, m) pairs the engine runs at ``pp`` (1F1B needs m >= pp; interleaved m >= pp here too)."""
    return [(schedule, m) for schedule in SCHEDULES for m in micro_batches if m >= pp]


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], timed=True)
    parser.add_argument("--pp", nargs="+", type=int, default=[2, 4], help="pipeline sizes (default: 2 4; pp 1 is measured with each)")
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[2, 4, 8], help="micro-batches per step (default: 2 4 8)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=6)
    args, started = parse(parser)
    if args.quick:
        args.pp, args.micro_batches, args.warmup, args.reps = [2], [2], 1, 1
    from boost_hf.perf.launcher import launch
    from boost_hf.perf.pipeline import ideal_bubble_fraction

    measured: dict[int, dict] = {}
    for pp in args.pp:
        t0 = time.perf_counter()
        spec = dict(variants=variants(pp, args.micro_batches), warmup=args.warmup, reps=args.reps)
        per_rank = launch(worker, pp, spec, timeout=1800)
        print(f"pp={pp}: {time.perf_counter() - t0:.0f} s")
        measured[pp] = {
            name: {"step": max(r[name]["median"] for r in per_rank), "fastest": max(r[name]["min"] for r in per_rank),
                   "idle": statistics.mean(r[name]["idle"] for r in per_rank) if "idle" in per_rank[0][name] else None}
            for name in per_rank[0]
        }

    rows, points, t1 = [], [], {}
    for pp in args.pp:
        single = {m: measured[pp][f"{SINGLE} m={m}"]["fastest"] for _, m in variants(pp, args.micro_batches)}  # m T1
        t1[pp] = statistics.median(single[m] / m for m in single)
        for schedule, m in variants(pp, args.micro_batches):
            v = SCHEDULES[schedule]
            result = measured[pp][f"{schedule} m={m}"]
            predicted = ideal_bubble_fraction(pp, m, v)
            versus_single = 1 - single[m] / (pp * result["fastest"])
            reference = measured[pp][f"{SINGLE} m={m}"]
            rows.append([pp, schedule, v, m, f"{1e3 * result['step']:.0f} ({1e3 * result['fastest']:.0f})",
                         f"{1e3 * reference['step']:.0f} ({1e3 * reference['fastest']:.0f})", f"{single[m] / result['fastest']:.2f}x",
                         f"{predicted:.2f}", f"{result['idle']:.2f}", f"{versus_single:.2f}"])
            points.append((pp, schedule, m, predicted, result["idle"], versus_single))

    spread = max(entry["step"] / entry["fastest"] for runs in measured.values() for entry in runs.values())
    body = [
        f"CoLA model: d={MODEL['hidden_size']}, d_ff={MODEL['intermediate_size']}, r={MODEL['rank']}, "
        f"{MODEL['num_hidden_layers']} layers, {MODEL['num_attention_heads']} heads, vocab {MODEL['vocab_size']}, fp32; "
        f"micro-batch {MICRO_BATCH} x {SEQ} tokens; a step = forward + backward of m micro-batches through the "
        "schedule (no optimizer), tp 1, dp 1, one gloo rank per pipeline rank, one thread each. "
        f"{args.warmup} warm-up + {args.reps} timed rounds, variants interleaved; median (fastest) step of the slowest rank.",
        "",
        "- **predicted bubble**: the estimator's `(p-1)/(v m + p-1)` (`boost_hf.perf.pipeline.ideal_bubble_fraction`; "
        "v = 1 for 1F1B, 2 for interleaved).",
        "- **measured idle**: per rank, 1 - (time inside the engine's stage forward/backward and the loss) / step, "
        "averaged over the ranks: the bubble plus waiting for transfers and for slower stages.",
        "- **1 - m T1 / (p T_p)**: the share of the step that a perfect p-way split of pp 1's work would not need "
        "(m T1: pp 1's step of the same m micro-batches, run one after the other, timed in the same rounds; T1 per "
        f"micro-batch {', '.join(f'{1e3 * t:.1f} ms (with pp {pp})' for pp, t in t1.items())}). It and the speed-up "
        "m T1 / T_p use the fastest steps (other jobs on the machine only ever add time; the medians of this run "
        f"are up to {spread:.1f}x the fastest steps).",
        "",
        "**Noise and oversubscription**: this machine has 2 cores shared with other jobs (see the busy line above), so "
        "the timings are noisy; pp 4 runs 4 ranks on 2 cores, so in its steady state two ranks share a core: a rank's "
        "compute takes longer while the others also compute and its idle share comes out *lower* than on 4 devices "
        "(and the speed-up cannot exceed ~2x). At this size a stage's compute per micro-batch is a few ms, so each "
        "gloo transfer (0.2-0.5 ms at best here) also shows up as idle time.",
        "",
        *table(["pp", "schedule", "v", "m", "step ms (fastest)", "pp 1 step ms (fastest)", "speed-up", "predicted bubble",
                "measured idle", "1 - m T1 / (p T_p)"], rows),
        "",
    ]
    body.append(_plot(points, args.out))
    write_result(args.out, "pipeline", "Pipeline parallelism: step time and bubble on CPU", body, quick=args.quick, started=started)


def _plot(points: list, out) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, schedule in zip(axes, SCHEDULES):
        for pp, color in ((2, "tab:blue"), (4, "tab:orange")):
            mine = sorted((m, pred, idle, vs) for p, s, m, pred, idle, vs in points if p == pp and s == schedule)
            if not mine:
                continue
            ms = [x[0] for x in mine]
            ax.plot(ms, [x[1] for x in mine], "-", color=color, label=f"pp {pp} predicted")
            ax.plot(ms, [x[2] for x in mine], "o", color=color, label=f"pp {pp} measured idle")
            ax.plot(ms, [x[3] for x in mine], "x", color=color, label=f"pp {pp} 1 - m T1 / (p T_p)")
        ax.set_title(schedule)
        ax.set_xlabel("micro-batches per step (m)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of the step")
    axes[0].legend(fontsize=8)
    return save_figure(fig, out, "pipeline")


if __name__ == "__main__":
    main()
