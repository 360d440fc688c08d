"""Runs of ``recipes/pretrain.py`` asking for bf16, in every mode, for ``test_precision.py``:

    python tests/training/precision_cases.py one OUT RECIPE.yaml [ARGS]       # one process
    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml tests/training/precision_cases.py four OUT RECIPE.yaml [ARGS]

Every run writes under ``OUT/<run>``:

* ``gemms.json``: per rank, the GEMMs of its first training step (forward and backward), of its first evaluation and
  of the end-of-training sample, counted by ``"phase op operand-dtypes"`` with a ``TorchDispatchMode`` (:class:`Gemms`:
  ``mm``, ``addmm``, ``bmm``, ``baddbmm``, SDPA and their backward, also the ``out=`` forms); under ``--torch_compile``
  instead the GEMMs of every graph inductor compiled during the run (its post-grad graphs, forward and backward;
  a dispatch mode would keep dynamo from compiling);
* ``dp_reduce.json``: per rank, the all-reduces over its DP group (dtype, elements, whether asynchronous: the
  gradient buckets of ``bf16_params`` are, the pipeline's loss sums are not) from the first training step to the end of
  its optimizer step, its trainable elements and the ``comm_dp_grad_bytes_per_step`` it logged; ``precision.json``: the run's policy (its record);
* ``p2p.json`` (pipelines): per rank, the bytes its stages handed to the engine's sends in each training step and the
  ``comm_p2p_bytes_per_step`` it logged;
* resumed runs, ``loaded/rank<r>.pt``: right after loading, per canonical parameter name, the parameter as the
  optimizer sees it (the fp32 master under ``bf16_params``), its optimizer state and its shard spec.

``MASTERS_FP32`` runs the ``bf16_params`` machinery (masters, hooks, fp32 accumulation, our DP reduction instead of
DDP) with fp32 parameters, which must compute exactly what the plain fp32 run computes.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import pretrain  # noqa: E402

import boost_hf.training.arguments as arguments_module  # noqa: E402
from boost_hf.parallel.sharding import shard_spec_of  # noqa: E402
from boost_hf.training import BoostTrainer  # noqa: E402
from boost_hf.training.pretrain import build_trainer  # noqa: E402
from tests.training.launcher import every_rank  # noqa: E402
from boost_hf.training.precision import PrecisionPolicy, full_precision_parameters  # noqa: E402
from boost_hf.training.zero1 import sharded_over_data_parallel  # noqa: E402

#: operand positions of each GEMM (the ``out=`` and in-place forms included); SDPA: query, key, value (and the
#: output gradient first in backward)
OPERANDS = {"mm": (0, 2), "bmm": (0, 2), "matmul": (0, 2), "linear": (0, 2), "addmm": (1, 3), "addmm_": (1, 3),
            "baddbmm": (1, 3), "baddbmm_": (1, 3), "addbmm": (1, 3)}


def gemm_operands(name: str, args) -> list[torch.Tensor] | None:
    if name in OPERANDS:
        start, stop = OPERANDS[name]
        return list(args[start:stop])
    if "scaled_dot_product" in name:
        return list(args[:4] if name.endswith("backward") else args[:3])
    return None


def outer_product(operands: list[torch.Tensor]) -> bool:
    """The rotary tables' ``inv_freq @ positions`` (an outer product, reduction length 1, fp32 by design)."""
    return len(operands) == 2 and operands[0].dim() >= 2 and operands[0].shape[-1] == 1


def gemm_key(phase: str, name: str, operands) -> str | None:
    if outer_product(operands):
        return None
    return f"{phase} {name} {','.join(str(t.dtype).removeprefix('torch.') for t in operands if isinstance(t, torch.Tensor))}"


class Gemms(TorchDispatchMode):
    """Counts every GEMM dispatched while active by ``"<phase> <op> <operand dtypes>"``, the phase ``forward`` or
    ``backward`` (an autograd node running)."""

    def __init__(self, counts: Counter, phase: str):
        super().__init__()
        self.counts, self.phase = counts, phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        operands = gemm_operands(name, args)
        if operands is not None:
            backward = torch._C._current_autograd_node() is not None
            key = gemm_key(f"{self.phase}-{'backward' if backward else 'forward'}", name, operands)
            if key is not None:
                self.counts[key] += 1
        return func(*args, **(kwargs or {}))


