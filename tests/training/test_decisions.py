"""One decision, broadcast (:mod:`boost_hf.checkpoint.decisions`): the checkpoint ``last`` / ``auto`` means and whether a
checkpoint exists are rank 0's on every rank, its errors raised on every rank with their type."""

from __future__ import annotations


import pytest

from boost_hf.checkpoint.integrity import write_manifest
from boost_hf.checkpoint.decisions import checkpoint_is_complete, decided_on_rank_zero, resume_checkpoint

from ..distributed import launch
from .decision_cases import stale_listings


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


def test_ranks_with_a_stale_listing_follow_rank_zero(tmp_path):
    """Rank 1 lists only checkpoint-2; both ranks resume checkpoint-4 and know it complete, and a run folder without
    checkpoints is the same FileNotFoundError on both (raised on rank 0, sent to rank 1)."""
    run = run_with_checkpoints(tmp_path / "run", 2, 4)
    first, second = launch(stale_listings, 2, run)
    assert first == second
    assert (first["last"], first["auto"], first["complete"]) == (f"{run}/checkpoint-4", f"{run}/checkpoint-4", True)
    assert "no complete checkpoint" in first["error"] and first["error"].endswith("(decided on rank 0)")
