"""A parallel model's parameters as DTensors for ``torch.distributed.checkpoint`` (DCP): every rank saves the
shards it holds, in parallel, and loads its own shards of a checkpoint saved at any pipeline x TP x DP layout.

Only at save and load time (training keeps plain tensors described by their
:class:`~boost_hf.parallel.sharding.ShardSpec`): a parameter's local tensor becomes
``DTensor.from_local(local, mesh, placements)`` over the ``("dp", "tp")`` mesh of this rank's pipeline stage(s):
``Replicate()`` over DP, and ``Shard(partition_dim)`` over TP for a sharded parameter (``Replicate()`` otherwise).
No copy: the DTensor wraps the parameter's own storage, so a load writes into the parameters in place.

Names are canonical (``model.layers.{i}....``, the single-device model's), so a pipeline rank's entries are the
parameters it holds and the checkpoint is the same whatever the layout. DCP's save planner writes each chunk of
the global tensor once, by one of the ranks holding it (the DP replicas and the TP ranks of a replicated
parameter are deduplicated, the writes balanced over them by size); its load planner reads, on each rank, only
the byte ranges overlapping this rank's shards (resharding: another TP size, other layers per pipeline rank).

:func:`model_state` is the one place a save reads the parameters (and :func:`load_model_state` the one place a load
writes them).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.sharding import ShardSpec, shard_spec_of
from ..parallel.state import ParallelState, tp_and_data_parallel_mesh

MODEL_KEY = "model"
"""Top-level key of the model's parameters in a DCP state dict (entries ``model.<canonical name>``)."""
DCP_FOLDER = "dcp"
"""Sub-folder of a training checkpoint holding the model (and optimizer) shards as a ``torch.distributed.checkpoint``."""


def is_distributed_checkpoint(folder: str) -> bool:
    """Whether ``folder`` is a training checkpoint holding its model as a ``torch.distributed.checkpoint`` in
    ``dcp/`` (checkpoints of boost-hf 0.x hold a ``model.safetensors`` and optimizer files per PP and TP rank)."""
    return os.path.isfile(os.path.join(folder, DCP_FOLDER, ".metadata"))


def parallel_state_of(model: nn.Module) -> ParallelState:
    """The model's :class:`ParallelState` (one process: the default, no mesh)."""
    plan = getattr(model, "plan", None)
    return plan.state if plan is not None else ParallelState()


def parameter_mesh(state: ParallelState):
    """The ``("dp", "tp")`` mesh of this rank's pipeline rank (``None`` in one process without ``torch.distributed``)."""
    if state.mesh is None:
        return None
    return state.mesh["dp", "tp"] if state.pp_size > 1 else state.mesh


def as_dtensor(local: torch.Tensor, spec: ShardSpec, state: ParallelState) -> torch.Tensor:
    """``local`` (this rank's shard, as ``spec`` describes it) as a DTensor over :func:`parameter_mesh`: replicated
    over DP, split along ``spec.partition_dim`` over TP when sharded. Shares ``local``'s storage. Without a mesh
    (one process) ``local`` itself.

    Under FSDP2 (``--data_parallel fsdp2``) ``local`` is a DTensor over the DP mesh holding this rank's dim-0 shard of
    its TP shard: it becomes the canonical tensor over ``("tp", "dp_shard")`` (HSDP: ``("tp", "dp_replicate",
    "dp_shard")``, :func:`~boost_hf.parallel.state.tp_and_data_parallel_mesh`), split over TP as above, then each TP
    shard's dim 0 over the DP shards (replicated over HSDP's replicas); at tp 1 the DP mesh's DTensor is that already.
    DCP then writes each DP shard once and reads, at any other layout (with or without FSDP2, ZeRO-1), the byte ranges
    a rank needs."""
    mesh = parameter_mesh(state)
    if mesh is None:
        return local
    from torch.distributed.tensor import DTensor, Replicate, Shard

    over_tp = Shard(spec.partition_dim) if spec.is_sharded else Replicate()
    if isinstance(local, DTensor):  # FSDP2's shard
        if state.tp_size == 1:
            return local
        mesh, placements, local = tp_and_data_parallel_mesh(state, local.device_mesh), [over_tp, *local.placements], local.to_local()
    else:
        placements = [Replicate(), over_tp]
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size(spec.full_shape), stride=_contiguous_stride(spec.full_shape))


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{canonical name: this rank's shard as a DTensor}`` of every parameter this rank holds (tied parameters
    once, under their first name). No copy, no communication. The one place a checkpoint reads the parameters."""
    state = parallel_state_of(model)
    return {name: as_dtensor(param.detach(), shard_spec_of(param), state) for name, param in model.named_parameters()}


def dcp_metadata(folder: str):
    """The ``.metadata`` of the DCP checkpoint in ``folder`` (``FileNotFoundError`` naming it when absent)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise FileNotFoundError(f"{folder!r} holds no torch.distributed.checkpoint (.metadata is missing).")
    return FileSystemReader(folder).read_metadata()


