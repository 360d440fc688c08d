"""No hangs: a frozen rank stops every process within ``--hang_timeout_s``, a rank alive but stuck outside the
collectives within ``--ddp_timeout`` (named), and ``kill -9`` of the launcher takes its workers with it; no lost step:
a preempted run (SIGTERM to the launcher, SIGUSR1 to one rank) saves at the step every rank agreed on and its requeue
takes the lock over. Each case launches ``torchrun`` with 2 CPU processes (tp 2) on a long run, waits for the first
logged loss, injects the fault and gives the processes a hard deadline; ``finally`` kills whatever is left.
(The multi-node launch is in ``test_distributed.py``.)"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time

import pytest

from boost_hf.training import BoostTrainingArguments
from boost_hf.training.preemption import PREEMPTED_EXIT_CODE
from boost_hf.training.watchdog import HANG_EXIT_CODE

from .launcher import DEMO_RECIPE, TINY, kill_group, run_command, start_command, torchrun_command

HANG_TIMEOUT_S = 5
STARTUP_DEADLINE_S = 180


DDP_TIMEOUT_S = 8


def long_run(training_env, output_dir, script: str = "recipes/pretrain.py", *extra, max_steps: int = 100000,
             phase_argument: str | None = None) -> list[str]:
    args = [*TINY, "--dataset", training_env["CORPUS"], "--tp_size", "2", "--per_device_train_batch_size", "8",
            "--output_dir", output_dir, "--hang_timeout_s", str(HANG_TIMEOUT_S), *extra]
    args[args.index("--max_steps") + 1] = str(max_steps)
    return torchrun_command(2, script, *([phase_argument] if phase_argument else []), DEMO_RECIPE, *args)


def worker_ranks(launcher_pid: int) -> dict[int, int]:
    """``{pid: RANK}`` of the launcher's child processes."""
    workers = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, IndexError, ValueError):
            continue
        if b"RANK" in env:
            workers[int(entry)] = int(env[b"RANK"])
    return workers


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Launch:
    """A started launcher whose output is read in the background; ``wait_for`` a fragment of it."""

    def __init__(self, args, env):
        self.proc = start_command(args, env)
        self.lines: list[str] = []
        self.workers: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, fragment: str, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        while fragment not in self.output:
            if time.monotonic() > end or self.proc.poll() is not None:
                raise AssertionError(f"no {fragment!r} in the output within {deadline_s}s:\n{self.output[-6000:]}")
            time.sleep(0.2)
        self.workers = worker_ranks(self.proc.pid)
        assert sorted(self.workers.values()) == [0, 1], self.workers

    def stops_within(self, limit_s: float) -> None:
        """The launcher exits, non-zero, within ``limit_s`` seconds from now."""
        start = time.monotonic()
        returncode = self.proc.wait(timeout=limit_s + 20)
        elapsed = time.monotonic() - start
        time.sleep(0.5)
        assert returncode != 0
        assert elapsed < limit_s, f"the run took {elapsed:.0f}s to stop"

    def cleanup(self) -> None:
        kill_group(self.proc)
        for pid in self.workers:  # the workers run in sessions of their own
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)


def test_frozen_rank_stops_every_process(training_env, tmp_path):
    launch = Launch(long_run(training_env, tmp_path / "run"), training_env)
    try:
        launch.wait_for("'loss'", STARTUP_DEADLINE_S)
        frozen = next(pid for pid, rank in launch.workers.items() if rank == 1)
        os.kill(frozen, signal.SIGSTOP)
        launch.stops_within(HANG_TIMEOUT_S + 20)
        message = f"boost-hf watchdog: rank 1 (pid {frozen} on {socket.gethostname()}) has not responded for {HANG_TIMEOUT_S} s"
        assert message in launch.output, launch.output[-4000:]
        assert "rank 0 stops at step" in launch.output and f"exit status {HANG_EXIT_CODE}" in launch.output, launch.output[-3000:]
        assert not [pid for pid in launch.workers if alive(pid)], "a worker is still running"
    finally:
        launch.cleanup()


