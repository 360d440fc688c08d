"""Communication per decoder layer, forward and backward, counted on gloo ranks and set next to the formula.

For each model size (1b/3b/7b/13b shapes: megatron runs ``llama-<size>``, the low-rank layouts
``cola-<size>``) and each layout, one 2-layer model is built (uninitialised weights set to a constant:
values do not change what is communicated) on ``tp`` local processes; a training step is counted with
:class:`boost_hf.CommCounter` with both layers and again with the first layer only, and the difference
is one layer's collectives (what the embedding, LM head and loss communicate cancels, so the
vocabulary is cut to ``--vocab`` to save time). The counts are compared with
:func:`boost_hf.perf.comm_formula.layer_communication` and scaled, exactly (every term is linear in
the tokens), to the paper's setting: batch 4 x seq 4096, bf16.

    python benchmarks/comm_per_layer.py            # 1b/3b/7b/13b at TP 2 and 4 (~1.5-3 min on 2 cores)
    python benchmarks/comm_per_layer.py --quick    # 60m at TP 2
"""

from __future__ import annotations

import gc
import time

import torch
from torch import nn

from common import GIB, base_parser, parse, save_figure, table, write_result

from boost_hf.parallel.comm_counter import count_training_step, counts_difference

LAYOUTS = {
    "megatron (full rank)": dict(tp_style="megatron"),
    "vanilla": dict(tp_style="vanilla"),
    "vanilla ungrouped": dict(tp_style="vanilla", group_linears=False),
    "btp online": dict(tp_style="btp", rmsnorm="online"),
    "btp sync": dict(tp_style="btp", rmsnorm="sync"),
    "btp online ungrouped": dict(tp_style="btp", rmsnorm="online", group_linears=False),
    "btp sync ungrouped": dict(tp_style="btp", rmsnorm="sync", group_linears=False),
}
PAPER_BATCH, PAPER_SEQ, PAPER_DTYPE_BYTES = 4, 4096, 2
# BOOST.md section 6 (paper, 7B, batch 4): per-layer forward communication, GB
PAPER_7B_GB = {"megatron (full rank)": 0.25, "vanilla": 1.32, "btp online": 0.22}


def model_config(size: str, fields: dict, layers: int, vocab: int):
    from boost_hf import BoostLlamaConfig

    arch = "llama" if fields["tp_style"] == "megatron" else "cola"
    return BoostLlamaConfig.from_preset(f"{arch}-{size}", num_hidden_layers=layers, vocab_size=vocab)


def _count_step(model, input_ids) -> tuple[dict, dict]:

    counts = count_training_step(model, input_ids)
    model.zero_grad(set_to_none=True)
    return counts


def measure(sizes: list[str], tp: int, batch: int, seq: int, vocab: int) -> dict:
    """Runs on each of ``tp`` ranks: ``{size: {layout: counts | {"not_applicable": reason}}}``."""
    import torch.distributed as dist
    from transformers.initialization import no_init_weights

    from boost_hf import BoostLlamaForCausalLM, ParallelConfig
    from boost_hf.perf.comm_formula import layer_communication

    results: dict = {}
    for size in sizes:
        for name, fields in LAYOUTS.items():
            parallel = ParallelConfig(tp_size=tp, **fields)
            config = model_config(size, fields, 2, vocab)
            try:
                parallel.check_model(config)
            except ValueError as err:
                results.setdefault(size, {})[name] = {"not_applicable": str(err)}
                continue
            t0 = time.perf_counter()
            with no_init_weights():
                model = BoostLlamaForCausalLM(config, parallel_config=parallel)
            for param in model.parameters():
                param.data.fill_(0.01)
            model.train()
            ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
            two = _count_step(model, ids)
            layers = model.model.layers
            model.model.layers = nn.ModuleList(list(layers)[:1])
            one = _count_step(model, ids)
            model.model.layers = layers
            formula = layer_communication(model_config(size, fields, 1, vocab), parallel, batch * seq)
            results.setdefault(size, {})[name] = {
                "measured_fwd": counts_difference(two[0], one[0]),
                "measured_bwd": counts_difference(two[1], one[1]),
                "formula_fwd": formula.forward.to_dict(),
                "formula_bwd": formula.backward.to_dict(),
                "seconds": time.perf_counter() - t0,
            }
            del model, layers
            gc.collect()
            dist.barrier()
    return results


