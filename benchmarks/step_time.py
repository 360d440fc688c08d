"""Training-step time on CPU (gloo): megatron (full rank) vs vanilla vs BTP at TP 2 and 4, each BTP
optimization toggled, and where the time goes.

Two shapes (``common.SHAPES``): ``compute-bound`` (d=1024, GEMMs dominate) and ``comm-balanced`` (d=128,
whose collective time per unit of GEMM time on this CPU is about that of a 3B model on A100s at TP2).
Every variant of one shape and TP size is built in the same process group before timing starts, and the variants
are then timed round-robin (the starting variant rotating each round), ``--warmup`` rounds discarded,
median of ``--reps`` rounds; a barrier starts every step on all ranks together, and each rank runs one
thread (``torch.set_num_threads(1)``, set by the launcher). A step = forward with labels, backward,
AdamW step. The profile (TP 2) re-runs 3 steps per layout under ``torch.profiler`` with every
collective wrapped in a barrier, so that waiting for a slower rank and the collective itself are
timed apart; a gloo all-reduce sweep and a GEMM measure this machine's communication and compute
rates. In the same run, single-process CoLA vs full-rank tokens/s and boost-hf's full-rank model vs
``transformers.LlamaForCausalLM`` holding identical weights.

    python benchmarks/step_time.py             # both shapes, TP 2 and 4: ~3.5 min on 2 cores
    python benchmarks/step_time.py --quick     # d=256, TP 2 only (smoke test)
"""

from __future__ import annotations

import os
import statistics
import time
from functools import partial

import torch

from common import (
    QUICK,
    SHAPES,
    BenchShape,
    CollectiveTimer,
    base_parser,
    bench_config,
    parse,
    ratio,
    save_figure,
    table,
    time_interleaved,
    training_step,
    write_result,
)

# name -> (bottleneck, ParallelConfig fields)
VARIANTS: dict[str, tuple[str | None, dict]] = {
    "megatron (full rank)": (None, dict(tp_style="megatron")),
    "vanilla": ("cola", dict(tp_style="vanilla")),
    "btp": ("cola", dict(tp_style="btp")),
    "btp sync norm": ("cola", dict(tp_style="btp", rmsnorm="sync")),
    "btp ungrouped": ("cola", dict(tp_style="btp", group_linears=False)),
    "btp full ckpt": ("cola", dict(tp_style="btp", activation_checkpointing="full")),
    "btp lowrank ckpt": ("cola", dict(tp_style="btp", activation_checkpointing="lowrank")),
}
PROFILED = ["megatron (full rank)", "vanilla", "btp", "btp sync norm", "btp ungrouped"]
GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")
COPY_OPS = ("aten::cat", "aten::stack", "aten::clone", "aten::copy_")
CATEGORIES = ("gemm", "attention", "copies", "collective", "wait", "optimizer", "other")
TARGETS = {"vanilla": 1.8, "megatron (full rank)": 1.45}  # paper's lower bounds: BTP speed-up at TP 2


def _build(name: str, shape: dict, seq: int, tp: int):
    from boost_hf import BoostLlamaForCausalLM, ParallelConfig

    bottleneck, fields = VARIANTS[name]
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(bench_config(shape, bottleneck, seq), parallel_config=ParallelConfig(tp_size=tp, **fields))
    return model.train(), torch.optim.AdamW(model.parameters(), lr=1e-5)


