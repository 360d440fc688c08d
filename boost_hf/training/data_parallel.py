"""What data parallelism a run applies to each part of its model, from its arguments: FSDP2's settings
(:func:`fully_shard_settings`, ``None`` under DDP, its masters or DeepSpeed) and the bytes one rank moves over the DP
group per optimizer step (:func:`data_parallel_bytes`, logged by :class:`~boost_hf.training.metrics.TrainingMetrics`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..data_parallel_config import DataParallelConfig
from ..parallel.fully_shard import FullyShard, units_of
from ..parallel.state import ParallelState, data_parallel_mesh
from ..perf.comm_formula import fully_shard_communication


def fully_shard_settings(args, state: ParallelState, precision) -> FullyShard | None:
    """FSDP2's settings under ``--data_parallel fsdp2`` with more than one DP rank (else ``None``): the DP mesh
    (HSDP's with ``--dp_replicate_size``; collective the first time), the reshard policy and units, and ``precision``'s
    dtypes (``bf16_params``: gathered in bf16, reduced in its reduce dtype; the sharded parameters are the fp32
    masters)."""
    settings = DataParallelConfig.of(args)
    if not settings.fully_sharded or state.dp_group is None:
        return None
    casts = precision.owner == "fsdp2"
    return FullyShard(mesh=data_parallel_mesh(state, settings.dp_replicate_size),
                      reshard_after_forward=settings.fsdp_reshard_after_forward,
                      layers_apart=settings.fsdp_units == "decoder_layers",
                      param_dtype=precision.param_dtype if casts else None,
                      reduce_dtype=precision.grad_reduce_dtype if casts else None)


def data_parallel_bytes(model, parts, state: ParallelState, precision, how: FullyShard | None,
                        micro_batches: int) -> tuple[int, int | None]:
    """``(gradient bytes, parameter bytes)`` this rank moves over DP per optimizer step of ``micro_batches``: the
    trainable gradients of ``model`` in ``precision``'s reduce dtype (0 at dp 1); under FSDP2 (``how``) the
    reduce-scatters (and HSDP's all-reduces) and the all-gathers of
    :func:`~boost_hf.perf.comm_formula.fully_shard_communication` over the units of every part of ``parts`` (parameter
    bytes ``None`` without FSDP2, or where the formula does not model it: a unit resharding after forward under
    pipeline parallelism gathers as the schedule interleaves; the reductions, once per step, do not depend on it)."""
    if how is None:
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return (0 if state.dp_size == 1 else trained * precision.grad_reduce_dtype.itemsize), None
    pipeline = state.pp_size > 1
    units = [unit for part in parts for unit in units_of(part, dataclasses.replace(how, pipeline=pipeline))]
    modelled = not (pipeline and any(unit.reshards_after_forward for unit in units))
    if not modelled:
        units = [dataclasses.replace(unit, reshards_after_forward=False) for unit in units]
    traffic = fully_shard_communication(
        units, how.shard_size, how.replicate_size, pipeline=pipeline, micro_batches=micro_batches,
        param_bytes=(how.param_dtype or torch.float32).itemsize, reduce_bytes=precision.grad_reduce_dtype.itemsize)
    gathered = traffic.bytes.get("all_gather", 0)
    return sum(traffic.bytes.values()) - gathered, gathered if modelled else None


__all__ = ["data_parallel_bytes", "fully_shard_settings"]
