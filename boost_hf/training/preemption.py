"""Preemption: on a signal or at the end of a time budget, every rank finishes its step, the run saves a complete
checkpoint and every rank exits with :data:`PREEMPTED_EXIT_CODE` (Megatron's ``--exit-signal-handler`` and
``--exit-duration-in-mins``).

``--exit_signals`` (default ``SIGTERM,SIGUSR1``): what schedulers send before they kill a job (SLURM and Kubernetes
send SIGTERM, then SIGKILL after a grace period; SLURM's ``--signal=USR1@<seconds>`` sends SIGUSR1 that long before
the time limit). The handler only records the signal, however often it comes (SLURM signals every process of a job
step, so a worker gets the scheduler's SIGTERM and ``torchrun``'s copy of it), and wakes a thread of its own: nothing
in the handler can block. That thread ends the process at once when another rank has already left the run
(``run_broken``: the watchdog's count of exited ranks, read from the launcher's store) before the ranks agreed to
stop: then the signal is ``torchrun`` stopping the survivors of a failed run, whose collectives could not complete;
else it says what the signal will do at that point of the run (``boost-hf: SIGTERM received by rank 3: every rank
finishes its step, ...``; during the final save: that the save goes on to its end). Once the ranks agreed to stop,
signals are only recorded (the first rank to exit makes ``torchrun`` signal the others, which are finishing the same
exit). SIGKILL (or SIGINT, not handled)
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
import os
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
_FOLLOW_UP_GRACE_S = 30.0
"""How long the end of :meth:`StopRequests.handling` waits for the follow-up thread (a store call under way)."""


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


TRAINING = (f"every rank finishes its step, the run saves a checkpoint at that step and exits with status "
            f"{PREEMPTED_EXIT_CODE} (continue with --resume_from_checkpoint last)")
"""What a signal of ``--exit_signals`` does during training (:meth:`StopRequests.meaning`)."""


class StopRequests:
    """This process's stop requests (the exit signals received, the time budget) and the collective decision.

    The signal handler only records the signal and writes its number into a pipe (neither can block); a thread of
    its own reads the pipe and does the rest: it asks ``run_broken()`` (the launcher's store, over the network)
    whether another rank has left the run, ending this process at once if so, and says what the signal will do now
    (:meth:`meaning`), once per signal and meaning."""

    def __init__(self, signals: tuple[signal.Signals, ...], budget_minutes: float = 0.0, run_broken=lambda: False):
        self.signals, self.budget_minutes, self.run_broken = signals, budget_minutes, run_broken
        self.received: set[signal.Signals] = set()
        self.stopping = False
        """The ranks agreed to stop: further signals are recorded only (the launcher's, once a rank has exited)."""
        self.now = TRAINING
        """What a signal does at this point of the run (said when one arrives)."""
        self._said: set[tuple[signal.Signals, str]] = set()
        self._previous: dict[signal.Signals, object] = {}
        self._depth = 0
        self._wake: int | None = None  # the pipe's end the handler writes to
        self._follow: threading.Thread | None = None

    @contextlib.contextmanager
    def handling(self):
        """Within (re-entrant): the exit signals are recorded instead of taking their default action; the previous
        handlers come back when the outermost block ends. Handlers can only be set from the main thread: elsewhere
        the signals keep their action (a warning says so)."""
        if self._depth == 0 and self.signals:
            if threading.current_thread() is threading.main_thread():
                self._start_following()
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
                self._stop_following()

    @contextlib.contextmanager
    def meaning(self, what: str):
        """Within: a signal does ``what`` (said when one arrives, e.g. "the final model's save goes on ...")."""
        before, self.now = self.now, what
        try:
            yield
        finally:
            self.now = before

    def _handle(self, number: int, frame) -> None:
        """The signal handler: record the signal and wake the follow-up thread. Nothing that can block (no store, no
        print): a non-blocking write of one byte, dropped if the pipe is full of earlier wake-ups."""
        self.received.add(signal.Signals(number))
        if self._wake is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake, bytes([number]))

    def _start_following(self) -> None:
        read, self._wake = os.pipe()
        os.set_blocking(self._wake, False)
        self._follow = threading.Thread(target=self._follow_signals, args=(read,), name="boost-hf-exit-signals", daemon=True)
        self._follow.start()

    def _stop_following(self) -> None:
        if self._wake is not None:
            os.close(self._wake)  # the thread reads the end of the pipe, says what is left to say and ends
            self._wake = None
            self._follow.join(timeout=_FOLLOW_UP_GRACE_S)
            self._follow = None

    def _follow_signals(self, read: int) -> None:
        """The follow-up thread: for each signal the handler recorded, end this process if another rank has left the
        run before the ranks agreed to stop (``torchrun`` stopping the survivors of a failed run, whose collectives
        could not complete); else say what the signal will do."""
        try:
            while data := os.read(read, 64):
                for number in map(signal.Signals, data):
                    if not self.stopping and self.run_broken():
                        os.write(2, f"boost-hf: {number.name} received after another rank left the run (the launcher "
                                    "stops the rest of a failed run): this rank exits now.\n".encode())
                        os._exit(128 + number)
                    if (number, self.now) not in self._said:
                        self._said.add((number, self.now))
                        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
                        print(f"boost-hf: {number.name} received by rank {rank}: {self.now}.", file=sys.stderr, flush=True)
        finally:
            os.close(read)

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


class SignalExit(SystemExit):
    """A signal of :func:`exiting_on` stopped the command where it was (exit status 128 + the signal's number)."""

    def __init__(self, number: signal.Signals):
        super().__init__(128 + number)
        self.signal = number


@contextlib.contextmanager
def exiting_on(signals: tuple[signal.Signals, ...]):
    """Within (the main thread; elsewhere nothing changes): each of ``signals`` raises :class:`SignalExit` where the
    main thread is, so the block's clean-up runs (an atomic folder's staging removed) and the caller says what
    happened; the handler does nothing else (nothing that can block). The previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(number: int, frame) -> None:
        raise SignalExit(signal.Signals(number))

    previous = {number: signal.signal(number, stop) for number in signals}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


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
    "TRAINING",
    "PREEMPTED_EXIT_CODE",
    "SignalExit",
    "StopAtStepEnd",
    "StopRequests",
    "TrainingStopped",
    "exiting_on",
    "parse_exit_signals",
]