def profile_step(model, optimizer, input_ids) -> dict:
    """One step under the profiler and the barrier-wrapped collective timer: seconds per category."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with CollectiveTimer() as collectives, profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        loss = model(input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        with record_function("optimizer step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        total = time.perf_counter() - t
    events = prof.key_averages()
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS) / 1e6
    attention = sum(e.self_cpu_time_total for e in events if "scaled_dot_product" in e.key or "flash_attention" in e.key) / 1e6
    copies = sum(e.self_cpu_time_total for e in events if e.key in COPY_OPS) / 1e6
    opt = sum(e.cpu_time_total for e in events if e.key == "optimizer step") / 1e6
    return {
        "total": total,
        "gemm": gemm,
        "attention": attention,
        "copies": copies,
        "optimizer": opt,
        "collective": collectives.comm_s,
        "wait": collectives.wait_s,
        "other": total - gemm - attention - copies - opt - collectives.comm_s - collectives.wait_s,
        "calls": collectives.calls,
        "bytes": collectives.bytes,
    }


def profile_median(model_and_optimizer, input_ids, steps: int) -> dict:
    """Per category, the median over ``steps`` profiled steps (one profiled step is noisy)."""
    profiles = [profile_step(*model_and_optimizer, input_ids) for _ in range(steps)]
    return {key: statistics.median(p[key] for p in profiles) for key in profiles[0]}


def machine_rates(reps: int = 10) -> dict:
    """Inside the process group: gloo all-reduce time per message size, and GEMM GFLOP/s per rank while
    every rank runs GEMMs at once."""
    import torch.distributed as dist

    sizes = [4 * 2**10, 256 * 2**10, 4 * 2**20, 16 * 2**20]
    allreduce, fastest = {}, {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        times = []
        for i in range(reps + 2):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            if i >= 2:
                times.append(time.perf_counter() - t)
        allreduce[nbytes], fastest[nbytes] = statistics.median(times), min(times)
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    dist.barrier()
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    gflops = 2 * 512 * 1024 * 1024 * reps / (time.perf_counter() - t) / 1e9
    return {"allreduce_s": allreduce, "allreduce_fastest_s": fastest, "gemm_gflops": gflops}


def tp_worker(spec: dict) -> dict:
    """Runs on every rank: build all variants, time them interleaved, then profile and measure rates."""
    import torch.distributed as dist

    tp = dist.get_world_size()
    model_fields, batch, seq = spec["model"], spec["batch"], spec["seq"]
    models = {name: _build(name, model_fields, seq, tp) for name in spec["variants"]}
    ids = torch.randint(0, model_fields["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    steps = {name: partial(training_step, model, opt, ids) for name, (model, opt) in models.items()}
    result = {"timing": time_interleaved(steps, warmup=spec["warmup"], reps=spec["reps"], sync=dist.barrier)}
    if spec["profile"]:
        result["profile"] = {name: profile_median(models[name], ids, spec["profile_steps"]) for name in PROFILED if name in models}
        result["rates"] = machine_rates()
    return result


def single_process(shape: BenchShape, warmup: int, reps: int, threads: int) -> dict:
    """In this process (``threads`` intra-op threads): boost-hf full rank, transformers' LlamaForCausalLM
    with the same weights, and boost-hf CoLA, timed interleaved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from boost_hf import BoostLlamaForCausalLM

    torch.set_num_threads(threads)
    seq = shape.seq
    full_config = bench_config(shape.model, None, seq)
    torch.manual_seed(0)
    boost_full = BoostLlamaForCausalLM(full_config).train()
    llama_fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings")
    hf = LlamaForCausalLM(LlamaConfig(**{f: getattr(full_config, f) for f in llama_fields}, attn_implementation="sdpa"))
    hf.load_state_dict(boost_full.state_dict(), strict=True)
    hf.train()
    torch.manual_seed(0)
    cola = BoostLlamaForCausalLM(bench_config(shape.model, "cola", seq)).train()
    ids = torch.randint(0, shape.model["vocab_size"], (shape.batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss_gap = abs(float(boost_full(ids, labels=ids).loss) - float(hf(ids, labels=ids).loss))
    models = {"boost-hf full rank": boost_full, "transformers LlamaForCausalLM": hf, "boost-hf cola": cola}
    steps = {n: partial(training_step, m, torch.optim.AdamW(m.parameters(), lr=1e-5), ids) for n, m in models.items()}
    timing = time_interleaved(steps, warmup=warmup, reps=reps)
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    return {"timing": timing, "loss_gap": loss_gap, "params": params}


def megatron_flop_per_byte(model_fields: dict, tp: int, dtype_bytes: int) -> float:
    """Training FLOPs of a full-rank layer's linears per byte its TP collectives send per rank (ring), from
    :mod:`boost_hf.perf.flops` and :mod:`boost_hf.perf.comm_formula`."""
    from boost_hf import BoostLlamaConfig, ParallelConfig
    from boost_hf.perf.comm_formula import layer_communication
    from boost_hf.perf.flops import linear_flops_per_token

    config = BoostLlamaConfig(bottleneck=None, **model_fields)
    comm = layer_communication(config, ParallelConfig(tp_size=tp, tp_style="megatron"), tokens=1)
    sent = comm.forward.ring_traffic_bytes(tp, dtype_bytes) + comm.backward.ring_traffic_bytes(tp, dtype_bytes)
    return 3 * linear_flops_per_token(config) / tp / sent


def _rates_summary(rates: dict, tp: int) -> tuple[float, float, str]:
    """(bus bandwidth GB/s, GEMM GFLOP/s, all-reduce sweep text) of this machine's measured rates."""
    sizes = sorted(rates["allreduce_s"], key=int)
    large = sizes[-1]
    busbw = 2 * (tp - 1) / tp * int(large) / rates["allreduce_fastest_s"][large] / 1e9
    sweep = ", ".join(
        f"{int(n) // 1024} KiB {1e6 * rates['allreduce_fastest_s'][n]:.0f} / {1e6 * rates['allreduce_s'][n]:.0f} us" for n in sizes
    )
    return busbw, rates["gemm_gflops"], sweep


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], timed=True)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="model shapes (default: all)")
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 4], help="tensor-parallel sizes (default: 2 4)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="threads of the single-process runs (default 1, as each TP rank)")
    parser.add_argument("--single-reps", type=int, default=4, help="timed rounds of the single-process runs (default 4)")
    args, started = parse(parser)
    shapes = [SHAPES[name] for name in args.shapes]
    if args.quick:
        shapes, args.tp, args.warmup, args.reps, args.single_reps = [QUICK], [2], 1, 2, 2
    from boost_hf.perf.launcher import launch

    runs: dict[str, dict[int, dict]] = {}
    for shape in shapes:
        for tp in args.tp:
            spec = dict(model=shape.model, batch=shape.batch, seq=shape.seq, warmup=args.warmup, reps=args.reps,
                        variants=list(VARIANTS), profile=tp == min(args.tp), profile_steps=1 if args.quick else 3)
            t0 = time.perf_counter()
            per_rank = launch(tp_worker, tp, spec, timeout=3600)
            print(f"{shape.name}, TP={tp}: {time.perf_counter() - t0:.0f} s")
            timing = {n: max(r["timing"][n]["median"] for r in per_rank) for n in VARIANTS}  # the slowest rank
            best = {n: max(r["timing"][n]["min"] for r in per_rank) for n in VARIANTS}
            spread = {n: (per_rank[0]["timing"][n]["min"], per_rank[0]["timing"][n]["max"]) for n in VARIANTS}
            extra = {k: per_rank[0][k] for k in ("profile", "rates") if k in per_rank[0]}
            runs.setdefault(shape.name, {})[tp] = {"timing": timing, "best": best, "spread": spread, **extra}
    single = single_process(shapes[0], 1, args.single_reps, args.threads)

    body = [
        "Low-rank variants are CoLA (r = d/4); megatron runs the full-rank LLaMA of the same d / d_ff / layers. "
        f"{args.warmup} warm-up + {args.reps} timed rounds, variants interleaved round-robin (the starting variant "
        "rotating); a step is forward with labels + backward + AdamW; median (and fastest) step of the slowest rank; "
        "one thread per rank. Defaults: `btp` = online norm, grouped linears, no checkpointing.",
        "",
    ]
    body += _targets_section(runs, shapes)
    for shape in shapes:
        body += [f"## Shape `{shape.name}`: {shape.describe()}", "", f"Why this shape: {shape.why}.", ""]
        body += _tp_section(runs[shape.name], shape.tokens)
        body += _profile_section(runs[shape.name])
    body += _balance_section(runs, shapes, min(args.tp))
    body += _single_section(single, shapes[0], args.threads)
    body += [_plot(runs, shapes, args.out), ""]
    write_result(args.out, "step_time", "Training-step time on CPU: megatron vs vanilla vs BTP", body, quick=args.quick, started=started)


