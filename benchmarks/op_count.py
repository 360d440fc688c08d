"""The ops each layout's decoder layer dispatches per training step, forward + backward, on one tensor-parallel rank.

Eager mode launches one kernel (or one collective call) per dispatched op, each paid by the host (dispatcher, autograd,
Python): a layer that dispatches many more ops than another of equal FLOPs is the one an eager GPU run may find
host-bound. Counted by :func:`boost_hf.perf.rank_cost.count_rank_layer_dispatches` (a ``TorchDispatchMode`` over fake
tensors, one layer = ``(t(3 layers) - t(1 layer)) / 2``, so embedding, head and loss cancel; the counts depend on the
model's structure, not its sizes): GEMMs, attention kernels, collectives, every other op that launches work (element-wise,
reductions, copies, casts, boost-hf's fused custom ops: each one generated kernel on CUDA,
``tests/parallel/test_latent_op.py``, ``tests/parallel/test_statistics_op.py``), and views (no kernel; host work only).

The 7B presets (megatron on the full-rank LLaMA-7B, the others on CoLA-7B: the same shape, r = d/4; svd-7b and lax-7b
for the other bottlenecks), TP 4, in both precisions: bf16 parameters without autocast (the default policy) and bf16
autocast over fp32 parameters. ``before`` is this same count at c1963a7, before the BTP path was made leaner (q and k's
B's, and gate and up's, as one batched GEMM each, the norm statistics and gamma's gradient in one op each, RoPE of q and
k in one pass, gradients written into one buffer, one fused latent kernel each way).

    python benchmarks/op_count.py            # -> benchmarks/results/op_count.md (~1 min, no GPU)
"""

from __future__ import annotations

import torch

from common import base_parser, parse, table, write_result

from boost_hf import BoostLlamaConfig, ParallelConfig
from boost_hf.perf.rank_cost import count_rank_layer_dispatches, fake_process_group

TP = 4
# row name -> (preset, ParallelConfig fields)
VARIANTS = {
    "llama-7b, megatron": ("llama-7b", dict(tp_style="megatron")),
    "llama-7b, megatron + SP": ("llama-7b", dict(tp_style="megatron", sequence_parallel=True)),
    "cola-7b, vanilla": ("cola-7b", dict(tp_style="vanilla")),
    "cola-7b, btp": ("cola-7b", dict(tp_style="btp")),
    "cola-7b, btp + latent SP": ("cola-7b", dict(tp_style="btp", sequence_parallel=True)),
    "cola-7b, btp, sync norm": ("cola-7b", dict(tp_style="btp", rmsnorm="sync")),
    "cola-7b, btp, low-rank checkpointing": ("cola-7b", dict(tp_style="btp", activation_checkpointing="lowrank")),
    "svd-7b, btp": ("svd-7b", dict(tp_style="btp")),
    "lax-7b, btp": ("lax-7b", dict(tp_style="btp")),
}
PRECISIONS = {
    "bf16-params": dict(autocast_dtype=None, param_dtype=torch.bfloat16),
    "autocast": dict(autocast_dtype=torch.bfloat16, param_dtype=None),
}
#: launches per layer (forward + backward) counted by this script at c1963a7, before the BTP changes
BEFORE = {
    ("llama-7b, megatron", "bf16-params"): 48, ("llama-7b, megatron", "autocast"): 62,
    ("llama-7b, megatron + SP", "bf16-params"): 56, ("llama-7b, megatron + SP", "autocast"): 70,
    ("cola-7b, vanilla", "bf16-params"): 79, ("cola-7b, vanilla", "autocast"): 101,
    ("cola-7b, btp", "bf16-params"): 86, ("cola-7b, btp", "autocast"): 104,
    ("cola-7b, btp + latent SP", "bf16-params"): 94, ("cola-7b, btp + latent SP", "autocast"): 112,
    ("cola-7b, btp, sync norm", "bf16-params"): 106, ("cola-7b, btp, sync norm", "autocast"): 128,
    ("cola-7b, btp, low-rank checkpointing", "bf16-params"): 119, ("cola-7b, btp, low-rank checkpointing", "autocast"): 144,
    ("svd-7b, btp", "bf16-params"): 84, ("svd-7b, btp", "autocast"): 102,
    ("lax-7b, btp", "bf16-params"): 216, ("lax-7b, btp", "autocast"): 262,
}
MEGATRON = "llama-7b, megatron"


def count(name: str, precision: str) -> dict:
    preset, fields = VARIANTS[name]
    return count_rank_layer_dispatches(BoostLlamaConfig.from_preset(preset), ParallelConfig(tp_size=TP, **fields),
                                       **PRECISIONS[precision])


def _cells(c: dict) -> str:
    return f"{c['launches']:g} ({c['gemm']:g} / {c['attention']:g} / {c['collective']:g} / {c['other']:g})"


def section(precision: str, counted: dict) -> list[str]:
    rows = []
    megatron = counted[MEGATRON]["total"]["launches"]
    for name, c in counted.items():
        f, b, t = c["forward"], c["backward"], c["total"]
        rows.append([name, _cells(f), _cells(b), f"**{t['launches']:g}**", BEFORE.get((name, precision), "-"),
                     f"{t['launches'] / megatron:.2f}", f"{t['view']:g}"])
    return [f"## {precision}", "", *table(
        ["model, layout", "forward: ops (GEMM / attention / collective / other)", "backward: ops (GEMM / attention / collective / other)",
         "forward + backward", "before (c1963a7)", "vs llama-7b megatron", "views"], rows), ""]


def other_ops(counted: dict, names: list[str]) -> list[str]:
    """The non-GEMM, non-collective ops of some variants, by name (where the 'other' column comes from)."""
    lines = []
    for name in names:
        by_op = counted[name]["total"]["by_op"]
        listed = ", ".join(f"{op.split('/', 1)[1]} {n:g}" for op, n in by_op.items() if op.startswith("other/"))
        gemms = ", ".join(f"{op.split('/', 1)[1]} {n:g}" for op, n in by_op.items() if op.startswith("gemm/"))
        lines.append(f"- {name}: GEMMs {gemms}; other: {listed}")
    return lines


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    args, started = parse(parser)
    names = list(VARIANTS) if not args.quick else [MEGATRON, "cola-7b, vanilla", "cola-7b, btp"]
    body = [
        f"One rank of TP {TP}, fake process group; one decoder layer per training step (forward with labels, no KV cache, "
        "backward), counted by `count_rank_layer_dispatches` (fake tensors: the counts depend on the structure, not the "
        "sizes). **ops**: what launches work in eager mode (one kernel, or one collective call, each), split into GEMMs, "
        "attention kernels, collectives and every other op; **views**: aliases (no kernel). `before`: the same count at "
        "c1963a7. Megatron runs the full-rank LLaMA-7B (it refuses a low-rank model); vanilla and btp split the same "
        "CoLA-7B.",
        "",
    ]
    with fake_process_group(TP):
        for precision in PRECISIONS:
            counted = {name: count(name, precision) for name in names}
            body += section(precision, counted)
            if precision == "bf16-params":
                body += ["Where the ops are (bf16 parameters, forward + backward):", "",
                         *other_ops(counted, [MEGATRON, "cola-7b, btp"]), ""]
    write_result(args.out, "op_count", "Ops dispatched per decoder layer, by layout", body, quick=args.quick, started=started)


if __name__ == "__main__":
    main()