def compiled_gemms(graph) -> None:
    """Inductor's post-grad pass: count the GEMMs of each compiled graph (forward or backward) by operand dtypes."""
    for node in graph.nodes:
        name = getattr(getattr(node.target, "overloadpacket", None), "__name__", None)
        operands = gemm_operands(name, node.args) if node.op == "call_function" and name else None
        if operands is not None:
            values = [a.meta["val"] for a in operands if hasattr(a, "meta") and "val" in a.meta]
            key = gemm_key("compiled", name, values)
            if key is not None:
                RUN["gemms"][key] += 1


RUN: dict = {}  # the current run's records on this rank
USE_CPU = os.environ.get("ACCELERATE_USE_CPU", "false")


def reset_run(compiled: bool) -> None:
    RUN.clear()
    RUN.update(gemms=Counter(), recorded=set(), reduces=[], recording_reduces=False, sent=[], logged=[], logged_dp=[], in_step=False,
               compiled=compiled, trainable=0)


def recording(phase: str):
    """The dispatch mode for the first ``phase`` of the run (none under ``--torch_compile``), else nothing."""
    if RUN["compiled"] or phase in RUN["recorded"]:
        return None
    RUN["recorded"].add(phase)
    return Gemms(RUN["gemms"], phase)


def _wrap(method, phase: str, before=None):
    def wrapped(self, *args, **kwargs):
        if before is not None:
            before(self)
        mode = recording(phase)
        if mode is None:
            return method(self, *args, **kwargs)
        with mode:
            return method(self, *args, **kwargs)

    return wrapped


def _start_recording_reduces(trainer) -> None:
    if "train" not in RUN["recorded"] or RUN["compiled"]:  # the first training step (recording() marks it)
        RUN["recording_reduces"] = trainer.state.global_step == 0
        RUN["dp_group"] = trainer.parallel_state.dp_group
        RUN["trainable"] = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        RUN["precision"] = trainer.precision.record()


_training_step = BoostTrainer.training_step


def _training_step_counting_sends(self, model, inputs, num_items_in_batch=None):
    RUN["sent"].append(0)
    RUN["in_step"] = True
    try:
        return _training_step(self, model, inputs, num_items_in_batch)
    finally:
        RUN["in_step"] = False


_get_grad_norm = BoostTrainer._get_grad_norm


def _grad_norm_then_stop_recording(self, model, grad_norm=None):
    try:
        return _get_grad_norm(self, model, grad_norm)
    finally:
        RUN["recording_reduces"] = False


_all_reduce = dist.all_reduce


def _recorded_all_reduce(tensor, *args, **kwargs):
    group = kwargs.get("group", args[1] if len(args) > 1 else None)
    asynchronous = kwargs.get("async_op", args[2] if len(args) > 2 else False)
    if RUN.get("recording_reduces") and group is not None and group is RUN.get("dp_group"):
        RUN["reduces"].append({"dtype": str(tensor.dtype).removeprefix("torch."), "numel": tensor.numel(), "async": bool(asynchronous)})
    return _all_reduce(tensor, *args, **kwargs)


def _counting_sends(get_send_ops):
    def counted(self, chunk_id):
        ops = get_send_ops(self, chunk_id)
        if RUN.get("in_step"):
            RUN["sent"][-1] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops

    return counted


_log = BoostTrainer.log


def _recorded_log(self, logs, start_time=None):
    _log(self, logs, start_time)
    if "comm_p2p_bytes_per_step" in logs:
        RUN["logged"].append(logs["comm_p2p_bytes_per_step"])
    if "comm_dp_grad_bytes_per_step" in logs:
        RUN["logged_dp"].append(logs["comm_dp_grad_bytes_per_step"])


_load_optimizer_and_scheduler = BoostTrainer._load_optimizer_and_scheduler


def _recording_load(self, checkpoint):
    """Load, then write per canonical name the parameter as the optimizer sees it and this rank's optimizer state."""
    _load_optimizer_and_scheduler(self, checkpoint)
    optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
    zero = sharded_over_data_parallel(optimizer)
    held = zero.optim.state if zero is not None else optimizer.state
    record = {}
    with full_precision_parameters(self.model):
        for name, param in self.model.named_parameters():
            spec = shard_spec_of(param)
            record[name] = {"value": param.detach().clone(), "state": {k: v.clone() for k, v in held.get(param, {}).items()},
                            "spec": [list(spec.full_shape), spec.partition_dim, spec.tp_rank, spec.tp_size]}
    folder = Path(self.args.output_dir) / "loaded"
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(record, folder / f"rank{dist.get_rank() if dist.is_initialized() else 0}.pt")