def _tp_section(runs: dict, tokens: int) -> list[str]:
    tps = sorted(runs)
    rows = []
    for name in VARIANTS:
        row = [name]
        for tp in tps:
            t, best = runs[tp]["timing"][name], runs[tp]["best"][name]
            lo, hi = runs[tp]["spread"][name]
            row += [f"{1000 * t:.0f} ({1000 * lo:.0f}-{1000 * hi:.0f})", f"{tokens / t:.0f}",
                    ratio(t, runs[tp]["timing"]["btp"]), ratio(best, runs[tp]["best"]["btp"])]
        rows.append(row)
    headers = ["variant"] + [h for tp in tps for h in (f"TP{tp} median step ms (rank 0 min-max)", f"TP{tp} tokens/s",
                                                       f"TP{tp} vs btp (median)", f"TP{tp} vs btp (fastest)")]
    lines = table(headers, rows)
    cores = os.cpu_count()
    if max(tps) > cores:
        lines += ["", f"TP{max(tps)} runs {max(tps)} single-threaded ranks on {cores} cores: ranks take turns on the cores, so its "
                  "times include oversubscription (a collective waits for a descheduled peer)."]
    lines += ["", "BTP toggles, time ratio median / fastest (> 1: the BTP default is faster):", ""]
    toggles = [
        ("sync norm vs online norm", "btp sync norm"),
        ("ungrouped vs grouped linears", "btp ungrouped"),
        ("full checkpointing vs none (recompute overhead)", "btp full ckpt"),
        ("low-rank checkpointing vs none (recompute overhead)", "btp lowrank ckpt"),
    ]
    rows = [
        [label] + [f"{ratio(runs[tp]['timing'][a], runs[tp]['timing']['btp'])} / {ratio(runs[tp]['best'][a], runs[tp]['best']['btp'])}" for tp in tps]
        for label, a in toggles
    ]
    return lines + table(["toggle"] + [f"TP{tp}" for tp in tps], rows) + [""]


