"""The ``boost-hf`` console script.

Subcommands live in :data:`SUBCOMMANDS` (name -> help, argument builder, runner); add one there.

    boost-hf estimate --preset cola-7b --tp 4 --micro-batch 4 --seq 4096 --gpu a100 [--json]
    boost-hf estimate --preset cola-13b --tp 4 --pp 2 --pp_schedule 1f1b --microbatches 8
    boost-hf plan --preset cola-13b --gpus 8 --gpu a100-nvswitch [--seq-len 4096 --global-batch 512] [--json]
    boost-hf doctor [--output-dir DIR] [--config-file ACCELERATE.yaml] [--json]
    boost-hf train RECIPE.yaml|NAME [--field value ...]      (accelerate launch ... -m boost_hf.cli train ...)
    boost-hf demo [--num-processes 4] [--tp-size 2] [--max-steps N]
    boost-hf eval CHECKPOINT --data FILE [--block-size N] [--json]
    boost-hf export CHECKPOINT OUT [--max-shard-size 5GB] [--overwrite]  (or under torchrun: each process writes its share)
    boost-hf export FOLDER --refresh-remote-code  (a saved folder's remote code replaced by this boost-hf's, in place)
    boost-hf convert RELEASE_CHECKPOINT OUTPUT [--dtype float32]   (the BOOST release's Nanotron checkpoints)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from typing import Callable

GIB = 2**30


def _add_hardware_options(group, *, default: str) -> None:
    """``--gpu`` (a preset of :mod:`boost_hf.perf.hardware`) and the options that override its fields."""
    from .perf.hardware import HARDWARE_PRESETS

    group.add_argument("--gpu", choices=tuple(HARDWARE_PRESETS), default=default, help=f"device preset (default {default})")
    group.add_argument("--peak-tflops", type=float, help="dense bf16 peak, TFLOP/s")
    group.add_argument("--hbm-gbps", type=float, help="HBM bandwidth, GB/s")
    group.add_argument("--bandwidth-gbps", type=float, help="collective bus bandwidth within a node, GB/s")
    group.add_argument("--latency-us", type=float, help="latency of one collective, microseconds")
    group.add_argument("--inter-node-gbps", type=float, help="network bandwidth per GPU between nodes, GB/s")


def _hardware(args: argparse.Namespace, **overrides):
    """The ``--gpu`` preset with the options of :func:`_add_hardware_options` (and ``overrides``) applied."""
    from .perf.hardware import get_hardware

    return get_hardware(args.gpu, peak_tflops=args.peak_tflops, hbm_gbps=args.hbm_gbps, link_gbps=args.bandwidth_gbps,
                        latency_us=args.latency_us, inter_node_gbps=args.inter_node_gbps, **overrides)


def _add_estimate_arguments(parser: argparse.ArgumentParser) -> None:
    from .parallel.settings import add_options
    from .precision_config import add_precision_options

    model = parser.add_argument_group("model and workload")
    model.add_argument("--preset", default="cola-7b", help="model preset, e.g. cola-7b, lax-13b, llama-3b "
                       "(megatron always runs the full-rank model of that size; vanilla and btp the low-rank one)")
    model.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    model.add_argument("--seq", type=int, default=4096, help="sequence length")
    model.add_argument("--layouts", nargs="+", choices=("megatron", "vanilla", "btp"),
                       default=["megatron", "vanilla", "btp"], help="layouts to compare")
    # The layout settings, as ParallelConfig declares them; the estimate's own: --layouts compares tp_style's values,
    # and the micro-batches default to 1 (the paper's calibration workload) and are timed even where torch refuses them.
    layout = parser.add_argument_group("layout (ParallelConfig's fields; the estimator models the 1f1b, gpipe and "
                                       "interleaved-1f1b schedules)")
    add_options(layout, exclude=("tp_style",), defaults={"pp_microbatches": 1}, notes={
        "pp_microbatches": " Here: micro-batches per iteration (default 1; gradient accumulation at pp 1), timed even "
        "where torch's schedule refuses them (noted); with --pp > 1 the estimate also recommends how to split the same "
        "micro-batch x M sequences.",
        "activation_checkpointing": " Megatron turns lowrank into full.",
        "sequence_parallel": " Vanilla is estimated without it.",
    })

    # PrecisionConfig's policy (the estimate models one data-parallel rank: no gradient all-reduce to set the dtype of)
    add_precision_options(parser.add_argument_group("precision"), exclude=("grad_reduce_dtype", "fp32_residual"), notes={
        "precision_policy": " Here: the policy whose casts are timed (default: none modelled, as the calibration ran).",
    })
    _add_hardware_options(parser.add_argument_group("hardware (overrides the --gpu preset)"), default="a100")

    eff = parser.add_argument_group("kernel efficiencies (override the calibrated values)")
    eff.add_argument("--efficiency", type=float, help="fraction of peak of a large GEMM")
    eff.add_argument("--gemm-half-dim", type=float, help="GEMM dimension at which its efficiency halves")
    eff.add_argument("--attention-efficiency", type=float, help="fraction of peak of flash attention")
    eff.add_argument("--memory-efficiency", type=float, help="fraction of HBM bandwidth of elementwise kernels")

    measured = parser.add_argument_group("measured compute (one GPU predicts a TP node)")
    measured.add_argument("--measured", metavar="PATH",
                          help="per-layer times of one rank measured by `benchmarks/rank_cost.py --json PATH` replace the "
                               "modelled compute; communication stays modelled for the chosen GPU/interconnect")
    measured.add_argument("--measured-mode", choices=("eager", "compiled"), default="eager",
                          help="which measured time to use (default: eager)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _estimate_table(est, preset: str, model_config) -> str:
    """Human-readable comparison: one column per layout, then the assumptions."""
    from .perf.estimator import COMPONENTS

    w, hw, layouts = est.workload, est.hardware, est.layouts
    parallel = w.parallel_config
    names = list(layouts)
    pipeline_rows: list[tuple[str, Callable]] = [
        ("pipeline bubble (% of step)", lambda e: f"{e.bubble_fraction:.1%}"),
        ("P2P per boundary each way (MiB)", lambda e: f"{e.p2p_bytes_per_boundary / 2**20:,.1f}"),
        ("micro-batches in flight/stage", lambda e: " / ".join(f"{n:g}" for n in e.micro_batches_in_flight)),
        ("peak activations/stage (GiB)", lambda e: "n/a" if e.peak_activation_bytes is None
         else " / ".join(f"{b / GIB:.1f}" for b in e.peak_activation_bytes)),
    ]
    rows: list[tuple[str, Callable]] = [
        ("model", lambda e: e.model.split(",")[0]),
        ("parameters (M)", lambda e: f"{e.parameters / 1e6:,.0f}"),
        ("comm per layer fwd (GiB)", lambda e: f"{e.comm_bytes_per_layer_fwd / GIB:.3f}"),
        ("comm per layer bwd (GiB)", lambda e: f"{e.comm_bytes_per_layer_bwd / GIB:.3f}"),
        ("collectives per layer fwd", lambda e: str(e.collectives_per_layer_fwd)),
        ("collectives per layer bwd", lambda e: str(e.collectives_per_layer_bwd)),
        ("sent per rank per layer f+b (GiB)", lambda e: f"{(e.comm_sent_bytes_per_layer_fwd + e.comm_sent_bytes_per_layer_bwd) / GIB:.3f}"),
        ("element-wise per layer fwd (GiB)", lambda e: f"{e.elementwise_bytes_per_layer_fwd / GIB:.3f}"),
        ("kept per layer (MiB)", lambda e: "n/a" if e.saved_bytes_per_layer is None else f"{e.saved_bytes_per_layer / 2**20:,.1f}"),
        ("GFLOP per layer fwd per rank", lambda e: f"{e.flops_per_layer_fwd / 1e9:,.1f}"),
        ("  of which attention", lambda e: f"{e.attention_flops_per_layer_fwd / 1e9:,.1f}"),
        ("smallest GEMM dimension", lambda e: str(e.min_gemm_dim)),
        ("layer time fwd (ms)", lambda e: f"{e.layer_time_fwd_s * 1e3:.2f}"),
        ("layer time bwd (ms)", lambda e: f"{e.layer_time_bwd_s * 1e3:.2f}"),
        *[(f"  {c} (s)", lambda e, c=c: f"{e.breakdown_s[c]:.3f}") for c in COMPONENTS],
        ("  of which pipeline bubble (s)", lambda e: f"{e.bubble_s:.3f}"),
        *(pipeline_rows if parallel.pp_size > 1 else []),
        ("step time (s)", lambda e: f"{e.step_time_s:.3f}"),
        ("tokens/s", lambda e: f"{e.tokens_per_s:,.0f}"),
        ("MFU", lambda e: f"{e.mfu:.1%}"),
    ]
    width = max(len(label) for label, _ in rows) + 2
    col = max(14, *(len(e.model.split(",")[0]) + 2 for e in layouts.values()))
    lines = [
        f"boost-hf estimate: {preset} ({model_config.num_hidden_layers} layers, d={model_config.hidden_size}, "
        f"f={model_config.intermediate_size}, r={model_config.rank}), TP={parallel.tp_size} PP={parallel.pp_size}, "
        f"{w.num_micro_batches} micro-batch(es) of {w.micro_batch} x {w.seq_len} tokens per iteration"
        + (f", {parallel.pp_schedule} with {w.stages_per_rank} stage(s) per rank" if parallel.pp_size > 1 else "") + f", {hw.name}",
        "",
        " " * width + "".join(name.rjust(col) for name in names),
    ]
    for label, value in rows:
        lines.append(label.ljust(width) + "".join(value(layouts[name]).rjust(col) for name in names))
    if "btp" in layouts:
        speedups = [f"{est.ratio(other, 'btp'):.2f}x vs {other}" for other in names if other != "btp"]
        if speedups:
            lines += ["", "btp speed-up: " + ", ".join(speedups)]
    e = est.efficiency
    switch = "NVSwitch" if hw.nvswitch else "fully connected NVLink, no switch"
    lines += [
        "",
        "assumptions:",
        f"  GPU {hw.name}: {hw.peak_tflops:g} TFLOP/s bf16, HBM {hw.hbm_gbps:g} GB/s, {hw.gpus_per_node} GPUs/node "
        f"({switch}); collectives {hw.collective_gbps(parallel.tp_size):g} GB/s bus bandwidth at TP{parallel.tp_size} "
        f"(node: {hw.link_gbps:g}), latency {hw.latency_us:g} us; inter-node {hw.inter_node_gbps:g} GB/s",
        f"  efficiency: GEMM {e.gemm_max:g} x 1/(1 + {e.gemm_half_dim:g} (1/M + 1/K + 1/N)), attention {e.attention:g}, "
        f"elementwise {e.memory:g} of HBM",
        f"  layout options: rmsnorm={parallel.rmsnorm}, group_linears={parallel.group_linears}, "
        f"activation_checkpointing={parallel.activation_checkpointing}, sequence_parallel={parallel.sequence_parallel}, bf16 activations ({w.dtype_bytes} bytes)",
        *(f"  {note}" for note in est.notes),
    ]
    return "\n".join(lines)


def _micro_batch_text(options, layout: str, workload) -> str:
    """The recommended split of the replica's batch into micro-batches and the alternatives."""
    from .perf.micro_batches import recommend_micro_batches

    best = recommend_micro_batches(options)
    sequences = workload.micro_batch * workload.num_micro_batches
    schedule, pp = workload.parallel_config.pp_schedule, workload.parallel_config.pp_size
    if best is None:
        return (f"\nno split of {sequences} sequences per pipeline replica suits {schedule} at pp {pp}: "
                f"give each replica at least {pp} sequences per step")

    def memory(option) -> str:
        return "" if option.peak_activation_bytes is None else f", peak activations {option.peak_activation_bytes / GIB:.1f} GiB"

    lines = [
        "",
        f"micro-batches ({layout}, {schedule}, {sequences} sequences per pipeline replica and step):",
        *(f"  m={o.num_micro_batches:<4} micro-batch {o.micro_batch:<4} step {o.step_time_s:.3f} s, "
          f"bubble {o.bubble_fraction:.1%}{memory(o)}" for o in options),
        f"recommended: --microbatches {best.num_micro_batches} (micro-batch {best.micro_batch}); "
        "the fastest split torch's schedule accepts",
    ]
    return "\n".join(lines)


