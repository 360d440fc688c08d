"""Resuming at any layout: the checkpoint's training layout, optimizer state resharded to another TP size, and
the checks that refuse what cannot be resumed exactly.

Every checkpoint holds ``training_layout.json`` (written by :func:`write_training_layout`): the TP and DP sizes, the
ZeRO stage (``None`` without DeepSpeed), the global batch and, without DeepSpeed, the optimizer's parameters in
its state-dict order with their canonical names and sharding (``partition_dim``). The optimizer state itself is
one ``torch`` state dict per TP rank (``optimizer.pt`` at tp_size 1, ``optimizer_tp<rank>.pt`` otherwise; DP ranks
hold identical copies).

* **Same TP size**: each rank loads its own file as saved (bit-identical resume).
* **Another TP size** (no DeepSpeed): :func:`reshard_optimizer_state` rebuilds each per-parameter tensor
  (AdamW's ``exp_avg`` / ``exp_avg_sq``) as the canonical tensor (the saved TP ranks' shards concatenated along
  ``partition_dim``, as the weights are) and takes this rank's slice with the parameter's
  :class:`~boost_hf.parallel.sharding.ShardSpec`; scalars (``step``) and the hyper-parameters of the
  parameter groups are copied. The DP size of a run without DeepSpeed does not enter the optimizer state.
* **DeepSpeed**: ZeRO partitions over the DP group are resumed by DeepSpeed at the same TP x DP size and
  ZeRO stage only; another layout raises :class:`ResumeLayoutError`.
* **Data position**: the trainer resumes at ``global_step`` and skips ``global_step x global batch`` samples of
  the epoch's seeded permutation. The permutation does not depend on the layout, and step ``s`` trains
  samples ``[s x B, (s + 1) x B)`` of it at any DP size, micro-batch and accumulation whose product is the global
  batch ``B``: so a change of DP size is exact when ``B`` stays the same. A different ``B`` raises (it would
  change what a step is, and the learning-rate schedule with it).
"""

from __future__ import annotations

import json
import os

import torch

from ..parallel.sharding import shard_spec_of
from .checkpoint import optimizer_file_name

LAYOUT_NAME = "training_layout.json"


class ResumeLayoutError(ValueError):
    """A checkpoint cannot be resumed at this layout (TP x DP size, ZeRO stage, global batch) as it is."""


