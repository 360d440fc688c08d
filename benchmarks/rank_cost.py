"""One tensor-parallel rank's decoder-layer cost: counted with fake tensors (any machine, seconds) and measured
on this machine's device.

Both run one rank of a ``--tp``-way layout alone under a fake process group (collectives are no-ops) and
take one layer as the difference of an ``L2``- and an ``L1``-layer model over ``L2 - L1``
(:mod:`boost_hf.perf.rank_cost`), in each precision of ``--precision`` (default both): ``autocast`` (bf16
autocast over fp32 parameters) and ``bf16-params`` (bf16 parameters without autocast: DeepSpeed's bf16 mode,
Megatron-LM's). Counted (forward + backward): GEMM and attention FLOPs, bytes and number of every other aten op,
collectives, checked against ``comm_formula``. Measured (forward + backward + AdamW, eager and with
``--compile``): milliseconds per layer, variants interleaved, medians.

    python benchmarks/rank_cost.py                     # counted 7B TP4, 2 x 4096; measured on CPU at a tiny 60m shape
    python benchmarks/rank_cost.py --device cuda --compile   # measured at the counted shape on the GPU too
    python benchmarks/rank_cost.py --size 13b --tp 2 --seq 2048 --variants "btp online grouped" --no-measure
    python benchmarks/rank_cost.py --precision bf16-params --no-measure   # bf16 parameters only
    python benchmarks/rank_cost.py --quick             # 60m TP2, a few steps (smoke test)
    python benchmarks/rank_cost.py --device cuda --compile --json h100.json   # then:
    boost-hf estimate --preset cola-7b --tp 4 --micro-batch 2 --seq 4096 --measured h100.json --gpu h100
"""

from __future__ import annotations

import torch

from common import base_parser, parse, save_figure, table, write_result

from boost_hf import BoostLlamaConfig, ParallelConfig
from boost_hf.perf.comm_formula import layer_communication
from boost_hf.perf.measured import MeasuredLayer, MeasuredRun
from boost_hf.perf.activation_memory import saved_bytes_per_layer
from boost_hf.perf.rank_cost import count_rank_layer, device_name, fake_process_group, measure_rank_layers, predicted_h100_eager_ms

# name -> (preset family: "llama" or the low-rank family of --low-rank, ParallelConfig fields)
VARIANTS = {
    "megatron": ("llama", dict(tp_style="megatron")),
    "megatron sp": ("llama", dict(tp_style="megatron", sequence_parallel=True)),
    "vanilla": ("low-rank", dict(tp_style="vanilla")),
    "vanilla ungrouped": ("low-rank", dict(tp_style="vanilla", group_linears=False)),
    "btp online grouped": ("low-rank", dict(tp_style="btp", rmsnorm="online")),
    "btp sync grouped": ("low-rank", dict(tp_style="btp", rmsnorm="sync")),
    "btp online grouped sp": ("low-rank", dict(tp_style="btp", rmsnorm="online", sequence_parallel=True)),
    "btp sync grouped sp": ("low-rank", dict(tp_style="btp", rmsnorm="sync", sequence_parallel=True)),
    "btp online ungrouped": ("low-rank", dict(tp_style="btp", rmsnorm="online", group_linears=False)),
    "btp sync ungrouped": ("low-rank", dict(tp_style="btp", rmsnorm="sync", group_linears=False)),
}
DEFAULT_VARIANTS = ["megatron", "megatron sp", "vanilla", "btp online grouped", "btp online grouped sp", "btp sync grouped",
                    "btp sync grouped sp", "btp online ungrouped"]
GB, MB = 1e9, 1e6
# name -> (count_rank_layer / measure_rank_layers keywords, bytes per residual element, description)
PRECISIONS = {
    "autocast": (dict(autocast_dtype=torch.bfloat16, param_dtype=None), 4, "bf16 autocast over fp32 parameters (fp32 residual)"),
    "bf16-params": (dict(autocast_dtype=None, param_dtype=torch.bfloat16), 2,
                    "bf16 parameters, no autocast (DeepSpeed's bf16 mode, Megatron-LM's; fp32 masters live in the optimizer)"),
}