def _measured_layer_times(args: argparse.Namespace, workload, layouts) -> tuple[dict[str, float], str]:
    """layout -> measured seconds per layer, from ``--measured`` (megatron's preset is the full-rank LLaMA)."""
    from .perf.measured import MeasuredRun, measured_layer_seconds

    run = MeasuredRun.load(args.measured)
    family, size = args.preset.split("-", 1)
    presets = {"megatron": f"llama-{size}"}
    presets["vanilla"] = presets["btp"] = args.preset if family != "llama" else f"cola-{size}"
    times = {
        layout: measured_layer_seconds(run, presets[layout], workload.parallel(layout), workload.micro_batch,
                                       workload.seq_len, args.measured_mode)
        for layout in layouts
    }
    return times, run.device


def _run_estimate(args: argparse.Namespace) -> int:
    from .configuration_boost_llama import BoostLlamaConfig
    from .perf.estimator import LAYOUTS, estimate
    from .perf.kernels import CALIBRATED_EFFICIENCY
    from .perf.micro_batches import micro_batch_options, recommend_micro_batches
    from .perf.workload import Workload
    from .parallel.settings import layout_values

    config = BoostLlamaConfig.from_preset(args.preset)
    workload = Workload(micro_batch=args.micro_batch, seq_len=args.seq, precision=args.precision_policy,
                        **layout_values(args))
    hardware = _hardware(args)
    overrides = {
        "gemm_max": args.efficiency,
        "gemm_half_dim": args.gemm_half_dim,
        "attention": args.attention_efficiency,
        "memory": args.memory_efficiency,
    }
    efficiency = replace(CALIBRATED_EFFICIENCY, **{k: v for k, v in overrides.items() if v is not None})
    layouts = tuple(layout for layout in LAYOUTS if layout in args.layouts)
    measured, device = None, None
    if args.measured:
        measured, device = _measured_layer_times(args, workload, layouts)
    est = estimate(config, workload, hardware, efficiency, layouts=layouts, measured_layer_s=measured)
    # the split recommendation models compute (a measured layer time holds for one micro-batch size only)
    advised = "btp" if "btp" in layouts else layouts[-1]
    pipelined = workload.parallel_config.pp_size > 1
    options = micro_batch_options(config, workload, hardware, efficiency, advised) if pipelined and not measured else []
    if args.json:
        out = est.to_dict()
        out["assumptions"]["preset"] = args.preset
        if measured:
            out["assumptions"]["measured"] = {"path": args.measured, "device": device, "mode": args.measured_mode}
        if pipelined and not measured:
            best = recommend_micro_batches(options)
            out["micro_batch_options"] = {"layout": advised, "options": [asdict(o) for o in options],
                                          "recommended": None if best is None else best.num_micro_batches}
        print(json.dumps(out, indent=2))
    else:
        print(_estimate_table(est, args.preset, config))
        if measured:
            print(f"  compute per layer measured ({args.measured_mode}) on {device}, from {args.measured}; "
                  "communication, LM head and the other parameters' optimizer step modelled")
        if pipelined and not measured:
            print(_micro_batch_text(options, advised, workload))
    return 0


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    from .data_parallel_config import add_data_parallel_options
    from .parallel.settings import add_options
    from .precision_config import add_precision_options

    model = parser.add_argument_group("model (one of)")
    model.add_argument("--recipe", help="a YAML recipe or a shipped one's name (demo, cola-7b, ...): its model, sequence "
                       "length and global batch; the command trains it")
    model.add_argument("--preset", help="a model preset, e.g. cola-13b (the command then trains the shipped recipe of "
                       "that name if there is one)")
    model.add_argument("--config", help="a model's config.json")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=int, required=True, help="GPUs (or CPU processes with --gpu cpu) in all")
    cluster.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the --gpu preset's; all for cpu)")
    cluster.add_argument("--gpu-memory-gb", type=float, help="memory per GPU, GiB (default: the preset's)")
    _add_hardware_options(cluster, default="a100-nvswitch")
    work = parser.add_argument_group("workload")
    work.add_argument("--seq-len", "--seq_len", "--seq", dest="seq", type=int,
                      help="tokens per sequence (default: the recipe's block_size, else 4096)")
    work.add_argument("--global-batch", type=int, help="sequences per optimizer step over all replicas (default: the "
                      "recipe's on this cluster, else 512)")
    search = parser.add_argument_group("search (ParallelConfig's fields: a value given is kept, the others are searched)")
    add_options(search, exclude=("pp_layer_split",), defaults={f: None for f in (
        "tp_size", "tp_style", "rmsnorm", "group_linears", "activation_checkpointing", "sequence_parallel", "pp_size",
        "pp_schedule", "pp_microbatches", "pp_stages_per_rank")})
    search.add_argument("--zero1", choices=("true", "false"), help="keep --zero1_optimizer true or false (default: both; "
                        "ddp only)")
    add_data_parallel_options(search, several=True, defaults={name: None for name in (
        "dp_replicate_size", "fsdp_reshard_after_forward", "fsdp_units")}, notes={
        "data_parallel": " Here: the backends to consider (default: both; fsdp2 at dp > 1, never with ZeRO-1: --zero1 "
                         "true searches ddp alone, an FSDP2 setting given fsdp2 alone).",
        "dp_replicate_size": " Here: kept when given (above 1: fsdp2 alone); default: 1 and, when the DP group spans "
                             "several nodes, one replica per node.",
        "fsdp_reshard_after_forward": " Here: kept when given (fsdp2 alone); default: torchtitan's.",
        "fsdp_units": " Here: kept when given (fsdp2 alone); default: decoder_layers.",
    })
    add_precision_options(search, exclude=("fp32_residual",), several=True, notes={
        "precision_policy": " Here: the policies to consider (default: autocast and bf16_params on GPUs, fp32 on cpu).",
        "grad_reduce_dtype": " bf16 halves its bytes and rounds the gradients' sum: your choice, not searched.",
    })
    out = parser.add_argument_group("output")
    out.add_argument("--top", type=int, default=5, help="layouts shown (default 5)")
    out.add_argument("--accelerate-config", default="boost-hf-plan.yaml",
                     help="where to write the winner's accelerate configuration (default: ./boost-hf-plan.yaml)")
    out.add_argument("--json", action="store_true", help="print the layouts as JSON, best first")
    out.add_argument("--all", dest="every", action="store_true",
                     help="with --json: every evaluated layout (the fitting ones with their time), not only the best")


