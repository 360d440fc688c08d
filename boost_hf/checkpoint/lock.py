"""The run's claim on ``output_dir``: ``<output_dir>/.boost_hf.lock``, held by one process of a run (global rank 0).

The lock file records who holds it: the run id, the host and pid, the launch (:func:`launch_identity`: the SLURM job
and its requeue count, or torchelastic's run id and restart count); it is created exclusively and never written over.
Its heartbeat is its modification time, which a thread of the owner moves every ``heartbeat_s`` seconds (a lock
written by an earlier boost-hf version holds a time stamp and a counter instead, rewritten at each beat). A second
run into the folder is refused with
:class:`OutputDirInUseError` unless the owner is provably gone:

* it ran on this host and its process is gone (checked by pid and the process's start time; a live one is refused
  at once);
* it is an earlier launch of the same job (the same ``SLURM_JOB_ID`` with a lower ``SLURM_RESTART_COUNT``, or the
  same ``TORCHELASTIC_RUN_ID`` with a lower ``TORCHELASTIC_RESTART_COUNT``): a requeued job takes its own lock
  over at once, on any node, as the scheduler ended the earlier launch before starting this one;
* its heartbeat stopped: the owner's last beat is older than ``stale_after_s`` seconds (by the time stamp it wrote)
  *and* its counter does not move while this process watches it for 1.5 heartbeats (by this process's own clock,
  so a skewed clock alone never takes a live run's lock). A beat younger than the bound is watched until it moves
  (a live run: refused within ~1.5 heartbeats) or becomes older than the bound (taken over: at most
  ``stale_after_s`` of waiting);
* the lock file is damaged (not JSON: a run killed between creating and writing it, or a file written over) and
  stays so, unchanged, for 2 heartbeats (said at once, while it is watched): a live owner rewrites its damaged lock
  at its next heartbeat (unless the damage is younger than half a heartbeat: another run's lock being created).

The owner's heartbeat thread also checks that the lock still names its run; if another run took it over (the
owner was frozen longer than the bound), the owner stops at once rather than write into a folder another run owns.

No check-then-act race: a run takes a gone owner's lock over by renaming it to a name of its own, then checking that
what it moved aside is the lock it judged (another run's new lock, created meanwhile, is put back and judged in
turn), and creates its own exclusively; the heartbeat moves only the modification time of the file the owner
created, through its descriptor, so it cannot write over a lock taken over while the owner was frozen between its
check and its beat.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid

LOCK_NAME = ".boost_hf.lock"
HEARTBEAT_S = 10.0
"""Seconds between two heartbeats of the lock's owner."""
STALE_AFTER_S = 120.0
"""A lock whose heartbeat is older than this (and does not move while watched) belongs to a dead run."""
LOST_LOCK_EXIT_CODE = 1


class OutputDirInUseError(RuntimeError):
    """Another run holds the lock of this ``output_dir``."""


def launch_identity(environ=os.environ) -> dict | None:
    """``{"job": ..., "attempt": [...]}`` of this launch, or ``None`` when no scheduler or elastic agent names it.

    ``job``: ``slurm-<SLURM_JOB_ID>`` (kept across requeues) or ``torchelastic-<TORCHELASTIC_RUN_ID>`` (the rendezvous
    id, e.g. ``torchrun --rdzv-id``; torchrun's static rendezvous names every launch ``none``, which identifies
    nothing). ``attempt``: ``[SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT]``, compared in that order."""
    slurm_job = environ.get("SLURM_JOB_ID")
    elastic_run = environ.get("TORCHELASTIC_RUN_ID")
    if slurm_job:
        job = f"slurm-{slurm_job}"
    elif elastic_run and elastic_run != "none":
        job = f"torchelastic-{elastic_run}"
    else:
        return None
    attempt = [int(environ.get("SLURM_RESTART_COUNT") or 0), int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0)]
    return {"job": job, "attempt": attempt}


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, Linux), ``None`` if it does not exist (or elsewhere
    than Linux: ``0`` when it exists). With the pid it names one process, even where pids are reused (a restarted
    container numbers its processes again)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except FileNotFoundError:
        return None
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0


def _describe(owner: dict) -> str:
    if owner.get("damaged"):
        return "a damaged lock file, owner unknown"
    launch = owner.get("launch")
    job = f", {launch['job']} attempt {launch['attempt']}" if launch else ""
    return f"pid {owner.get('pid')} on {owner.get('host')}{job}, since {owner.get('since')}"


