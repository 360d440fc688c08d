"""Resuming at any layout: the checkpoint's training layout, optimizer state resharded to another PP x TP layout,
and the checks that refuse what cannot be resumed exactly.

Every checkpoint holds ``training_layout.json`` (written by :func:`write_training_layout`): the PP, TP and DP sizes,
the ZeRO stage (``None`` without DeepSpeed), the global batch and, without DeepSpeed, the optimizer record
(``"optimizer"``, :func:`saved_optimizer_record`): for each pipeline rank, the files of its TP ranks, its optimizer's
group sizes and its parameters in state-dict order with their canonical names and sharding (``partition_dim``).
The optimizer state itself is one ``torch`` state dict per (pipeline rank, TP rank)
(:func:`~boost_hf.checkpoint.folders.optimizer_file_name`: ``optimizer.pt`` at pp 1 x tp 1,
``optimizer_tp<rank>.pt`` at pp 1, ``optimizer_pp<rank>_tp<rank>.pt`` under PP), over that pipeline rank's
parameters; DP ranks hold identical copies (with ``--zero1_optimizer`` they are consolidated first, so the files
are the same). Together the files hold every parameter's state under its canonical name.

* **Same TP size, same parameters per pipeline rank**: each rank loads its own file as saved (bit-identical).
* **Any other PP x TP** (no DeepSpeed): :func:`reshard_optimizer_state` reads the files of the saved pipeline
  ranks that hold this rank's parameters only, rebuilds each per-parameter tensor (AdamW's ``exp_avg`` /
  ``exp_avg_sq``) as the canonical tensor (the saved TP ranks' shards concatenated along ``partition_dim``, as the
  weights are) and takes this rank's slice with the parameter's :class:`~boost_hf.parallel.sharding.ShardSpec`;
  scalars (``step``) and the hyper-parameters of the parameter groups are copied. Exact (no arithmetic). The DP
  size of a run without DeepSpeed does not enter the optimizer state.
* **DeepSpeed**: ZeRO partitions over the DP group are resumed by DeepSpeed as saved at the same TP x DP size and
  ZeRO stage; a checkpoint whose DeepSpeed flat buffers order the parameters otherwise (``deepspeed_parameter_order``,
  written by an earlier version: :mod:`boost_hf.training.deepspeed`) raises :class:`ResumeLayoutError`. A ZeRO-1/2
  checkpoint at another TP x DP size or ZeRO-1/2 stage goes through DeepSpeed's universal checkpoint
  (:mod:`boost_hf.checkpoint.deepspeed_universal`, which says what it refuses).
* **Data position**: the trainer resumes at ``global_step`` and skips ``global_step x global batch`` samples of
  the epoch's seeded permutation. The permutation does not depend on the layout, and step ``s`` trains
  samples ``[s x B, (s + 1) x B)`` of it at any DP size, micro-batch and accumulation whose product is the global
  batch ``B``: so a change of DP size is exact when ``B`` stays the same. A different ``B`` raises (it would
  change what a step is, and the learning-rate schedule with it).
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import os

import torch

from ..parallel.sharding import shard_spec_of
from .folders import optimizer_file_name
from .deepspeed_universal import UNIVERSAL_INFO_RECORD, universal_resume_refusal

logger = logging.getLogger(__name__)

#: how DeepSpeed's flat buffers order the parameters (:mod:`boost_hf.training.deepspeed`), recorded in a checkpoint's
#: training layout: each group of parameters stored together consecutively, at the place of its first member
DEEPSPEED_PARAMETER_ORDER = "stored-together-consecutive"

LAYOUT_NAME = "training_layout.json"


class ResumeLayoutError(ValueError):
    """A checkpoint cannot be resumed at this layout (TP x DP size, ZeRO stage, global batch) as it is."""


def parameter_names(model, optimizer) -> list[str]:
    """The canonical name of each parameter of ``optimizer``, in its state-dict order (groups in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_record(model, optimizer) -> dict:
    """This rank's part of a checkpoint's optimizer record: the parameter count of each of ``optimizer``'s groups and
    its parameters in state-dict order, each ``{"name": canonical name, "partition_dim": TP split or None}``. The
    same on every TP and DP rank of one pipeline rank."""
    params = dict(model.named_parameters())

    def partition_dim(name: str) -> int | None:
        spec = shard_spec_of(params[name])
        return spec.partition_dim if spec.is_sharded else None

    return {
        "groups": [len(group["params"]) for group in optimizer.param_groups],
        "parameters": [{"name": name, "partition_dim": partition_dim(name)} for name in parameter_names(model, optimizer)],
    }


def training_layout(*, tp_size: int, dp_size: int, zero_stage: int | None, args, pp_size: int = 1,
                    optimizer_records: list[dict] | None = None) -> dict:
    """The layout a checkpoint records; ``optimizer_records``: :func:`optimizer_record` of each pipeline rank (without
    DeepSpeed), stored under ``"optimizer"``."""
    layout = {
        "pp_size": pp_size,
        "tp_size": tp_size,
        "dp_size": dp_size,
        "zero_stage": zero_stage,
        "global_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * dp_size,
        "per_device_train_batch_size": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
    }
    if zero_stage is not None:
        layout["deepspeed_parameter_order"] = DEEPSPEED_PARAMETER_ORDER
        layout["deepspeed_universal_info"] = UNIVERSAL_INFO_RECORD
    if zero_stage is None and optimizer_records is not None:
        layout["optimizer"] = optimizer_records
    return layout


def saved_optimizer_record(layout: dict | None) -> list[dict] | None:
    """The checkpoint's optimizer record, one entry per pipeline rank (``files`` per TP rank, ``groups``,
    ``parameters``); a checkpoint of an earlier version without pipeline ranks has one; ``None`` without a record."""
    if layout is None:
        return None
    if "optimizer" in layout:
        return layout["optimizer"]
    if "optimizer_files" in layout:  # written before pipeline parallelism: one pipeline rank
        return [{"files": layout["optimizer_files"], "groups": layout["optimizer_groups"], "parameters": layout["optimizer_parameters"]}]
    return None


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
    pp = f"pp_size={layout['pp_size']} x " if layout.get("pp_size", 1) > 1 else ""
    return f"{pp}tp_size={layout['tp_size']} x dp={layout['dp_size']}{zero}, global batch {layout['global_batch_size']}"


def precision_change(checkpoint: str, saved: dict | None, current: dict | None) -> str | None:
    """What a resume under another precision policy changes (``saved`` and ``current``: the policies' records,
    :meth:`~boost_hf.training.precision.PrecisionPolicy.record`), or ``None`` when they are the same (or one is
    unknown: a checkpoint of an earlier version)."""
    if not saved or not current or saved == current:
        return None
    changed = ", ".join(f"{key} {saved.get(key)} -> {current.get(key)}" for key in sorted(saved.keys() | current.keys())
                        if saved.get(key) != current.get(key))
    return (f"{checkpoint} was saved under the precision policy {saved.get('policy')} and this run resumes it under "
            f"{current.get('policy')} ({changed}): its weights and optimizer state load as this policy keeps them, and from "
            "here the steps compute as this policy does, so the losses differ from the saved run's. Resume with the saved "
            "policy (--bf16, --precision_policy, --grad_reduce_dtype, --fp32_residual) to continue it exactly.")


def check_resume_layout(checkpoint: str, current: dict) -> None:
    """Raise :class:`ResumeLayoutError` if ``checkpoint`` (its ``training_layout.json``) cannot be resumed exactly
    at the ``current`` layout (:func:`training_layout` of this run). Reads files only: same answer on every rank. A
    resume under another precision policy is said (a warning on global rank 0, :func:`precision_change`)."""
    saved = read_training_layout(checkpoint)
    if saved is None:
        return  # an older checkpoint: the optimizer loader checks its files
    change = precision_change(checkpoint, saved.get("precision"), current.get("precision"))
    launched = torch.distributed.is_available() and torch.distributed.is_initialized()
    if change is not None and (not launched or torch.distributed.get_rank() == 0):
        logger.warning(change)
    weights_only = f"start from its weights only with --init_from {checkpoint} (a new optimizer and learning-rate schedule)"
    if saved["global_batch_size"] != current["global_batch_size"]:
        raise ResumeLayoutError(
            f"{checkpoint} was saved with a global batch of {saved['global_batch_size']} samples per step "
            f"({_describe(saved)}), this run has {current['global_batch_size']} ({_describe(current)}): the data position "
            "and the learning-rate schedule count steps of one global batch. Resume with per_device_train_batch_size x "
            f"gradient_accumulation_steps x dp = {saved['global_batch_size']}, or {weights_only}."
        )
    saved_pp, saved_tp = saved.get("pp_size", 1), saved["tp_size"]
    if (saved["zero_stage"] is None and saved_optimizer_record(saved) is None and saved_pp > 1
            and (saved_pp, saved_tp) != (current.get("pp_size", 1), current["tp_size"])):
        raise ResumeLayoutError(
            f"{checkpoint} was saved at {_describe(saved)} by a boost-hf version that did not record its optimizer's "
            f"parameters per pipeline rank, so its optimizer state cannot be resharded to this run's {_describe(current)}. "
            f"Resume at pp_size={saved_pp} and tp_size={saved_tp} (any dp), or {weights_only}."
        )
    if saved["zero_stage"] is None and current["zero_stage"] is None:
        return  # any PP x TP x DP: the optimizer state is resharded
    if saved["zero_stage"] is None or current["zero_stage"] is None:
        which = "with DeepSpeed" if saved["zero_stage"] is not None else "without DeepSpeed"
        raise ResumeLayoutError(
            f"{checkpoint} was saved {which} ({_describe(saved)}) and this run is {_describe(current)}: the optimizer "
            f"state of one cannot be loaded by the other. Resume {which}, or {weights_only}."
        )
    if (saved["tp_size"], saved["dp_size"], saved["zero_stage"]) != (current["tp_size"], current["dp_size"], current["zero_stage"]):
        refusal = universal_resume_refusal(checkpoint, saved, current)  # else converted (deepspeed_universal)
        if refusal is not None:
            raise ResumeLayoutError(refusal)
        return
    if saved.get("deepspeed_parameter_order") != current.get("deepspeed_parameter_order"):
        raise ResumeLayoutError(
            f"{checkpoint} is a DeepSpeed checkpoint written by an earlier boost-hf version, whose DeepSpeed flat buffers "
            "hold the parameters in another order (this version keeps each grouped projection's parameters consecutive): "
            "its ZeRO partitions would load into the wrong parameters. Resume it with the boost-hf version that wrote "
            f"it, or {weights_only}."
        )


def missing_file_error(path: str, checkpoint: str, what: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"{path} is missing: resuming needs the {what} saved with the weights (the checkpoint is incomplete or was "
        f"copied without it). Resume from a complete checkpoint, or start from this checkpoint's weights only with "
        f"--init_from {checkpoint} (a new optimizer and learning-rate schedule)."
    )


def _group_of(counts: list[int], position: int) -> int:
    """The group holding the ``position``-th parameter of an optimizer whose groups hold ``counts`` parameters."""
    return bisect.bisect_right(list(itertools.accumulate(counts)), position)


def locate_saved_parameters(record: list[dict], names: list[str], groups: list[dict],
                            held_elsewhere: frozenset[str] = frozenset()) -> dict[str, tuple[int, int]]:
    """``{name: (saved pipeline rank q, position j in its optimizer)}`` for each of ``names`` (an optimizer's
    parameters in state-dict order, grouped as ``groups``) in the checkpoint's optimizer ``record``
    (:func:`saved_optimizer_record`). Raises :class:`ResumeLayoutError` when the saved parameters are others (a saved
    parameter neither here nor in ``held_elsewhere``, the parameters other pipeline ranks of this run hold) or a
    parameter sits in another group (weight decay or learning rates per group)."""
    where = {p["name"]: (q, j) for q, entry in enumerate(record) for j, p in enumerate(entry["parameters"])}
    missing = [n for n in names if n not in where]
    unexpected = sorted(set(where) - set(names) - set(held_elsewhere))
    if missing or unexpected:
        raise ResumeLayoutError(
            f"the checkpoint's optimizer state is over other parameters: missing {missing[:5]}, unexpected {unexpected[:5]}."
        )
    counts = [len(group["params"]) for group in groups]
    for i, name in enumerate(names):
        q, j = where[name]
        if len(record[q]["groups"]) != len(groups) or _group_of(record[q]["groups"], j) != _group_of(counts, i):
            raise ResumeLayoutError(
                "the checkpoint's optimizer has other parameter groups (weight decay or learning rates per group): resume "
                "with the optimizer settings it was saved with, or start from its weights only with --init_from."
            )
    return {name: where[name] for name in names}


def reshard_optimizer_state(load, record: list[dict], names: list[str], specs: list, groups: list[dict],
                            held_elsewhere: frozenset[str] = frozenset()) -> dict:
    """The state dict of an optimizer over parameters ``names`` (with :class:`ShardSpec` ``specs``, grouped as
    ``groups`` = the optimizer's ``param_groups``) from a checkpoint of the per-(PP, TP)-rank file format of
    boost-hf 0.x (before distributed checkpoints), saved at any PP x TP layout.

    ``record``: the checkpoint's :func:`saved_optimizer_record`; ``load(q)``: the state dicts of pipeline rank ``q``'s
    TP ranks, called only for the pipeline ranks holding one of ``names``; ``held_elsewhere``: see
    :func:`locate_saved_parameters`.

    Per-parameter tensors (AdamW's ``exp_avg`` / ``exp_avg_sq``) are concatenated over the saved TP ranks along the
    saved ``partition_dim`` (the canonical tensor) and sliced with this rank's spec; scalar entries (``step``) come
    from TP rank 0; each group's hyper-parameters from the first pipeline rank read. Exact: no arithmetic on values.
    """
    where = locate_saved_parameters(record, names, groups, held_elsewhere)
    loaded: dict[int, list[dict]] = {}
    state = {}
    for i, (name, spec) in enumerate(zip(names, specs)):
        q, j = where[name]
        if q not in loaded:
            loaded[q] = load(q)
        saved = loaded[q]
        if j not in saved[0]["state"]:
            continue  # never stepped (no gradient yet)
        pdim = record[q]["parameters"][j]["partition_dim"]
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
    saved_groups = loaded[where[names[0]][0]][0]["param_groups"]
    start, param_groups = 0, []
    for group, saved_group in zip(groups, saved_groups):
        param_groups.append({**saved_group, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": state, "param_groups": param_groups}


def load_optimizer_files(optimizer, model, checkpoint: str, tp_rank: int, tp_size: int, device, pp_rank: int = 0,
                         pp_size: int = 1, held_elsewhere: frozenset[str] = frozenset()) -> None:
    """Load ``checkpoint``'s optimizer state into ``optimizer`` (this rank: ``tp_rank`` of ``tp_size``, ``pp_rank`` of
    ``pp_size``; ``held_elsewhere``: the parameters of the other pipeline ranks). The rank's own file as saved when the
    checkpoint has this TP size and this pipeline rank held the same parameters; otherwise resharded
    (:func:`reshard_optimizer_state`) from the files of the saved pipeline ranks holding this rank's parameters (each
    read memory-mapped). A missing file raises ``FileNotFoundError`` naming it."""
    layout = read_training_layout(checkpoint)
    record = saved_optimizer_record(layout)
    names = parameter_names(model, optimizer)
    own = os.path.join(checkpoint, optimizer_file_name(tp_rank, tp_size, pp_rank, pp_size))
    same_files = record is None or (
        layout["tp_size"] == tp_size and len(record) == pp_size and [p["name"] for p in record[pp_rank]["parameters"]] == names
    )
    if same_files:
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

    def load(q: int) -> list[dict]:
        files = [os.path.join(checkpoint, name) for name in record[q]["files"]]
        for path in files:
            if not os.path.isfile(path):
                raise missing_file_error(path, checkpoint, "optimizer state")
        return [torch.load(path, map_location="cpu", weights_only=True, mmap=True) for path in files]

    params = dict(model.named_parameters())
    specs = [shard_spec_of(params[n]) for n in names]
    state = reshard_optimizer_state(load, record, names, specs, optimizer.param_groups, held_elsewhere)
    optimizer.load_state_dict(state)  # moves the tensors to each parameter's device


__all__ = [
    "LAYOUT_NAME",
    "ResumeLayoutError",
    "parameter_names",
    "optimizer_record",
    "training_layout",
    "saved_optimizer_record",
    "write_training_layout",
    "read_training_layout",
    "check_resume_layout",
    "precision_change",
    "reshard_optimizer_state",
    "load_optimizer_files",
    "locate_saved_parameters",
    "missing_file_error",
]