def _num(x: float) -> str:
    """Whole numbers from 100 up, three significant digits below (0.0609, 12.6, 2487)."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def variant_case(name: str, size: str, low_rank: str, tp: int, checkpointing: str, **overrides):
    """``(preset name, BoostLlamaConfig, ParallelConfig)`` of a variant."""
    family, fields = VARIANTS[name]
    preset = f"{low_rank if family == 'low-rank' else family}-{size}"
    config = BoostLlamaConfig.from_preset(preset, **overrides)
    return preset, config, ParallelConfig(tp_size=tp, activation_checkpointing=checkpointing, **fields)


def _collectives(summary: dict) -> str:
    c = summary["collectives"]
    return f"{sum(k['calls'] for k in c.values())}, {_num(sum(k['bytes'] for k in c.values()) / MB)} MB"


def _equals_formula(cost: dict, config, parallel) -> str:
    formula = layer_communication(config, parallel, cost["tokens"])
    counted = {d: {k: {"calls": v["calls"], "elements": v["elements"]} for k, v in cost[d]["collectives"].items()}
               for d in ("forward", "backward")}
    return "yes" if counted == {"forward": formula.forward.to_dict(), "backward": formula.backward.to_dict()} else "**NO**"


def _saved_mb(config, parallel, tokens: int, checkpointing: str, precision: str) -> str:
    """Bytes one layer keeps for backward under ``checkpointing`` (the residual in ``precision``'s dtype, bf16
    latents), in MB ("-" where not applicable)."""
    if checkpointing == "lowrank" and config.bottleneck is None:
        return "-"
    checkpointed = ParallelConfig(**{**parallel.to_dict(), "activation_checkpointing": checkpointing})
    return _num(saved_bytes_per_layer(config, checkpointed, tokens, residual_bytes=PRECISIONS[precision][1]) / MB)


def _predicted_ms(total: dict, config, *, floor: bool = False) -> float:
    """REVIEW-2's H100 eager fit of a counted layer; ``floor``: its GEMM and attention terms only."""
    if floor:
        total = {**total, "non_gemm_bytes": 0, "non_gemm_ops": 0}
    return predicted_h100_eager_ms(total, low_rank=config.bottleneck is not None)


