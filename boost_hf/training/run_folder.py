"""A run's output folder over the run's lifetime: which checkpoint it resumes from, its lock, the run id naming its
staging folders, the checkpoint writer, the hang watchdog and the stop requests (preemption).

:class:`~boost_hf.training.trainer.BoostTrainer` holds one :class:`RunFolder`; ``train`` resolves the checkpoint to
resume (:meth:`RunFolder.resume_point`), then starts the run (:meth:`RunFolder.start`: lock, staging clean-up,
watchdog) and trains inside :meth:`RunFolder.running` (exit signals recorded, a collective that times out named).
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid

import torch.distributed as dist
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .checkpoint import (
    CheckpointSaver,
    check_fresh_output_dir,
    completed_checkpoints,
    newest_complete_checkpoint,
    remove_earlier_run,
    remove_stale_staging,
    verify_checkpoint_once,
)
from .output_lock import OutputDirInUseError, OutputDirLock
from .preemption import StopAtStepEnd, StopRequests, TrainingStopped, parse_exit_signals
from .resume import check_resume_layout
from .watchdog import TRAINING, HangWatchdog, enter_phase, naming_collective_timeouts, running_watchdog


class RunFolder:
    """The run writing ``args.output_dir`` (any ``TrainingArguments``; boost-hf's add the exit signals, the time budget
    and the hang timeout). ``run_id`` and ``saver`` (the :class:`~boost_hf.training.checkpoint.CheckpointSaver`)
    exist once the folder is claimed (:meth:`claim`)."""

    def __init__(self, args):
        self.args = args
        self.run_id: str | None = None
        self.saver: CheckpointSaver | None = None
        self.hang_watchdog: HangWatchdog | None = None
        self._lock: OutputDirLock | None = None
        self.stop_requests = StopRequests(parse_exit_signals(getattr(args, "exit_signals", "")),
                                          getattr(args, "exit_after_minutes", 0.0), run_broken=self.a_peer_exited)
        self.stop_at_step_end = StopAtStepEnd(self.stop_requests, args.device)

    def claim(self) -> None:
        """Collective, once per run: lock ``output_dir`` on the writing rank and share the run id (which names the
        staging folders) with every rank; every rank raises the writer's error if the folder is in use."""
        if self.run_id is not None:
            return
        claim = [None, None]  # [run id, error]
        if self.args.should_save:
            claim[0] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self._lock = OutputDirLock(self.args.output_dir)
            try:
                self._lock.acquire(claim[0])
                remove_stale_staging(self.args.output_dir, claim[0])
            except OutputDirInUseError as error:
                claim[1] = str(error)
        if dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(claim, src=0)
        if claim[1] is not None:
            raise OutputDirInUseError(claim[1])
        self.run_id = claim[0]
        self.saver = CheckpointSaver(is_writer=self.args.should_save, run_id=self.run_id)

    def release(self) -> None:
        """Release the output folder's lock now (a process's exit releases it too): another run may write the folder."""
        if self._lock is not None:
            self._lock.release()

    def resume_point(self, resume_from_checkpoint: str | bool | None, config, layout: dict) -> str | None:
        """The checkpoint a run continues from (``True``: the last *complete* one; ``None``: a new run, which refuses an
        ``output_dir`` holding an earlier run unless ``overwrite_output_dir``), verified against its manifest and
        architecture and resumable at this run's ``layout``."""
        run_dir = self.args.output_dir
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_complete_checkpoint(run_dir)
        elif isinstance(resume_from_checkpoint, str) and not os.path.isdir(resume_from_checkpoint):
            raise FileNotFoundError(f"resume_from_checkpoint: no such file or folder: {resume_from_checkpoint!r}")
        elif not resume_from_checkpoint:
            check_fresh_output_dir(run_dir, getattr(self.args, "overwrite_output_dir", False))
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
        return resume_from_checkpoint

    def start(self, resumed: bool) -> None:
        """Collective: claim the folder, start the hang watchdog, enter the training phase; a new run (reached only
        with ``overwrite_output_dir``, or nothing to remove) removes the earlier run's checkpoints and final model."""
        self.claim()
        self.start_hang_watchdog()
        enter_phase(TRAINING)
        if not resumed and self.args.should_save and os.path.isdir(self.args.output_dir):
            remove_earlier_run(self.args.output_dir)

    @contextlib.contextmanager
    def running(self, step):
        """Within: the exit signals are recorded (:class:`~boost_hf.training.preemption.StopRequests`) and a collective
        that times out is named with ``step()`` (:func:`~boost_hf.training.watchdog.naming_collective_timeouts`)."""
        with self.stop_requests.handling(), naming_collective_timeouts(step):
            yield

    def start_hang_watchdog(self) -> None:
        """This rank's :class:`~boost_hf.training.watchdog.HangWatchdog` (launched runs, ``hang_timeout_s > 0``): the
        one started with the launch (:func:`~boost_hf.training.watchdog.watch_launch`), else one on the process group's
        store."""
        timeout = getattr(self.args, "hang_timeout_s", 0)
        if self.hang_watchdog is not None or not timeout or not (dist.is_available() and dist.is_initialized()):
            return
        if running_watchdog() is not None:
            self.hang_watchdog = running_watchdog()
            return
        if dist.get_world_size() == 1:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        self.hang_watchdog = HangWatchdog(_get_default_store(), dist.get_rank(), dist.get_world_size(), timeout)
        self.hang_watchdog.start()

    def a_peer_exited(self) -> bool:
        return self.hang_watchdog is not None and self.hang_watchdog.a_peer_exited()

    def stop_if_requested(self, step: int, save_checkpoint) -> None:
        """Collective: a signal of ``--exit_signals`` or the spent ``--exit_after_minutes`` budget saves a checkpoint at
        ``step`` (``save_checkpoint()``, unless there is one) and raises
        :class:`~boost_hf.training.preemption.TrainingStopped` on every rank."""
        reason = self.stop_requests.agreed_reason(self.args.device)
        if reason is None:
            return
        checkpoint = self.checkpoint_path(step)
        if checkpoint not in completed_checkpoints(self.args.output_dir):
            save_checkpoint()
        self.stop(reason, step)

    def stop_after_training(self) -> None:
        """After ``Trainer.train``: raise :class:`~boost_hf.training.preemption.TrainingStopped` if the ranks agreed to
        stop at a step's end (:class:`~boost_hf.training.preemption.StopAtStepEnd`; its checkpoint is saved)."""
        if self.stop_at_step_end.stopped is not None:
            reason, step = self.stop_at_step_end.stopped
            self.stop(reason, step)

    def stop(self, reason: str, step: int):
        self.saver.wait()  # the checkpoint named below is complete before any rank exits
        stopped = TrainingStopped(reason, step, self.checkpoint_path(step))
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(stopped, file=sys.stderr, flush=True)
        raise stopped

    def checkpoint_path(self, step: int) -> str:
        return os.path.join(self.args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")


__all__ = ["RunFolder"]