def parameter_names(model, optimizer) -> list[str]:
    """The canonical name of each parameter of ``optimizer``, in its state-dict order (groups in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def training_layout(*, tp_size: int, dp_size: int, zero_stage: int | None, args, model=None, optimizer=None, pp_size: int = 1) -> dict:
    layout = {
        "pp_size": pp_size,
        "tp_size": tp_size,
        "dp_size": dp_size,
        "zero_stage": zero_stage,
        "global_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * dp_size,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
    }
    if zero_stage is None and optimizer is not None and pp_size == 1:
        params = {n: p for n, p in model.named_parameters()}
        layout["optimizer_files"] = [optimizer_file_name(r, tp_size) for r in range(tp_size)]
        layout["optimizer_groups"] = [len(group["params"]) for group in optimizer.param_groups]
        layout["optimizer_parameters"] = [
            {"name": name, "partition_dim": shard_spec_of(params[name]).partition_dim if shard_spec_of(params[name]).is_sharded else None}
            for name in parameter_names(model, optimizer)
        ]
    return layout


def write_training_layout(checkpoint: str, layout: dict) -> None:
    with open(os.path.join(checkpoint, LAYOUT_NAME), "w") as f:
        json.dump(layout, f, indent=1)


def read_training_layout(checkpoint: str) -> dict | None:
    path = os.path.join(checkpoint, LAYOUT_NAME)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _describe(layout: dict) -> str:
    zero = f", ZeRO-{layout['zero_stage']}" if layout.get("zero_stage") is not None else ", no DeepSpeed"
    return f"tp_size={layout['tp_size']} x dp={layout['dp_size']}{zero}, global batch {layout['global_batch_size']}"


def check_resume_layout(checkpoint: str, current: dict) -> None:
    """Raise :class:`ResumeLayoutError` if ``checkpoint`` (its ``training_layout.json``) cannot be resumed exactly
    at the ``current`` layout (:func:`training_layout` of this run). Reads files only: same answer on every rank."""
    saved = read_training_layout(checkpoint)
    if saved is None:
        return  # an older checkpoint: the optimizer loader checks its files
    weights_only = f"start from its weights only with --init_from {checkpoint} (a new optimizer and learning-rate schedule)"
    if saved["global_batch_size"] != current["global_batch_size"]:
        raise ResumeLayoutError(
            f"{checkpoint} was saved with a global batch of {saved['global_batch_size']} samples per step "
            f"({_describe(saved)}), this run has {current['global_batch_size']} ({_describe(current)}): the data position "
            "and the learning-rate schedule count steps of one global batch. Resume with per_device_train_batch_size x "
            f"gradient_accumulation_steps x dp = {saved['global_batch_size']}, or {weights_only}."
        )
    if saved.get("pp_size", 1) != current.get("pp_size", 1) or (current.get("pp_size", 1) > 1 and saved["tp_size"] != current["tp_size"]):
        raise ResumeLayoutError(
            f"{checkpoint} was saved at pp_size={saved.get('pp_size', 1)} x {_describe(saved)} and this run is pp_size="
            f"{current.get('pp_size', 1)} x {_describe(current)}: the optimizer state of a pipeline run is resumed at its own "
            f"pp_size and tp_size only (any dp). Resume at pp_size={saved.get('pp_size', 1)} and tp_size={saved['tp_size']}, "
            f"or {weights_only}."
        )
    if saved["zero_stage"] is None and current["zero_stage"] is None:
        return  # any TP x DP: the optimizer state is resharded
    if saved["zero_stage"] is None or current["zero_stage"] is None:
        which = "with DeepSpeed" if saved["zero_stage"] is not None else "without DeepSpeed"
        raise ResumeLayoutError(
            f"{checkpoint} was saved {which} ({_describe(saved)}) and this run is {_describe(current)}: the optimizer "
            f"state of one cannot be loaded by the other. Resume {which}, or {weights_only}."
        )
    if (saved["tp_size"], saved["dp_size"], saved["zero_stage"]) != (current["tp_size"], current["dp_size"], current["zero_stage"]):
        raise ResumeLayoutError(
            f"{checkpoint} is a DeepSpeed checkpoint of {_describe(saved)} and this run is {_describe(current)}: DeepSpeed "
            "cannot reshard ZeRO partitions to another TP x DP size or stage. Resume at "
            f"tp_size={saved['tp_size']} on {saved['tp_size'] * saved['dp_size']} processes with ZeRO-{saved['zero_stage']}, "
            f"or {weights_only}."
        )


def missing_file_error(path: str, checkpoint: str, what: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{path} is missing: resuming needs the {what} saved with the weights (the checkpoint is incomplete or was "
        f"copied without it). Resume from a complete checkpoint, or start from this checkpoint's weights only with "
        f"--init_from {checkpoint} (a new optimizer and learning-rate schedule)."
    )


def reshard_optimizer_state(saved: list[dict], saved_parameters: list[dict], names: list[str], specs: list, groups: list[dict]) -> dict:
    """The state dict of an optimizer over parameters ``names`` (with :class:`ShardSpec` ``specs``, grouped as
    ``groups`` = the optimizer's ``param_groups``) from the state dicts ``saved`` of every TP rank of another run,
    whose parameters are ``saved_parameters`` (``{"name", "partition_dim"}`` in state-dict order).

    Per-parameter tensors are concatenated along the saved ``partition_dim`` (the canonical tensor) and sliced
    with this rank's spec; scalar entries (``step``) come from TP rank 0. Exact: no arithmetic on the values.
    """
    index = {p["name"]: i for i, p in enumerate(saved_parameters)}
    unknown = [n for n in names if n not in index]
    if unknown or len(names) != len(saved_parameters):
        extra = sorted(set(index) - set(names))
        raise ResumeLayoutError(
            f"the checkpoint's optimizer state is over other parameters: missing {unknown[:5]}, unexpected {extra[:5]}."
        )
    state = {}
    for i, (name, spec) in enumerate(zip(names, specs)):
        j = index[name]
        if j not in saved[0]["state"]:
            continue  # never stepped (no gradient yet)
        pdim = saved_parameters[j]["partition_dim"]
        entry = {}
        for key, value in saved[0]["state"][j].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                full = torch.cat([s["state"][j][key] for s in saved], dim=pdim) if pdim is not None else value
                if tuple(full.shape) != spec.full_shape:
                    raise ResumeLayoutError(
                        f"optimizer state {key!r} of {name} has shape {tuple(full.shape)} in the checkpoint, the model's "
                        f"parameter {spec.full_shape}: the checkpoint is of another architecture."
                    )
                value = spec.local_slice(full).clone()
            entry[key] = value
        state[i] = entry
    saved_groups = saved[0]["param_groups"]
    if len(saved_groups) != len(groups) or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ResumeLayoutError("the checkpoint's optimizer has other parameter groups (weight decay or learning rates per group).")
    start, param_groups = 0, []
    for group, saved_group in zip(groups, saved_groups):
        param_groups.append({**saved_group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state(optimizer, model, checkpoint: str, tp_rank: int, tp_size: int, device, pp_rank: int = 0, pp_size: int = 1) -> None:
    """Load ``checkpoint``'s optimizer state into ``optimizer`` (this rank: ``tp_rank`` of ``tp_size``, ``pp_rank`` of
    ``pp_size``), resharded when the checkpoint was saved at another TP size (without pipeline parallelism). A missing
    file raises ``FileNotFoundError`` naming it."""
    layout = read_training_layout(checkpoint)
    own = os.path.join(checkpoint, optimizer_file_name(tp_rank, tp_size, pp_rank, pp_size))
    same_tp = layout is None or layout["tp_size"] == tp_size
    if same_tp:
        if not os.path.isfile(own):
            others = sorted(n for n in os.listdir(checkpoint) if n.startswith("optimizer"))
            if layout is None and others:
                raise ResumeLayoutError(
                    f"{checkpoint} has no {os.path.basename(own)} but {', '.join(others)}: it was saved at another TP size "
                    f"by a boost-hf version without {LAYOUT_NAME}, so its optimizer state cannot be resharded. Resume at "
                    f"its TP size, or start from its weights only with --init_from {checkpoint}."
                )
            raise missing_file_error(own, checkpoint, "optimizer state")
        optimizer.load_state_dict(torch.load(own, map_location=device, weights_only=True))
        return
    files = [os.path.join(checkpoint, name) for name in layout["optimizer_files"]]
    for path in files:
        if not os.path.isfile(path):
            raise missing_file_error(path, checkpoint, "optimizer state")
    saved = [torch.load(path, map_location="cpu", weights_only=True, mmap=True) for path in files]
    params = dict(model.named_parameters())
    names = parameter_names(model, optimizer)
    state = reshard_optimizer_state(saved, layout["optimizer_parameters"], names, [shard_spec_of(params[n]) for n in names], optimizer.param_groups)
    optimizer.load_state_dict(state)  # moves the tensors to each parameter's device


__all__ = [
    "LAYOUT_NAME",
    "ResumeLayoutError",
    "training_layout",
    "write_training_layout",
    "read_training_layout",
    "check_resume_layout",
    "reshard_optimizer_state",
    "load_optimizer_state",
    "missing_file_error",
]
