"""Training checkpoints: what each rank writes, complete-or-absent folders, and the run's claim on ``output_dir``.

A checkpoint folder ``checkpoint-<step>`` holds

* the model as the canonical, unsharded ``model.safetensors`` + ``config.json`` + tokenizer (loadable with
  ``from_pretrained`` at any TP size; written by global rank 0 after a TP all-gather);
* the optimizer: without DeepSpeed, one file per (pipeline rank, TP rank) over that pipeline rank's parameters
  (:func:`optimizer_file_name`: ``optimizer.pt`` at pp 1 x tp 1, ``optimizer_tp<rank>.pt`` at pp 1,
  ``optimizer_pp<rank>_tp<rank>.pt`` under PP; DP ranks hold identical copies, or ZeRO-1 shares consolidated
  first, and DP rank 0 writes); with DeepSpeed, its own ``global_step<N>/`` folder (ZeRO partitions per DP rank
  and TP rank);
* ``scheduler.pt``, ``rng_state_<rank>.pth`` (every rank) and ``trainer_state.json`` (step, epoch, logs:
  the data position follows from the step and the seeded sampler);
* ``training_layout.json``: PP x TP x DP sizes, ZeRO stage, global batch and, per pipeline rank, the optimizer's
  parameters (canonical names) with their sharding, which lets a run at another layout reshard the optimizer state
  (:mod:`boost_hf.training.resume`);
* ``manifest.json``, written last by rank 0 once every rank has written (:mod:`boost_hf.checkpoint_integrity`):
  size and SHA-256 of every file and the model's architecture record. A folder without it is incomplete;
  resuming verifies it.

Every checkpoint and the ``final`` model are written by :func:`atomic_directory`: into a staging folder unique to
the run (``.checkpoint-<step>.tmp-<run id>``), then its manifest, then one rename to the final name; the trainer
rotates old checkpoints out (``--save_total_limit``) only after that. A folder named ``checkpoint-<step>`` is
therefore always complete, and a complete checkpoint exists at every moment. If a save fails (disk full, I/O
error) the staging folder is removed, the earlier folders are untouched, and :class:`CheckpointWriteError` says
what happened (and how much space is left). Staging folders left by a killed run are removed when the next run
takes the output folder's lock (:func:`remove_stale_staging`; the lock is :mod:`boost_hf.training.output_lock`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil

import torch.distributed as dist
from transformers.trainer import OPTIMIZER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoint_integrity import MANIFEST_NAME, CheckpointIntegrityError, verify_checkpoint, write_manifest

LOW_SPACE_BYTES = 1 << 20
"""A failed write with less free space than this on the target's file system is reported as a full disk."""
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class CheckpointWriteError(OSError):
    """A checkpoint or the final model could not be written (disk full or another I/O error). Its text is the message
    alone (no ``[Errno N]`` prefix); ``errno`` stays readable."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def optimizer_file_name(tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The optimizer state file of one TP rank (``transformers``' own name at tp_size 1), and of one pipeline rank
    under pipeline parallelism (``optimizer_pp<rank>_tp<rank>.pt``)."""
    if pp_size > 1:
        return f"optimizer_pp{pp_rank:02d}_tp{tp_rank:02d}.pt"
    return OPTIMIZER_NAME if tp_size == 1 else f"optimizer_tp{tp_rank:02d}.pt"


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


_DISK_FULL_MESSAGES = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
"""How a full disk reads in errors that are not ``OSError`` (safetensors' ``SafetensorError: ... os error 28``)."""


def _is_disk_full(error: BaseException) -> bool:
    return getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or any(m in str(error).lower() for m in _DISK_FULL_MESSAGES)


_WRITE_FAILED_MESSAGES = ("unexpected pos", "pytorchstreamwriter failed", "iostream error", "file write failed")
"""How ``torch.save`` reports a write that failed (its zip writer checks positions, not ``errno``)."""
_PEER_GONE_MESSAGES = ("connection closed by peer", "connection reset by peer")
"""A collective of the save broke because another rank stopped (gloo's words)."""


def _is_io_error(error: BaseException, free_bytes: int) -> bool:
    text = str(error).lower()
    return (isinstance(error, OSError) or _is_disk_full(error) or free_bytes < LOW_SPACE_BYTES
            or any(m in text for m in _WRITE_FAILED_MESSAGES + _PEER_GONE_MESSAGES))


def _write_error_cause(error: BaseException, free: int) -> tuple[str, str]:
    """``(cause, fix)`` of a failed save, for :class:`CheckpointWriteError`."""
    text = str(error).lower()
    if _is_disk_full(error) or free < LOW_SPACE_BYTES:
        return f"no space left on device ({free / 2**20:.1f} MiB free)", "free space or point output_dir to a larger disk"
    if any(m in text for m in _PEER_GONE_MESSAGES):
        return ("another rank stopped while saving (this rank's collective lost it); that rank's error names the cause "
                "(a full disk, an I/O error)"), "see the first failing rank's error"
    if any(m in text for m in _WRITE_FAILED_MESSAGES):
        return (f"a write failed ({type(error).__name__}: {error}), {free / 2**20:.1f} MiB free now (a full disk is the "
                "usual cause: other ranks may have removed their partial files since)"), \
            "free space or point output_dir to a larger disk, or check the file system"
    return f"I/O error ({type(error).__name__}: {error})", "check the file system"


