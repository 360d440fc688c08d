"""Training-step time on CPU (gloo): megatron (full rank) vs vanilla vs BTP at TP 2 and 4, each BTP
optimization toggled, and where the time goes.

Every variant of one TP size is built in the same process group before timing starts, and the variants
are then timed round-robin (the starting variant rotating each round), ``--warmup`` rounds discarded,
median of ``--reps`` rounds; a barrier starts every step on all ranks together, and each rank runs one
thread (``torch.set_num_threads(1)``, set by the launcher). A step = forward with labels, backward,
AdamW step. The profile (TP 2) re-runs one step per layout under ``torch.profiler`` with every
collective wrapped in a barrier, so that waiting for a slower rank and the collective itself are
timed apart; a gloo all-reduce sweep and a GEMM measure this machine's communication and compute
rates. In the same run, single-process CoLA vs full-rank tokens/s and boost-hf's full-rank model vs
``transformers.LlamaForCausalLM`` holding identical weights.

    python benchmarks/step_time.py             # ~5 min on 2 cores
    python benchmarks/step_time.py --quick     # d=256, TP 2 only
"""

from __future__ import annotations

import os
import statistics
import time
from functools import partial

import torch

from common import (
    BENCH_SHAPE,
    QUICK_SHAPE,
    CollectiveTimer,
    base_parser,
    bench_config,
    interleaved_medians,
    parse,
    ratio,
    save_figure,
    shape_line,
    table,
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
        loss = model(input_ids, labels=input_ids).loss
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


def machine_rates(reps: int = 10) -> dict:
    """Inside the process group: gloo all-reduce time per message size, and GEMM GFLOP/s per rank while
    every rank runs GEMMs at once."""
    import torch.distributed as dist

    sizes = [4 * 2**10, 256 * 2**10, 4 * 2**20, 16 * 2**20]
    allreduce = {}
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        times = []
        for i in range(reps + 2):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            if i >= 2:
                times.append(time.perf_counter() - t)
        allreduce[nbytes] = statistics.median(times)
    a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
    dist.barrier()
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    gflops = 2 * 512 * 1024 * 1024 * reps / (time.perf_counter() - t) / 1e9
    return {"allreduce_s": allreduce, "gemm_gflops": gflops}


def tp_worker(spec: dict) -> dict:
    """Runs on every rank: build all variants, time them interleaved, then profile and measure rates."""
    import torch.distributed as dist

    tp = dist.get_world_size()
    shape, batch, seq = spec["shape"], spec["batch"], spec["seq"]
    models = {name: _build(name, shape, seq, tp) for name in spec["variants"]}
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    steps = {name: partial(training_step, model, opt, ids) for name, (model, opt) in models.items()}
    result = {"timing": interleaved_medians(steps, warmup=spec["warmup"], reps=spec["reps"], sync=dist.barrier)}
    if spec["profile"]:
        result["profile"] = {name: profile_step(*models[name], ids) for name in PROFILED if name in models}
        result["rates"] = machine_rates()
    return result


def single_process(shape: dict, batch: int, seq: int, warmup: int, reps: int, threads: int) -> dict:
    """In this process (``threads`` intra-op threads): boost-hf full rank, transformers' LlamaForCausalLM
    with the same weights, and boost-hf CoLA, timed interleaved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from boost_hf import BoostLlamaForCausalLM

    torch.set_num_threads(threads)
    full_config = bench_config(shape, None, seq)
    torch.manual_seed(0)
    boost_full = BoostLlamaForCausalLM(full_config).train()
    llama_fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings")
    hf = LlamaForCausalLM(LlamaConfig(**{f: getattr(full_config, f) for f in llama_fields}, attn_implementation="sdpa"))
    hf.load_state_dict(boost_full.state_dict(), strict=True)
    hf.train()
    torch.manual_seed(0)
    cola = BoostLlamaForCausalLM(bench_config(shape, "cola", seq)).train()
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss_gap = abs(float(boost_full(ids, labels=ids).loss) - float(hf(ids, labels=ids).loss))
    models = {"boost-hf full rank": boost_full, "transformers LlamaForCausalLM": hf, "boost-hf cola": cola}
    steps = {n: partial(training_step, m, torch.optim.AdamW(m.parameters(), lr=1e-5), ids) for n, m in models.items()}
    timing = interleaved_medians(steps, warmup=warmup, reps=reps)
    params = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    return {"timing": timing, "loss_gap": loss_gap, "params": params}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0], timed=True)
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 4], help="tensor-parallel sizes (default: 2 4)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=BENCH_SHAPE["num_hidden_layers"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="threads of the single-process runs (default 1, as each TP rank)")
    parser.add_argument("--single-reps", type=int, default=4, help="timed rounds of the single-process runs (default 4)")
    args, started = parse(parser)
    shape = dict(BENCH_SHAPE, num_hidden_layers=args.layers)
    if args.quick:
        shape, args.tp, args.batch, args.seq, args.warmup, args.reps = dict(QUICK_SHAPE), [2], 1, 64, 1, 2
    from boost_hf.parallel.launcher import launch

    tokens = args.batch * args.seq
    runs = {}
    for tp in args.tp:
        spec = dict(shape=shape, batch=args.batch, seq=args.seq, warmup=args.warmup, reps=args.reps,
                    variants=list(VARIANTS), profile=tp == min(args.tp))
        t0 = time.perf_counter()
        per_rank = launch(tp_worker, tp, spec, timeout=3600)
        print(f"TP={tp}: {time.perf_counter() - t0:.0f} s")
        timing = {n: max(r["timing"][n]["median"] for r in per_rank) for n in VARIANTS}  # the slowest rank
        best = {n: max(r["timing"][n]["min"] for r in per_rank) for n in VARIANTS}
        spread = {n: (per_rank[0]["timing"][n]["min"], per_rank[0]["timing"][n]["max"]) for n in VARIANTS}
        runs[tp] = {"timing": timing, "best": best, "spread": spread, **{k: per_rank[0][k] for k in ("profile", "rates") if k in per_rank[0]}}
    single = single_process(shape, args.batch, args.seq, 1, min(args.single_reps, args.reps), args.threads)

    body = [
        f"Model: {shape_line(shape, args.batch, args.seq)}. Low-rank variants are CoLA (r = d/4); megatron runs the "
        f"full-rank LLaMA of the same d / d_ff / layers. {args.warmup} warm-up + {args.reps} timed rounds, variants "
        "interleaved round-robin; median step (forward + backward + AdamW) of the slowest rank; one thread per rank.",
        "",
    ]
    body += _tp_section(runs, tokens)
    body += _targets_section(runs)
    if any("profile" in r for r in runs.values()):
        body += _profile_section(runs, tokens)
    body += _single_section(single, tokens, args.threads)
    body += [_plot(runs, args.out), ""]
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
                                                       f"TP{tp} vs btp (median)", f"TP{tp} vs btp (fastest step)")]
    lines = ["## Step time per variant", ""] + table(headers, rows)
    lines += ["", "The fastest-step ratio is less sensitive to other processes taking the cores (they only ever add time)."]
    cores = os.cpu_count()
    if max(tps) > cores:
        lines += ["", f"TP{max(tps)} runs {max(tps)} single-threaded ranks on {cores} cores: ranks take turns on the cores, so its "
                  "times include oversubscription (each collective waits for a descheduled peer)."]
    lines += ["", "BTP toggles (time ratio, median / fastest step; > 1 means the BTP default is faster):", ""]
    toggles = [
        ("online norm vs sync norm", "btp sync norm", "btp"),
        ("grouped linears vs ungrouped", "btp ungrouped", "btp"),
        ("recompute overhead, full checkpointing", "btp full ckpt", "btp"),
        ("recompute overhead, low-rank checkpointing", "btp lowrank ckpt", "btp"),
    ]
    rows = [
        [label] + [f"{ratio(runs[tp]['timing'][a], runs[tp]['timing'][b])} / {ratio(runs[tp]['best'][a], runs[tp]['best'][b])}" for tp in tps]
        for label, a, b in toggles
    ]
    lines += table(["toggle"] + [f"TP{tp}" for tp in tps], rows) + [""]
    return lines


def _targets_section(runs: dict) -> list[str]:
    if 2 not in runs:
        return []
    median, best = runs[2]["timing"], runs[2]["best"]
    lines = ["## Targets at TP2 (the paper's lower bounds on GPUs)", ""]
    rows = []
    for name, target in TARGETS.items():
        speedup, speedup_best = median[name] / median["btp"], best[name] / best["btp"]
        status = "met" if min(speedup, speedup_best) >= target else ("**not met**" if max(speedup, speedup_best) < target else "borderline")
        rows.append([f"BTP vs {name}", f">= {target:.2f}x", f"{speedup:.2f}x", f"{speedup_best:.2f}x", status])
    return lines + table(["comparison", "target", "speed-up (median)", "speed-up (fastest step)", "status"], rows) + [""]


def _profile_section(runs: dict, tokens: int) -> list[str]:
    tp = min(tp for tp in runs if "profile" in runs[tp])
    prof, rates = runs[tp]["profile"], runs[tp]["rates"]
    lines = [
        f"## Where the time goes (TP{tp}, rank 0, one profiled step per layout)",
        "",
        "GEMM, attention, copies: self CPU time of `aten::mm/bmm/addmm`, of the SDPA kernels (forward and backward) "
        "and of `aten::cat/stack/clone/copy_` (grouped weights concatenated each step, all-reduce input clones, dtype "
        "copies) from `torch.profiler`; collective: the gloo collectives, each started after a barrier; wait: time in that "
        "barrier (this rank was ahead: redundant or unbalanced work elsewhere, plus one barrier latency per "
        "collective); optimizer: AdamW step; other: the rest (norms, activations, RoPE, copies, autograd and Python "
        "overhead). The profiler and barriers make this step slower than the timed one.",
        "",
    ]
    rows = []
    for name, p in prof.items():
        total = p["total"]
        share = lambda key: f"{1000 * p[key]:.0f} ({100 * p[key] / total:.0f}%)"  # noqa: E731
        rows.append([name, f"{1000 * total:.0f}", *(share(k) for k in CATEGORIES), p["calls"], f"{p['bytes'] / 2**20:.1f}"])
    lines += table(["layout", "step ms", *(f"{k} ms" for k in CATEGORIES), "collectives", "MiB reduced/gathered"], rows)
    if "btp" in prof:
        lines += ["", "Difference to btp by category (ms of the profiled step; positive = slower than btp):", ""]
        rows = [
            [name, f"{1000 * (p['total'] - prof['btp']['total']):+.0f}", *(f"{1000 * (p[k] - prof['btp'][k]):+.0f}" for k in CATEGORIES)]
            for name, p in prof.items() if name != "btp"
        ]
        lines += table(["layout", "step", *CATEGORIES], rows)
    small, large = min(rates["allreduce_s"], key=int), max(rates["allreduce_s"], key=int)
    latency = rates["allreduce_s"][small]
    t_large = rates["allreduce_s"][large]
    busbw = 2 * (tp - 1) / tp * int(large) / t_large / 1e9
    gflops = rates["gemm_gflops"]
    from boost_hf.perf.hardware import get_hardware

    a100 = get_hardware("a100")
    sweep = ", ".join(f"{int(n) // 1024} KiB {1e6 * s:.0f} us" for n, s in sorted(rates["allreduce_s"].items(), key=lambda kv: int(kv[0])))
    lines += [
        "",
        f"This machine at TP{tp}: gloo all-reduce {sweep} (latency ~{1e6 * latency:.0f} us, bus bandwidth "
        f"~{busbw:.1f} GB/s at {int(large) // 2**20} MiB); fp32 GEMM {gflops:.0f} GFLOP/s per rank with all ranks busy. "
        f"Compute per byte of collective bandwidth: {gflops / busbw:.0f} FLOP/B here vs "
        f"{a100.peak_flops / (a100.collective_gbps(tp) * 1e9):.0f} FLOP/B on an A100 node at TP{tp} (bf16 peak / NVLink bus bandwidth, "
        "`boost_hf.perf.hardware`): relative to compute, communication is far cheaper here than on GPUs, so the "
        "layouts differ on this machine mainly by FLOPs and redundant work, not by bytes moved.",
        "",
    ]
    return lines


def _single_section(single: dict, tokens: int, threads: int) -> list[str]:
    t = single["timing"]
    rows = [[n, f"{single['params'][n] / 1e6:.1f}", f"{1000 * v['median']:.0f}", f"{tokens / v['median']:.0f}"] for n, v in t.items()]
    full, hf, cola = (t[n]["median"] for n in ("boost-hf full rank", "transformers LlamaForCausalLM", "boost-hf cola"))
    return [
        f"## Single process ({threads} threads, no tensor parallelism)",
        "",
        *table(["model", "params (M)", "step ms", "tokens/s"], rows),
        "",
        f"CoLA vs full rank: {full / cola:.2f}x the tokens/s. boost-hf full rank vs transformers' LlamaForCausalLM "
        f"with identical weights: step time {100 * (full / hf - 1):+.1f}% (|loss difference| {single['loss_gap']:.1e}).",
        "",
    ]


def _plot(runs: dict, out) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = sorted(runs)
    profiled = [tp for tp in tps if "profile" in runs[tp]]
    fig, axes = plt.subplots(1, 2 if profiled else 1, figsize=(14, 4.2), squeeze=False)
    axes = axes[0]
    names = list(VARIANTS)
    width = 0.8 / len(tps)
    for i, tp in enumerate(tps):
        axes[0].barh([y + i * width for y in range(len(names))], [1000 * runs[tp]["timing"][n] for n in names], width, label=f"TP{tp}")
    axes[0].set_yticks([y + width * (len(tps) - 1) / 2 for y in range(len(names))], names)
    axes[0].invert_yaxis()
    axes[0].set_xlabel("median step time (ms)")
    axes[0].legend()
    if profiled:
        prof = runs[profiled[0]]["profile"]
        keys = CATEGORIES
        left = [0.0] * len(prof)
        for key in keys:
            values = [1000 * p[key] for p in prof.values()]
            axes[1].barh(list(prof), values, left=left, label=key)
            left = [a + b for a, b in zip(left, values)]
        axes[1].invert_yaxis()
        axes[1].set_xlabel(f"profiled step, ms (TP{profiled[0]}, rank 0)")
        axes[1].legend(fontsize=8)
    return save_figure(fig, out, "step_time")


if __name__ == "__main__":
    main()