def saved_tensors(metadata, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (global shape, dtype)}`` of the tensors saved under ``<prefix>.<name>``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    start = len(prefix) + 1
    return {key[start:]: (tuple(entry.size), entry.properties.dtype) for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(prefix + ".") and isinstance(entry, TensorStorageMetadata)}


def check_saved_parameters(model: nn.Module, saved: dict[str, tuple], folder: str) -> None:
    """Raise ``ValueError`` naming missing, unexpected (held by no pipeline rank of this run) or wrongly-shaped
    parameters of ``saved`` (:func:`saved_tensors`) against ``model``, before any parameter is modified."""
    params = dict(model.named_parameters())
    pipeline = getattr(model, "pipeline", None)
    elsewhere = pipeline.placement.absent if pipeline is not None else frozenset()
    missing = [name for name in params if name not in saved]
    unexpected = sorted(set(saved) - set(params) - set(elsewhere))
    wrong = [f"{name}: checkpoint {saved[name][0]} vs model {shard_spec_of(p).full_shape}"
             for name, p in params.items() if name in saved and saved[name][0] != shard_spec_of(p).full_shape]
    if missing or unexpected or wrong:
        parts = [f"{kind} {names[:5]}{'...' if len(names) > 5 else ''}"
                 for kind, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", wrong)) if names]
        raise ValueError(
            f"the checkpoint {folder!r} does not match this model's architecture (was it saved from another bottleneck, "
            f"rank or size? load it with its own config.json): {'; '.join(parts)}"
        )


@contextlib.contextmanager
def quiet_single_process_warning():
    """Silence DCP's warning that a save or load without ``torch.distributed`` is one process's (it is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@torch.no_grad()
def load_model_state(model: nn.Module, folder: str, process_group=None) -> None:
    """Copy this rank's shard of every parameter from the DCP checkpoint in ``folder`` (saved at any layout) into
    ``model``, in place; reads only the byte ranges of this rank's shards. Checks names and shapes first
    (:func:`check_saved_parameters`). Collective when ``torch.distributed`` is initialised."""
    import torch.distributed.checkpoint as dcp

    check_saved_parameters(model, saved_tensors(dcp_metadata(folder), MODEL_KEY), folder)
    with quiet_single_process_warning():
        dcp.load({MODEL_KEY: model_state(model)}, checkpoint_id=folder, process_group=process_group,
                 no_dist=not (dist.is_available() and dist.is_initialized()))


__all__ = [
    "DCP_FOLDER",
    "MODEL_KEY",
    "is_distributed_checkpoint",
    "as_dtensor",
    "check_saved_parameters",
    "dcp_metadata",
    "load_model_state",
    "model_state",
    "parallel_state_of",
    "parameter_mesh",
    "quiet_single_process_warning",
    "saved_tensors",
]
