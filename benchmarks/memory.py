"""Activation memory and recompute cost of checkpointing none / full / lowrank, under BTP and vanilla TP.

Per variant, on ``--tp`` gloo ranks (rank 0 reported):

* bytes one decoder layer (layer 1) saves for backward: the unique storages seen by
  ``saved_tensors_hooks`` during its forward (parameters excluded; what the tests' LayerProbe measures),
  next to :func:`boost_hf.perf.activation_memory.saved_elements_per_layer` (x 4 bytes, fp32);
* the peak RSS of a forward + backward above the RSS before it (``VmHWM`` reset through
  ``/proc/self/clear_refs``; glibc is told to unmap freed tensors at once so the RSS follows live memory);
* collectives of the whole step, counted and compared with
  :func:`boost_hf.perf.comm_formula.model_communication` (recomputation collectives included);
* the step time (separate processes, default allocator), all variants interleaved, and from it the
  recompute overhead and the paper's figure of merit "activation memory saved per ms of recompute"
  (BOOST.md section 5).

    python benchmarks/memory.py           # both shapes of common.SHAPES, ~2 min on 2 cores
    python benchmarks/memory.py --quick
"""

from __future__ import annotations

import gc
import time
from functools import partial

import torch

from common import (
    MIB,
    QUICK,
    SHAPES,
    BenchShape,
    base_parser,
    bench_config,
    paired_median_difference,
    parse,
    peak_rss_bytes,
    reset_peak_rss,
    returned_to_os_on_free,
    rss_bytes,
    save_figure,
    table,
    time_interleaved,
    training_step,
    write_result,
)

from boost_hf.perf.activation_memory import SavedTensorsProbe

LAYOUTS = ("vanilla", "btp")
MODES = ("none", "full", "lowrank")


def _variant(layout: str, mode: str) -> str:
    return f"{layout} {mode}"


def _build(layout: str, mode: str, config, tp: int):
    from boost_hf import BoostLlamaForCausalLM, ParallelConfig

    parallel = ParallelConfig(tp_size=tp, tp_style=layout, activation_checkpointing=mode)
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(config, parallel_config=parallel).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5), parallel


def memory_worker(spec: dict) -> dict:
    """Runs on every rank (spawned with glibc unmapping freed tensors): per variant, the bytes layer 1 saves
    for backward, the peak RSS of a forward + backward, and the step's collectives vs the formula."""
    import torch.distributed as dist

    from boost_hf import CommCounter
    from boost_hf.perf.activation_memory import saved_elements_per_layer
    from boost_hf.perf.comm_formula import model_communication

    tp = dist.get_world_size()
    shape, batch, seq = spec["shape"], spec["batch"], spec["seq"]
    config = bench_config(shape, "cola", seq)
    tokens = batch * seq
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    counted = lambda c: {k: {"calls": v["calls"], "elements": v["elements"]} for k, v in c.as_dict().items()}  # noqa: E731
    results = {}
    for layout in LAYOUTS:
        for mode in MODES:
            model, optimizer, parallel = _build(layout, mode, config, tp)
            probe = SavedTensorsProbe(model.model.layers[1])
            with CommCounter() as forward:
                loss = model(ids, labels=ids).loss
            probe.remove()
            with CommCounter() as backward:
                loss.backward()
            optimizer.step()  # AdamW states exist from here on: the peak below is the step's own memory
            optimizer.zero_grad(set_to_none=True)
            del loss
            gc.collect()
            dist.barrier()
            before = rss_bytes()
            resettable = reset_peak_rss()
            model(ids, labels=ids).loss.backward()
            peak = peak_rss_bytes() - before
            formula = model_communication(config, parallel, tokens)
            results[_variant(layout, mode)] = {
                "saved_bytes": probe.saved_bytes,
                "expected_bytes": 4 * saved_elements_per_layer(config, parallel, tokens) if mode != "none" else None,
                "peak_bytes": peak if resettable else None,
                "fwd_calls": forward.calls,
                "bwd_calls": backward.calls,
                "comm_matches": counted(forward) == formula.forward.to_dict() and counted(backward) == formula.backward.to_dict(),
            }
            del model, optimizer
            gc.collect()
    return results


