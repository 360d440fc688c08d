"""``boost-hf plan`` on the paper's clusters and the shipped recipes' clusters (BOOST.md section 6: A100, seq 4096, bf16): cola-3b on 2 GPUs, cola-7b
on 4, cola-13b on 8 (4 A100-80GB per node, as the paper's nodes), at the paper's workload (micro-batches of 4
sequences, the estimator's calibration) and at a training-sized global batch. Per cluster: the paper's layout
(tp, pp fixed, the rest searched) next to what ``plan`` picks, predicted step time, memory per GPU and why the
slower one loses. Then every shipped CoLA recipe on the cluster its header names (8 A100-80GB per node, NVSwitch,
autocast as the recipes train): the recipe's layout (its tp, pp, schedule, micro-batches, SP and checkpointing
fixed, DDP as the recipes train; ZeRO-1 searched) next to ``plan``'s pick (FSDP2 and HSDP searched too). Predictions of the calibrated estimator and the memory model,
nothing run.

    python benchmarks/plan_paper.py        # ~1 min on 2 cores
"""

from __future__ import annotations

from common import base_parser, parse, table, write_result

from boost_hf import BoostLlamaConfig
from boost_hf.perf.hardware import get_hardware
from boost_hf.perf.memory import GIB
from boost_hf.perf.planner import Cluster, plan, plan_inputs, why_slower

# (preset, GPUs, the paper's tp, pp)
PAPER = (("cola-3b", 2, 2, 1), ("cola-7b", 4, 4, 1), ("cola-13b", 8, 4, 2))
PRECISIONS = ("autocast", "bf16_params")
# shipped recipe -> the GPUs its header runs it on
RECIPE_CLUSTERS = {"cola-60m": 8, "cola-130m": 8, "cola-350m": 8, "cola-1b": 8, "cola-3b": 8, "cola-7b": 16,
                   "cola-13b": 32, "cola-30b": 32}


def recipe_rows(quick: bool) -> list[list]:
    """The shipped recipes' layouts against ``plan``'s pick on their clusters."""
    hardware = get_hardware("a100-nvswitch")
    rows = []
    for name, gpus in list(RECIPE_CLUSTERS.items())[:1] if quick else RECIPE_CLUSTERS.items():
        inputs = plan_inputs(recipe=name, gpus=gpus)
        cluster = Cluster(gpus, hardware, round(hardware.memory_gb * GIB))
        own = inputs.recipe_layout
        fixed = {"tp_size": own["tp_size"] or 1, "pp_size": own["pp_size"] or 1,
                 "activation_checkpointing": own["activation_checkpointing_mode"] or "none",
                 "sequence_parallel": bool(own["sequence_parallel"])}
        if fixed["pp_size"] > 1:
            fixed.update(pp_schedule=own["pp_schedule"] or "1f1b", pp_microbatches=own["pp_microbatches"])
        else:
            fixed["pp_microbatches"] = own["gradient_accumulation_steps"] or 1
        kwargs = dict(seq_len=inputs.seq_len, global_batch=inputs.global_batch, precisions=("autocast",))
        best = plan(inputs.config, cluster, **kwargs).ranked[0]
        recipes = plan(inputs.config, cluster, fixed=fixed, data_parallel={"data_parallel": ("ddp",)}, **kwargs).ranked
        mine = recipes[0] if recipes else None
        rows.append([
            f"{name} on {gpus}", "does not fit" if mine is None else mine.candidate.describe(),
            "-" if mine is None else f"{mine.step_s:.3f} s, {mine.peak_bytes / GIB:.1f} GiB",
            best.candidate.describe(), f"{best.step_s:.3f} s, {best.peak_bytes / GIB:.1f} GiB",
            "-" if mine is None else ("the recipe's" if mine.step_s <= best.step_s else why_slower(best, mine)),
        ])
        print(rows[-1])
    return rows


def main() -> None:
    args, started = parse(base_parser(__doc__.splitlines()[0]))
    hardware = get_hardware("a100")
    rows, notes = [], []
    for preset, gpus, tp, pp in PAPER[:1] if args.quick else PAPER:
        config = BoostLlamaConfig.from_preset(preset)
        cluster = Cluster(gpus, hardware, round(hardware.memory_gb * GIB))
        for global_batch in (4 * gpus // (tp * pp), 64 * gpus):
            free = plan(config, cluster, seq_len=4096, global_batch=global_batch, precisions=PRECISIONS)
            papers = plan(config, cluster, seq_len=4096, global_batch=global_batch, precisions=PRECISIONS,
                          fixed={"tp_size": tp, "pp_size": pp})
            best = free.ranked[0]
            paper = papers.ranked[0] if papers.ranked else None
            same = paper is not None and paper.step_s <= best.step_s
            rows.append([
                f"{preset} on {gpus}", global_batch, f"tp {tp} x pp {pp}",
                "does not fit" if paper is None else f"{paper.step_s:.3f} s, {paper.peak_bytes / GIB:.1f} GiB",
                best.candidate.describe(), f"{best.step_s:.3f} s, {best.peak_bytes / GIB:.1f} GiB",
                "the paper's" if same else ("-" if paper is None else why_slower(best, paper)),
            ])
            if paper is not None and not same:
                notes.append(f"- {preset} on {gpus}, {global_batch} sequences: the paper's best is {paper.candidate.describe()}")
            print(rows[-1])
    body = [
        "Step time and memory per GPU predicted for the paper's clusters (a100 preset: 4 GPUs per node, NVLink without",
        "NVSwitch, 80 GiB). `paper's tp x pp` fixes those two and searches the rest (micro-batches, SP, checkpointing,",
        "ZeRO-1 or FSDP2 / HSDP, precision); `plan's pick` searches everything; the last column says what makes the paper's",
        "slower. The recipes' rows keep DDP for the recipe's layout (as the recipes train; ZeRO-1 searched).",
        "",
        *table(["cluster", "global batch", "paper's tp x pp", "its best: step, GiB/GPU", "plan's pick", "step, GiB/GPU",
                "paper's layout loses by"], rows),
        "",
        *notes,
        "",
        "## The shipped recipes (sequences of 256 tokens, 512 per step; a100-nvswitch, autocast)",
        "",
        *table(["recipe on GPUs", "recipe's layout", "step, GiB/GPU", "plan's pick", "step, GiB/GPU",
                "recipe's layout loses by"], recipe_rows(args.quick)),
    ]
    write_result(args.out, "plan_paper", "boost-hf plan on the paper's clusters", body, quick=args.quick, started=started)


if __name__ == "__main__":
    main()
