"""Where a run resumes, decided once for every rank: the checkpoint ``--resume_from_checkpoint`` means and the
facts about a run folder that decide it, each decided on global rank 0 and broadcast
(:func:`~boost_hf.checkpoint.decisions.decided_on_rank_zero`: one ``broadcast_object_list``; a plain call in one
process):

* :func:`last_checkpoint`: the checkpoint ``last`` continues, the lineage's record first
  (:mod:`boost_hf.checkpoint.lineage`), read on the calling rank;
* :func:`resume_checkpoint`: the checkpoint ``--resume_from_checkpoint`` means (``last``/``True``: the last complete
  one of the run's lineage, ``auto``: that or none, a path: itself);
* :func:`checkpoint_is_complete`: whether a checkpoint folder exists complete (a stop request saves one unless it
  does);
* :func:`steps_trained`: the optimizer steps a checkpoint holds (a run resumed at its ``max_steps`` trains no more);
* :func:`final_is_published`: whether a run's ``final/`` is complete (a finished run requeued publishes nothing).

It reads the folders through :mod:`boost_hf.checkpoint.folders` (the saver's own notion of a complete checkpoint),
which in turn records each commit in the lineage: this module sits above both.
"""

from __future__ import annotations

import json
import logging
import os

from transformers.trainer import TRAINER_STATE_NAME

from . import folders
from .decisions import decided_on_rank_zero
from .lineage import RECORD_NAME, checkpoint_step, recorded_checkpoint

logger = logging.getLogger(__name__)


def last_checkpoint(run_dir: str) -> str:
    """The checkpoint ``--resume_from_checkpoint last`` continues: the one ``run_dir``'s record names if it is complete,
    else the newest complete checkpoint of an earlier step (a warning says why the recorded one is skipped); without a
    record, the newest complete checkpoint (a warning says so). ``FileNotFoundError`` when there is none."""
    recorded = recorded_checkpoint(run_dir)
    skipped: list[tuple[str, str]] = []
    complete = folders.completed_checkpoints(run_dir, skipped)
    if recorded is not None:
        reason = "it is missing (its save was stopped before its rename)" if not os.path.isdir(recorded) else folders.incomplete_reason(recorded)
        if reason is None:
            return recorded
        complete = [c for c in complete if checkpoint_step(c) < checkpoint_step(recorded)]
        logger.warning("--resume_from_checkpoint last: %s records %s, not a complete checkpoint: %s", RECORD_NAME, recorded, reason)
    elif complete:
        logger.warning("--resume_from_checkpoint last: %s has no %s (an output folder of an earlier boost-hf version): "
                       "resuming its newest complete checkpoint", run_dir, RECORD_NAME)
    newest = complete[-1] if complete else None
    for folder, reason in skipped:
        if newest is None or checkpoint_step(folder) > checkpoint_step(newest):
            logger.warning("--resume_from_checkpoint last: skipping %s, not a complete checkpoint: %s", folder, reason)
    if newest is None:
        raise FileNotFoundError(
            f"no complete checkpoint (with a valid manifest.json) in output_dir {run_dir!r} to resume from"
            + (f"; skipped: {', '.join(os.path.basename(f) for f, _ in skipped)}" if skipped else "") + "."
        )
    if skipped or recorded is not None:
        logger.warning("--resume_from_checkpoint last: resuming from %s", newest)
    return newest


def resume_checkpoint(run_dir: str, resume_from_checkpoint: str | bool | None) -> str | None:
    """The checkpoint a run resumes, decided on global rank 0 (:func:`decided_on_rank_zero`): ``True`` or ``"last"``:
    the last complete checkpoint of ``run_dir``'s lineage (``FileNotFoundError`` when there is none,
    :func:`last_checkpoint`); ``"auto"``: that, or ``None`` (a new run) when there is
    none; a path: itself (``FileNotFoundError`` if it is no folder); ``None`` / ``False``: ``None``."""
    def decide() -> str | None:
        if resume_from_checkpoint in (None, False, ""):
            return None
        if resume_from_checkpoint == "auto":
            return last_checkpoint(run_dir) if folders.completed_checkpoints(run_dir) else None
        if resume_from_checkpoint is True or resume_from_checkpoint == "last":
            return last_checkpoint(run_dir)
        if not os.path.isdir(resume_from_checkpoint):
            raise FileNotFoundError(f"resume_from_checkpoint: no such file or folder: {resume_from_checkpoint!r}")
        return resume_from_checkpoint

    return decided_on_rank_zero(decide)


def checkpoint_is_complete(folder: str) -> bool:
    """Whether ``folder`` (a ``checkpoint-<step>``) is a complete checkpoint of its run, decided on global rank 0."""
    return decided_on_rank_zero(
        lambda: os.path.abspath(folder) in map(os.path.abspath, folders.completed_checkpoints(os.path.dirname(os.path.abspath(folder)))))


def steps_trained(checkpoint: str) -> int:
    """The optimizer steps ``checkpoint`` was saved after (its ``trainer_state.json``'s ``global_step``), decided on
    global rank 0."""
    def decide() -> int:
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as f:
            return int(json.load(f)["global_step"])

    return decided_on_rank_zero(decide)


def final_is_published(run_dir: str) -> bool:
    """Whether ``run_dir/final`` is a complete published model (its manifest and every file in it), decided on global
    rank 0."""
    final = os.path.join(run_dir, "final")
    return decided_on_rank_zero(lambda: os.path.isdir(final) and folders.incomplete_reason(final) is None)


__all__ = ["checkpoint_is_complete", "final_is_published", "last_checkpoint", "resume_checkpoint", "steps_trained"]