def _run_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dataclasses import fields

    from .data_parallel_config import DATA_PARALLEL_BACKENDS, DataParallelConfig
    from .parallel.settings import layout_values
    from .perf.planner import Cluster, check_positive, plan_inputs, plan, plan_report, search_of_recipe

    check_positive(gpus_per_node=args.gpus_per_node, gpu_memory_gb=args.gpu_memory_gb, top=args.top)
    inputs = plan_inputs(recipe=args.recipe, preset=args.preset, config_path=args.config, gpus=args.gpus,
                         seq_len=args.seq, global_batch=args.global_batch)
    hardware = _hardware(args, gpus_per_node=args.gpus_per_node or (args.gpus if args.gpu == "cpu" else None),
                         memory_gb=args.gpu_memory_gb)
    cluster = Cluster(args.gpus, hardware, round(hardware.memory_gb * GIB))
    fixed = {name: value for name, value in layout_values(args).items() if value is not None}
    cpu = args.gpu == "cpu"
    precisions = tuple(args.precision_policy or (("fp32",) if cpu else ("autocast", "bf16_params")))
    zero1 = None if args.zero1 is None else (args.zero1 == "true",)
    sharding = {f.name: getattr(args, f.name) for f in fields(DataParallelConfig)}
    sharding["data_parallel"] = tuple(sharding["data_parallel"] or DATA_PARALLEL_BACKENDS)
    fixed, sharding, zero1, precisions, grad_reduce_dtype = search_of_recipe(
        inputs.recipe_training, inputs.recipe, fixed=fixed, data_parallel=sharding, zero1_options=zero1,
        precisions=precisions, grad_reduce_dtype=args.grad_reduce_dtype)
    result = plan(inputs.config, cluster, seq_len=inputs.seq_len, global_batch=inputs.global_batch, fixed=fixed,
                  precisions=precisions, zero1_options=zero1, data_parallel=sharding, grad_reduce_dtype=grad_reduce_dtype)
    report = plan_report(result, inputs, cluster, accelerate_config_path=args.accelerate_config, top=args.top,
                         every=args.every)
    if report.accelerate_config is not None:
        Path(args.accelerate_config).write_text(report.accelerate_config)
    print(json.dumps(report.layouts, indent=2) if args.json else report.text)
    return 0 if result.ranked else 1


