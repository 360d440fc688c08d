"""A training run over its lifetime: its output folder (:class:`~boost_hf.checkpoint.run_folder.RunFolder`: the
checkpoint it resumes from, the lock, the run id, the checkpoint writer), the hang watchdog and the stop requests
(preemption).

:class:`~boost_hf.training.trainer.BoostTrainer` holds one :class:`TrainingRun`; ``train`` resolves the checkpoint to
resume (:meth:`~boost_hf.checkpoint.run_folder.RunFolder.resume_point`), then starts the run (:meth:`TrainingRun.start`:
lock, staging clean-up, watchdog) and trains inside :meth:`TrainingRun.running` (exit signals recorded, a collective
that times out named).
"""

from __future__ import annotations

import contextlib
import sys

import torch.distributed as dist

from ..checkpoint.resume_point import checkpoint_is_complete
from ..checkpoint.run_folder import RunFolder
from .preemption import StopAtStepEnd, StopRequests, TrainingStopped, parse_exit_signals
from .watchdog import TRAINING, HangWatchdog, enter_phase, naming_collective_timeouts, running_watchdog


class TrainingRun(RunFolder):
    """The run writing ``args.output_dir`` (boost-hf's training arguments add the exit signals, the time budget and
    the hang timeout)."""

    def __init__(self, args):
        super().__init__(args)
        self.hang_watchdog: HangWatchdog | None = None
        self.stop_requests = StopRequests(parse_exit_signals(getattr(args, "exit_signals", "")),
                                          getattr(args, "exit_after_minutes", 0.0), run_broken=self.a_peer_exited)
        self.stop_at_step_end = StopAtStepEnd(self.stop_requests, args.device)

    def start(self, resumed: bool) -> None:
        """Collective: take the folder over (:meth:`~boost_hf.checkpoint.run_folder.RunFolder.take_over`), start the
        hang watchdog, enter the training phase."""
        self.claim()
        self.start_hang_watchdog()
        enter_phase(TRAINING)
        self.take_over(resumed)

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

        self.hang_watchdog = HangWatchdog(_get_default_store(), dist.get_rank(), dist.get_world_size(), timeout,
                                          startup_timeout_s=getattr(self.args, "startup_timeout_s", None))
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
        if not checkpoint_is_complete(self.checkpoint_path(step)):  # rank 0's view: every rank saves, or none
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


__all__ = ["TrainingRun"]
