"""Single-GPU training throughput and MFU: CoLA vs full rank at 1B-size layers, bf16 autocast, SDPA.

Runs only where CUDA is available; elsewhere it says so and exits 0 without writing results (never a
test or CI dependency). Both models are built on the CPU and moved to the GPU (fp32 master weights, bf16
autocast, fused AdamW, no KV cache as the Trainer trains; ``--compile``: every decoder layer compiled in
place, and the loss, as ``BoostTrainer --torch_compile``), timed interleaved (median after warm-up,
``torch.cuda.synchronize`` closing each step), and
MFU = tokens/s x :func:`boost_hf.perf.flops.training_flops_per_token` / the GPU's dense bf16 peak
(from :mod:`boost_hf.perf.hardware` by device name, or ``--peak-tflops``).

    python benchmarks/gpu_throughput.py                 # 24-layer llama-1b vs cola-1b, batch 4 x seq 1024
    python benchmarks/gpu_throughput.py --compile       # the same with compiled decoder layers (gpu_throughput_compiled.md)
    python benchmarks/gpu_throughput.py --quick         # 2 layers, seq 256
    python benchmarks/gpu_throughput.py --device cpu --quick --out /tmp/x   # code-path check only
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from common import base_parser, parse, table, time_interleaved, write_result

PRESETS = ("llama-1b", "cola-1b")
PEAK_BY_NAME = {"H200": "h200", "H100": "h100", "A100": "a100"}


def device_peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a known GPU (``boost_hf.perf.hardware`` presets) from its CUDA device name."""
    from boost_hf.perf.hardware import get_hardware

    for key, preset in PEAK_BY_NAME.items():
        if key in device_name.upper():
            return get_hardware(preset).peak_tflops
    return None


def build(presets, layers: int, seq: int, device: str) -> dict:
    """``{preset: (model, fused AdamW)}``: each model built on the CPU (fp32) and moved to ``device``."""
    from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM

    models = {}
    for preset in presets:
        config = BoostLlamaConfig.from_preset(preset, num_hidden_layers=layers, max_position_embeddings=max(seq, 2048))
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = BoostLlamaForCausalLM(config).to(device).train()
        models[preset] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=torch.device(device).type == "cuda"))
    return models


def time_models(models: dict, batch: int, seq: int, warmup: int, reps: int) -> dict:
    """Training steps of every model (bf16 autocast, no KV cache, AdamW), interleaved: ``{"timing", "flops",
    "params", "peak_memory"}`` per preset (peak memory of each model's first step, in bytes; ``None`` off CUDA)."""
    from boost_hf.perf.flops import training_flops_per_token

    some_model = next(iter(models.values()))[0]
    dev = some_model.device
    cuda = dev.type == "cuda"
    ids = torch.randint(0, some_model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(dev)

    def step(model, optimizer):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(ids, labels=ids, use_cache=False).loss  # as the Trainer trains: no KV cache
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()

    peak_memory = {}
    for preset, (model, optimizer) in models.items():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step(model, optimizer)
        peak_memory[preset] = torch.cuda.max_memory_allocated() if cuda else None
    timing = time_interleaved({p: partial(step, *m) for p, m in models.items()}, warmup=warmup, reps=reps)
    return {"timing": timing, "peak_memory": peak_memory,
            "flops": {p: training_flops_per_token(m.config, seq) for p, (m, _) in models.items()},
            "params": {p: sum(x.numel() for x in m.parameters()) for p, (m, _) in models.items()}}


def measure(presets, layers: int, batch: int, seq: int, warmup: int, reps: int, device: str, compile: bool = False) -> dict:
    """Build the models, compile their decoder layers and loss with ``compile`` (what ``BoostTrainer --torch_compile`` does),
    and time them (:func:`time_models`)."""
    from boost_hf.parallel.compile import compile_model

    models = build(presets, layers, seq, device)
    if compile:
        for model, _ in models.values():
            compile_model(model)
    return time_models(models, batch, seq, warmup, reps)


def result_rows(result: dict, tokens: int, peak_tflops: float | None) -> tuple[list[list], dict]:
    """The table rows of :func:`time_models`'s result and ``{preset: tokens/s}``."""
    rows, tps = [], {}
    for preset in result["timing"]:
        t = result["timing"][preset]["median"]
        tps[preset] = tokens / t
        model_tflops = tps[preset] * result["flops"][preset] / 1e12
        memory = result["peak_memory"][preset]
        rows.append([
            preset, f"{result['params'][preset] / 1e6:.0f}", f"{1000 * t:.1f}", f"{tps[preset]:,.0f}", f"{model_tflops:.1f}",
            f"{100 * model_tflops / peak_tflops:.1f}%" if peak_tflops else "n/a (unknown peak: pass --peak-tflops)",
            f"{memory / 2**30:.1f}" if memory is not None else "-",
        ])
    return rows, tps


HEADERS = ["model", "params (M)", "step ms", "tokens/s", "model TFLOP/s", "MFU", "peak memory (GiB)"]


def main() -> int:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to check the code path")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (default 24: the 1B models)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of the device (default: by device name)")
    parser.add_argument("--compile", action="store_true", help="compile each decoder layer in place (as BoostTrainer --torch_compile)")
    args, started = parse(parser)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_throughput: CUDA is not available on this machine; nothing measured, no results written.")
        return 0
    if args.quick:
        args.layers, args.batch, args.seq, args.warmup, args.reps = 2, 2, 256, 1, 2
        if args.device == "cpu":
            args.seq = 64
    cuda = args.device.startswith("cuda")
    device_name = torch.cuda.get_device_name() if cuda else f"CPU ({args.device}; code-path check, not a GPU result)"
    peak = args.peak_tflops or (device_peak_tflops(device_name) if cuda else None)
    res = measure(PRESETS, args.layers, args.batch, args.seq, args.warmup, args.reps, args.device, compile=args.compile)
    tokens = args.batch * args.seq
    rows, tps = result_rows(res, tokens, peak)
    cuda_version = f", CUDA {torch.version.cuda}" if cuda else ""
    body = [
        f"- device: **{device_name}**{cuda_version}; dense bf16 peak used for MFU: {f'{peak:.0f} TFLOP/s' if peak else 'unknown'}",
        f"- models: {', '.join(PRESETS)} with {args.layers} layers; micro-batch {args.batch} x seq {args.seq} = {tokens} tokens; "
        f"bf16 autocast, fp32 master weights, {'fused ' if cuda else ''}AdamW, SDPA attention, no KV cache; "
        f"{'decoder layers compiled in place (torch.compile); ' if args.compile else 'eager; '}median of {args.reps} interleaved steps "
        f"after {args.warmup} warm-up",
        "- MFU counts model FLOPs only (`training_flops_per_token`: 3 x forward, causal attention, LM head), not recomputation",
        "",
        *table(HEADERS, rows),
        "",
        f"CoLA vs full rank: {tps['cola-1b'] / tps['llama-1b']:.2f}x the tokens/s "
        f"(paper, 1B on A100 at TP1: 0.85 s / 0.59 s = 1.44x per iteration; BOOST.md section 6).",
        "",
    ]
    stem = ("gpu_throughput" if cuda else "gpu_throughput_cpu_check") + ("_compiled" if args.compile else "")
    write_result(args.out, stem, "Single-GPU throughput and MFU: CoLA vs full rank (1B-size layers)", body, quick=args.quick, started=started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
