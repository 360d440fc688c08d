"""No hangs: a frozen rank stops the whole run within a timeout, and workers die with their launcher.

:class:`HangWatchdog` (one daemon thread per rank) covers the whole run, from the process group's set-up to the last
save: under ``torchrun`` / ``accelerate launch`` (whose agent hosts the key-value store) :func:`watch_launch` starts
it before the process group exists (``BoostTrainingArguments`` calls it), on a client of the launcher's store;
elsewhere (a process group initialised by hand) ``BoostTrainer.train`` starts it on the process group's store. The
code names the phase each rank is in (:func:`enter_phase`: process-group set-up, dataset building, model building,
training, evaluation, saving the final model), and the message names the frozen rank's phase. Every ``interval``
seconds each rank increments its counter ``boost_hf/watchdog/beat/<rank>`` in the process
group's key-value store (the launcher's TCP store under ``torchrun``/``accelerate launch``, which outlives any
worker) and reads every other rank's counter. A rank whose counter has not moved for ``timeout_s`` seconds, as
measured by the reader's own clock (no clock is compared across hosts), is frozen or dead: a SIGSTOPped process,
a machine that hangs, a process stuck without releasing the interpreter. The thread keeps beating while its main
thread waits inside a collective (collectives release the interpreter lock), so the ranks that wait are never
blamed. A rank that never beat (frozen before its watchdog started, e.g. while importing) is judged after
``startup_timeout_s`` (``--startup_timeout_s``; default ``max(timeout_s, STARTUP_GRACE_S)``: ranks start at different
times), counted from this rank's start. Every rank that sees it prints ::

    boost-hf watchdog: rank 3 (pid 4242 on node-b) has not responded for 300 s during dataset building ...

and exits with :data:`HANG_EXIT_CODE`, after sending SIGKILL to the frozen process if it runs on the same host
(else the launcher stops it: SIGTERM, then SIGKILL after 30 s). A rank that finishes or fails marks itself done and is not watched any more. The
timeout is ``--hang_timeout_s`` (default 300 s; 0 disables). If the process group's set-up fails first (its own
timeout, ``--ddp_timeout``, shorter than the start-up timeout), :func:`ranks_never_started` names the ranks that never
beat, for the error that replaces the store's (``BoostTrainingArguments``).

A rank that is alive but never reaches the next collective (stuck in I/O, a deadlock, a loop: its heartbeat thread
keeps beating) is caught by the collective's own timeout, ``--ddp_timeout``, which every boost-hf process group
carries (:func:`~boost_hf.parallel.state.new_group_with_timeout`). The ranks waiting for it get an error from the
backend that names no collective (gloo: "Timed out waiting 1800000ms for recv operation"); under
:func:`naming_collective_timeouts` (``BoostTrainer.train`` and ``evaluate``) it becomes a
:class:`CollectiveTimeoutError` naming the collective, its group, the step and the calling code. The failed rank
exits and the launcher stops the others.

:func:`exit_with_launcher`: each worker asks the kernel to SIGKILL it when its parent (the launcher) dies
(``prctl(PR_SET_PDEATHSIG)``), and a thread checks ``os.getppid()`` every second as well (other platforms,
or a parent that died before the call). ``kill -9`` of ``torchrun`` then leaves no orphan training on.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time

HANG_EXIT_CODE = 75
"""Exit status of a rank that stopped because another rank stopped responding."""
STARTUP_GRACE_S = 300.0
"""A rank that has not beaten once is taken for frozen only after this long (or ``timeout_s`` if longer)."""
TRAINING = "training"
"""The phase in which messages name the step rather than the phase."""
PR_SET_PDEATHSIG = 1
_PREFIX = "boost_hf/watchdog/"
_STORE_CALL_GRACE_S = 30.0
"""How long :meth:`HangWatchdog.stop` waits, beyond one interval, for the thread's store calls to return."""
_launcher_watch_started = False
_running: "HangWatchdog | None" = None
"""The watchdog running in this process (one per process: a later one replaces it)."""


class CollectiveTimeoutError(TimeoutError):
    """A collective did not complete within the process group's timeout (``--ddp_timeout``)."""


_C10D = os.path.join("torch", "distributed", "distributed_c10d.py")