class OutputDirLock:
    """``<output_dir>/.boost_hf.lock``, created exclusively by one process of a run and removed at its exit; its
    heartbeat is the lock's modification time, moved every ``heartbeat_s`` through the file descriptor the owner
    created it with, so the lock's content is written once and a beat can only ever touch the owner's own file, never
    another run's lock under that name. :meth:`acquire` takes over the lock of a run that is provably gone (see the
    module) and raises :class:`OutputDirInUseError` for any other. A lock is taken over (or released, or a damaged one
    repaired) by renaming it to a name of this process's own and checking that the file moved aside is the one judged:
    if another run's lock was created meanwhile, it is put back and judged in turn, so two runs racing for a dead
    run's folder never both hold it."""

    def __init__(self, output_dir: str, *, heartbeat_s: float = HEARTBEAT_S, stale_after_s: float = STALE_AFTER_S):
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_NAME)
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.held = False
        self.taken_over: str | None = None
        """Why an earlier owner's lock was taken over (``None``: the folder was free)."""
        self._owner: dict | None = None
        self._fd: int | None = None  # the lock this run created (its inode, wherever it is renamed to)
        self._stop = threading.Event()
        self._releasing = threading.Lock()  # a heartbeat and the release never interleave

    def acquire(self, run_id: str) -> None:
        """Create the lock for ``run_id`` (taking over a gone owner's) and start the heartbeat."""
        os.makedirs(self.output_dir, exist_ok=True)
        owner = {"run_id": run_id, "pid": os.getpid(), "pid_start": _process_start(os.getpid()), "host": socket.gethostname(),
                 "launch": launch_identity(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(3):
            self._fd = _create(self.path, json.dumps(owner))
            if self._fd is not None:
                self._owner, self.held = owner, True
                atexit.register(self.release)
                threading.Thread(target=self._beat, name="boost-hf-output-lock", daemon=True).start()
                return
            self._take_over_if_gone()
        raise OutputDirInUseError(f"could not lock output_dir {self.output_dir!r}: another run keeps creating {self.path}.")

    def _record(self, path: str) -> dict:
        """The lock file ``path`` as written (``{}``: none). A damaged one (e.g. empty: its owner died between creating
        and writing it) reads as a record whose heartbeat is the file's modification time."""
        try:
            with open(path) as f:
                record = json.load(f)
            if isinstance(record, dict):
                return record
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            pass
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            return {}
        return {"damaged": True, "heartbeat": stat.st_mtime, "beats": stat.st_mtime_ns}

    def _read(self) -> dict:
        """The lock's owner with its heartbeat, ``heartbeat`` (a time stamp) and ``beats`` (what moves at each beat):
        the lock's modification time (a lock written by an earlier boost-hf version holds them itself), and
        ``written``, the record as the lock holds it. ``{}``: no lock."""
        record = self._record(self.path)
        if not record:
            return {}
        owner = {**record, "written": record}
        if "beats" not in record:
            with contextlib.suppress(FileNotFoundError):
                stat = os.stat(self.path)
                owner.update(heartbeat=stat.st_mtime, beats=stat.st_mtime_ns)
        return owner

    def _move_aside_if(self, written: dict) -> bool:
        """Remove the lock if it is still ``written`` (a record as :meth:`_record` reads it): renamed to a name of this
        process's own first, then checked; another run's lock (created since ``written`` was read) is put back under
        its name (the same file, where hard links exist). Whether ``written`` was removed."""
        aside = f"{self.path}.{os.getpid()}-{uuid.uuid4().hex[:8]}.aside"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False  # removed meanwhile (released, or taken over by another run)
        if self._record(aside) == written:
            os.remove(aside)
            return True
        try:  # another run's: back under its name, unless a third run created one meanwhile
            os.link(aside, self.path)
        except FileExistsError:
            pass
        except OSError:  # no hard links on this file system: a copy (its owner adopts it at its next beat)
            with open(aside, "rb") as f:
                fd = _create(self.path, f.read())
            if fd is not None:
                os.close(fd)
        os.remove(aside)
        return False

    def _take_over_if_gone(self) -> None:
        """Remove the lock if its owner is provably gone (see the module); else raise :class:`OutputDirInUseError`."""
        owner = self._read()
        if not owner:
            return  # released meanwhile
        reason = self._gone_reason(owner)
        if reason is None:
            raise OutputDirInUseError(
                f"output_dir {self.output_dir!r} is in use by another run ({_describe(owner)}; its heartbeat goes on): "
                f"wait for it to finish or choose another output_dir. A dead run's lock is taken over by itself "
                f"(same host; a requeue of the same SLURM job or torchelastic run; or a heartbeat older than "
                f"{self.stale_after_s:g} s); to take it now, delete {self.path}."
            )
        if not self._move_aside_if(owner["written"]):
            return  # another run's lock now: the next attempt judges it
        self.taken_over = f"{_describe(owner)}: {reason}"
        print(f"boost-hf: took over the lock of output_dir {self.output_dir!r} from {self.taken_over}.", file=sys.stderr, flush=True)

    def _gone_reason(self, owner: dict) -> str | None:
        """Why ``owner`` is provably gone, or ``None`` if it may be alive (watching its heartbeat if it has one)."""
        if owner.get("host") == socket.gethostname():
            started = _process_start(int(owner.get("pid", -1)))
            if started is None or owner.get("pid_start", started) != started:
                return "its process is gone"
            return None  # that very process runs on this host
        ours, theirs = launch_identity(), owner.get("launch")
        if ours and theirs and ours["job"] == theirs["job"] and list(theirs["attempt"]) < ours["attempt"]:
            return f"it is an earlier launch of this job (attempt {theirs['attempt']}, this one {ours['attempt']})"
        if "beats" not in owner:
            return None  # a lock without heartbeat: only its pid, on its host, can tell
        confirm = (2.0 if owner.get("damaged") else 1.5) * self.heartbeat_s
        if owner.get("damaged"):
            print(f"boost-hf: output_dir {self.output_dir!r} holds a damaged lock file {self.path} (not the record a run "
                  f"writes): taking it over if it stays so for {confirm:g} s (a live run rewrites its lock every "
                  f"{self.heartbeat_s:g} s).", file=sys.stderr, flush=True)
        watched_since = time.monotonic()
        while True:
            time.sleep(min(self.heartbeat_s / 2, 1.0))
            now = self._read()
            if now.get("run_id") != owner.get("run_id") or now.get("beats") != owner.get("beats"):
                return None if now else "it released the lock"  # alive (or replaced by a live run)
            age = time.time() - float(owner.get("heartbeat", 0))
            watched = time.monotonic() - watched_since
            if owner.get("damaged") and watched >= confirm:  # a live owner repairs its lock at its next beat
                return f"it stayed damaged for {watched:.0f} s, unrepaired by any live run's heartbeat"
            if age > self.stale_after_s and watched >= confirm:
                return f"its heartbeat stopped {age:.0f} s ago"
            if watched > self.stale_after_s + confirm:  # its clock runs ahead of ours: our own watch decides
                return f"its heartbeat did not move for {watched:.0f} s"

    def _beat(self) -> None:
        """Every ``heartbeat_s``: check that the lock is still this run's, then move the modification time of the file
        this run created (:meth:`acquire`'s descriptor: its own lock, never one another run created under the name). A
        lock deleted by hand is created again (the folder gone: the beat ends), a copy of this run's lock (put back by a
        run that moved it aside) adopted, a damaged one repaired (unless younger than half a heartbeat: maybe another
        run's between its creation and its first write); one naming another run ends this process
        (:data:`LOST_LOCK_EXIT_CODE`)."""
        while not self._stop.wait(self.heartbeat_s):
            with self._releasing:
                if self._stop.is_set():
                    return
                current = self._record(self.path)
                if current.get("damaged") and time.time() - current["heartbeat"] < self.heartbeat_s / 2:
                    continue  # maybe another run's lock between its creation and its first write: read it next beat
                if current.get("damaged"):
                    print(f"boost-hf: the lock file {self.path} of this run was damaged; rewriting it.", file=sys.stderr, flush=True)
                    if self._move_aside_if(current):
                        self._adopt(_create(self.path, json.dumps(self._owner)))
                    continue  # whose it is now: the next beat reads it
                if current and current.get("run_id") != self._owner["run_id"]:
                    print(f"boost-hf: the lock of output_dir {self.output_dir!r} was taken over by another run "
                          f"({_describe(current)}) while this run (pid {os.getpid()}) held it; this run stops so that only one "
                          "run writes there.", file=sys.stderr, flush=True)
                    os._exit(LOST_LOCK_EXIT_CODE)
                if not os.path.isdir(self.output_dir):
                    return
                if not current:  # deleted by hand
                    self._adopt(_create(self.path, json.dumps(self._owner)))
                    continue
                with contextlib.suppress(OSError):
                    if not os.path.samestat(os.fstat(self._fd), os.stat(self.path)):  # this run's lock, copied back
                        self._adopt(os.open(self.path, os.O_RDONLY))
                    os.utime(self._fd)  # a full or unreachable disk: the next beat tries again

    def _adopt(self, fd: int | None) -> None:
        """Beat through ``fd`` from now on (``None``: another run created the lock first; the next beat reads it)."""
        if fd is not None:
            os.close(self._fd)
            self._fd = fd

    def release(self) -> None:
        """Stop the heartbeat and remove the lock (if it is still this run's)."""
        if not self.held:
            return
        self.held = False
        with self._releasing:
            self._stop.set()
            with contextlib.suppress(OSError):
                os.close(self._fd)  # before the file goes (NFS keeps a removed open file as .nfs<id> until it is closed)
            written = self._record(self.path)
            if written.get("run_id") == self._owner["run_id"]:
                self._move_aside_if(written)


def _create(path: str, content: str | bytes) -> int | None:
    """Create ``path`` holding ``content`` if it does not exist (``O_EXCL``): the open file descriptor, or ``None`` if
    the file exists."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR)
    except FileExistsError:
        return None
    os.write(fd, content.encode() if isinstance(content, str) else content)
    return fd


__all__ = ["LOCK_NAME", "OutputDirInUseError", "OutputDirLock", "launch_identity"]