def counted_section(args, names: list[str], precision: str) -> tuple[list[str], dict]:
    """Count every variant in ``precision``; return the Markdown lines and ``{name: (config, parallel, count)}``."""
    rows, counted = [], {}
    keywords, residual_bytes, described = PRECISIONS[precision]
    for name in names:
        preset, config, parallel = variant_case(name, args.size, args.low_rank, args.tp, args.checkpointing)
        try:
            parallel.check_model(config)
        except ValueError as err:
            rows.append([name, preset, f"not applicable: {err}", *[""] * 10])
            continue
        cost = count_rank_layer(config, parallel, args.batch, args.seq, layers=tuple(args.layers), **keywords)
        counted[name] = (config, parallel, cost)
        total = cost["total"]
        movers = ", ".join(f"{op} {_num(v['bytes'] / GB)}" for op, v in list(total["non_gemm_by_op"].items())[:5])
        rows.append([
            name, preset, _num(total["gemm_flops"] / GB), _num(total["attention_flops"] / GB),
            _num(total["non_gemm_bytes"] / GB), f"{total['non_gemm_ops']:g}",
            f"{_collectives(cost['forward'])} / {_collectives(cost['backward'])}", _equals_formula(cost, config, parallel),
            f"{_predicted_ms(total, config):.2f}", _num(total["saved_bytes"] / MB),
            _saved_mb(config, parallel, cost["tokens"], "full", precision),
            _saved_mb(config, parallel, cost["tokens"], "lowrank", precision), movers,
        ])
        print(f"counted {name} ({precision}): {rows[-1][2:6]}", flush=True)
    residual = "fp32" if residual_bytes == 4 else "bf16"
    lines = [
        f"## Counted, {precision}: {args.size}, TP {args.tp}, micro-batch {args.batch} x seq {args.seq} "
        f"(N = {args.batch * args.seq}), {described}, forward + backward",
        "",
        f"Per decoder layer on one rank = (model with {args.layers[1]} layers - model with {args.layers[0]}) / "
        f"{args.layers[1] - args.layers[0]}, counted under `FakeTensorMode` and a fake process group "
        f"(`boost_hf.perf.rank_cost.count_rank_layer`); activation checkpointing: {args.checkpointing}. "
        "GEMM = mm/addmm/bmm/baddbmm (2mkn); attention = the fused SDPA kernels (score and weighted-sum GEMMs, "
        "backward 2x forward; without padding SDPA runs its causal kernel: half the score matrix); non-GEMM = "
        "bytes read + written and number of every other aten op (views, metadata and bare allocations excluded; "
        "collectives excluded: they are the next column, from `CommCounter`, forward / backward). Predicted H100 "
        "eager ms: REVIEW-2's fit (`boost_hf.perf.rank_cost.H100_EAGER_FIT`: GEMM at 650 / 450 TFLOP/s full-rank / "
        "low-rank, attention at 412 TFLOP/s, non-GEMM bytes at 2.5 TB/s, 5 us per non-GEMM op; within ~10 % of five "
        "measured layouts at 7B TP4 N = 8192 under autocast; it has no communication term). Kept per layer: what the "
        f"counted forward saves for backward ({args.checkpointing} checkpointing; unique storages, parameters excluded, "
        "`SavedTensorsProbe`), and what full / low-rank activation checkpointing keeps per layer and rank "
        f"(`boost_hf.perf.activation_memory.saved_bytes_per_layer`: the {residual} residual stream and "
        "the bf16 latents; layer 1, so LaX's handed-on latents count).",
        "",
        *table(["layout", "preset", "GEMM GFLOP", "attention GFLOP", "non-GEMM GB", "non-GEMM ops",
                "collectives fwd / bwd (calls, bytes)", "= comm formula", "predicted H100 eager ms",
                f"kept per layer, counted, {args.checkpointing} ckpt (MB)", "kept per layer, full ckpt (MB)",
                "kept per layer, low-rank ckpt (MB)", "biggest movers (GB)"], rows),
        "",
    ]
    return lines, counted


def precision_section(counted: dict) -> list[str]:
    """Each layout counted in both precisions, side by side: no layout should be slower with bf16 parameters."""
    first, second = list(counted)
    rows = []
    for name in counted[first]:
        if name not in counted[second]:
            continue
        cells = []
        for precision in (first, second):
            config, _, cost = counted[precision][name]
            total = cost["total"]
            cells.append(f"{_num(total['non_gemm_bytes'] / GB)} / {total['non_gemm_ops']:g} / {_predicted_ms(total, config):.2f}")
        rows.append([name, *cells])
    return [
        "## Precision, side by side",
        "",
        "Per layer and rank, the same counts as above: non-GEMM GB / non-GEMM ops / predicted H100 eager ms (the GEMM "
        "and attention FLOPs are the same in both).",
        "",
        *table(["layout", first, second], rows),
        "",
    ]


# (full-rank baseline, the best BTP variant) of the headline ratio, each with sequence parallelism
HEADLINE = ("megatron sp", "btp online grouped sp")