def _calls_elements(comm: dict) -> tuple[int, int]:
    return sum(v["calls"] for v in comm.values()), sum(v["elements"] for v in comm.values())


def _fmt(comm: dict) -> str:
    return ", ".join(f"{k.replace('_', '-')} {v['calls']}x {v['elements']:,}" for k, v in comm.items()) or "none"


def paper_gib(size: str, name: str, vocab: int, tp: int) -> tuple[float, float]:
    """Formula forward and backward GiB per layer at batch 4 x seq 4096, bf16."""
    from boost_hf import ParallelConfig
    from boost_hf.perf.comm_formula import layer_communication

    fields = LAYOUTS[name]
    comm = layer_communication(model_config(size, fields, 1, vocab), ParallelConfig(tp_size=tp, **fields), PAPER_BATCH * PAPER_SEQ)
    return comm.forward.bytes(PAPER_DTYPE_BYTES) / GIB, comm.backward.bytes(PAPER_DTYPE_BYTES) / GIB


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["1b", "3b", "7b", "13b"], help="preset sizes (default: 1b 3b 7b 13b)")
    parser.add_argument("--tp", nargs="+", type=int, default=[2, 4], help="tensor-parallel sizes (default: 2 4)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary of the measured models (cancels; default 1024)")
    args, started = parse(parser)
    if args.quick:
        args.sizes, args.tp = ["60m"], [2]
    from boost_hf.perf.launcher import launch

    tokens, paper_tokens = args.batch * args.seq, PAPER_BATCH * PAPER_SEQ
    body = [
        f"Measured: a training step of a micro-batch of {args.batch} x {args.seq} = {tokens} tokens, per TP rank, "
        "one decoder layer = (2-layer model) - (same model run with its first layer only). "
        "Elements: all-reduce = size of the reduced tensor, all-gather = size of the gathered output. "
        f"GiB columns: the measured elements scaled by {paper_tokens // tokens} to batch {PAPER_BATCH} x seq {PAPER_SEQ} "
        f"(N = {paper_tokens}), x {PAPER_DTYPE_BYTES} bytes (bf16). Calls and elements per layer do not depend on the TP size: "
        f"the table shows TP{args.tp[0]}'s counts, and for every TP size whether the measured calls and elements equal the "
        "formula (`boost_hf.perf.comm_formula.layer_communication`) in both directions. No activation checkpointing "
        "(its recomputation collectives are in `memory.md`).",
        "",
    ]
    per_tp = {}
    for tp in args.tp:
        t0 = time.perf_counter()
        per_tp[tp] = launch(measure, tp, args.sizes, tp, args.batch, args.seq, args.vocab, timeout=3600)[0]
        print(f"TP={tp}: measured in {time.perf_counter() - t0:.0f} s")
    first = per_tp[args.tp[0]]
    headline: dict[str, tuple[float, float, float]] = {}
    all_match, plotted, rows, not_applicable = True, {}, [], set()
    for size in args.sizes:
        megatron_fwd = None
        for name in LAYOUTS:
            if "not_applicable" in first[size][name]:
                not_applicable |= {f"{size}, {name} at TP {tp}: {per_tp[tp][size][name]['not_applicable']}" for tp in args.tp}
                rows.append([size, name, "not applicable", "", "", "", *["-"] * len(args.tp), "", "", ""])
                continue
            matches = []
            for tp in args.tp:
                r = per_tp[tp][size][name]
                matches.append(r["measured_fwd"] == r["formula_fwd"] and r["measured_bwd"] == r["formula_bwd"])
            all_match &= all(matches)
            row = first[size][name]
            fwd_gib, bwd_gib = (
                _calls_elements(row[key])[1] * paper_tokens // tokens * PAPER_DTYPE_BYTES / GIB for key in ("measured_fwd", "measured_bwd")
            )
            if name.startswith("megatron"):
                megatron_fwd = fwd_gib
            plotted.setdefault(size, {})[name] = (fwd_gib, bwd_gib)
            if size == "7b":
                headline[name] = (fwd_gib, bwd_gib, paper_gib(size, name, args.vocab, args.tp[0])[0])
            rows.append([
                size, name, _fmt(row["measured_fwd"]), _fmt(row["formula_fwd"]), _fmt(row["measured_bwd"]), _fmt(row["formula_bwd"]),
                *("yes" if m else "**NO**" for m in matches), f"{fwd_gib:.3f}", f"{bwd_gib:.3f}",
                f"{fwd_gib / megatron_fwd:.2f}x" if megatron_fwd else "-",
            ])
    body += table(
        ["model", "layout", f"forward measured (TP{args.tp[0]})", "forward formula", f"backward measured (TP{args.tp[0]})",
         "backward formula", *(f"= formula at TP{tp}" for tp in args.tp), "fwd GiB/layer", "bwd GiB/layer", "fwd vs megatron"],
        rows,
    )
    if not_applicable:
        body += ["", "Not applicable (the layout cannot hold the model at that TP size):", ""] + [f"- {m}" for m in sorted(not_applicable)]
    body.append("")
    if headline:
        body += ["## Headline: 7B, per layer forward, batch 4 x seq 4096, bf16", ""]
        rows = [
            [name, f"{fwd:.3f}", f"{formula:.3f}", PAPER_7B_GB.get(name, "-"), f"{bwd:.3f}"]
            for name, (fwd, bwd, formula) in headline.items()
        ]
        body += table(["layout", "measured, forward (GiB)", "formula, forward (GiB)", "paper, forward (\"GB\")", "measured, backward (GiB)"], rows)
        fwd = {n: v[0] for n, v in headline.items()}
        body += [
            "",
            "The paper's per-layer figures agree with GiB (2^30 bytes): 0.25 \"GB\" full rank is exactly 2 N d x 2 bytes / 2^30. "
            f"BTP moves {fwd['megatron (full rank)'] / fwd['btp online']:.2f}x less than full-rank TP and "
            f"{fwd['vanilla'] / fwd['btp online']:.2f}x less than vanilla low-rank TP per layer forward "
            "(7 N r vs 2 N d vs N (5d + 2 d_ff)). The online norm adds 2N elements (the partial sums of squares, one extra "
            "column) to the existing collectives; the sync norm adds 2 latency-bound collectives per layer and direction; "
            "ungrouped linears turn 4 collectives into 7 with the same volume.",
            "",
        ]
    body += [f"All measured counts equal the formula: **{'yes' if all_match else 'NO'}**.", ""]
    if plotted:
        body += [_plot(plotted, args.out), ""]
    write_result(args.out, "comm_per_layer", "Communication per decoder layer: counted vs formula", body, quick=args.quick, started=started)


def _plot(plotted: dict, out) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = plotted
    names = ["megatron (full rank)", "vanilla", "btp online"]
    sizes = list(data)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    width = 0.27
    for ax, direction, title in zip(axes, (0, 1), ("forward", "backward")):
        for i, name in enumerate(names):
            values = [data[s].get(name, (float("nan"),) * 2)[direction] for s in sizes]
            ax.bar([x + (i - 1) * width for x in range(len(sizes))], values, width, label=name)
        ax.set_xticks(range(len(sizes)), sizes)
        ax.set_title(f"{title}, per layer")
        ax.set_xlabel("model size (1b: megatron/btp not applicable, d_ff=5461)")
    axes[0].set_ylabel("GiB per layer at batch 4 x seq 4096, bf16")
    axes[0].legend(loc="upper left")
    return save_figure(fig, out, "comm_per_layer")


if __name__ == "__main__":
    main()
