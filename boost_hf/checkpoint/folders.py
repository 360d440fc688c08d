"""Training checkpoints: what each rank writes, complete-or-absent folders, and the run's claim on ``output_dir``.

A checkpoint folder ``checkpoint-<step>`` holds

* ``dcp/``: the model's parameters and the optimizer's state as a ``torch.distributed.checkpoint`` (DCP): every
  rank writes the shards it holds, in parallel, into its own files ``__<rank>_<n>.distcp`` (DP replicas and TP
  copies of a replicated tensor written once; :mod:`boost_hf.checkpoint.sharded_state`,
  :mod:`boost_hf.checkpoint.optimizer_state`), global rank 0 the small ``.metadata``; under DeepSpeed the model only,
  the optimizer in DeepSpeed's own ``global_step<N>/`` folder (ZeRO partitions per DP and TP rank);
* ``config.json``, ``generation_config.json``, the remote code, the tokenizer and ``README.md`` (the model card): the
  Hugging Face folder without its weights, which :func:`~boost_hf.training.publish.export_checkpoint` (``boost-hf
  export``) turns into one, streaming the weights out of ``dcp/``;
* ``scheduler.pt``, ``rng_state_<rank>.pth`` (every rank), ``trainer_state.json``, ``training_args.bin`` and any
  other file the trainer writes into the folder;
* ``training_layout.json``: PP x TP x DP sizes, ZeRO stage, global batch and, per pipeline rank, the optimizer's
  parameters (canonical names) and groups (:mod:`boost_hf.checkpoint.resume`);
* ``manifest.json``, written last by global rank 0 once every rank has written
  (:mod:`boost_hf.checkpoint.integrity`): size and SHA-256 of every file and the model's architecture record. Each
  rank hashes its share of the files (those it wrote itself, then the others balanced by size) and the digests are
  gathered: no rank reads every file. A folder without it is incomplete; resuming verifies it, each rank its share
  (:func:`verify_checkpoint_once`).

Every checkpoint and the ``final`` model are written into a staging folder unique to the run
(``.checkpoint-<step>.tmp-<run id>``), then its manifest, then one rename to the final name; the trainer rotates
old checkpoints out (``--save_total_limit``) only after that. A folder named ``checkpoint-<step>`` is therefore
always complete, and a complete checkpoint exists at every moment. :class:`CheckpointSaver` does this at once
(``--save_async false``) or with the writes in the background (``--save_async true``: the tensors are copied to
host memory, training goes on, a thread writes ``dcp/``, hashes, gathers the digests, writes the manifest and
renames; the next save, the final model and the end of ``train`` wait for it). If a save fails (disk full, I/O
error) the staging folder is removed, the earlier folders are untouched, and :class:`CheckpointWriteError` says
what happened (and how much space is left). Staging folders left by a killed run are removed when the next run
takes the output folder's lock, and a folder it had moved aside to replace is moved back if the new one never got
its name (:func:`remove_stale_staging`; the lock, which keeps a second run out of an ``output_dir`` in use, is
:mod:`boost_hf.checkpoint.lock`).

The folders must be on a file system every rank reads and writes at the same path (shared by all nodes): global
rank 0 writes ``.metadata``, the manifest and the rename, and a resume at another layout reads other ranks' files.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import os
import re
import shutil
import threading

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import AsyncStager
from transformers.trainer import OPTIMIZER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .integrity import (
    CheckpointIntegrityError,
    check_architecture,
    check_files,
    file_digests,
    file_sizes,
    hashing_shares,
    read_manifest,
    write_manifest,
)

from .decisions import decided_on_rank_zero, on_every_rank
from .lineage import RECORD_NAME, checkpoint_step, finished_step, is_abandoned, record_checkpoint
from .sharded_state import DCP_FOLDER, is_distributed_checkpoint, quiet_single_process_warning

logger = logging.getLogger(__name__)

LOW_SPACE_BYTES = 1 << 20
"""A failed write with less free space than this on the target's file system is reported as a full disk."""


class CheckpointWriteError(OSError):
    """A checkpoint or the final model could not be written (disk full or another I/O error). Its text is the message
    alone (no ``[Errno N]`` prefix); ``errno`` stays readable."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def optimizer_file_name(tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """The optimizer state file of one TP rank in checkpoints of boost-hf 0.x (before distributed checkpoints):
    ``transformers``' own name at tp_size 1, ``optimizer_tp<rank>.pt``, under PP ``optimizer_pp<rank>_tp<rank>.pt``."""
    if pp_size > 1:
        return f"optimizer_pp{pp_rank:02d}_tp{tp_rank:02d}.pt"
    return OPTIMIZER_NAME if tp_size == 1 else f"optimizer_tp{tp_rank:02d}.pt"


