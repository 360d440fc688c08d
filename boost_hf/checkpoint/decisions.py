"""One decision, broadcast: the choices that lead to collectives, made by global rank 0 and sent to every rank.

A rank that decides from its own view of the file system can disagree with the others: a shared file system's
listing is stale on one node, a checkpoint is renamed while the ranks look. Ranks then resume different checkpoints,
or one rank saves (a collective) while the others do not, and the run hangs or mixes states. As Megatron reads its
tracker file on rank 0 and broadcasts it, these are decided once:

* :func:`decided_on_rank_zero`: ``decide()`` on global rank 0, its result (or its error, raised on every rank with
  the same type and message) on every rank: one ``broadcast_object_list`` of a few bytes;
* :func:`on_every_rank`: work every rank does (a phase of a save), then one ``all_gather_object`` of the outcomes:
  an error on one rank (a full disk, a failed rename) is raised on every rank before the next collective, instead
  of leaving the others waiting in it until ``--ddp_timeout``;
* :func:`resume_checkpoint`: the checkpoint ``--resume_from_checkpoint`` means (``last``/``True``: the last complete
  one of the run's lineage, ``auto``: that or none, a path: itself);
* :func:`checkpoint_is_complete`: whether a checkpoint folder exists complete (a stop request saves one unless it
  does);
* :func:`steps_trained`: the optimizer steps a checkpoint holds (a run resumed at its ``max_steps`` trains no more);
* :func:`final_is_published`: whether a run's ``final/`` is complete (a finished run requeued publishes nothing).

Each is collective when ``torch.distributed`` is initialised with more than one rank (every rank calls it at the
same point), and a plain function call in one process.
"""

from __future__ import annotations

import os

import torch.distributed as dist

_RAISED_AS_THEMSELVES = (FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError, ValueError, TypeError,
                         KeyError, RuntimeError, OSError)
"""Errors raised on every rank with their own type (another: ``RuntimeError`` naming it)."""


def _launched(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _outcome(error: Exception) -> tuple[str, int | None, str]:
    """What another rank needs to raise ``error`` again: its type's name, its ``errno`` and its message."""
    return type(error).__name__, getattr(error, "errno", None) if isinstance(error, OSError) else None, str(error)


def _raised(outcome: tuple[str, int | None, str], where: str, kinds: tuple[type, ...]) -> Exception:
    """The error of :func:`_outcome` ``outcome`` on this rank: its type if one of ``kinds`` or
    :data:`_RAISED_AS_THEMSELVES` (else ``RuntimeError`` naming it), its message followed by ``(where)``, its
    ``errno`` kept."""
    name, number, message = outcome
    kind = next((kind for kind in (*kinds, *_RAISED_AS_THEMSELVES) if kind.__name__ == name), None)
    error = kind(f"{message} ({where})") if kind is not None else RuntimeError(f"{name}: {message} ({where})")
    if number is not None and isinstance(error, OSError):
        error.errno = number
    return error


def decided_on_rank_zero(decide, group=None, kinds: tuple[type, ...] = ()):
    """``decide()`` run on rank 0 of ``group`` (default: every rank) only; its result (picklable) returned on every
    rank. An error of ``decide()`` is raised on every rank: its type if one of ``kinds`` or
    :data:`_RAISED_AS_THEMSELVES` (else ``RuntimeError``), its message followed by "(decided on rank 0)". Collective
    when launched."""
    if not _launched(group):
        return decide()
    outcome = [None, None]  # [result, _outcome of its error]
    if dist.get_rank(group) == 0:
        try:
            outcome[0] = decide()
        except Exception as error:  # noqa: BLE001 (raised on every rank below)
            outcome[1] = _outcome(error)
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if outcome[1] is not None:
        raise _raised(outcome[1], "decided on rank 0", kinds)
    return outcome[0]


def on_every_rank(work, group=None, kinds: tuple[type, ...] = ()) -> list:
    """``work()`` on every rank of ``group`` (default: every rank), then one ``all_gather_object`` of what each
    returned (picklable) or raised: the list of the results, in rank order, on every rank; if ``work()`` failed on any
    rank, every rank raises instead, a failed rank its own error, the others the first failed rank's (its type if one
    of ``kinds`` or :data:`_RAISED_AS_THEMSELVES`, its message followed by "(on rank <global rank>)"). A phase of
    work that one rank may fail (a write, a rename) ends so, before the next collective: no rank waits in it for a
    rank that left. Collective when launched."""
    if not _launched(group):
        return [work()]
    result, error = None, None
    try:
        result = work()
    except Exception as raised:  # noqa: BLE001 (raised on every rank below)
        error = raised
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (result, None if error is None else _outcome(error)), group=group)
    if error is not None:
        raise error
    failed = next(((rank, outcome) for rank, (_, outcome) in enumerate(gathered) if outcome is not None), None)
    if failed is not None:
        rank = dist.get_global_rank(group, failed[0]) if group is not None else failed[0]
        raise _raised(failed[1], f"on rank {rank}", kinds)
    return [value for value, _ in gathered]


def resume_checkpoint(run_dir: str, resume_from_checkpoint: str | bool | None) -> str | None:
    """The checkpoint a run resumes, decided on global rank 0 (:func:`decided_on_rank_zero`): ``True`` or ``"last"``:
    the last complete checkpoint of ``run_dir``'s lineage (``FileNotFoundError`` when there is none,
    :func:`~boost_hf.checkpoint.lineage.last_checkpoint`); ``"auto"``: that, or ``None`` (a new run) when there is
    none; a path: itself (``FileNotFoundError`` if it is no folder); ``None`` / ``False``: ``None``."""
    from .folders import completed_checkpoints
    from .lineage import last_checkpoint

    def decide() -> str | None:
        if resume_from_checkpoint in (None, False, ""):
            return None
        if resume_from_checkpoint == "auto":
            return last_checkpoint(run_dir) if completed_checkpoints(run_dir) else None
        if resume_from_checkpoint is True or resume_from_checkpoint == "last":
            return last_checkpoint(run_dir)
        if not os.path.isdir(resume_from_checkpoint):
            raise FileNotFoundError(f"resume_from_checkpoint: no such file or folder: {resume_from_checkpoint!r}")
        return resume_from_checkpoint

    return decided_on_rank_zero(decide)


def checkpoint_is_complete(folder: str) -> bool:
    """Whether ``folder`` (a ``checkpoint-<step>``) is a complete checkpoint of its run, decided on global rank 0."""
    from .folders import completed_checkpoints

    return decided_on_rank_zero(
        lambda: os.path.abspath(folder) in map(os.path.abspath, completed_checkpoints(os.path.dirname(os.path.abspath(folder)))))


def steps_trained(checkpoint: str) -> int:
    """The optimizer steps ``checkpoint`` was saved after (its ``trainer_state.json``'s ``global_step``), decided on
    global rank 0."""
    import json

    from transformers.trainer import TRAINER_STATE_NAME

    def decide() -> int:
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as f:
            return int(json.load(f)["global_step"])

    return decided_on_rank_zero(decide)


def final_is_published(run_dir: str) -> bool:
    """Whether ``run_dir/final`` is a complete published model (its manifest and every file in it), decided on global
    rank 0."""
    from .folders import incomplete_reason

    final = os.path.join(run_dir, "final")
    return decided_on_rank_zero(lambda: os.path.isdir(final) and incomplete_reason(final) is None)


__all__ = ["checkpoint_is_complete", "decided_on_rank_zero", "final_is_published", "on_every_rank", "resume_checkpoint",
           "steps_trained"]