def sequence_parallel_section(args, counted: dict, precision: str) -> list[str]:
    """Every layout with and without sequence parallelism side by side (counted in ``precision``), and the headline
    ratio: BTP against megatron *with* sequence parallelism, next to the GEMM + attention floor."""
    rows = []
    for name in [n for n in counted if not n.endswith(" sp") and f"{n} sp" in counted]:
        for variant in (name, f"{name} sp"):
            config, parallel, cost = counted[variant]
            total = cost["total"]
            calls = [sum(c["calls"] for c in cost[d]["collectives"].values()) for d in ("forward", "backward")]
            rows.append([variant, "yes" if parallel.sequence_parallel else "no",
                         f"{_num(total['non_gemm_bytes'] / GB)} / {total['non_gemm_ops']:g}", f"{calls[0]} / {calls[1]}",
                         f"{_predicted_ms(total, config):.2f}", _num(total["saved_bytes"] / MB),
                         f"{_saved_mb(config, parallel, cost['tokens'], 'full', precision)} / "
                         f"{_saved_mb(config, parallel, cost['tokens'], 'lowrank', precision)}"])
    lines = [
        f"## Sequence parallelism, side by side, {precision}",
        "",
        "Megatron-LM's sequence parallelism for megatron, latent sequence parallelism for BTP (the same counts as "
        "above; collectives: calls forward / backward, the same ring bytes per rank with and without SP).",
        "",
        *table(["layout", "sequence parallel", "non-GEMM GB / ops", "collectives fwd / bwd (calls)", "predicted H100 eager ms",
                f"kept per layer, counted, {args.checkpointing} ckpt (MB)", "kept per layer, full / low-rank ckpt (MB)"], rows),
        "",
    ]
    if all(name in counted for name in (*HEADLINE, "megatron")):
        (mc, _, megatron_sp), (bc, _, btp_sp), (_, _, megatron) = (counted[n] for n in (*HEADLINE, "megatron"))
        fastest = min((n for n in counted if counted[n][0].bottleneck is not None),
                      key=lambda n: _predicted_ms(counted[n][2]["total"], counted[n][0]))
        ms = {n: _predicted_ms(counted[n][2]["total"], counted[n][0]) for n in (*HEADLINE, "megatron")}
        floor = _predicted_ms(megatron_sp["total"], mc, floor=True) / _predicted_ms(btp_sp["total"], bc, floor=True)
        lines += [
            f"**Headline** (predicted H100 eager, per layer): {HEADLINE[1]} {ms[HEADLINE[1]]:.2f} ms vs {HEADLINE[0]} "
            f"{ms[HEADLINE[0]]:.2f} ms: **{ms[HEADLINE[0]] / ms[HEADLINE[1]]:.2f}x**, next to the GEMM + attention "
            f"floor's {floor:.2f}x (the fit's GEMM and attention terms only). Against megatron without sequence "
            f"parallelism ({ms['megatron']:.2f} ms) it would read {ms['megatron'] / ms[HEADLINE[1]]:.2f}x: not the "
            f"honest baseline. Fastest low-rank variant counted: {fastest}.",
            "",
        ]
    return lines


def _ms(result: dict) -> str:
    if "error" in result:
        return result["error"]
    return f"{result['ms_per_layer']:.2f} [{result['ms_per_layer_min']:.2f}, {result['ms_per_layer_max']:.2f}]"


