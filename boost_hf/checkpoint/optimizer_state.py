"""The optimizer's state in a training checkpoint (``torch.distributed.checkpoint``): each rank writes the state it
holds, under the parameters' canonical names, and reads its own slice of it at any layout.

Entries of the DCP state dict (``optimizer.`` + ...):

* ``state.<canonical name>.<key>``: a tensor of the parameter's shape (AdamW's and LORO's ``exp_avg``,
  ``exp_avg_sq``) as a DTensor with the parameter's placements (:func:`~boost_hf.checkpoint.sharded_state.as_dtensor`:
  split over TP like the parameter, replicated over DP, so DCP writes it once; under FSDP2 also split over DP like
  the parameter, each DP rank writing its own shard); any other tensor (``step``) as it is, written once; other
  values pickled.
* ``param_groups.pp<q>``: the hyper-parameters of each parameter group (without ``params``) of pipeline rank ``q``.

With ``--zero1_optimizer`` each DP rank holds the state of its share of the parameters only, and writes exactly
that (no consolidation on one rank); on load, each rank reads the state of its share of the new partition. Plain
optimizers, LORO (AdamW's keys; its place in the period is a group hyper-parameter) and ZeRO-1 are saved alike, so a
run resumes with or without ZeRO-1 at any PP x TP x DP. The group of each parameter is checked against the
checkpoint's ``training_layout.json`` record (:mod:`boost_hf.checkpoint.resume`).
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist

from torch.distributed.optim import ZeroRedundancyOptimizer

from ..parallel.sharding import shard_spec_of
from .sharded_state import DCP_FOLDER, as_dtensor, dcp_metadata, parallel_state_of, quiet_single_process_warning
from .resume import (
    LAYOUT_NAME,
    ResumeLayoutError,
    locate_saved_parameters,
    missing_file_error,
    parameter_names,
    read_training_layout,
    saved_optimizer_record,
)

OPTIMIZER_KEY = "optimizer"


def _optimizers(optimizer):
    """``(whole, local)``: the optimizer over all of this rank's parameters (the ZeRO-1 wrapper, or the plain
    optimizer without accelerate's wrapper) and the one holding state (ZeRO-1: this DP rank's share)."""
    whole = getattr(optimizer, "optimizer", optimizer)
    zero = sharded_over_data_parallel(whole)
    return whole, (zero.optim if zero is not None else whole)


def _is_per_element(value, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape


def optimizer_state(model, optimizer) -> dict:
    """This rank's optimizer state as DCP entries (see the module docstring): no copy, no communication."""
    state = parallel_state_of(model)
    whole, local = _optimizers(optimizer)
    names = {id(p): n for n, p in model.named_parameters()}
    entries = {}
    for group in local.param_groups:
        for param in group["params"]:
            held = local.state.get(param)
            if not held:
                continue  # never stepped
            spec = shard_spec_of(param)
            entries[names[id(param)]] = {
                key: as_dtensor(value.detach(), spec, state) if _is_per_element(value, param) else value for key, value in held.items()
            }
    groups = [{k: v for k, v in group.items() if k != "params"} for group in whole.param_groups]
    return {"state": entries, "param_groups": {f"pp{state.pp_rank}": pickle.dumps(groups)}}


def _saved_entries(metadata) -> dict[str, dict[str, object]]:
    """``{canonical name: {key: storage metadata}}`` of the checkpoint's optimizer state."""
    prefix = f"{OPTIMIZER_KEY}.state."
    entries: dict[str, dict[str, object]] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            name, _, field = key[len(prefix):].rpartition(".")
            entries.setdefault(name, {})[field] = entry
    return entries


