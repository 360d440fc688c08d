"""Preemption: on a signal or at the end of a time budget, every rank finishes its step, the run saves a complete
checkpoint and every rank exits with :data:`PREEMPTED_EXIT_CODE` (Megatron's ``--exit-signal-handler`` and
``--exit-duration-in-mins``).

``--exit_signals`` (default ``SIGTERM,SIGUSR1``): what schedulers send before they kill a job (SLURM and Kubernetes
send SIGTERM, then SIGKILL after a grace period; SLURM's ``--signal=USR1@<seconds>`` sends SIGUSR1 that long before
the time limit). The handler only records the signal, however often it comes (SLURM signals every process of a job
step, so a worker gets the scheduler's SIGTERM and ``torchrun``'s copy of it). It takes the signal's default action
(the process dies at once) when another rank has already left the run (``run_broken``: the watchdog's count of
exited ranks) before the ranks agreed to stop: then the signal is ``torchrun`` stopping the survivors of a failed
run, whose collectives could not complete. Once the ranks agreed to stop, signals are only recorded (the first rank
to exit makes ``torchrun`` signal the others, which are finishing the same exit). SIGKILL (or SIGINT, not handled)
ends a run at once. ``--exit_after_minutes`` (default 0: none): the budget, counted from the start of the process.

The ranks must stop at the same step, though a signal may reach only some of them (one node, one process) and their
clocks differ. :class:`StopRequests` decides at the end of every optimizer step: each rank's requests (one flag per
signal and one for the budget) go through one all-reduce (max) over all ranks, a few bytes per step; the Trainer
already waits for the step's gradient norm on the host, so it adds no synchronisation point. When any flag is set,
:class:`StopAtStepEnd` asks the Trainer to save a checkpoint at that step and to stop; ``BoostTrainer.train`` then
raises :class:`TrainingStopped` (a ``SystemExit``: the process exits with :data:`PREEMPTED_EXIT_CODE` unless the
script catches it), after rank 0 printed which request stopped the run, the step and the checkpoint.

Launchers: ``torchrun`` (and ``accelerate launch``, which runs it) forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT to
its workers, then waits ``--shutdown-timeout`` seconds (default 30; also ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) before
SIGKILL; the step and the save must fit in that time: raise it for large models. SIGUSR1 sent to the launcher kills
it (and, through it, its workers) unless it is told to forward it: ``torchrun --signals-to-handle
SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1`` (``PET_SIGNALS_TO_HANDLE`` for ``accelerate launch``).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback

PREEMPTED_EXIT_CODE = 76
"""Exit status of every rank of a run stopped by ``--exit_signals`` or ``--exit_after_minutes`` after its checkpoint."""
DEFAULT_EXIT_SIGNALS = "SIGTERM,SIGUSR1"
UNCATCHABLE = ("SIGKILL", "SIGSTOP")
_PROCESS_START = time.monotonic()


def parse_exit_signals(names: str) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,SIGUSR1"`` -> the signals (``""``: none); raises ``ValueError`` naming an unknown or uncatchable one."""
    parsed = []
    for name in filter(None, (part.strip().upper() for part in names.split(","))):
        name = name if name.startswith("SIG") else f"SIG{name}"
        number = getattr(signal.Signals, name, None)
        if number is None or name in UNCATCHABLE:
            raise ValueError(
                f"exit_signals: {name!r} is {'not a signal' if number is None else 'a signal no process can catch'}: give "
                f"signal names separated by commas (default {DEFAULT_EXIT_SIGNALS!r}), or '' to keep every signal's default action."
            )
        parsed.append(number)
    return tuple(parsed)


class TrainingStopped(SystemExit):
    """The run stopped early (a signal of ``--exit_signals`` or the ``--exit_after_minutes`` budget) after saving a
    checkpoint at ``step``. Uncaught, the process exits with :data:`PREEMPTED_EXIT_CODE`."""

    def __init__(self, reason: str, step: int, checkpoint: str | None):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.reason, self.step, self.checkpoint = reason, step, checkpoint

    def __str__(self) -> str:
        saved = f"saved {self.checkpoint!r}" if self.checkpoint else "saved no checkpoint (not a save-writing process)"
        return (
            f"boost-hf: {self.reason}: every rank finished step {self.step} and the run {saved}; exiting with status "
            f"{PREEMPTED_EXIT_CODE}. Continue with --resume_from_checkpoint last."
        )