def _launched() -> bool:
    return dist.is_available() and dist.is_initialized()


_DISK_FULL_MESSAGES = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")
"""How a full disk reads in errors that are not ``OSError`` (safetensors' ``SafetensorError: ... os error 28``)."""


def _cause(error: BaseException) -> BaseException:
    """The error of the first failing rank inside DCP's ``CheckpointException``, else ``error``."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return next(iter(failures.values()))[0]
    return error


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


def _write_error(target: str, raised: BaseException) -> BaseException:
    """What a failed save of ``target`` raises for ``raised``: an I/O error (or any error on a nearly full disk) as
    :class:`CheckpointWriteError` naming the cause, measured now (before the partial folder goes: the space it takes
    counts); another error, or one already a :class:`CheckpointWriteError`, as it is."""
    error = _cause(raised)
    parent = os.path.dirname(os.path.abspath(target))
    free = shutil.disk_usage(parent).free if os.path.isdir(parent) else LOW_SPACE_BYTES
    if isinstance(error, CheckpointWriteError) or not _is_io_error(error, free):
        return raised
    cause, fix = _write_error_cause(error, free)
    return CheckpointWriteError(
        getattr(error, "errno", None) or (errno.ENOSPC if cause.startswith("no space") else errno.EIO),
        f"could not save {target!r}: {cause}; {fix}. The partial folder was removed; earlier checkpoints are intact.",
    )


@contextlib.contextmanager
def _removed_on_error(target: str, partial: str | None):
    """On an exception in the block: remove ``partial`` and re-raise it as :func:`_write_error` says."""
    try:
        yield
    except BaseException as raised:
        error = _write_error(target, raised)
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if error is raised:
            raise
        raise error from _cause(raised)


def _staging_path(target: str, run_id: str, kind: str = "tmp") -> str:
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".{name}.{kind}-{run_id}")


def _every_rank(work, group=None, target: str | None = None) -> list:
    """:func:`~boost_hf.checkpoint.decisions.on_every_rank` for a phase of the save of ``target``: ``work()`` on every
    rank of ``group``, its error made what a failed save raises (:func:`_write_error`: the cause named where it
    happened), then the outcomes shared, so an error of one rank (the writer's full disk, a failed rename) is raised
    on every rank before the next collective (a :class:`CheckpointWriteError` as itself, "(on rank 0)")."""

    def phase():
        try:
            return work()
        except Exception as raised:  # noqa: BLE001 (raised again, as a failed save raises it)
            error = _write_error(target, raised) if target is not None else raised
            if error is raised:
                raise
            raise error from _cause(raised)

    return on_every_rank(phase, group, kinds=(CheckpointWriteError, CheckpointIntegrityError))


def _gathered_digests(staging: str, group=None, target: str | None = None) -> dict | None:
    """Collective over ``group`` (all ranks): each rank hashes its share of ``staging``'s files
    (:func:`~boost_hf.checkpoint.integrity.hashing_shares`: what it wrote, then the rest balanced by size) and the
    digests are shared, for the manifest; ``None`` in one process (the manifest hashes every file itself). The
    listing is global rank 0's (every file written); an error of any rank is raised on every rank."""
    if not _launched():
        return None
    sizes = decided_on_rank_zero(lambda: file_sizes(staging), group, kinds=(CheckpointIntegrityError,))
    share = hashing_shares(sizes, dist.get_world_size(group))[dist.get_rank(group)]
    parts = _every_rank(lambda: file_digests(staging, share), group, target)
    return {name: entry for part in parts for name, entry in part.items()}


def _commit(target: str, staging: str, *, is_writer: bool, run_id: str, config, files: dict | None, group=None,
            record: bool = False, after_commit=None) -> None:
    """Collective over ``group``: the writer writes ``staging``'s manifest (``files``: the gathered digests), records
    ``target`` as the lineage's last checkpoint (``record``), renames ``staging`` to ``target`` (:func:`_replace`) and
    runs ``after_commit()`` (e.g. the rotation of old checkpoints); its error, if any, is raised on every rank (the
    staging folder removed, the earlier folders intact)."""

    def commit() -> None:
        if not is_writer:
            return
        with _removed_on_error(target, staging):
            write_manifest(staging, config, files=files)
            if record:  # the lineage's last, before its rename (boost_hf.checkpoint.lineage)
                record_checkpoint(os.path.dirname(os.path.abspath(target)), target)
            _replace(target, staging, run_id)
        if after_commit is not None:
            after_commit()

    _every_rank(commit, group)


def _replace(target: str, staging: str, run_id: str) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is moved aside first (``.<name>.old-<run id>``), then
    deleted. If the second rename fails, the old folder is moved back; if the process dies between the renames,
    :func:`remove_stale_staging` moves it back at the next run's start."""
    previous = _staging_path(target, run_id, "old")
    if os.path.exists(target):
        os.replace(target, previous)
    try:
        os.replace(staging, target)
    except BaseException:
        if os.path.exists(previous) and not os.path.exists(target):
            os.replace(previous, target)
        raise
    shutil.rmtree(previous, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(target: str, *, is_writer: bool, run_id: str, config=None, group=None):
    """Collective (all ranks of ``group``, default every rank): yield a staging folder to write into; on success it
    becomes ``target``.

    The staging folder ``.<name>.tmp-<run_id>`` is unique to the run. ``is_writer`` (global rank 0) creates it; after
    every rank wrote, the ranks hash their shares of the files and global rank 0 writes the manifest (with
    ``config``'s architecture record) and renames the folder; an existing ``target`` is replaced (moved aside first, so
    a crash never leaves a half-written folder under that name). Each phase ends with the ranks' outcomes shared
    (:func:`_every_rank`): an error of one rank, in the block too, is raised on every rank.
    """
    staging = _staging_path(target, run_id)
    with _removed_on_error(target, staging if is_writer else None):
        _every_rank(lambda: os.makedirs(staging) if is_writer else None, group, target)
        failed = None
        try:
            yield staging
        except Exception as error:  # noqa: BLE001 (raised on every rank by the agreement below)
            failed = error

        def wrote() -> None:
            if failed is not None:
                raise failed

        _every_rank(wrote, group, target)
        files = _gathered_digests(staging, group, target)
    _commit(target, staging, is_writer=is_writer, run_id=run_id, config=config, files=files, group=group)


def host_copy(state):
    """A copy of the (nested) DCP state dict ``state`` in host memory that later training steps cannot change: every
    tensor's own elements copied (a view of a larger buffer becomes a tensor of its own size), a DTensor re-wrapped
    with its placements; other values deep-copied."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {key: host_copy(value) for key, value in state.items()}
    if isinstance(state, DTensor):
        return DTensor.from_local(state.to_local().detach().to("cpu", copy=True), state.device_mesh, state.placements,
                                  run_check=False, shape=state.shape, stride=state.stride())
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    return copy.deepcopy(state)


class HostCopyStager(AsyncStager):
    """``dcp.async_save``'s staging: :func:`host_copy` of the state dict (this rank's own shards, once), made before
    ``async_save`` returns."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return host_copy(state_dict)


class CheckpointSaver:
    """Writes the trainer's checkpoint folders with :func:`atomic_directory`'s guarantees, at once or in the
    background.

    :meth:`save` is collective: the small files are written by the caller into the staging folder, then the DCP state
    dict (the model's and optimizer's shards) into its ``dcp/``. Synchronous: ``dcp.save``, the spread hashing, the
    manifest and the rename before returning. Asynchronous: ``dcp.async_save`` copies this rank's tensors to host
    memory (its own shards only), then a daemon thread waits for the write, hashes, gathers and renames, in a gloo
    group of its own (the training's collectives go on meanwhile); :meth:`wait` joins it and raises its error. A
    crash before the manifest leaves only a staging folder (never a complete-looking checkpoint). Each phase ends with
    the ranks' outcomes shared (:func:`_every_rank`), so a failure on one rank (the writer's full disk while writing
    the small files, a failed rename or rotation) is raised on every rank at once, not left for the others to wait
    out in the next collective until ``--ddp_timeout``."""

    def __init__(self, *, is_writer: bool, run_id: str):
        self.is_writer, self.run_id = is_writer, run_id
        self._group = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _checkpoint_group(self):
        """A gloo group of every rank for the checkpoint's collectives (created once, collectively, at the first
        save; ``None`` in one process)."""
        if self._group is None and _launched() and dist.get_world_size() > 1:
            from ..parallel.state import new_group_with_timeout

            self._group = new_group_with_timeout(list(range(dist.get_world_size())), "the checkpoint group", backend="gloo")
        return self._group

    def save(self, target: str, *, write_files, state_dict: dict, config=None, asynchronous: bool = False, after_commit=None) -> None:
        """Write the checkpoint ``target``: ``write_files(staging)`` (every rank, at once), then ``state_dict`` as a DCP
        checkpoint in ``staging/dcp`` (each rank its entries), the manifest, the rename, then ``after_commit()`` on the
        writer (e.g. the rotation of old checkpoints). Waits for the previous save first."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        self.wait()
        group = self._checkpoint_group()
        staging = _staging_path(target, self.run_id)
        writer = FileSystemWriter(os.path.join(staging, DCP_FOLDER))
        with _removed_on_error(target, staging if self.is_writer else None), quiet_single_process_warning():
            _every_rank(lambda: os.makedirs(staging) if self.is_writer else None, group, target)
            _every_rank(lambda: write_files(staging), group, target)  # the small files: the writer's full disk is every rank's
            if not asynchronous:
                dcp.save(state_dict, storage_writer=writer, process_group=group)  # DCP shares its ranks' errors itself
                files = _gathered_digests(staging, group, target)
            else:
                upload = dcp.async_save(state_dict, storage_writer=writer, process_group=group, async_stager=HostCopyStager())
        if not asynchronous:
            self._commit(target, staging, config, files, after_commit, group)
            return
        self._thread = threading.Thread(target=self._finish, args=(upload, target, staging, config, after_commit, group),
                                        name=f"boost-hf checkpoint {os.path.basename(target)}", daemon=True)
        self._thread.start()

    def _commit(self, target: str, staging: str, config, files, after_commit, group) -> None:
        _commit(target, staging, is_writer=self.is_writer, run_id=self.run_id, config=config, files=files, group=group,
                record=True, after_commit=after_commit)

    def _finish(self, upload, target: str, staging: str, config, after_commit, group) -> None:
        """The background half of an asynchronous save (runs in :meth:`save`'s thread)."""
        try:
            with _removed_on_error(target, staging if self.is_writer else None):
                _every_rank(lambda: upload.result() and None, group, target)  # the outcome only (not DCP's metadata)
                files = _gathered_digests(staging, group, target)
            self._commit(target, staging, config, files, after_commit, group)
        except BaseException as error:  # noqa: BLE001 (raised by wait() in the training thread)
            self._error = error

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def wait(self) -> None:
        """Wait for the asynchronous save in flight (if any) to be complete under its final name; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


_STAGING = re.compile(rf"^\.({PREFIX_CHECKPOINT_DIR}-\d+|final|{re.escape(RECORD_NAME)})\.(tmp|old)-(.+)$")


def remove_stale_staging(output_dir: str, run_id: str) -> list[str]:
    """Clean up after earlier runs killed while saving in ``output_dir``: a folder moved aside by :func:`_replace`
    (``.<name>.old-<run id>``) whose ``<name>`` is missing (killed between the two renames) is moved back under its
    name (the newest such folder, with a warning); every other staging folder of an earlier run (and temporary file
    of the lineage's record, :mod:`~boost_hf.checkpoint.lineage`) is deleted. Return the
    names deleted. Call while holding the output folder's lock (no other run writes there)."""
    stale = sorted((m for n in os.listdir(output_dir) if (m := _STAGING.match(n)) and m.group(3) != run_id),
                   key=lambda m: os.path.getmtime(os.path.join(output_dir, m.group(0))), reverse=True)
    for match in stale:
        name, target = match.group(0), os.path.join(output_dir, match.group(1))
        if match.group(2) == "old" and not os.path.exists(target):
            os.replace(os.path.join(output_dir, name), target)
            logger.warning("restored %s from %s: an earlier run was stopped while replacing it (between moving the old "
                           "folder aside and renaming the new one into place)", target, name)
    removed = [m.group(0) for m in stale if os.path.exists(os.path.join(output_dir, m.group(0)))]
    for name in removed:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:  # the record's temporary file
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return removed


def _previous_complete(folder: str) -> str | None:
    """The newest complete checkpoint of ``folder``'s run older than ``folder`` (a ``checkpoint-<step>``), if any."""
    step = checkpoint_step(folder)
    if step is None:
        return None
    earlier = [c for c in completed_checkpoints(os.path.dirname(os.path.abspath(folder))) if checkpoint_step(c) < step]
    return earlier[-1] if earlier else None


def verify_checkpoint_once(folder: str, config) -> None:
    """Collective when launched: ``folder`` checked against its manifest, the work spread over the ranks: every rank
    reads the manifest and checks the architecture record against ``config``, then checks its share of the files
    (size and SHA-256, :func:`~boost_hf.checkpoint.integrity.hashing_shares`: each file read once, by one rank); every
    rank raises the same :class:`~boost_hf.checkpoint.integrity.CheckpointIntegrityError`. A damaged
    ``checkpoint-<step>`` (its manifest included) names the previous complete checkpoint of its run to resume from."""
    problem = None
    try:
        manifest = read_manifest(folder)
        if manifest["architecture"] is not None:
            check_architecture(manifest["architecture"], config)
        sizes = {name: entry["size"] for name, entry in manifest["files"].items()}
        rank, world = (dist.get_rank(), dist.get_world_size()) if _launched() else (0, 1)
        check_files(folder, manifest, hashing_shares(sizes, world)[rank])
    except CheckpointIntegrityError as failure:
        problem = str(failure)
    if _launched():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        earlier = _previous_complete(folder)
        if earlier is not None:
            problem += (f" The previous complete checkpoint of this run is {earlier!r}: resume from it with "
                        f"--resume_from_checkpoint {earlier}.")
        raise CheckpointIntegrityError(problem)


def incomplete_reason(folder: str) -> str | None:
    """Why ``folder`` is not a complete checkpoint without reading its data (no manifest, a damaged manifest, a file
    missing or of another size than recorded), else ``None``."""
    try:
        manifest = read_manifest(folder)
        check_files(folder, manifest, list(manifest["files"]), hashes=False)
    except CheckpointIntegrityError as problem:
        return str(problem)
    return None


def completed_checkpoints(run_dir: str, skipped: list[tuple[str, str]] | None = None) -> list[str]:
    """``checkpoint-<step>`` folders of ``run_dir`` that are complete (a valid manifest, every file present with its
    recorded size; :func:`incomplete_reason`), oldest step first; the others are appended to ``skipped`` as
    ``(folder, reason)``."""
    if not os.path.isdir(run_dir):
        return []
    found = [(step, name) for name in os.listdir(run_dir) if (step := checkpoint_step(name)) is not None]
    complete = []
    for _, name in sorted(found):
        folder = os.path.join(run_dir, name)
        reason = incomplete_reason(folder)
        if reason is None:
            complete.append(folder)
        elif skipped is not None:
            skipped.append((folder, reason))
    return complete


def check_fresh_output_dir(output_dir: str, overwrite: bool) -> None:
    """A new (not resumed) run must not silently overwrite an earlier run's checkpoints or final model; a finished run
    without checkpoints (``--save_strategy no``) has none to continue from: ``--init_from`` trains on from its weights."""
    if overwrite or not os.path.isdir(output_dir):
        return
    earlier = sorted(n for n in os.listdir(output_dir) if checkpoint_step(n) is not None or n == "final")
    if earlier == ["final"]:
        finished = finished_step(output_dir)
        final = os.path.join(output_dir, "final")
        raise FileExistsError(
            f"output_dir {output_dir!r} holds a finished run (final/{f', trained to step {finished}' if finished else ''}) "
            f"and no checkpoint to continue it from (it was saved with --save_strategy no, or its checkpoints were removed): "
            f"train on from its weights with --init_from {final} (a new optimizer and learning-rate schedule) into another "
            "output_dir, pass --overwrite_output_dir true to replace it, or choose another output_dir."
        )
    if earlier:
        raise FileExistsError(
            f"output_dir {output_dir!r} already holds a run ({', '.join(earlier[:4])}): resume it with "
            "--resume_from_checkpoint last, pass --overwrite_output_dir true to replace it, or choose another output_dir."
        )


def remove_earlier_run(output_dir: str) -> None:
    """Delete the checkpoints (those set aside as another lineage's too), the record of the last one and the final model
    of an earlier run (``--overwrite_output_dir``)."""
    for name in os.listdir(output_dir):
        path = os.path.join(output_dir, name)
        if checkpoint_step(name) is not None or is_abandoned(name) or name == "final":
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(output_dir, RECORD_NAME))


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
    "DCP_FOLDER",
    "CheckpointSaver",
    "CheckpointWriteError",
    "optimizer_file_name",
    "atomic_directory",
    "completed_checkpoints",
    "incomplete_reason",
    "is_distributed_checkpoint",
    "verify_checkpoint_once",
    "remove_stale_staging",
    "check_fresh_output_dir",
    "remove_earlier_run",
    "full_parameters",
]