def _targets_section(runs: dict, shapes: list[BenchShape]) -> list[str]:
    rows = []
    for shape in shapes:
        if 2 not in runs[shape.name]:
            continue
        median, best = runs[shape.name][2]["timing"], runs[shape.name][2]["best"]
        for name, target in TARGETS.items():
            speedup, fastest = median[name] / median["btp"], best[name] / best["btp"]
            status = "met" if min(speedup, fastest) >= target else ("**not met**" if max(speedup, fastest) < target else "met by one measure only")
            rows.append([shape.name, f"BTP vs {name}", f">= {target:.2f}x", f"{speedup:.2f}x", f"{fastest:.2f}x", status])
    if not rows:
        return []
    return ["## Targets at TP2 (the paper's lower bounds on GPUs)", ""] + table(
        ["shape", "comparison", "target", "speed-up (median)", "speed-up (fastest step)", "status"], rows) + [""]


def _profile_section(runs: dict) -> list[str]:
    profiled = [tp for tp in sorted(runs) if "profile" in runs[tp]]
    if not profiled:
        return []
    tp = profiled[0]
    prof = runs[tp]["profile"]
    lines = [
        f"Where the time goes (TP{tp}, rank 0; per category the median of 3 profiled steps per layout; the profiler and "
        "the barriers make a profiled step slower than a timed one):",
        "",
    ]
    rows = []
    for name, p in prof.items():
        share = lambda key: f"{1000 * p[key]:.0f} ({100 * p[key] / p['total']:.0f}%)"  # noqa: E731
        per_call = 1000 * p["collective"] / p["calls"] if p["calls"] else 0.0
        rows.append([name, f"{1000 * p['total']:.0f}", *(share(k) for k in CATEGORIES), p["calls"], f"{per_call:.1f}", f"{p['bytes'] / 2**20:.1f}"])
    lines += table(["layout", "step ms", *(f"{k} ms" for k in CATEGORIES), "collectives", "ms per collective", "MiB reduced/gathered"], rows)
    if "btp" in prof:
        lines += ["", "Difference to btp by category (ms; positive = slower than btp):", ""]
        rows = [
            [name, f"{1000 * (p['total'] - prof['btp']['total']):+.0f}", *(f"{1000 * (p[k] - prof['btp'][k]):+.0f}" for k in CATEGORIES)]
            for name, p in prof.items() if name != "btp"
        ]
        lines += table(["layout", "step", *CATEGORIES], rows)
    return lines + [""]