@contextlib.contextmanager
def _removed_on_error(target: str, partial: str | None, previous: str | None = None):
    """On an exception in the block: remove ``partial``, move ``previous`` back to ``target``, and re-raise an I/O
    error (or any error on a nearly full disk) as :class:`CheckpointWriteError` naming the cause."""
    try:
        yield
    except BaseException as error:
        parent = os.path.dirname(os.path.abspath(target))
        free = shutil.disk_usage(parent).free if os.path.isdir(parent) else LOW_SPACE_BYTES
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if previous is not None and os.path.exists(previous):
            os.replace(previous, target)
        if not _is_io_error(error, free) or isinstance(error, CheckpointWriteError):
            raise
        cause, fix = _write_error_cause(error, free)
        raise CheckpointWriteError(
            getattr(error, "errno", None) or (errno.ENOSPC if cause.startswith("no space") else errno.EIO),
            f"could not save {target!r}: {cause}; {fix}. The partial folder was removed; earlier checkpoints are intact.",
        ) from error


@contextlib.contextmanager
def atomic_directory(target: str, *, is_writer: bool, run_id: str, config=None):
    """Collective (all ranks): yield a staging folder to write into; on success it becomes ``target``.

    The staging folder ``.<name>.tmp-<run_id>`` is unique to the run. ``is_writer`` (one rank) creates it, writes
    its manifest (with ``config``'s architecture record) after every rank wrote, and renames it; an existing
    ``target`` is replaced (moved aside first, so a crash never leaves a half-written folder under that name).
    """
    parent, name = os.path.split(os.path.abspath(target))
    staging = os.path.join(parent, f".{name}.tmp-{run_id}")
    with _removed_on_error(target, staging if is_writer else None):
        if is_writer:
            os.makedirs(staging)
        _barrier()
        yield staging
        _barrier()
        if is_writer:
            write_manifest(staging, config)
    if is_writer:
        previous = os.path.join(parent, f".{name}.old-{run_id}")
        if os.path.exists(target):
            os.replace(target, previous)
        os.replace(staging, target)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()


_STAGING = re.compile(rf"^\.({PREFIX_CHECKPOINT_DIR}-\d+|final)\.(tmp|old)-(.+)$")


def remove_stale_staging(output_dir: str, run_id: str) -> list[str]:
    """Delete the staging folders of earlier runs in ``output_dir`` (left by a run killed while saving); return their
    names. Call while holding the output folder's lock (no other run writes there)."""
    stale = [n for n in os.listdir(output_dir) if (m := _STAGING.match(n)) and m.group(3) != run_id]
    for name in stale:
        shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    return stale


def verify_checkpoint_once(folder: str, config) -> None:
    """Collective when launched: global rank 0 checks every file of ``folder`` against its manifest (size and SHA-256,
    each file read once, by one process) and its architecture record against ``config``; every rank raises the same
    :class:`~boost_hf.checkpoint_integrity.CheckpointIntegrityError`. A damaged ``checkpoint-<step>`` names the
    previous complete checkpoint of its run to resume from instead."""
    launched = dist.is_available() and dist.is_initialized()
    error = [None]
    if not launched or dist.get_rank() == 0:
        try:
            verify_checkpoint(folder, config)
        except CheckpointIntegrityError as failure:
            error[0] = str(failure)
            match = _CHECKPOINT.match(os.path.basename(os.path.normpath(folder)))
            earlier = [c for c in completed_checkpoints(os.path.dirname(os.path.abspath(folder)))
                       if match and int(_CHECKPOINT.match(os.path.basename(c)).group(1)) < int(match.group(1))]
            if earlier:
                error[0] += (f" The previous complete checkpoint of this run is {earlier[-1]!r}: resume from it with "
                             f"--resume_from_checkpoint {earlier[-1]}.")
    if launched:
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointIntegrityError(error[0])


def completed_checkpoints(run_dir: str) -> list[str]:
    """``checkpoint-<step>`` folders of ``run_dir`` that have a manifest, oldest step first."""
    if not os.path.isdir(run_dir):
        return []
    found = [(int(m.group(1)), m.group(0)) for m in map(_CHECKPOINT.match, os.listdir(run_dir)) if m]
    return [os.path.join(run_dir, name) for _, name in sorted(found) if os.path.isfile(os.path.join(run_dir, name, MANIFEST_NAME))]


def check_fresh_output_dir(output_dir: str, overwrite: bool) -> None:
    """A new (not resumed) run must not silently overwrite an earlier run's checkpoints or final model."""
    if overwrite or not os.path.isdir(output_dir):
        return
    earlier = sorted(n for n in os.listdir(output_dir) if _CHECKPOINT.match(n) or n == "final")
    if earlier:
        raise FileExistsError(
            f"output_dir {output_dir!r} already holds a run ({', '.join(earlier[:4])}): resume it with "
            "--resume_from_checkpoint last, pass --overwrite_output_dir true to replace it, or choose another output_dir."
        )


def remove_earlier_run(output_dir: str) -> None:
    """Delete the checkpoints and final model of an earlier run (``--overwrite_output_dir``)."""
    for name in os.listdir(output_dir):
        if _CHECKPOINT.match(name) or name == "final":
            shutil.rmtree(os.path.join(output_dir, name))


@contextlib.contextmanager
def full_parameters(model, zero_stage: int | None):
    """Under ZeRO-3, gather this rank's (TP-local) parameters from the DP group for the block; else nothing."""
    if zero_stage != 3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        yield


__all__ = [
    "CheckpointWriteError",
    "optimizer_file_name",
    "atomic_directory",
    "completed_checkpoints",
    "verify_checkpoint_once",
    "remove_stale_staging",
    "check_fresh_output_dir",
    "remove_earlier_run",
    "full_parameters",
]