@pytest.mark.parametrize("phase, named", [("process-group", "process-group set-up"), ("datasets", "dataset building")])
def test_a_rank_frozen_before_training_is_named_with_its_phase(training_env, tmp_path, phase, named):
    """The watchdog starts before the process group: a rank stopped while the others set up the process group (they
    wait in its rendezvous) or build the datasets (they wait in a barrier) ends the run within ``--hang_timeout_s``,
    not ``--ddp_timeout`` (30 minutes by default) with raw store or gloo errors."""
    launch = Launch(long_run(training_env, tmp_path / "run", "tests/training/frozen_rank.py", phase_argument=phase), training_env)
    try:
        launch.wait_for(f"rank 1 stops itself during {phase}", STARTUP_DEADLINE_S)
        launch.stops_within(HANG_TIMEOUT_S + 20)
        frozen = next(pid for pid, rank in launch.workers.items() if rank == 1)
        assert (f"boost-hf watchdog: rank 1 (pid {frozen} on {socket.gethostname()}) has not responded for {HANG_TIMEOUT_S} s "
                f"during {named} (frozen, stopped or its machine hangs); rank 0 stops during {named} with exit status "
                f"{HANG_EXIT_CODE}") in launch.output, launch.output[-4000:]
        assert not [pid for pid in launch.workers if alive(pid)], "a worker is still running"
    finally:
        launch.cleanup()


@pytest.mark.parametrize("bound", ["startup_timeout_s", "ddp_timeout"])
def test_a_rank_that_never_starts_is_named_within_the_start_up_timeout(training_env, tmp_path, bound):
    """Rank 1 frozen before its watchdog starts (as while importing): it never beats. ``--startup_timeout_s 15``: the
    watchdog names it ~15 s after rank 0 started (it used to wait max(--hang_timeout_s, 300 s)); a shorter
    ``--ddp_timeout`` (10 s): the process group's set-up fails first, and its error names the rank that never started
    instead of the store's ``DistStoreError``."""
    limit = {"startup_timeout_s": 15, "ddp_timeout": 10}[bound]
    launch = Launch(long_run(training_env, tmp_path / "run", "tests/training/frozen_rank.py", f"--{bound}", str(limit),
                             phase_argument="start-up"), training_env)
    try:
        launch.wait_for("rank 1 stops itself during start-up", STARTUP_DEADLINE_S)
        launch.stops_within(limit + 90)  # rank 0's imports, its limit, the launcher's 30 s before SIGKILL of the stopped rank
        if bound == "startup_timeout_s":
            expected = (rf"boost-hf watchdog: rank 1 has not started \(no heartbeat 15 s after rank 0's start, "
                        rf"--startup_timeout_s: .*\); rank 0 stops during process-group set-up with exit status {HANG_EXIT_CODE}")
        else:
            expected = (r"RuntimeError: the process group could not be set up \(.*\): rank 1 never started \(no heartbeat in "
                        r"the launcher's store: .*\) within --ddp_timeout 10 s")
        assert re.search(expected, launch.output), launch.output[-4000:]
        assert not [pid for pid in launch.workers if alive(pid)], "a worker is still running"
    finally:
        launch.cleanup()


STUCK_COLLECTIVES = {
    "tp2": r"\w+ in the (TP group \(ranks \[0, 1\]\)|default group \(all 2 ranks\)), called from .+",
    # pp 2 x dp 1: the first stage waits for the second stage's gradients (was: "a collective run by torch itself")
    "pp2": r"a point-to-point send/receive between pipeline stages of stage 0 \(of 2\) in the PP group \(ranks \[0, 1\]\) "
           r"\(activations forward, gradients backward\), called from .+pipeline.py:\d+ \(_run\)",
}


@pytest.mark.parametrize("layout", list(STUCK_COLLECTIVES))
def test_alive_but_stuck_rank_ends_the_run_within_ddp_timeout_naming_the_collective(training_env, tmp_path, layout):
    """Rank 1 sleeps before step 3 (tests/training/stuck_rank.py): its heartbeat goes on, so the hang watchdog does
    not fire; rank 0 waits in step 3's first collective until ``--ddp_timeout`` (8 s; gloo's default is 30 min)."""
    sizes = ("--tp_size", "1", "--pp_size", "2") if layout == "pp2" else ()
    launch = Launch(long_run(training_env, tmp_path / "run", "tests/training/stuck_rank.py", "--ddp_timeout", str(DDP_TIMEOUT_S),
                             *sizes), training_env)
    try:
        launch.wait_for("rank 1 is stuck before step 3", STARTUP_DEADLINE_S)
        launch.stops_within(DDP_TIMEOUT_S + 30)
        assert re.search(
            rf"CollectiveTimeoutError: rank 0: {STUCK_COLLECTIVES[layout]} did not complete within {DDP_TIMEOUT_S} s "
            r"\(--ddp_timeout\) at step 3: another rank of that group is alive but did not reach it", launch.output), launch.output[-4000:]
        assert "boost-hf watchdog" not in launch.output  # the stuck rank kept beating: not taken for frozen
        assert not [pid for pid in launch.workers if alive(pid)], "a worker is still running"
    finally:
        launch.cleanup()


