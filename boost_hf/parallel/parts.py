"""Parallelism applied to each part of a model, in one place, in torchtitan's order.

A *part* is what one step runs as a unit: the whole model, or one pipeline stage
(:class:`~boost_hf.parallel.pipeline.PipelineChunk`). :func:`prepare_part` takes a part from tensor parallelism and
activation checkpointing (applied when the model was built, :func:`~boost_hf.parallel.parallelize`: the layouts'
decoder layers recompute themselves) through ``torch.compile`` (each decoder layer, in place, and the loss) to data parallelism
(DDP, or FSDP2: :mod:`boost_hf.parallel.fully_shard`);
:func:`data_parallelism` decides which data parallelism a run's parts get. The trainer's step engines
(:mod:`boost_hf.training.engine`) and a pipeline used on its own (:class:`~boost_hf.parallel.pipeline.Pipeline`) both
prepare their parts here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist
from torch import nn

from .compile import compile_model
from .fully_shard import FullyShard, fully_shard_part
from .state import ParallelState

DataParallelism = Literal["ddp", "fsdp2", "none", "accelerate"]


@dataclass(frozen=True)
class PartParallelism:
    """How each part is prepared after tensor parallelism and activation checkpointing.

    ``compile``: ``torch.compile`` arguments for each decoder layer and the loss (``None``: eager). ``context``: what each call of a
    part runs under when the pipeline schedule, not the caller, calls it (the precision policy's autocast; ``None``:
    nothing). ``data_parallel``: ``"ddp"`` (DDP over ``dp_group`` with ``ddp_kwargs``, after ``place``: what puts a
    part on its device first, e.g. accelerate's ``prepare_model`` without DDP), ``"fsdp2"`` (``fully_shard`` as
    ``fully_shard`` says, after ``place``), ``"none"`` or ``"accelerate"`` (accelerate wraps the model itself; see
    :func:`data_parallelism`)."""

    compile: dict | None = None
    context: Callable[[], contextlib.AbstractContextManager] | None = None
    data_parallel: DataParallelism = "none"
    dp_group: dist.ProcessGroup | None = None
    ddp_kwargs: dict = field(default_factory=dict)
    place: Callable[[nn.Module], nn.Module] | None = None
    fully_shard: FullyShard | None = None


def data_parallelism(state: ParallelState, *, masters: bool = False, deepspeed: bool = False, pipeline: bool = False,
                     fully_shard: bool = False) -> DataParallelism:
    """Which data parallelism a run's parts get: ``"accelerate"`` where accelerate prepares the model itself
    (DeepSpeed's engine, which also owns ZeRO; one process; a model that is not split, under DDP over the whole
    world); ``"fsdp2"`` where FSDP2 is asked for (``fully_shard``) and there are DP ranks to shard over; ``"none"``
    where no wrapper reduces the gradients (the fp32 master parameters reduce them over DP, or a split model has one
    DP rank); else ``"ddp"`` over the DP group (never across TP ranks or pipeline stages)."""
    if deepspeed:
        return "accelerate"
    if fully_shard and state.dp_group is not None:
        return "fsdp2"
    if masters:
        return "none"
    if not pipeline and (not state.is_distributed or (state.tp_size == 1 and state.dp_group is not None)):
        return "accelerate"
    return "ddp" if state.dp_group is not None else "none"


class CalledUnder(nn.Module):
    """``module``, each call under ``context()`` (a pipeline stage, which the schedule calls, under the run's
    autocast)."""

    def __init__(self, module: nn.Module, context: Callable[[], contextlib.AbstractContextManager]):
        super().__init__()
        self.module, self.context = module, context

    def forward(self, *args, **kwargs):
        with self.context():
            return self.module(*args, **kwargs)


def prepare_part(part: nn.Module, how: PartParallelism) -> nn.Module:
    """``part`` as its steps run it, in torchtitan's order: 1. tensor parallelism and 2. activation checkpointing (done
    when the model was built); 3. ``torch.compile`` of each decoder layer, in place, and of the loss
    (:func:`~boost_hf.parallel.compile.compile_model`); 4. ``how.context`` around each
    call; 5. data parallelism (``how.data_parallel``: DDP over the DP group, FSDP2 over it, in place, or nothing
    here)."""
    if how.compile is not None:
        compile_model(part, **how.compile)
    if how.context is not None:
        part = CalledUnder(part, how.context)
    if how.data_parallel == "ddp":
        if how.place is not None:
            part = how.place(part)
        part = nn.parallel.DistributedDataParallel(part, process_group=how.dp_group, **how.ddp_kwargs)
    elif how.data_parallel == "fsdp2":
        if how.place is not None:
            part = how.place(part)
        part = fully_shard_part(part, how.fully_shard)
    return part


__all__ = ["CalledUnder", "DataParallelism", "PartParallelism", "data_parallelism", "prepare_part"]