def _in_collective(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(_C10D):
            return True
        tb = tb.tb_next
    return False


def _is_collective_timeout(error: BaseException) -> bool:
    """A backend's timeout of a collective (gloo: "Timed out waiting ...ms for recv operation"), not any timeout."""
    text = str(error).lower()
    return "timed out" in text and ("gloo" in text or _in_collective(error) or type(error).__name__ == "DistBackendError")


_PIPELINING = os.path.join("torch", "distributed", "pipelining", "")


def _pipeline_stage(frame):
    """The ``PipelineStage`` a frame of torch's pipeline schedules runs (``self._stage``; ``None`` elsewhere)."""
    schedule = frame.f_locals.get("self")
    stage = getattr(schedule, "_stage", None)
    return stage if stage is not None and hasattr(stage, "stage_index") else None


def describe_stuck_collective(error: BaseException) -> str:
    """"all_reduce in the TP group (ranks [0, 1]), called from boost_hf/parallel/primitives.py:49 (_all_reduce_)",
    read from ``error``'s traceback: the innermost ``torch.distributed`` call and the innermost frame outside torch.
    A wait on the pipeline engine's sends and receives (``torch.distributed.pipelining``) is named as such, with the
    stage and the pipeline group."""
    from ..parallel.state import describe_group

    collective, pipeline, caller, tb = None, None, None, error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(_C10D):
            collective = (code.co_name, tb.tb_frame.f_locals.get("group"))
        elif _PIPELINING in code.co_filename:
            pipeline = _pipeline_stage(tb.tb_frame) or pipeline or "unknown"
            if code.co_name == "_wait_batch_p2p":
                collective = None  # the schedule waits on the sends and receives it posted
        elif f"{os.sep}torch{os.sep}" not in code.co_filename:
            caller = f"{code.co_filename}:{tb.tb_lineno} ({code.co_name})"
        tb = tb.tb_next
    if collective is not None:
        what = f"{collective[0]} in {describe_group(collective[1])}"
    elif pipeline is not None:
        where = "" if pipeline == "unknown" else (
            f" of stage {pipeline.stage_index} (of {pipeline.num_stages}) in {describe_group(pipeline.group)}")
        what = f"a point-to-point send/receive between pipeline stages{where} (activations forward, gradients backward)"
    else:  # raised inside C++ (e.g. DDP's gradient all-reduce in backward)
        what = "a collective run by torch itself (e.g. DistributedDataParallel's gradient all-reduce in the DP group)"
    return what + (f", called from {caller}" if caller else "")


@contextlib.contextmanager
def naming_collective_timeouts(step=lambda: None):
    """Re-raise a collective's timeout inside the block as :class:`CollectiveTimeoutError` naming the collective, its
    group, the step (``step()``), the timeout and what to do."""
    try:
        yield
    except RuntimeError as error:
        if not _is_collective_timeout(error):
            raise
        import torch.distributed as dist

        from ..parallel.state import collective_timeout

        launched = dist.is_available() and dist.is_initialized()
        rank = f"rank {dist.get_rank()}" if launched else "this process"
        limit = f"{collective_timeout().total_seconds():g} s" if launched else "the process group's timeout"
        at = f" at step {step()}" if step() is not None else ""
        raise CollectiveTimeoutError(
            f"{rank}: {describe_stuck_collective(error)} did not complete within {limit} (--ddp_timeout){at}: "
            "another rank of that group is alive but did not reach it (stuck in I/O, a deadlock or much slower than its "
            "peers). The run stops; resume with --resume_from_checkpoint last. If that rank was only slow (saving a large "
            "checkpoint, building a dataset cache), raise --ddp_timeout."
        ) from error


def _die(message: str, code: int) -> None:
    print(message, file=sys.stderr, flush=True)
    os._exit(code)


def exit_with_launcher() -> None:
    """In a process started by a launcher (``torchrun``, ``accelerate launch``: ``LOCAL_RANK`` is set), die when
    the launcher dies. Idempotent; does nothing in a process started by hand."""
    global _launcher_watch_started
    if _launcher_watch_started or "LOCAL_RANK" not in os.environ:
        return
    _launcher_watch_started = True
    parent = os.getppid()
    if parent == 1:
        _die(f"boost-hf: the launcher of rank {os.environ.get('RANK', '?')} is already gone; exiting.", 1)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                _die(f"boost-hf: the launcher (pid {parent}) of rank {os.environ.get('RANK', '?')} died; exiting.", 1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="boost-hf-launcher-watch", daemon=True).start()


def _kill_local(owners) -> None:
    """SIGKILL the frozen processes that run on this host: a stopped process would otherwise wait for the
    launcher's SIGKILL (30 s after its SIGTERM)."""
    for owner in owners:
        if owner["host"] == socket.gethostname():
            try:
                os.kill(owner["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class HangWatchdog:
    """Heartbeats of every rank through ``store``; exits this process when a peer has been silent ``timeout_s``."""

    def __init__(self, store, rank: int, world_size: int, timeout_s: float, interval_s: float | None = None,
                 phase: str = TRAINING, startup_timeout_s: float | None = None):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.startup_timeout_s = startup_timeout_s or max(timeout_s, STARTUP_GRACE_S)
        self.interval_s = interval_s if interval_s is not None else min(5.0, max(min(timeout_s, self.startup_timeout_s) / 10, 0.2))
        self.step = 0
        self.phase = phase
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def enter_phase(self, phase: str) -> None:
        """Record (in the store, for the other ranks' messages) that this rank now runs ``phase``."""
        self.phase = phase
        self._publish()

    def where(self, phase: str | None = None) -> str:
        """"at step 37" in training (ranks train in step), else "during <phase>"."""
        phase = self.phase if phase is None else phase
        return f"at step {self.step}" if phase == TRAINING else f"during {phase}"

    def _publish(self) -> None:
        record = {"pid": os.getpid(), "host": socket.gethostname(), "phase": self.phase}
        self.store.set(f"{_PREFIX}who/{self.rank}", json.dumps(record))

    def start(self) -> None:
        """Start beating and watching. A watchdog already running in this process (an earlier ``Trainer.train``)
        is stopped first, without marking the rank done: this one goes on beating the same counter."""
        global _running
        if _running is not None:
            _running.stop(mark_done=False)
        self._publish()
        self.store.add(f"{_PREFIX}beat/{self.rank}", 1)
        self._thread = threading.Thread(target=self._run, name="boost-hf-hang-watchdog", daemon=True)
        self._thread.start()
        _running = self
        atexit.register(self.stop)

    def stop(self, mark_done: bool = True) -> None:
        """Stop watching, wait for the thread to leave the store, and mark this rank done (it may exit before its
        peers without being taken for frozen).

        The wait matters at exit: a daemon thread still inside a store call (which releases the interpreter lock in
        C++) when the interpreter shuts down is ended by ``pthread_exit`` as it takes the lock back, and the forced
        unwind through pybind11's lock guard aborts the process ("terminate called without an active exception"),
        turning a finished run into a failed one."""
        global _running
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=self.interval_s + _STORE_CALL_GRACE_S)
        if _running is self:
            _running = None
        if mark_done:
            self._mark_exited()

    def _mark_exited(self) -> None:
        try:
            self.store.add(f"{_PREFIX}done/{self.rank}", 1)
            self.store.add(f"{_PREFIX}exited", 1)
        except Exception:  # the store may be gone at exit
            pass

    def a_peer_exited(self) -> bool:
        """Whether another rank has already left the run (finished, failed or stopped by this watchdog): one store
        call, made by the exit signals' follow-up thread (:class:`~boost_hf.training.preemption.StopRequests`), never in
        the signal handler. A SIGTERM then comes from the launcher stopping the rest of the run, not from a scheduler. A store that
        cannot be reached (``DistNetworkError``: the connection closed or refused, the launcher hosting it is gone)
        counts as the run's end; any other store error (a timeout, a busy store) says nothing about the peers: this
        returns ``False`` (the signal is taken for a scheduler's, and the run saves) and prints why."""
        import torch.distributed as dist

        try:
            return self.store.add(f"{_PREFIX}exited", 0) > 0
        except (dist.DistNetworkError, ConnectionError):  # the launcher's store is gone: so is the run
            return True
        except Exception as error:  # noqa: BLE001 (not evidence of an exit: the stop request is honoured)
            message = (f"boost-hf: rank {self.rank} could not read the count of exited ranks from the launcher's store "
                       f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); taking the signal "
                       "for a stop request (the run saves a checkpoint).\n")
            print(message, end="", file=sys.stderr, flush=True)  # from the exit signals' follow-up thread
            return False

    def ranks_never_started(self) -> list[int]:
        """The other ranks that have not beaten once (no record in the store): frozen or stuck before their watchdog
        started, or never launched."""
        return [r for r in range(self.world_size) if r != self.rank and not self.store.check([f"{_PREFIX}who/{r}"])]

    def _run(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        last = {r: (0, time.monotonic()) for r in peers}  # a rank's counter is 0 until it starts beating
        never_started_after = self.startup_timeout_s
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(f"{_PREFIX}beat/{self.rank}", 1)
                now = time.monotonic()
                silent = []
                for r in peers:
                    if self.store.add(f"{_PREFIX}done/{r}", 0):
                        continue
                    count = self.store.add(f"{_PREFIX}beat/{r}", 0)
                    if count != last[r][0]:
                        last[r] = (count, now)
                    elif now - last[r][1] > (self.timeout_s if count else never_started_after):
                        silent.append(r)
                if silent and not self._stop.is_set():
                    self._stop_the_run(silent, never_started_after)
            except Exception as error:  # the store is unreachable: the launcher is gone
                if self._stop.is_set():
                    return
                _die(f"boost-hf watchdog: rank {self.rank} lost the launcher's store ({type(error).__name__}: {error}); exiting.", 1)

    def _stop_the_run(self, silent: list[int], never_started_after: float) -> None:
        """Print which ranks are silent (each with its phase), kill those on this host and exit this process."""
        found = {r: self.store.check([f"{_PREFIX}who/{r}"]) for r in silent}
        owners = {r: json.loads(self.store.get(f"{_PREFIX}who/{r}")) for r in silent if found[r]}
        started = [f"rank {r} (pid {o['pid']} on {o['host']}) has not responded for {self.timeout_s:g} s "
                   f"{self.where(o.get('phase', TRAINING))}" for r, o in owners.items()]
        never = [f"rank {r} has not started (no heartbeat {never_started_after:g} s after rank {self.rank}'s start, "
                 "--startup_timeout_s: frozen or stuck before reaching the process group, e.g. while importing, or not "
                 "launched)" for r in silent if not found[r]]
        _kill_local(owners.values())
        self._mark_exited()
        _die(
            f"boost-hf watchdog: {'; '.join(started + never)} (frozen, stopped or its machine hangs); rank {self.rank} "
            f"stops {self.where()} with exit status {HANG_EXIT_CODE}, and the launcher stops the others. Resume from the "
            "last checkpoint (--resume_from_checkpoint last); raise --hang_timeout_s if that rank was only slow.",
            HANG_EXIT_CODE,
        )


def running_watchdog() -> HangWatchdog | None:
    """The watchdog running in this process, if any."""
    return _running


def enter_phase(phase: str) -> None:
    """Name the phase this rank enters (in the running watchdog's messages); nothing without a watchdog."""
    if _running is not None:
        _running.enter_phase(phase)


@contextlib.contextmanager
def in_phase(phase: str):
    """:func:`enter_phase` for the block, then back to the phase before it (an evaluation inside training)."""
    before = _running.phase if _running is not None else None
    enter_phase(phase)
    try:
        yield
    finally:
        if before is not None:
            enter_phase(before)


def ranks_never_started() -> list[int]:
    """:meth:`HangWatchdog.ranks_never_started` of the running watchdog (``[]`` without one, or without its store)."""
    try:
        return _running.ranks_never_started() if _running is not None else []
    except Exception:  # noqa: BLE001 (the store is gone: nothing to name)
        return []


def watch_launch(timeout_s: float, startup_timeout_s: float | None = None) -> HangWatchdog | None:
    """Start this rank's watchdog before its process group exists, on a client of the store that ``torchrun``'s agent
    hosts (``TORCHELASTIC_USE_AGENT_STORE``; ``MASTER_ADDR:MASTER_PORT``), in phase "process-group set-up". Nothing
    when not launched so (``BoostTrainer.train`` then starts it on the process group's store), for one process, with
    ``timeout_s == 0``, or when a watchdog already runs. Keys live under ``attempt_<TORCHELASTIC_RESTART_COUNT>``.
    ``startup_timeout_s``: how long a rank that never beat is waited for (:class:`HangWatchdog`)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if _running is not None or not timeout_s or world < 2 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return _running
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    client = TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60))
    store = PrefixStore(f"attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)
    watchdog = HangWatchdog(store, int(env["RANK"]), world, timeout_s, phase="process-group set-up",
                            startup_timeout_s=startup_timeout_s)
    watchdog.start()
    return watchdog


__all__ = [
    "HANG_EXIT_CODE",
    "enter_phase",
    "in_phase",
    "running_watchdog",
    "watch_launch",
    "HangWatchdog",
    "exit_with_launcher",
    "CollectiveTimeoutError",
    "describe_stuck_collective",
    "naming_collective_timeouts",
    "ranks_never_started",
]