BoostTrainer.training_step = _wrap(_training_step_counting_sends, "train", before=_start_recording_reduces)
BoostTrainer.evaluation_loop = _wrap(BoostTrainer.evaluation_loop, "eval")
BoostTrainer.generate_sample = _wrap(BoostTrainer.generate_sample, "sample")
BoostTrainer._get_grad_norm = _grad_norm_then_stop_recording
BoostTrainer.log = _recorded_log
BoostTrainer._load_optimizer_and_scheduler = _recording_load
dist.all_reduce = _recorded_all_reduce
_PipelineStageBase.get_fwd_send_ops = _counting_sends(_PipelineStageBase.get_fwd_send_ops)
_PipelineStageBase.get_bwd_send_ops = _counting_sends(_PipelineStageBase.get_bwd_send_ops)

MASTERS_FP32 = PrecisionPolicy("bf16_params")  # the bf16_params machinery with fp32 parameters
_resolve_precision = arguments_module.resolve_precision  # the arguments resolve the policy, once


def deepspeed_config(out: Path, stage: int) -> str:
    """This rank's DeepSpeed config file (``auto`` batch sizes, clipping and bf16, filled from the arguments)."""
    path = out / f"zero{stage}-rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}, "train_batch_size": "auto", "bf16": {"enabled": "auto"},
                                "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                                "gradient_clipping": "auto"}))
    return str(path)


def train(out: Path, run: str, *argv: str, masters_fp32: bool = False, deepspeed: bool = False, brief: bool = True,
          evaluate: bool = False, sample: bool = False) -> None:
    """One run. ``brief``: the trainer's ``train()`` only (``evaluate`` / ``sample``: then one evaluation / the
    end-of-training sample); otherwise the recipe's whole ``main`` (evaluations, sample, final model).
    Accelerate drops DeepSpeed under ``ACCELERATE_USE_CPU`` (the cpu-4proc config sets it) and keeps
    ``ACCELERATE_USE_DEEPSPEED`` after a DeepSpeed run, so each run sets both for itself."""
    import torch._inductor.config as inductor_config

    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    os.environ["ACCELERATE_USE_CPU"] = "false" if deepspeed else USE_CPU
    argv = [*argv, "--output_dir", str(out / run)]
    compiled = "--torch_compile" in argv
    reset_run(compiled)
    inductor_config.post_grad_custom_pre_pass = compiled_gemms if compiled else None
    arguments_module.resolve_precision = (lambda args: MASTERS_FP32) if masters_fp32 else _resolve_precision
    try:
        if brief:
            trainer = build_trainer(argv)
            resume = trainer.args.resume_from_checkpoint
            trainer.train(resume_from_checkpoint=resume)
            trainer.save_state()
            if evaluate:
                trainer.evaluate()
            if sample:
                trainer.generate_sample(max_new_tokens=2)
        else:
            pretrain.main(argv)
    finally:
        arguments_module.resolve_precision = _resolve_precision
        inductor_config.post_grad_custom_pre_pass = None
    gemms = every_rank(dict(RUN["gemms"]))
    reduces = every_rank({"reduces": RUN["reduces"], "trainable": RUN["trainable"], "logged": RUN["logged_dp"]})
    p2p = every_rank({"sent": RUN["sent"], "logged": RUN["logged"]})
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name, value in (("gemms", gemms), ("dp_reduce", reduces), ("p2p", p2p), ("precision", RUN.get("precision"))):
            (out / run / f"{name}.json").write_text(json.dumps(value))