class StopRequests:
    """This process's stop requests (the exit signals received, the time budget) and the collective decision."""

    def __init__(self, signals: tuple[signal.Signals, ...], budget_minutes: float = 0.0, run_broken=lambda: False):
        self.signals, self.budget_minutes, self.run_broken = signals, budget_minutes, run_broken
        self.received: set[signal.Signals] = set()
        self.stopping = False
        """The ranks agreed to stop: further signals are recorded only (the launcher's, once a rank has exited)."""
        self._previous: dict[signal.Signals, object] = {}
        self._depth = 0

    @contextlib.contextmanager
    def handling(self):
        """Within (re-entrant): the exit signals are recorded instead of taking their default action; the previous
        handlers come back when the outermost block ends. Handlers can only be set from the main thread: elsewhere
        the signals keep their action (a warning says so)."""
        if self._depth == 0 and self.signals:
            if threading.current_thread() is threading.main_thread():
                self._previous = {number: signal.signal(number, self._handle) for number in self.signals}
            else:
                print("boost-hf: --exit_signals not handled: training runs outside the main thread.", file=sys.stderr)
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                for number, previous in self._previous.items():
                    signal.signal(number, previous)
                self._previous = {}

    def _handle(self, number: int, frame) -> None:
        if not self.stopping and self.run_broken():  # the launcher stops the survivors of a failed run: die now
            signal.signal(number, signal.SIG_DFL)
            signal.raise_signal(number)
            return
        self.received.add(signal.Signals(number))

    def _flags(self) -> list[float]:
        over_budget = self.budget_minutes > 0 and time.monotonic() - _PROCESS_START > 60 * self.budget_minutes
        return [float(number in self.received) for number in self.signals] + [float(over_budget)]

    def agreed_reason(self, device: torch.device | str = "cpu") -> str | None:
        """Collective (every rank, at the same point): why the run stops here, or ``None``. One all-reduce (max) of
        ``len(signals) + 1`` floats over the default group."""
        flags = torch.tensor(self._flags(), device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        raised = flags.tolist()
        self.stopping = any(raised)
        names = [number.name for number, flag in zip(self.signals, raised) if flag]
        if names:
            return f"{' and '.join(names)} received"
        if raised[-1]:
            return f"the time budget of --exit_after_minutes {self.budget_minutes:g} is spent"
        return None


class StopAtStepEnd(TrainerCallback):
    """At the end of each optimizer step, and after an evaluation during training, the ranks agree
    (:meth:`StopRequests.agreed_reason`); on a stop the Trainer saves a checkpoint at that step (skipping an evaluation
    due there) and leaves its loop. ``stopped``: the reason and the step, once stopped."""

    def __init__(self, requests: StopRequests, device):
        self.requests, self.device = requests, device
        self.stopped: tuple[str, int] | None = None
        self._saved_step: int | None = None
        self._training = False  # inside Trainer.train (an evaluation there is followed by the step's save)

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped is None:
            reason = self.requests.agreed_reason(self.device)
            if reason is not None:
                self.stopped = (reason, state.global_step)
                control.should_save, control.should_training_stop, control.should_evaluate = True, True, False
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        self._training = True
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._training = False
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        """A stop asked for during an evaluation inside training: the checkpoint is saved at the step the evaluation
        followed (the Trainer saves right after it), not at the end of the next step."""
        if self._training and self.stopped is None and state.global_step > 0:
            reason = self.requests.agreed_reason(self.device)
            if reason is not None:
                self.stopped = (reason, state.global_step)
                control.should_save, control.should_training_stop = True, True
        return control

    def on_save(self, args, state, control, **kwargs):
        self._saved_step = state.global_step
        return control

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.stopped is not None and self._saved_step == state.global_step:
            control.should_save = False  # saved at this step already
        return control


__all__ = [
    "DEFAULT_EXIT_SIGNALS",
    "PREEMPTED_EXIT_CODE",
    "StopAtStepEnd",
    "StopRequests",
    "TrainingStopped",
    "parse_exit_signals",
]