def _balance_section(runs: dict, shapes: list[BenchShape], tp: int) -> list[str]:
    rated = [s for s in shapes if "rates" in runs[s.name].get(tp, {})]
    if not rated:
        return []
    from boost_hf import BoostLlamaConfig
    from boost_hf.perf.hardware import get_hardware

    busbw, gflops, sweep = _rates_summary(runs[rated[0].name][tp]["rates"], tp)
    cpu_flop_per_byte = gflops / busbw
    a100 = get_hardware("a100")
    a100_flop_per_byte = a100.peak_flops / (a100.collective_gbps(tp) * 1e9)
    preset = BoostLlamaConfig.from_preset("llama-3b")
    llama_3b = {k: getattr(preset, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")}
    workload = megatron_flop_per_byte(llama_3b, tp, 2)
    rows = [["A100 node (`boost_hf.perf.hardware`), bf16, peak", f"llama-3b (d={llama_3b['hidden_size']})", f"{a100_flop_per_byte:.0f}",
             f"{workload:.0f}", f"{a100_flop_per_byte / workload:.2f}"]]
    for shape in shapes:
        workload = megatron_flop_per_byte(shape.model, tp, 4)
        rows.append(["this CPU, fp32, measured", f"{shape.name} (d={shape.model['hidden_size']})", f"{cpu_flop_per_byte:.0f}",
                     f"{workload:.0f}", f"{cpu_flop_per_byte / workload:.2f}"])
    return [
        f"## Communication vs compute on this machine (TP{tp})",
        "",
        f"Measured: gloo all-reduce (fastest / median of 10) {sweep}; bus bandwidth ~{busbw:.1f} GB/s; fp32 GEMM "
        f"{gflops:.0f} GFLOP/s per rank with all ranks busy. Even a tiny collective costs 0.3-0.5 ms at best and often "
        "~3-4 ms (see also 'ms per collective' in the profiles: a rank blocked in a collective is slow to be woken on this "
        "virtual machine), against ~15 us on NVLink: every extra collective (sync norm, ungrouped linears, BTP's 4 per "
        "layer against Megatron's 2) weighs far more here than on GPUs. "
        "Machine balance = FLOP/s per byte/s of collective bus bandwidth; workload "
        "balance = a full-rank layer's training FLOPs per rank per byte its Megatron collectives send per rank (ring), from "
        "`boost_hf.perf.flops` and `comm_formula`; their ratio is the time the collectives take per unit of GEMM time at "
        "those rates. The paper's GPUs sit near the first row; the `compute-bound` CPU shape has far less communication "
        "per unit of compute, which is why the `comm-balanced` shape is also measured.",
        "",
        *table(["machine", "model", "machine FLOP/B", "workload FLOP/B (megatron)", "collective time / GEMM time"], rows),
        "",
    ]


def _single_section(single: dict, shape: BenchShape, threads: int) -> list[str]:
    t = single["timing"]
    tokens = shape.tokens
    rows = [[n, f"{single['params'][n] / 1e6:.1f}", f"{1000 * v['median']:.0f}", f"{tokens / v['median']:.0f}"] for n, v in t.items()]
    full, hf, cola = (t[n]["median"] for n in ("boost-hf full rank", "transformers LlamaForCausalLM", "boost-hf cola"))
    return [
        f"## Single process, shape `{shape.name}` ({threads} thread{'s' if threads > 1 else ''}, no tensor parallelism)",
        "",
        *table(["model", "params (M)", "median step ms", "tokens/s"], rows),
        "",
        f"CoLA vs full rank: {full / cola:.2f}x the tokens/s. boost-hf full rank vs transformers' LlamaForCausalLM "
        f"with identical weights: step time {100 * (full / hf - 1):+.1f}% (|loss difference| {single['loss_gap']:.1e}).",
        "",
    ]


def _plot(runs: dict, shapes: list[BenchShape], out) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(shapes), 2, figsize=(14, 4.2 * len(shapes)), squeeze=False)
    names = list(VARIANTS)
    for row, shape in zip(axes, shapes):
        shape_runs = runs[shape.name]
        tps = sorted(shape_runs)
        width = 0.8 / len(tps)
        for i, tp in enumerate(tps):
            row[0].barh([y + i * width for y in range(len(names))], [1000 * shape_runs[tp]["timing"][n] for n in names], width, label=f"TP{tp}")
        row[0].set_yticks([y + width * (len(tps) - 1) / 2 for y in range(len(names))], names)
        row[0].invert_yaxis()
        row[0].set_xlabel(f"median step time (ms), shape {shape.name}")
        row[0].legend()
        profiled = [tp for tp in tps if "profile" in shape_runs[tp]]
        if profiled:
            prof = shape_runs[profiled[0]]["profile"]
            left = [0.0] * len(prof)
            for key in CATEGORIES:
                values = [1000 * p[key] for p in prof.values()]
                row[1].barh(list(prof), values, left=left, label=key)
                left = [a + b for a, b in zip(left, values)]
            row[1].invert_yaxis()
            row[1].set_xlabel(f"profiled step (ms), shape {shape.name}, TP{profiled[0]}, rank 0")
            row[1].legend(fontsize=8)
    return save_figure(fig, out, "step_time")


if __name__ == "__main__":
    main()