def test_killed_launcher_takes_its_workers_with_it(training_env, tmp_path):
    launch = Launch(long_run(training_env, tmp_path / "run"), training_env)
    try:
        launch.wait_for("'loss'", STARTUP_DEADLINE_S)
        os.kill(launch.proc.pid, signal.SIGKILL)  # the launcher only, as `kill -9 <torchrun pid>` does
        end = time.monotonic() + 10
        while [pid for pid in launch.workers if alive(pid)] and time.monotonic() < end:
            time.sleep(0.1)
        assert not [pid for pid in launch.workers if alive(pid)], "workers kept training after their launcher died"
    finally:
        launch.cleanup()


def test_hang_timeout_is_validated(tmp_path):
    with pytest.raises(ValueError, match=r"hang_timeout_s must be >= 0 \(0 disables the watchdog\), got -1"):
        BoostTrainingArguments(output_dir=str(tmp_path), hang_timeout_s=-1)
    with pytest.raises(ValueError, match=r"startup_timeout_s must be > 0 \(unset: max\(hang_timeout_s, 300\)\), got 0"):
        BoostTrainingArguments(output_dir=str(tmp_path), startup_timeout_s=0)


def logged_losses(trainer_state) -> dict[int, float]:
    with open(trainer_state) as f:
        return {log["step"]: log["loss"] for log in json.load(f)["log_history"] if "loss" in log}


def test_a_preempted_run_loses_no_step_and_its_requeue_on_another_node_takes_the_lock_over(training_env, tmp_path):
    """(1) SIGUSR1 reaches rank 1 only: both ranks stop after the same step, save it, exit 76. (2) The requeue (the same
    SLURM job, restart 1) finds the lock of a launch killed on "node-b", takes it over, resumes, and stops on SIGTERM
    to ``torchrun`` (which forwards it). (3) The uninterrupted run has the same loss at every step."""
    run, constant = tmp_path / "run", ("--lr_scheduler_type", "constant", "--warmup_steps", "0", "--sample_max_new_tokens", "0")
    stopped_at = r"(SIG\w+) received: every rank finished step (\d+) and the run saved '.*checkpoint-\2'; exiting with status 76"
    first = Launch(long_run(training_env, run, "recipes/pretrain.py", *constant, "--resume_from_checkpoint", "auto"), training_env)
    try:
        first.wait_for("'loss'", STARTUP_DEADLINE_S)
        os.kill(next(pid for pid, rank in first.workers.items() if rank == 1), signal.SIGUSR1)
        first.proc.wait(timeout=120)
        signal_name, step = re.search(stopped_at, first.output).groups()
        assert signal_name == "SIGUSR1" and re.search(rf"exitcode\s*: {PREEMPTED_EXIT_CODE}", first.output), first.output[-3000:]
        assert not [pid for pid in first.workers if alive(pid)]
    finally:
        first.cleanup()
    first_stop = int(step)
    assert (run / f"checkpoint-{first_stop}" / "manifest.json").is_file() and not (run / "final").exists()

    killed = {"run_id": "killed", "pid": 4242, "host": "node-b", "since": "before", "heartbeat": 0, "beats": 9,
              "launch": {"job": "slurm-4711", "attempt": [0, 0]}}
    (run / ".boost_hf.lock").write_text(json.dumps(killed))  # as a launch SIGKILLed on another node leaves it
    requeue = {**training_env, "SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "1"}
    second = Launch(long_run(training_env, run, "recipes/pretrain.py", *constant, "--resume_from_checkpoint", "auto"), requeue)
    try:
        second.wait_for("'loss'", STARTUP_DEADLINE_S)
        second.proc.send_signal(signal.SIGTERM)  # to torchrun, as SLURM and Kubernetes do
        second.proc.wait(timeout=120)
        signal_name, step = re.search(stopped_at, second.output).groups()
        assert signal_name == "SIGTERM", second.output[-3000:]
        assert "took over the lock of output_dir" in second.output and "an earlier launch of this job" in second.output
        assert not [pid for pid in second.workers if alive(pid)]
    finally:
        second.cleanup()
    second_stop = int(step)
    assert second_stop > first_stop and (run / f"checkpoint-{second_stop}" / "manifest.json").is_file()

    run_command(long_run(training_env, tmp_path / "whole", "recipes/pretrain.py", *constant, max_steps=second_stop), training_env,
                timeout=STARTUP_DEADLINE_S + 120)
    preempted = logged_losses(run / f"checkpoint-{second_stop}" / "trainer_state.json")
    assert list(preempted) == list(range(1, second_stop + 1))
    assert preempted == logged_losses(tmp_path / "whole" / "trainer_state.json")  # bit-identical, step by step