@torch.no_grad()
def load_optimizer_state(optimizer, model, checkpoint: str, held_elsewhere: frozenset[str] = frozenset()) -> None:
    """Load into ``optimizer`` this rank's slice of the optimizer state of ``checkpoint`` (its ``dcp/``, saved at
    any PP x TP x DP, with or without ZeRO-1): per-element tensors resharded by DCP to the parameters' shards, the
    other entries as saved, each group's hyper-parameters from the pipeline rank that held this rank's first
    parameter. The parameters and groups are checked against the checkpoint's optimizer record
    (``training_layout.json``); ``held_elsewhere``: the parameters of the other pipeline ranks. Under ZeRO-1 only
    this DP rank's share is read. Collective when launched (``dcp.load``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    folder = os.path.join(checkpoint, DCP_FOLDER)
    metadata = dcp_metadata(folder)
    saved = _saved_entries(metadata)
    if not any(key.startswith(f"{OPTIMIZER_KEY}.") for key in metadata.state_dict_metadata):
        raise FileNotFoundError(
            f"{checkpoint} holds no optimizer state (it was saved with --save_only_model, or under DeepSpeed): resuming "
            f"needs it. Resume from a complete checkpoint, or start from this checkpoint's weights only with --init_from "
            f"{checkpoint} (a new optimizer and learning-rate schedule)."
        )
    record = saved_optimizer_record(read_training_layout(checkpoint))
    if record is None:
        raise missing_file_error(os.path.join(checkpoint, LAYOUT_NAME), checkpoint, "optimizer record")
    whole, local = _optimizers(optimizer)
    names = parameter_names(model, whole)
    where = locate_saved_parameters(record, names, whole.param_groups, held_elsewhere)
    state = parallel_state_of(model)
    by_id = {id(p): n for n, p in model.named_parameters()}
    targets: dict[str, dict] = {}
    for group in local.param_groups:
        for param in group["params"]:
            name = by_id[id(param)]
            entry = {}
            for key, md in saved.get(name, {}).items():
                if not isinstance(md, TensorStorageMetadata):
                    entry[key] = None  # a pickled value
                elif len(md.size) > 0:
                    if tuple(md.size) != shard_spec_of(param).full_shape:
                        raise ResumeLayoutError(
                            f"optimizer state {key!r} of {name} has shape {tuple(md.size)} in the checkpoint, the model's "
                            f"parameter {shard_spec_of(param).full_shape}: the checkpoint is of another architecture."
                        )
                    entry[key] = as_dtensor(torch.empty_like(param, dtype=md.properties.dtype), shard_spec_of(param), state)
                else:
                    entry[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            if entry:
                targets[name] = entry
    source = f"pp{where[names[0]][0]}" if names else "pp0"
    request = {OPTIMIZER_KEY: {"state": targets, "param_groups": {source: b""}}}
    with quiet_single_process_warning():
        dcp.load(request, checkpoint_id=folder, no_dist=not (dist.is_available() and dist.is_initialized()))
    saved_groups = pickle.loads(request[OPTIMIZER_KEY]["param_groups"][source])
    if len(saved_groups) != len(whole.param_groups):
        raise ResumeLayoutError("the checkpoint's optimizer has other parameter groups: resume with the optimizer settings it was saved with.")
    loaded = {"state": {}, "param_groups": []}
    index = 0
    for group, saved_group in zip(local.param_groups, saved_groups):
        ids = []
        for param in group["params"]:
            entry = targets.get(by_id[id(param)])
            if entry is not None:
                loaded["state"][index] = {k: _as_held(v, param) if isinstance(v, DTensor) else v for k, v in entry.items()}
            ids.append(index)
            index += 1
        loaded["param_groups"].append({**saved_group, "params": ids})
    local.load_state_dict(loaded)
    if local is not whole:  # ZeRO-1: the wrapper's groups carry the hyper-parameters too
        for group, saved_group in zip(whole.param_groups, saved_groups):
            group.update(saved_group)
        whole.holds_state = True


def _as_held(loaded, param: torch.Tensor) -> torch.Tensor:
    """A loaded per-element state tensor (a DTensor over the checkpoint's mesh) as the optimizer holds it for
    ``param``: this rank's local tensor, or under FSDP2 a DTensor with the parameter's own mesh and placements."""
    from torch.distributed.tensor import DTensor

    local = loaded.to_local()
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())


def sharded_over_data_parallel(optimizer) -> ZeroRedundancyOptimizer | None:
    """The ``ZeroRedundancyOptimizer`` inside ``optimizer`` (as it is, or wrapped by accelerate), else ``None``."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, ZeroRedundancyOptimizer) else None


__all__ = ["OPTIMIZER_KEY", "optimizer_state", "load_optimizer_state", "sharded_over_data_parallel"]
