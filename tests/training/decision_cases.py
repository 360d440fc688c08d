"""Run on 2 gloo ranks by ``test_decisions.py``, in one launch (:func:`decisions_and_failures`): each rank sees its own
listing of the run folder (rank 1's is stale, as a shared file system's may be), the decisions are rank 0's on both;
a save that fails on the writer only reaches both ranks."""

from __future__ import annotations

import os

import torch.distributed as dist


def stale_listings(run_dir: str) -> dict:
    from boost_hf.checkpoint import folders as checkpoint
    from boost_hf.checkpoint import resume_point

    rank = dist.get_rank()
    if rank == 1:  # a stale listing: the newest checkpoint is not there yet
        def stale(run, skipped=None):
            return [os.path.join(run, "checkpoint-2")] if os.path.isdir(run) else []

        checkpoint.completed_checkpoints = stale
        resume_point.last_checkpoint = lambda run: stale(run)[-1]
    outcome = {"last": resume_point.resume_checkpoint(run_dir, True), "auto": resume_point.resume_checkpoint(run_dir, "auto"),
               "complete": resume_point.checkpoint_is_complete(os.path.join(run_dir, "checkpoint-4"))}
    try:
        resume_point.resume_checkpoint(os.path.join(run_dir, "empty"), "last")
    except FileNotFoundError as error:
        outcome["error"] = str(error)
    return outcome


def _fail_on_rank_zero(module, name: str, error: Exception):
    """``module.name`` replaced, on global rank 0 only, by a function raising ``error``; the original returned."""
    original = getattr(module, name)

    def failing(*args, **kwargs):
        raise error

    if dist.get_rank() == 0:
        setattr(module, name, failing)
    return original


def failures_reach_every_rank(run_dir: str) -> dict:
    """Each case: a save (or the output folder's claim) that fails on the writer (global rank 0) only, before a
    collective the other rank is already in. Per case, what this rank raised (type, message), how long it took and
    the staging folders left."""
    import errno
    import time

    import torch

    from boost_hf.checkpoint import folders, lock, run_folder
    from types import SimpleNamespace

    from boost_hf.checkpoint.folders import CheckpointSaver, atomic_directory

    rank = dist.get_rank()
    full = OSError(errno.ENOSPC, "No space left on device")

    def small_files(staging: str) -> None:
        if rank == 0:  # the writer's trainer_state.json, config.json ...: a full disk
            raise full
        torch.save({"rng": rank}, os.path.join(staging, f"rng_state_{rank}.pth"))

    def save(folder: str, asynchronous: bool = False, write_files=lambda staging: None, after_commit=None) -> None:
        saver = CheckpointSaver(is_writer=rank == 0, run_id="run")
        saver.save(os.path.join(folder, "checkpoint-1"), write_files=write_files,
                   state_dict={"model": {"w": torch.full((4,), float(rank))}}, asynchronous=asynchronous,
                   after_commit=after_commit if rank == 0 else None)
        saver.wait()

    def final(folder: str) -> None:
        with atomic_directory(os.path.join(folder, "final"), is_writer=rank == 0, run_id="run"):
            if rank == 0:
                raise full

    def claim(folder: str) -> None:
        run_folder.RunFolder(SimpleNamespace(output_dir=folder, should_save=rank == 0)).claim()

    def rotation() -> None:
        raise OSError(errno.EACCES, "Permission denied: checkpoint-0")

    cases = {  # name: (what fails on rank 0: (module, attribute, error) or None, the case)
        "small files": (None, lambda folder: save(folder, write_files=small_files)),
        "rename": ((folders, "_replace", OSError(errno.EIO, "Input/output error")), save),
        "rotation": (None, lambda folder: save(folder, after_commit=rotation)),
        "async manifest": ((folders, "write_manifest", full), lambda folder: save(folder, asynchronous=True)),
        "final": (None, final),
        "claim": ((lock.OutputDirLock, "acquire", PermissionError(errno.EACCES, "Permission denied: '.boost_hf.lock'")), claim),
    }
    outcome = {}
    for name, (patch, case) in cases.items():
        folder = os.path.join(run_dir, name.replace(" ", "-"))
        original = _fail_on_rank_zero(*patch) if patch is not None else None
        started = time.monotonic()
        try:
            case(folder)
            raised = None
        except Exception as error:  # noqa: BLE001 (what each rank raised is the result)
            raised = [type(error).__name__, str(error)]
        finally:
            if patch is not None:
                setattr(patch[0], patch[1], original)
        seconds = time.monotonic() - started
        dist.barrier()  # both ranks are done with the case (the writer removed its staging folder)
        staging = sorted(n for n in os.listdir(folder) if ".tmp-" in n) if os.path.isdir(folder) else []
        outcome[name] = {"raised": raised, "seconds": seconds, "staging": staging}
    return outcome


def decisions_and_failures(run_dir: str, failures_dir: str) -> dict:
    """The two groups of cases in one launch: :func:`stale_listings`, :func:`failures_reach_every_rank`."""
    return {"decisions": stale_listings(run_dir), "failures": failures_reach_every_rank(failures_dir)}
