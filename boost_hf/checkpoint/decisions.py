"""One decision, broadcast: the choices that lead to collectives, made by global rank 0 and sent to every rank.

A rank that decides from its own view of the file system can disagree with the others: a shared file system's
listing is stale on one node, a checkpoint is renamed while the ranks look. Ranks then resume different checkpoints,
or one rank saves (a collective) while the others do not, and the run hangs or mixes states. As Megatron reads its
tracker file on rank 0 and broadcasts it, these are decided once:

* :func:`decided_on_rank_zero`: ``decide()`` on global rank 0, its result (or its error, raised on every rank with
  the same type and message) on every rank: one ``broadcast_object_list`` of a few bytes;
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
                         KeyError, RuntimeError)
"""Errors of ``decide()`` raised on every rank with their own type (another: ``RuntimeError``)."""


def _launched() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def decided_on_rank_zero(decide):
    """``decide()`` run on global rank 0 only; its result (picklable) returned on every rank. An error of
    ``decide()`` is raised on every rank: its type if one of :data:`_RAISED_AS_THEMSELVES` (else ``RuntimeError``),
    its message followed by "(decided on rank 0)". Collective when launched."""
    if not _launched():
        return decide()
    outcome = [None, None]  # [result, (error type, message)]
    if dist.get_rank() == 0:
        try:
            outcome[0] = decide()
        except Exception as error:  # noqa: BLE001 (raised on every rank below)
            outcome[1] = (type(error).__name__, str(error))
    dist.broadcast_object_list(outcome, src=0)
    if outcome[1] is not None:
        name, message = outcome[1]
        kind = next((kind for kind in _RAISED_AS_THEMSELVES if kind.__name__ == name), RuntimeError)
        raise kind(f"{message} (decided on rank 0)" if kind.__name__ == name else f"{name}: {message} (decided on rank 0)")
    return outcome[0]


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


__all__ = ["checkpoint_is_complete", "decided_on_rank_zero", "final_is_published", "resume_checkpoint", "steps_trained"]
