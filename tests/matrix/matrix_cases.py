"""The exactness matrix's runs, many per launched group, for ``test_matrix.py``: each case through ``boost-hf train``'s
own code (:func:`boost_hf.training.pretrain.main` with the command line's arguments: the checks, the output folder
claimed, training, the evaluations, a sample, the final save), each one-process reference through
:func:`~boost_hf.training.pretrain.build_trainer` and the trainer's ``train``:

    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml tests/matrix/matrix_cases.py cases OUT PLAN.json
    python tests/matrix/matrix_cases.py references OUT PLAN.json      # the one-process runs

``PLAN.json`` lists the runs: ``{"name", "argv", "deepspeed", "deepspeed_config"}`` (``deepspeed``: its ZeRO stage, or
``null``; the config is written into the run's folder and passed as ``--deepspeed``), and for a float64 truth
(a one-process run of an fp32 reference's arguments, its model then cast to float64: :func:`as_float64`)
``"float64": {"through_bf16": bool}``. Each run writes into ``OUT/<name>/``:

* ``done-rank<r>.json`` (every rank): ``"trained"``, or the error it raised (type, message, the end of its traceback)
  and the collectives this rank issued before it (every ``torch.distributed`` collective and group creation,
  counted from the run's start);
* ``grads-pp<q>.pt``: the gradient of every parameter of pipeline rank ``q`` at the first optimizer step, canonical
  (FSDP2's shards gathered over DP, DeepSpeed's partitions assembled, TP shards gathered), after the reduction over DP
  and before clipping; ``params-pp<q>.pt``: every parameter after the last step (fp32 masters where the policy keeps
  them); written by the rank with DP and TP rank 0 of each pipeline rank;
* ``run.json`` (global rank 0): the logged losses, the model's config, what data parallelism the run applied;
* ``final/``: the trainer's published folder (``cases`` only: the references train and stop).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from boost_hf.parallel.sharding import gather_full_many, shard_spec_of
from boost_hf.training import BoostTrainer, pretrain
from boost_hf.training.precision import cast_parameters, full_precision_parameters

USE_CPU = os.environ.get("ACCELERATE_USE_CPU", "false")
RUN: dict = {}  # this rank's record of the run in progress

# ---------------------------------------------------------------------- collectives issued
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
               "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "send",
               "recv", "isend", "irecv", "batch_isend_irecv", "new_group", "new_subgroups", "init_device_mesh")


def _counted(function):
    @functools.wraps(function)
    def counting(*args, **kwargs):
        RUN["collectives"] = RUN.get("collectives", 0) + 1
        return function(*args, **kwargs)
    return counting


for _name in COLLECTIVES:  # one wrapper per function, in both modules: P2POp checks its op is c10d's isend or irecv
    _original = getattr(c10d, _name, None) or getattr(dist, _name, None)
    if _original is not None and not hasattr(_original, "__wrapped__"):
        _wrapper = _counted(_original)
        for _module in (dist, c10d):
            if getattr(_module, _name, None) is _original:
                setattr(_module, _name, _wrapper)
if hasattr(dist, "device_mesh"):
    import torch.distributed.device_mesh as _device_mesh

    _device_mesh.init_device_mesh = _counted(_device_mesh.init_device_mesh)


# ---------------------------------------------------------------------- what a run computed
def canonical(trainer: BoostTrainer, named: list[tuple[str, torch.Tensor, object]]) -> dict[str, torch.Tensor] | None:
    """``{name: canonical tensor}`` of ``(name, this rank's tensor, its parameter)`` (collective over DP for DTensors,
    over TP for the shards), on the rank that writes (DP and TP rank 0), else ``None``."""
    state = trainer.parallel_state
    local = [t.full_tensor() if hasattr(t, "full_tensor") else t for _, t, _ in named]
    full = gather_full_many([t.detach().float().cpu() for t in local], [shard_spec_of(p) for _, _, p in named], state.tp_group)
    if state.dp_rank == 0 and state.tp_rank == 0:
        return {name: tensor.clone() for (name, _, _), tensor in zip(named, full)}
    return None


def save(trainer: BoostTrainer, kind: str, tensors: dict | None) -> None:
    if tensors is not None:
        torch.save(tensors, RUN["folder"] / f"{kind}-pp{trainer.parallel_state.pp_rank}.pt")


def gradients(trainer: BoostTrainer) -> None:
    """The first step's gradients after the DP reduction (the trainer's clipping is next)."""
    if RUN.get("grads_saved"):
        return
    RUN["grads_saved"] = True
    if trainer.master_parameters is not None:  # bf16_params: the reduced fp32 gradients presented on the masters
        trainer.master_parameters.gradients_ready()
    named = [(n, p.grad, p) for n, p in trainer.model.named_parameters() if p.grad is not None]
    save(trainer, "grads", canonical(trainer, named))


def deepspeed_gradients(engine) -> None:
    """Under DeepSpeed: each parameter's gradient as DeepSpeed assembles it from its partitions, at the first step's
    boundary, before the engine steps (clipping, the optimizer)."""
    from deepspeed.utils import safe_get_full_grad

    trainer = RUN.get("trainer")
    if trainer is None or RUN.get("grads_saved") or not engine.is_gradient_accumulation_boundary():
        return
    RUN["grads_saved"] = True
    named = [(n, safe_get_full_grad(p), p) for n, p in trainer.model.named_parameters()]
    save(trainer, "grads", canonical(trainer, [(n, g, p) for n, g, p in named if g is not None]))


def parameters(trainer: BoostTrainer) -> None:
    """Every parameter after training, as the optimizer steps it (the fp32 masters; DeepSpeed's assembled)."""
    model = trainer.model
    if trainer.is_deepspeed_enabled:
        from deepspeed.utils import safe_get_full_fp32_param

        named = [(n, safe_get_full_fp32_param(p), p) for n, p in model.named_parameters()]
        save(trainer, "params", canonical(trainer, [(n, full if full is not None else p, p) for n, full, p in named]))
        return
    with full_precision_parameters(model):
        save(trainer, "params", canonical(trainer, [(n, p, p) for n, p in model.named_parameters()]))


def run_record(trainer: BoostTrainer) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    how = trainer.fully_shard()
    record = {
        "losses": {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
        "config": trainer.model.config.to_dict(),
        "deepspeed_stage": trainer.zero_stage,
        "fully_shard": None if how is None else {"shard_size": how.shard_size, "replicate_size": how.replicate_size},
        "precision": trainer.precision.describe(),
        "world": dist.get_world_size() if dist.is_initialized() else 1,
    }
    (RUN["folder"] / "run.json").write_text(json.dumps(record, default=str))


_init = BoostTrainer.__init__
_clip_grad_norm = BoostTrainer._clip_grad_norm
_save_final_model = BoostTrainer.save_final_model


def _registering_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    RUN["trainer"] = self


def _recording_clip_grad_norm(self, model):
    if not self.is_deepspeed_enabled:
        gradients(self)
    return _clip_grad_norm(self, model)


def _recording_save_final_model(self, output_dir=None):
    parameters(self)
    run_record(self)
    RUN["trained"] = True
    return _save_final_model(self, output_dir)


BoostTrainer.__init__ = _registering_init
BoostTrainer._clip_grad_norm = _recording_clip_grad_norm
BoostTrainer.save_final_model = _recording_save_final_model
try:
    from deepspeed.runtime.engine import DeepSpeedEngine

    _engine_step = DeepSpeedEngine.step

    def _recording_engine_step(self, *args, **kwargs):
        deepspeed_gradients(self)
        return _engine_step(self, *args, **kwargs)

    DeepSpeedEngine.step = _recording_engine_step
except ImportError:  # pragma: no cover - without DeepSpeed no run uses it
    pass


# ---------------------------------------------------------------------- float64 truths
def float64_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                           shift_labels=None, **kwargs) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` without its cast of the logits to fp32 (a float64 truth keeps them)."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits, shift_labels = logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return torch.nn.functional.cross_entropy(logits, shift_labels, ignore_index=ignore_index)
    loss = torch.nn.functional.cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum")
    return loss / (num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch)


def as_float64(trainer: BoostTrainer, through_bf16: bool) -> None:
    """Make the one-process fp32 run of ``trainer`` a float64 truth: its parameters cast to float64 (first rounded to
    bf16 when ``through_bf16``: the runs it is the truth of compute at bf16 weights, ``bf16_params``), its loss in float64.
    The RMSNorm statistics stay fp32, as the single-device model computes them: the truth is then up to 1.1e-6 of a
    gradient's scale off one with float64 statistics (measured on the cases of benchmarks/matrix_rounding_floor.py),
    small beside the counted fp32 bound (3.6e-5) that any case judged against the truth exceeds."""
    if through_bf16:
        cast_parameters(trainer.model, torch.bfloat16)
    cast_parameters(trainer.model, torch.float64)
    trainer.model.loss_function = float64_causal_lm_loss


# ---------------------------------------------------------------------- the runs
def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def run(entry: dict, out: Path, reference: bool) -> None:
    """One run of ``entry`` (see the module docstring); its outcome in ``done-rank<r>.json``."""
    folder = out / entry["name"]
    folder.mkdir(parents=True, exist_ok=True)
    RUN.clear()
    RUN.update(folder=folder, collectives=0)
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # accelerate leaves it set after a DeepSpeed run
    os.environ["ACCELERATE_USE_CPU"] = "false" if entry["deepspeed"] is not None else USE_CPU  # (it drops DeepSpeed)
    argv = [*entry["argv"], "--output_dir", str(folder)]
    if entry["deepspeed"] is not None:  # each rank its own copy (no rank waits for another's file)
        config = folder / f"deepspeed-rank{rank()}.json"
        config.write_text(json.dumps(entry["deepspeed_config"]))
        argv += ["--deepspeed", str(config)]
    outcome: dict = {"outcome": "trained"}
    try:
        if reference:
            trainer = pretrain.build_trainer(argv)  # the arguments, model and data checked as `boost-hf train` checks them
            if entry.get("float64") is not None:
                as_float64(trainer, entry["float64"]["through_bf16"])
            trainer.train()
            parameters(trainer)
            run_record(trainer)
        else:
            pretrain.main(argv)  # `boost-hf train`: its final/ saved last (the run's records first)
    except Exception as error:  # noqa: BLE001 (recorded; test_matrix.py judges it)
        outcome = {"outcome": "error", "type": type(error).__name__, "message": str(error),
                   "traceback": traceback.format_exc()[-4000:], "collectives_before": RUN["collectives"],
                   "after_training": bool(RUN.get("trained"))}
    RUN.pop("trainer", None)
    (folder / f"done-rank{rank()}.json").write_text(json.dumps(outcome))
    if dist.is_initialized():  # every rank done with this run before the next (a rank stuck in it ends the launch)
        dist.monitored_barrier(timeout=timedelta(seconds=300))


def main(mode: str, out: str, plan: str) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # the group every run of the launch uses, made before the first
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # (the runs' --ddp_timeout)
    for entry in json.loads(Path(plan).read_text()):
        run(entry, Path(out), reference=mode == "references")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
