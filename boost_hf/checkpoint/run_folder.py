"""A run's output folder: which checkpoint a run resumes from, the lock that keeps a second run out, the run id
naming its staging folders, the checkpoint writer, and the earlier run a new one replaces.

The training run (:class:`~boost_hf.training.run.TrainingRun`) adds the hang watchdog and the stop requests.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .folders import (
    CheckpointSaver,
    check_fresh_output_dir,
    incomplete_reason,
    remove_earlier_run,
    remove_stale_staging,
    verify_checkpoint_once,
)
from .decisions import decided_on_rank_zero
from .resume_point import final_is_published, resume_checkpoint, steps_trained
from .lineage import finished_step, set_aside_later_checkpoints
from .lock import OutputDirInUseError, OutputDirLock
from .resume import check_resume_layout


class RunFolder:
    """The folder a run writes, ``args.output_dir`` (``args``: any ``TrainingArguments``). ``run_id`` and ``saver``
    (the :class:`~boost_hf.checkpoint.folders.CheckpointSaver`) exist once the folder is claimed (:meth:`claim`)."""

    def __init__(self, args):
        self.args = args
        self.run_id: str | None = None
        self.saver: CheckpointSaver | None = None
        self._lock: OutputDirLock | None = None
        self._resumed: str | None = None  # the checkpoint resume_point just decided and checked (not decided again next)

    def claim(self) -> None:
        """Collective, once per run: lock ``output_dir`` on global rank 0 (the writer), restore or remove what killed runs
        left while saving (:func:`~boost_hf.checkpoint.folders.remove_stale_staging`) and share the run id (which names
        the staging folders) with every rank; every rank raises the writer's error (the folder in use, a folder it cannot
        write)."""
        if self.run_id is not None:
            return

        def lock() -> str:
            run_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self._lock = OutputDirLock(self.args.output_dir)
            self._lock.acquire(run_id)
            remove_stale_staging(self.args.output_dir, run_id)
            return run_id

        self.run_id = decided_on_rank_zero(lock, kinds=(OutputDirInUseError,))
        self.saver = CheckpointSaver(is_writer=self.args.should_save, run_id=self.run_id)

    def release(self) -> None:
        """Release the output folder's lock now (a process's exit releases it too): another run may write the folder."""
        if self._lock is not None:
            self._lock.release()

    def resume_point(self, resume_from_checkpoint: str | bool | None, config, layout: dict) -> str | None:
        """The checkpoint a run continues from (``True`` or ``"last"``: the last *complete* one of the run's lineage;
        ``"auto"``: that, or a new run if there is none; ``None``: a new run, which refuses an ``output_dir`` holding an
        earlier run unless ``overwrite_output_dir``), decided on global rank 0
        (:func:`~boost_hf.checkpoint.resume_point.resume_checkpoint`) once the folder is claimed (:meth:`claim`: locked,
        staging folders of killed runs restored or removed), verified against its manifest and architecture and
        resumable at this run's ``layout``; the checkpoints of ``output_dir`` of later steps are then set aside as
        another lineage's (:func:`~boost_hf.checkpoint.lineage.set_aside_later_checkpoints`). Collective."""
        if resume_from_checkpoint is not None and resume_from_checkpoint == self._resumed:
            self._resumed = None  # decided and checked just before (boost-hf train's main, then train()): once
            return resume_from_checkpoint
        self.claim()
        with self._released_on_error():
            resume = self._checked_resume_point(resume_from_checkpoint, config, layout)
        self._resumed = resume
        return resume

    @contextlib.contextmanager
    def _released_on_error(self):
        """An error in the block (a refusal, on every rank) releases the folder the run claimed for it: a run that
        never trained leaves no lock behind, also in a process that goes on (a notebook, a test)."""
        try:
            yield
        except BaseException:
            self.release()
            self.run_id, self.saver, self._lock = None, None, None
            raise

    def _checked_resume_point(self, asked, config, layout: dict) -> str | None:
        run_dir = self.args.output_dir
        resume_from_checkpoint = self._checkpoint_meant(asked)
        if resume_from_checkpoint is None:
            decided_on_rank_zero(lambda: check_fresh_output_dir(run_dir, getattr(self.args, "overwrite_output_dir", False)))
            return None
        if not os.path.isfile(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)):
            raise FileNotFoundError(
                f"resume_from_checkpoint: {resume_from_checkpoint!r} has no {TRAINER_STATE_NAME}, so it is a saved model (e.g. "
                f"final/), not a training checkpoint: it holds no optimizer, schedule or data position to continue. Start a "
                f"new run from its weights with --init_from {resume_from_checkpoint}, or resume from a checkpoint-<step> folder."
            )
        # verified here for every resume: transformers skips _load_from_checkpoint under DeepSpeed
        verify_checkpoint_once(resume_from_checkpoint, config)
        check_resume_layout(resume_from_checkpoint, layout)
        step = steps_trained(resume_from_checkpoint)
        decided_on_rank_zero(lambda: set_aside_later_checkpoints(run_dir, resume_from_checkpoint, step))
        return resume_from_checkpoint

    def _checkpoint_meant(self, asked: str | bool | None) -> str | None:
        """The checkpoint ``asked`` means (:func:`~boost_hf.checkpoint.resume_point.resume_checkpoint`); ``last`` in a finished
        run without checkpoints means none (a new run: refused, naming ``--init_from``). Collective."""
        try:
            return resume_checkpoint(self.args.output_dir, asked)  # rank 0's view, on every rank
        except FileNotFoundError:
            if asked in (True, "last") and self.final_is_published():
                return None
            raise

    def completion(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """Why the run in ``output_dir`` has nothing left to do, asked to resume as ``resume_from_checkpoint`` (its
        ``final/`` is published and its training done: the checkpoint meant is at or past ``max_steps``; or, with
        ``last`` / ``auto``, the run ended at or past it after that checkpoint, or saved no checkpoint to continue
        from), else ``None``. Claims the folder first. Collective (decided on global rank 0)."""
        self.claim()
        if resume_from_checkpoint in (None, False, ""):
            return None
        with self._released_on_error():
            checkpoint = self._checkpoint_meant(resume_from_checkpoint)
        run_dir, max_steps = self.args.output_dir, getattr(self.args, "max_steps", -1)

        def decide() -> str | None:
            final = os.path.join(run_dir, "final")
            if not os.path.isdir(final) or incomplete_reason(final) is not None:
                return None
            finished = finished_step(run_dir)
            if checkpoint is None:
                if max_steps > 0 and finished is not None and finished < max_steps:
                    return None  # raised since: nothing to continue from (the resume names --init_from)
                trained = f" (trained to step {finished}, its max_steps {max_steps})" if finished is not None else ""
                return f"final/ is published{trained} and no checkpoint was saved to continue from"
            if not os.path.isfile(os.path.join(checkpoint, TRAINER_STATE_NAME)):
                return None  # not a checkpoint: the resume says so
            step = _global_step(checkpoint)
            if max_steps > 0 and step >= max_steps:
                where = "its max_steps" if step == max_steps else f"past max_steps {max_steps}"
                return f"{checkpoint} is at step {step}, {where}, and final/ is published"
            requeued = resume_from_checkpoint in (True, "last", "auto")  # not a checkpoint named: a rollback goes on
            if requeued and finished is not None and finished >= step and (max_steps <= 0 or finished >= max_steps):
                return f"it ended at step {finished} (after {checkpoint}) and final/ is published"
            return None

        return decided_on_rank_zero(decide)

    def take_over(self, resumed: bool) -> None:
        """Collective: claim the folder; a new run (reached only with ``overwrite_output_dir``, or nothing to remove)
        removes the earlier run's checkpoints and final model."""
        self.claim()
        if not resumed:
            decided_on_rank_zero(lambda: remove_earlier_run(self.args.output_dir) if os.path.isdir(self.args.output_dir) else None)

    def training_is_complete(self, checkpoint: str | None) -> bool:
        """Whether ``checkpoint`` was saved at (or past) ``args.max_steps`` (> 0): resumed, the run trains no step more.
        Collective."""
        max_steps = getattr(self.args, "max_steps", -1)
        return checkpoint is not None and max_steps > 0 and steps_trained(checkpoint) >= max_steps

    def final_is_published(self) -> bool:
        """Whether ``output_dir/final`` is complete. Collective."""
        return final_is_published(self.args.output_dir)

    def checkpoint_path(self, step: int) -> str:
        return os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


def _global_step(checkpoint: str) -> int:
    with open(os.path.join(checkpoint, TRAINER_STATE_NAME)) as f:
        return int(json.load(f)["global_step"])


__all__ = ["RunFolder"]
