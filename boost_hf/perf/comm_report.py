"""Per-layer communication measured by the counters, next to the formula (``boost-hf comm``).

Each layout's model is built twice (1 and 2 decoder layers, uninitialised weights: only the
collectives matter) on ``tp`` local gloo processes; the difference of the counted collectives is one
layer's, forward and backward. It is compared with :func:`~boost_hf.perf.comm_formula.layer_communication`
and then scaled, through the same formula, to a paper-sized micro-batch.
"""

from __future__ import annotations

import torch
from transformers.initialization import no_init_weights

from ..parallel.comm_counter import count_training_step, counts_difference
from .comm_formula import layer_communication
from ..parallel.config import ParallelConfig

LAYOUTS = {
    "megatron (full rank)": dict(tp_style="megatron"),
    "vanilla": dict(tp_style="vanilla"),
    "btp online": dict(tp_style="btp", rmsnorm="online"),
    "btp sync": dict(tp_style="btp", rmsnorm="sync"),
    "btp online ungrouped": dict(tp_style="btp", rmsnorm="online", group_linears=False),
}


def _config(preset: str, full_rank: bool, layers: int):
    from ..configuration_boost_llama import BoostLlamaConfig

    size = preset.split("-", 1)[1]
    return BoostLlamaConfig.from_preset(f"llama-{size}" if full_rank else preset, num_hidden_layers=layers)


def _count(config, parallel, batch: int, seq: int) -> tuple[dict, dict]:
    from ..modeling_boost_llama import BoostLlamaForCausalLM

    with no_init_weights():
        model = BoostLlamaForCausalLM(config, parallel_config=parallel)
    for param in model.parameters():  # values do not change the counts; keep them finite
        param.data.normal_(0, 0.02)
    model.train()
    return count_training_step(model, torch.randint(0, config.vocab_size, (batch, seq)))


def measure_layer_communication(preset: str, tp: int, batch: int, seq: int) -> dict:
    """Run inside a ``tp``-rank process group: measured and formula per-layer communication per layout."""
    rows = {}
    for name, fields in LAYOUTS.items():
        parallel = ParallelConfig(tp_size=tp, **fields)
        full_rank = fields["tp_style"] == "megatron"
        one, two = (_count(_config(preset, full_rank, n), parallel, batch, seq) for n in (1, 2))
        formula = layer_communication(_config(preset, full_rank, 1), parallel, batch * seq)
        rows[name] = {
            "measured_fwd": counts_difference(two[0], one[0]),
            "measured_bwd": counts_difference(two[1], one[1]),
            "formula_fwd": formula.forward.to_dict(),
            "formula_bwd": formula.backward.to_dict(),
        }
    return rows


def _fmt(comm: dict) -> str:
    return ", ".join(f"{k} {v['calls']}x / {v['elements']:,}" for k, v in comm.items()) or "-"


def report(preset: str, tp: int, batch: int, seq: int, paper_batch: int = 4, paper_seq: int = 4096, dtype_bytes: int = 2) -> str:
    """Launch ``tp`` processes, measure, and format a Markdown table."""
    from .launcher import launch

    rows = launch(measure_layer_communication, tp, preset, tp, batch, seq, timeout=1800)[0]
    lines = [
        f"Per-layer communication of {preset} at TP={tp}, measured on a micro-batch of {batch}x{seq} tokens "
        f"(calls x elements), and the formula scaled to batch {paper_batch} x seq {paper_seq}, {8 * dtype_bytes}-bit:",
        "",
        "| layout | measured forward | formula forward | measured backward | formula backward | match | fwd GiB/layer at paper size |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        match = row["measured_fwd"] == row["formula_fwd"] and row["measured_bwd"] == row["formula_bwd"]
        fields = LAYOUTS[name]
        full_rank = fields["tp_style"] == "megatron"
        scaled = layer_communication(_config(preset, full_rank, 1), ParallelConfig(tp_size=tp, **fields), paper_batch * paper_seq)
        gib = scaled.forward.bytes(dtype_bytes) / 2**30
        lines.append(
            f"| {name} | {_fmt(row['measured_fwd'])} | {_fmt(row['formula_fwd'])} | {_fmt(row['measured_bwd'])} | "
            f"{_fmt(row['formula_bwd'])} | {'yes' if match else 'NO'} | {gib:.3f} |"
        )
    return "\n".join(lines)


__all__ = ["measure_layer_communication", "report", "LAYOUTS"]