def measured_section(args, names: list[str], precision: str) -> tuple[list[str], dict]:
    """Time every variant eager (and compiled with ``--compile``) in ``precision``; Markdown lines and
    ``{mode: results}``."""
    m = args.measure
    cases = {}
    for name in names:
        preset, config, parallel = variant_case(name, m["size"], args.low_rank, args.tp, args.checkpointing, **m["overrides"])
        try:
            parallel.check_model(config)
        except ValueError:
            continue
        cases[name] = (config, parallel)
    keywords, _, described = PRECISIONS[precision]
    timing = dict(device=args.device, layers=m["layers"], warmup=args.warmup, reps=args.reps, **keywords)
    runs = {"eager": measure_rank_layers(cases, m["batch"], m["seq"], **timing)}
    if args.compile:
        runs["compiled"] = measure_rank_layers(cases, m["batch"], m["seq"], compile=True, **timing)
    rows = [[name, *(_ms(runs[mode][name]) for mode in runs),
             " / ".join(f"{v:.1f}" for v in runs["eager"][name].get("step_ms", {}).values())] for name in cases]
    overrides = ", ".join(f"{k}={v}" for k, v in m["overrides"].items())
    lines = [
        f"## Measured on {device_name(args.device)} ({args.device}), {precision}",
        "",
        f"{m['size']} presets{' (' + overrides + ')' if overrides else ''}, TP {args.tp} (one rank, fake process group), "
        f"micro-batch {m['batch']} x seq {m['seq']}, {described}, forward + backward + AdamW (on the parameters as "
        "they are); per layer = "
        f"(t({m['layers'][1]} layers) - t({m['layers'][0]} layers)) / {m['layers'][1] - m['layers'][0]} per round, "
        f"all models interleaved, median [min, max] of {args.reps} rounds after {args.warmup} warm-up rounds "
        "(`boost_hf.perf.rank_cost.measure_rank_layers`).",
        "",
        *table(["layout", *(f"{mode} ms per layer" for mode in runs), f"eager step ms ({m['layers'][0]} / {m['layers'][1]} layers)"], rows),
        "",
    ]
    return lines, runs


def measured_run(args, runs: dict) -> MeasuredRun:
    """The measured times as :class:`boost_hf.perf.measured.MeasuredRun` (what ``boost-hf estimate --measured`` reads)."""
    m, layers = args.measure, []
    for name in runs["eager"]:
        preset, _, parallel = variant_case(name, m["size"], args.low_rank, args.tp, args.checkpointing, **m["overrides"])
        ms = {mode: runs[mode][name].get("ms_per_layer") for mode in runs}
        layers.append(MeasuredLayer(preset, parallel.tp_style, parallel.rmsnorm, parallel.group_linears, parallel.sequence_parallel,
                                    eager_ms=ms.get("eager"), compiled_ms=ms.get("compiled")))
    return MeasuredRun(f"{device_name(args.device)} ({args.device})", args.tp, m["batch"], m["seq"], args.checkpointing, tuple(layers))