BF16 = ["--bf16", "true"]
BF16_PARAMS = [*BF16, "--precision_policy", "bf16_params"]  # the default with bf16, named
AUTOCAST = [*BF16, "--precision_policy", "autocast"]
ONE_STEP = ["--max_steps", "1", "--max_eval_blocks", "8"]  # GEMM dtypes only
TP2_DP2 = ["--tp_size", "2", "--per_device_train_batch_size", "4"]
PP2_TP2 = ["--pp_size", "2", "--tp_size", "2", "--pp_microbatches", "2", "--per_device_train_batch_size", "8"]
PP2_DP2 = ["--pp_size", "2", "--tp_size", "1", "--pp_microbatches", "2", "--per_device_train_batch_size", "4"]
INTERLEAVED = ["--pp_schedule", "interleaved-1f1b", "--pp_microbatches", "4"]
#: every run: (mode, name, arguments, options of train())
RUNS = [
    ("one", "single-fp32", [], {}),
    ("one", "single-autocast", AUTOCAST, {"evaluate": True, "sample": True}),
    ("one", "single-bf16", BF16_PARAMS, {"evaluate": True, "sample": True}),
    # bf16_params: losses against fp32 and one process, checkpoints, resume at the same and another layout
    ("four", "pp2-tp2-bf16", [*PP2_TP2, *BF16_PARAMS, "--save_strategy", "steps", "--save_steps", "3"], {"brief": False}),
    ("four", "pp2-tp2-bf16-resumed", [*PP2_TP2, *BF16_PARAMS, "--resume_from_checkpoint", "{out}/pp2-tp2-bf16/checkpoint-3"], {}),
    ("four", "tp2-dp2-bf16-from-pp2", [*TP2_DP2, *BF16_PARAMS, "--resume_from_checkpoint", "{out}/pp2-tp2-bf16/checkpoint-3"], {}),
    ("four", "tp2-dp2-bf16-sp", [*TP2_DP2, *BF16_PARAMS, "--sequence_parallel", "true", "--sample_max_new_tokens", "0"], {"evaluate": True}),
    ("four", "pp2-dp2-bf16-zero1", [*PP2_DP2, *INTERLEAVED, *BF16_PARAMS, "--zero1_optimizer", "true"], {"evaluate": True, "sample": True}),
    # the bf16_params machinery in fp32: exactly the fp32 run
    ("four", "tp2-dp2-masters32", TP2_DP2, {"masters_fp32": True}),
    ("four", "pp2-dp2-masters32", PP2_DP2, {"masters_fp32": True}),
    # every other mode, GEMM dtypes only
    ("four", "tp2-dp2-autocast", [*TP2_DP2, *AUTOCAST, *ONE_STEP], {"evaluate": True, "sample": True}),
    ("four", "pp2-tp2-lax-autocast", [*PP2_TP2, *AUTOCAST, *ONE_STEP, "--preset", "lax-60m"], {"evaluate": True, "sample": True}),
    ("four", "pp2-dp2-gpipe-autocast", [*PP2_DP2, *AUTOCAST, *ONE_STEP, "--pp_schedule", "gpipe"], {"evaluate": True, "sample": True}),
    ("four", "pp2-dp2-looped-fp32-residual", [*PP2_DP2, *BF16_PARAMS, *ONE_STEP, "--pp_schedule", "looped-bfs", "--pp_microbatches", "4",
                                              "--fp32_residual", "true", "--grad_reduce_dtype", "bf16"], {"evaluate": True, "sample": True}),
    ("four", "tp2-dp2-loro", [*TP2_DP2, *BF16_PARAMS, "--max_steps", "2", "--max_eval_blocks", "8", "--bottleneck", "svd",
                              "--lowrank_optimizer", "loro", "--loro_exact_every", "2", "--fp32_residual", "true"],
     {"evaluate": True, "sample": True}),
    ("four", "pp2-tp2-lax-fp32-residual", [*PP2_TP2, *BF16_PARAMS, *ONE_STEP, "--preset", "lax-60m", "--lax_gate", "identity",
                                           "--fp32_residual", "true"], {}),
    ("four", "pp2-dp2-lax-fsdp2-fp32-residual", [*PP2_DP2, *BF16_PARAMS, *ONE_STEP, "--preset", "lax-60m", "--lax_gate", "identity",
                                                 "--fp32_residual", "true", "--data_parallel", "fsdp2"], {}),
    ("four", "pp2-tp2-compiled", [*PP2_TP2, *BF16_PARAMS, *ONE_STEP, "--fp32_residual", "true", "--torch_compile", "true"], {}),
    ("four", "tp2-dp2-deepspeed", [*TP2_DP2, *BF16, *ONE_STEP, "--deepspeed", "{zero2}"],
     {"deepspeed": True, "evaluate": True, "sample": True}),
]


def main(mode: str, out: str, *common: str) -> None:
    out = Path(out)
    if mode not in ("one", "four"):
        raise ValueError(f"unknown mode {mode!r}")
    for run_mode, name, argv, options in RUNS:
        if run_mode == mode:
            layout = ["--tp_size", "1", "--per_device_train_batch_size", "8"] if mode == "one" else []
            zero2 = deepspeed_config(out, 2) if options.get("deepspeed") else None
            train(out, name, *common, *layout, *(a.format(out=out, zero2=zero2) for a in argv), **options)


if __name__ == "__main__":
    main(*sys.argv[1:])