def timing_worker(spec: dict) -> dict:
    """Runs on every rank (default allocator): all variants' step times, interleaved."""
    import torch.distributed as dist

    tp = dist.get_world_size()
    shape, batch, seq = spec["shape"], spec["batch"], spec["seq"]
    config = bench_config(shape, "cola", seq)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    steps = {}
    for layout in LAYOUTS:
        for mode in MODES:
            model, optimizer, _ = _build(layout, mode, config, tp)
            steps[_variant(layout, mode)] = partial(training_step, model, optimizer, ids)
    timing = time_interleaved(steps, warmup=spec["warmup"], reps=spec["reps"], sync=dist.barrier)
    return {name: {"median": t["median"], "min": t["min"], "times": t["times"]} for name, t in timing.items()}


def _shape_section(res: dict, shape: BenchShape, tp: int) -> tuple[list[str], dict]:
    """The tables of one shape, and the figure of merit per checkpointed variant."""
    layers = shape.model["num_hidden_layers"]
    rows = []
    for name, r in res.items():
        expected = r["expected_bytes"]
        rows.append([
            name,
            f"{r['saved_bytes'] / MIB:.2f}",
            f"{expected / MIB:.2f}" if expected is not None else "- (not modelled)",
            ("yes" if expected == r["saved_bytes"] else "**NO**") if expected is not None else "-",
            f"{r['peak_bytes'] / MIB:.0f}" if r["peak_bytes"] is not None else "n/a",
            f"{r['fwd_calls']} / {r['bwd_calls']}",
            "yes" if r["comm_matches"] else "**NO**",
            f"{1000 * r['step_s']:.0f} ({1000 * r['fastest_s']:.0f})",
        ])
    lines = [f"## Shape `{shape.name}`: CoLA, {shape.describe()}; TP={tp}", ""]
    lines += table(["variant", "saved MiB/layer", "saved_elements_per_layer x 4 B (MiB)", "equal", "peak RSS of fwd+bwd (MiB)",
                    "collectives fwd / bwd (model)", "= formula", "step ms, median (fastest)"], rows)
    lines += ["", f"Memory saved per ms of recompute: saved = (saved bytes per layer without checkpointing - with) x {layers} "
              "layers; recompute = step time with checkpointing - without: 'paired' is the median over rounds of the "
              "difference within a round (the two steps ran seconds apart), 'fastest' the difference of the fastest steps; "
              "the last column uses the drop of the peak RSS instead (full checkpointing re-creates a whole layer's "
              "activations during its recompute, low-rank one segment's).", ""]
    merit, rows = {}, []
    fmt = lambda v: f"{v:.2f}" if v is not None else "n/a"  # noqa: E731
    for layout in LAYOUTS:
        base = res[_variant(layout, "none")]
        for mode in ("full", "lowrank"):
            name = _variant(layout, mode)
            r = res[name]
            saved = (base["saved_bytes"] - r["saved_bytes"]) * layers
            recompute_ms = {"paired": 1000 * paired_median_difference(r["times"], base["times"]),
                            "fastest": 1000 * (r["fastest_s"] - base["fastest_s"])}
            merit[name] = {stat: saved / MIB / ms if ms > 0 else None for stat, ms in recompute_ms.items()}
            ms = recompute_ms["paired"]
            peak_saved = base["peak_bytes"] - r["peak_bytes"] if r["peak_bytes"] is not None else None
            peak_merit = peak_saved / MIB / ms if ms > 0 and peak_saved is not None else None
            rows.append([
                name, f"{saved / MIB:.1f}", f"{100 * (1 - r['saved_bytes'] / base['saved_bytes']):.0f}%",
                f"{ms:.0f} ({recompute_ms['fastest']:.0f}); {100 * ms / (1000 * base['step_s']):+.0f}%",
                r["bwd_calls"] - base["bwd_calls"], f"{fmt(merit[name]['paired'])} ({fmt(merit[name]['fastest'])})", fmt(peak_merit),
            ])
    lines += table(["variant", "activation MiB saved (model)", "of layer's saved bytes", "recompute ms per step, paired (fastest); overhead",
                    "extra backward collectives (model)", "saved MiB per ms, paired (fastest)", "peak-RSS MiB saved per ms"], rows)
    return lines + [""], merit


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], timed=True)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="model shapes (default: all)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=12)
    args, started = parse(parser)
    shapes = [SHAPES[name] for name in args.shapes]
    if args.quick:
        shapes, args.warmup, args.reps = [QUICK], 1, 2
    from boost_hf.perf.launcher import launch

    body = [
        f"TP={args.tp}, rank 0. Saved bytes: one decoder layer (layer 1) during the forward (unique storages seen by "
        "`saved_tensors_hooks`, parameters excluded). Peak RSS: forward + backward of the whole model above the RSS "
        "before it (gradients included; measured in processes whose allocator unmaps freed tensors at once). Step time "
        "(forward + backward + AdamW, in separate processes with the default allocator): median (and fastest) of "
        f"{args.reps} interleaved rounds after {args.warmup} warm-up, slowest rank.",
        "",
    ]
    sections, merits, all_res = [], {}, {}
    for shape in shapes:
        spec = dict(shape=shape.model, batch=shape.batch, seq=shape.seq, warmup=args.warmup, reps=args.reps)
        t0 = time.perf_counter()
        with returned_to_os_on_free():  # the RSS probe only: unmapping every free would slow the timed steps
            res = launch(memory_worker, args.tp, spec, timeout=3600)[0]
        timings = launch(timing_worker, args.tp, spec, timeout=3600)
        print(f"{shape.name}: {time.perf_counter() - t0:.0f} s")
        for name in res:  # the slowest rank's step time
            res[name]["step_s"] = max(t[name]["median"] for t in timings)
            res[name]["fastest_s"] = max(t[name]["min"] for t in timings)
            res[name]["times"] = [max(round_) for round_ in zip(*(t[name]["times"] for t in timings))]
        lines, merits[shape.name] = _shape_section(res, shape, args.tp)
        sections += lines
        all_res[shape.name] = res
    rows = []
    for shape in shapes:
        merit = merits[shape.name]
        for a, b in (("btp lowrank", "vanilla lowrank"), ("btp lowrank", "vanilla full"), ("btp full", "vanilla full")):
            ratios = [merit[a][s] / merit[b][s] if merit[a][s] and merit[b][s] else None for s in ("paired", "fastest")]
            rows.append([shape.name, f"{a} vs {b}", *(f"{x:.2f}x" if x is not None else "n/a (no measurable overhead)" for x in ratios)])
    body += ["## Memory saved per ms of recompute, BTP vs vanilla", "",
             "Paper (7B, batch 4, GPU): BTP 1.70x the activation memory saved per ms of recompute of vanilla TP. Measured "
             "(ratio of the 'saved MiB per ms' columns below):", ""]
    body += table(["shape", "comparison", "ratio (paired recompute time)", "ratio (fastest steps)"], rows) + [""]
    body += sections
    body += [_plot(all_res, merits, args.out), ""]
    write_result(args.out, "memory", "Activation memory and recompute: checkpointing none / full / lowrank", body, quick=args.quick, started=started)


def _plot(all_res: dict, merits: dict, out) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(all_res), 3, figsize=(16, 3.8 * len(all_res)), squeeze=False)
    for row, (shape, res) in zip(axes, all_res.items()):
        names = list(res)
        colors = ["C0" if n.startswith("btp") else "C1" for n in names]
        row[0].barh(names, [res[n]["saved_bytes"] / MIB for n in names], color=colors)
        row[0].set_xlabel(f"MiB saved for backward per layer ({shape})")
        if all(res[n]["peak_bytes"] is not None for n in names):
            row[1].barh(names, [res[n]["peak_bytes"] / MIB for n in names], color=colors)
        row[1].set_xlabel(f"peak RSS of fwd + bwd, MiB ({shape})")
        merit = merits[shape]
        valued = [n for n in merit if merit[n]["paired"] is not None]
        row[2].barh(valued, [merit[n]["paired"] for n in valued], color=["C0" if n.startswith("btp") else "C1" for n in valued])
        row[2].set_xlabel(f"MiB saved per ms of recompute ({shape})")
        for ax in row:
            ax.invert_yaxis()
    return save_figure(fig, out, "memory")


if __name__ == "__main__":
    main()