def plot(counted: dict, runs: dict, args, out) -> str:
    """Counted panels (one bar per layout and precision) and, where measured, ms per layer per mode and precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("GEMM + attention TFLOP", lambda c, t: (t["gemm_flops"] + t["attention_flops"]) / 1e12),
        ("non-GEMM GB", lambda c, t: t["non_gemm_bytes"] / GB),
        ("non-GEMM ops (eager kernels)", lambda c, t: t["non_gemm_ops"]),
        ("predicted H100 eager ms", lambda c, t: _predicted_ms(t, c)),
        (f"kept per layer MB ({args.checkpointing} ckpt)", lambda c, t: t["saved_bytes"] / MB),
    ]
    fig, axes = plt.subplots(1, len(panels) + bool(runs), figsize=(3.6 * (len(panels) + bool(runs)), 4.5))
    names = list(dict.fromkeys(n for by_name in counted.values() for n in by_name))
    width = 0.8 / len(counted)
    for i, (ax, (title, value)) in enumerate(zip(axes, panels)):
        for j, (precision, by_name) in enumerate(counted.items()):
            shown = [n for n in names if n in by_name]
            ax.barh([names.index(n) + j * width for n in shown], [value(by_name[n][0], by_name[n][2]["total"]) for n in shown],
                    height=width, label=precision)
        ax.set_yticks(range(len(names)), names if i == 0 else [""] * len(names))  # the layouts are named on the first panel
        ax.invert_yaxis()
        ax.set_title(f"counted: {title}", fontsize=9)
    axes[0].legend(fontsize=8)
    if runs:
        ax = axes[-1]
        bars = [(precision, mode, results) for precision, by_mode in runs.items() for mode, results in by_mode.items()]
        width = 0.8 / len(bars)
        measured = list(dict.fromkeys(n for _, _, results in bars for n in results))
        for i, (precision, mode, results) in enumerate(bars):
            ok = [n for n in results if "ms_per_layer" in results[n]]
            ax.barh([measured.index(n) + i * width for n in ok], [results[n]["ms_per_layer"] for n in ok], height=width,
                    label=f"{mode}, {precision}")
        ax.set_yticks(range(len(measured)), measured)
        ax.invert_yaxis()
        ax.set_title(f"measured ms per layer, {args.device}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"one rank's decoder layer: counted {args.size} TP{args.tp}, {args.batch} x {args.seq}", fontsize=10)
    return save_figure(fig, out, "rank_cost")


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], timed=True)
    parser.add_argument("--size", default="7b", help="preset size of the counted models (default: 7b)")
    parser.add_argument("--low-rank", default="cola", choices=["cola", "svd", "lax"], help="preset family of the low-rank layouts (megatron uses llama)")
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size (default: 4)")
    parser.add_argument("--batch", type=int, default=2, help="micro-batch of the counted run (default: 2)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length of the counted run (default: 4096)")
    parser.add_argument("--layers", type=int, nargs=2, default=[1, 3], metavar=("L1", "L2"), help="layer counts differenced (default: 1 3)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=DEFAULT_VARIANTS, metavar="NAME",
                        help=f"layouts to run (default: {', '.join(DEFAULT_VARIANTS)}; all: {', '.join(VARIANTS)})")
    parser.add_argument("--checkpointing", default="none", choices=["none", "full", "lowrank"], help="activation checkpointing of every variant")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"],
                        help="device of the measured run (default: cuda where available)")
    parser.add_argument("--compile", action="store_true", help="also measure torch.compile-d models")
    parser.add_argument("--no-measure", action="store_true", help="count only")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up rounds of the measured run (default: 2)")
    parser.add_argument("--reps", type=int, default=None, help="timed rounds (default: 10 on cuda, 20 on cpu)")
    parser.add_argument("--precision", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS),
                        help="precisions to count and measure: autocast (bf16 autocast over fp32 parameters), bf16-params "
                             "(bf16 parameters, no autocast) (default: both)")
    parser.add_argument("--json", metavar="PATH", help="also write the measured layer times (of the first --precision) for "
                                                        "`boost-hf estimate --measured PATH`")
    args, started = parse(parser)
    if args.quick:
        args.size, args.tp, args.batch, args.seq = "60m", 2, 1, 128
    on_cpu = args.device == "cpu"
    # On CPU the counted shape would take minutes per step: time a 60m model with a small vocabulary (the LM
    # head, identical in both models, only adds noise to the difference).
    args.measure = dict(
        size="60m" if on_cpu else args.size, batch=1 if on_cpu else args.batch, seq=(64 if args.quick else 128) if on_cpu else args.seq,
        layers=(1, 2) if args.quick else (1, 5) if on_cpu else (2, 10), overrides=dict(vocab_size=1024) if on_cpu else {},
    )
    args.reps = args.reps or (2 if args.quick else 20 if on_cpu else 10)
    args.warmup = 1 if args.quick else args.warmup

    lines: list[str] = []
    counted: dict = {}  # precision -> name -> (config, parallel, count)
    runs: dict = {}  # precision -> mode -> name -> result
    with fake_process_group(args.tp):
        for precision in args.precision:
            section, counted[precision] = counted_section(args, args.variants, precision)
            lines += section + sequence_parallel_section(args, counted[precision], precision)
        if len(counted) == 2:
            lines += precision_section(counted)
        if not args.no_measure:
            for precision in args.precision:
                measured, runs[precision] = measured_section(args, args.variants, precision)
                lines += measured
            if args.json:
                measured_run(args, runs[args.precision[0]]).save(args.json)
                print(f"wrote {args.json}")
    lines.append(plot(counted, runs, args, args.out))
    write_result(args.out, "rank_cost", "One tensor-parallel rank's decoder-layer cost", lines, quick=args.quick, started=started)


if __name__ == "__main__":
    main()
