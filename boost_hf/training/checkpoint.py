"""Training checkpoints: what each rank writes, and atomic publication of the folder.

A checkpoint folder ``checkpoint-<step>`` holds

* the model as the canonical, unsharded ``model.safetensors`` + ``config.json`` + tokenizer (loadable with
  ``from_pretrained`` at any TP size; written by global rank 0 after a TP all-gather);
* the optimizer: without DeepSpeed, one file per TP rank (``optimizer.pt`` at tp_size 1,
  ``optimizer_tp<rank>.pt`` otherwise; DP ranks hold identical copies, DP rank 0 writes); with
  DeepSpeed, its own ``global_step<N>/`` folder (ZeRO partitions per DP rank and TP rank);
* ``scheduler.pt``, ``rng_state_<rank>.pth`` (every rank) and ``trainer_state.json`` (step, epoch, logs:
  the data position follows from the step and the seeded sampler).

All ranks write into a hidden staging folder ``.checkpoint-<step>.tmp``; after a barrier, rank 0 renames
it to ``checkpoint-<step>``. A crash mid-save leaves only the staging folder, which ``--resume_from_checkpoint``
(``transformers.trainer_utils.get_last_checkpoint``) and checkpoint rotation ignore.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import torch.distributed as dist
from transformers.trainer import OPTIMIZER_NAME


def optimizer_file_name(tp_rank: int, tp_size: int) -> str:
    """The optimizer state file of one TP rank (``transformers``' own name at tp_size 1)."""
    return OPTIMIZER_NAME if tp_size == 1 else f"optimizer_tp{tp_rank:02d}.pt"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def atomic_directory(target: str, *, is_writer: bool):
    """Collective (all ranks): yield a staging folder to write into; on success it becomes ``target``.

    ``is_writer`` (one rank) creates the staging folder and renames it. An existing ``target`` is replaced
    (moved aside first, so that a crash never leaves a half-written folder under the final name).
    """
    parent, name = os.path.split(os.path.abspath(target))
    staging = os.path.join(parent, f".{name}.tmp")
    if is_writer:
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
    _barrier()
    yield staging
    _barrier()
    if is_writer:
        previous = os.path.join(parent, f".{name}.old")
        if os.path.exists(target):
            shutil.rmtree(previous, ignore_errors=True)
            os.replace(target, previous)
        os.replace(staging, target)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()


@contextlib.contextmanager
def full_parameters(model, zero_stage: int | None):
    """Under ZeRO-3, gather this rank's (TP-local) parameters from the DP group for the block; else nothing."""
    if zero_stage != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        yield


__all__ = ["optimizer_file_name", "atomic_directory", "full_parameters"]