def _add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output-dir", "--output_dir", dest="output_dir", default="outputs",
                        help="the run's output folder (default: outputs): shared across nodes?")
    parser.add_argument("--config-file", "--config_file", dest="config_file",
                        help="the accelerate config the run will use (default: accelerate's own)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _run_doctor(args: argparse.Namespace) -> int:
    from .doctor import doctor, render

    report = doctor(output_dir=args.output_dir, config_file=args.config_file)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 1 if report["problems"] else 0


def _add_comm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="cola-7b", help="low-rank preset; megatron runs llama-<size> (default: cola-7b)")
    parser.add_argument("--tp", type=int, default=4, help="tensor-parallel size = local CPU processes (default: 4)")
    parser.add_argument("--batch", type=int, default=1, help="measured micro-batch size (default: 1)")
    parser.add_argument("--seq", type=int, default=16, help="measured sequence length (default: 16)")


def _run_comm(args: argparse.Namespace) -> int:
    from .perf.comm_report import report

    print(report(args.preset, args.tp, args.batch, args.seq))
    return 0


def _add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    from .training.demo import add_arguments

    add_arguments(parser)


def _run_demo(args: argparse.Namespace) -> int:
    from .training.demo import run

    return run(args)


class _RecipeFieldsHelp(argparse.Action):
    """``boost-hf train --help``: the command's usage, then every recipe field with its type, default and help, as
    the recipe parser (generated from the model, data and training arguments' dataclasses) lists them."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .training.recipe import SECTIONS, recipe_parser

        parser.print_help()
        for section, arguments in SECTIONS.items():
            print(f"\nrecipe section {section!r} ({arguments.__name__}): its keys, or --field value after RECIPE")
            print(recipe_parser(arguments, usage=argparse.SUPPRESS, add_help=False).format_help())
        parser.exit()


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a YAML recipe, or the name of a shipped one (demo, cola-60m, ..., cola-7b)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER,
                        help="--field value ... overriding any model, data or training field of the recipe (listed below)")
    parser.add_argument("-h", "--help", action=_RecipeFieldsHelp, help="show this help and every recipe field, then exit")


def _run_train(args: argparse.Namespace) -> int:
    from .training.pretrain import main as pretrain
    from .training.recipe import resolve_recipe

    pretrain([resolve_recipe(args.recipe), *args.overrides])
    return 0


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a saved model folder with its tokenizer (e.g. outputs/demo/final)")
    parser.add_argument("--data", required=True, help="local text/JSON/CSV/Parquet file, one document per row")
    parser.add_argument("--block-size", type=int, help="tokens per block (default: the tokenizer's model_max_length)")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks per forward pass (default: 8)")
    parser.add_argument("--text-column", default="text", help="column holding the documents (default: text)")
    parser.add_argument("--max-blocks", type=int, help="evaluate at most this many blocks")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _run_eval(args: argparse.Namespace) -> int:
    from . import evaluation  # importing boost_hf registers boost_llama with the Auto classes

    metrics = evaluation.evaluate_checkpoint(args.checkpoint, args.data, block_size=args.block_size, batch_size=args.batch_size,
                                             text_column=args.text_column, max_blocks=args.max_blocks)
    if args.json:
        print(json.dumps(metrics, indent=2))
    else:
        for name, value in metrics.items():
            print(f"{name:20s} {value:.4f}" if isinstance(value, float) else f"{name:20s} {value}")
    return 0


def _add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a training checkpoint folder (e.g. outputs/demo/checkpoint-200); with "
                                           "--refresh-remote-code, any saved boost-hf folder (e.g. outputs/demo/final)")
    parser.add_argument("output_dir", nargs="?", help="the Hugging Face folder to write: a new or empty folder (never the "
                                                      "checkpoint or a folder holding it); none with --refresh-remote-code")
    parser.add_argument("--refresh-remote-code", action="store_true",
                        help="write nothing new: replace the remote code of the saved folder CHECKPOINT, in place, with this "
                             "boost-hf's (for folders saved by an older boost-hf; weights and config untouched)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default: 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing, non-empty output folder (atomically: the old one stays until the new one is complete)")


def _run_export(args: argparse.Namespace) -> int:
    """One process, or every process of a ``torchrun`` launch (each writes every world-th file). SIGTERM stops it where
    it is, saying so, with the output folder as it was (exit status 143)."""
    import os
    import signal

    import torch.distributed as dist

    from .training.preemption import SignalExit, exiting_on
    from .training.publish import export_checkpoint

    if args.refresh_remote_code:
        if args.output_dir is not None:
            raise ValueError("boost-hf export --refresh-remote-code FOLDER changes FOLDER in place: give no output folder.")
        from .checkpoint.remote_code import refresh_remote_code

        changed = refresh_remote_code(args.checkpoint)
        print(f"refreshed {', '.join(changed)} in {args.checkpoint}" if changed else f"{args.checkpoint}: its remote code is current")
        return 0
    if args.output_dir is None:
        raise ValueError("boost-hf export CHECKPOINT OUTPUT_DIR: give the folder to write (or --refresh-remote-code FOLDER).")
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and not dist.is_initialized():
        dist.init_process_group("gloo")
    try:
        with exiting_on((signal.SIGTERM,)):  # stopped where it is: the staging folder is removed, the output untouched
            folder = export_checkpoint(args.checkpoint, args.output_dir, max_shard_size=args.max_shard_size,
                                       overwrite=args.overwrite)
    except SignalExit as stopped:
        print(f"boost-hf export: {stopped.signal.name} received: the export stopped before its end; {args.output_dir!r} "
              f"is as it was before it (its partial copy removed). Run the export again.", file=sys.stderr, flush=True)
        return stopped.code
    finally:
        if launched:
            dist.destroy_process_group()
    if not launched or int(os.environ.get("RANK", "0")) == 0:
        print(f"exported {args.checkpoint} to {folder}")
    return 0


def _add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a checkpoint of the BOOST release (Arcana-2236/BOOST, Nanotron): its <checkpoints_path>/<step> "
                                       "folder, or <checkpoints_path> (the step its latest.txt names)")
    parser.add_argument("output", help="the canonical boost-hf checkpoint to write (a new folder)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="dtype of the written weights (default: as the release stored them)")


def _run_convert(args: argparse.Namespace) -> int:
    import torch

    from .convert import convert_boost_release

    output = convert_boost_release(args.source, args.output, dtype=getattr(torch, args.dtype) if args.dtype else None)
    record = json.loads((output / "conversion.json").read_text())
    print(f"converted {record['folder']} ({record['model']}, written at TP {record['tp_size']} x PP {record['pp_size']}, "
          f"{record['files_read']} files) -> {output}: BoostLlamaForCausalLM.from_pretrained({str(output)!r})")
    return 0


# name -> (help, add_arguments(parser), run(args) -> exit code).
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "estimate": (
        "predict per-layer communication and iteration time of megatron / vanilla / btp TP",
        _add_estimate_arguments,
        _run_estimate,
    ),
    "plan": (
        "the fastest layout that fits a cluster (tp, pp, dp, schedule, micro-batches, SP, checkpointing, ZeRO-1 or "
        "FSDP2 / HSDP, precision), its memory per GPU, and the accelerate config and command that run it",
        _add_plan_arguments,
        _run_plan,
    ),
    "doctor": (
        "check a machine before a long run: versions, GPUs and bf16, attention kernels, a shared output folder, "
        "the accelerate config in effect",
        _add_doctor_arguments,
        _run_doctor,
    ),
    "comm": (
        "measure one layer's collectives per layout on local CPU processes and print them next to the formula",
        _add_comm_arguments,
        _run_comm,
    ),
    "eval": (
        "held-out perplexity and bits per byte of a saved model on local text (the local `evaluate` metric)",
        _add_eval_arguments,
        _run_eval,
    ),
    "export": (
        "write a training checkpoint's Hugging Face folder (sharded safetensors streamed from its dcp/, config, remote "
        "code, tokenizer, card); under `torchrun` each process writes its share of the files",
        _add_export_arguments,
        _run_export,
    ),
    "train": (
        "pre-train from a YAML recipe (any field overridable); under `accelerate launch ... -m boost_hf.cli train` on many processes",
        _add_train_arguments,
        _run_train,
    ),
    "convert": (
        "convert a checkpoint of the BOOST authors' Nanotron release (its CoLA models, any TP x PP) to a canonical boost-hf checkpoint",
        _add_convert_arguments,
        _run_convert,
    ),
    "demo": (
        "pre-train the tiny CoLA demo with BTP x DP on local CPU processes: perplexity, a sample, ./outputs/demo/final",
        _add_demo_arguments,
        _run_demo,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="boost-hf", description="Bottleneck-aware tensor parallelism for low-rank LLaMA.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
        # conflict_handler="resolve": a subcommand may replace -h/--help with its own (train lists the recipe fields)
        add_arguments(sub.add_parser(name, help=help_text, description=help_text, conflict_handler="resolve"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from .training.stack import TrainingStackError

    try:
        return SUBCOMMANDS[args.command][2](args)
    except (ValueError, FileNotFoundError, TrainingStackError) as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())
