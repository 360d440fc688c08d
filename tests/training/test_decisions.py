"""One decision, broadcast (:mod:`boost_hf.checkpoint.decisions`): the checkpoint ``last`` / ``auto`` means and whether a
checkpoint exists are rank 0's on every rank, its errors raised on every rank with their type; a phase of a save that
fails on one rank is raised on every rank before the next collective."""

from __future__ import annotations

import re

import pytest

from boost_hf.checkpoint.integrity import write_manifest
from boost_hf.checkpoint.decisions import decided_on_rank_zero
from boost_hf.checkpoint.resume_point import checkpoint_is_complete, resume_checkpoint

from ..distributed import launch
from .decision_cases import decisions_and_failures


def run_with_checkpoints(folder, *steps) -> str:
    for step in steps:
        checkpoint = folder / f"checkpoint-{step}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "trainer_state.json").write_text("{}")
        write_manifest(str(checkpoint))
    (folder / "empty").mkdir()
    return str(folder)


def test_in_one_process_each_decision_is_the_file_systems(tmp_path):
    run = run_with_checkpoints(tmp_path / "run", 2, 4)
    (tmp_path / "run" / "checkpoint-6").mkdir()  # incomplete: no manifest
    assert resume_checkpoint(run, True) == resume_checkpoint(run, "last") == resume_checkpoint(run, "auto") == f"{run}/checkpoint-4"
    assert resume_checkpoint(f"{run}/empty", "auto") is None and resume_checkpoint(run, None) is None
    assert resume_checkpoint(run, f"{run}/checkpoint-2") == f"{run}/checkpoint-2"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resume_checkpoint(f"{run}/empty", "last")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        resume_checkpoint(run, f"{run}/checkpoint-9")
    assert checkpoint_is_complete(f"{run}/checkpoint-4") and not checkpoint_is_complete(f"{run}/checkpoint-6")
    assert decided_on_rank_zero(lambda: 7) == 7


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> tuple[str, list[dict]]:
    """One 2-rank launch for the module's cases (:func:`~tests.training.decision_cases.decisions_and_failures`); a case
    that hangs (a rank waiting for a peer that left) ends the launch at its timeout."""
    folder = tmp_path_factory.mktemp("decisions")
    run = run_with_checkpoints(folder / "run", 2, 4)
    return run, launch(decisions_and_failures, 2, run, str(folder / "failures"), timeout=240)


def test_ranks_with_a_stale_listing_follow_rank_zero(launched):
    """Rank 1 lists only checkpoint-2; both ranks resume checkpoint-4 and know it complete, and a run folder without
    checkpoints is the same FileNotFoundError on both (raised on rank 0, sent to rank 1)."""
    run, (first, second) = launched[0], (outcome["decisions"] for outcome in launched[1])
    assert first == second
    assert (first["last"], first["auto"], first["complete"]) == (f"{run}/checkpoint-4", f"{run}/checkpoint-4", True)
    assert "no complete checkpoint" in first["error"] and first["error"].endswith("(decided on rank 0)")


FAILED_ON_THE_WRITER = {  # case: (type, what its message says)
    "small files": ("CheckpointWriteError", r"could not save '.*checkpoint-1': no space left on device"),
    "rename": ("CheckpointWriteError", r"could not save '.*checkpoint-1': I/O error \(OSError: \[Errno 5\] Input/output error\)"),
    "rotation": ("PermissionError", r"Permission denied: checkpoint-0"),
    "async manifest": ("CheckpointWriteError", r"could not save '.*checkpoint-1': no space left on device"),
    "final": ("CheckpointWriteError", r"could not save '.*final': no space left on device"),
    "claim": ("PermissionError", r"Permission denied: '.boost_hf.lock'"),
}


@pytest.mark.parametrize("case", list(FAILED_ON_THE_WRITER))
def test_a_failure_on_the_writer_reaches_every_rank_at_once(launched, case):
    """A save (or the output folder's claim) failing on global rank 0 only, before a collective rank 1 is already in
    (the small files on a full disk, the rename, the rotation, the asynchronous save's manifest, the final model, the
    lock): both ranks raise the same error within seconds, rank 1's naming rank 0, and no staging folder is left.
    Before, rank 1 waited in the next collective until --ddp_timeout (30 minutes by default)."""
    kind, message = FAILED_ON_THE_WRITER[case]
    writer, other = (outcome["failures"][case] for outcome in launched[1])
    for outcome in (writer, other):
        assert outcome["raised"] is not None and outcome["raised"][0] == kind, outcome
        assert re.search(message, outcome["raised"][1]), outcome["raised"][1]
        assert outcome["seconds"] < 30, outcome
        assert outcome["staging"] == [], outcome
    assert re.search(r"\((on|decided on) rank 0\)$", other["raised"][1]), other["raised"][1]
