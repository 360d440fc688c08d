"""The pieces of BoostTrainer on their own: gradient norm under TP, DeepSpeed configuration, atomic
checkpoint folders, evaluation shards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import boost_hf.checkpoint.folders as checkpoint_module
from boost_hf.checkpoint.folders import atomic_directory, remove_stale_staging
from boost_hf.training.data import EvalShard
from boost_hf.training.deepspeed import configure_deepspeed
from boost_hf.training.grad_norm import clip_grad_norm_, global_grad_norm

from ..parallel.tp2_model_cases import section


def _norm_case() -> list[float]:
    """A sharded [8, 4] parameter (rows split over 2 ranks) and a replicated [3] one: the TP norm equals
    the norm of the full gradients, and clipping scales every shard by the same factor."""
    import torch.distributed as dist

    from boost_hf.parallel.sharding import ShardSpec, attach_shard_spec

    rank = dist.get_rank()
    torch.manual_seed(0)
    full, replicated = torch.randn(8, 4), torch.randn(3)
    sharded = torch.nn.Parameter(torch.zeros(4, 4))
    attach_shard_spec(sharded, ShardSpec((8, 4), 0, rank, 2))
    sharded.grad = full.chunk(2)[rank].clone()
    shared = torch.nn.Parameter(torch.zeros(3))
    attach_shard_spec(shared, ShardSpec((3,)))
    shared.grad = replicated.clone()
    norm = clip_grad_norm_([sharded, shared], 1.0, dist.group.WORLD)
    expected = torch.cat([full.flatten(), replicated]).norm()
    return [norm.item(), expected.item(), (sharded.grad / full.chunk(2)[rank]).mean().item()]


def test_global_grad_norm_sums_shards_once(tp2_model_results):
    """Run in the 2-rank launch shared with other files (tests/parallel/tp2_model_cases.py)."""
    for norm, expected, scale in section(tp2_model_results, "grad_norm"):
        assert norm == pytest.approx(expected, rel=1e-6)
        assert scale == pytest.approx(1.0 / expected, rel=1e-5)


def test_global_grad_norm_single_process_is_torch_norm():
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn_like(p)
    expected = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert global_grad_norm(params, None).item() == pytest.approx(expected.item(), rel=1e-6)


def _ds_args(**overrides):
    return SimpleNamespace(**{"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "world_size": 8,
                              "max_grad_norm": 0.5, **overrides})


def test_deepspeed_batch_size_counts_data_parallel_ranks_only():
    hf_config = SimpleNamespace(config={"train_batch_size": 64, "gradient_clipping": "auto"}, mismatches=["- ds train_batch_size=64 vs hf ..."])
    configure_deepspeed(hf_config, _ds_args(), dp_size=2)  # tp 4 x dp 2: 64 was transformers' world-size guess
    assert hf_config.config["train_batch_size"] == 4 * 2 * 2 and hf_config.config["gradient_clipping"] == 0.5
    assert hf_config.mismatches == []
    with pytest.raises(ValueError, match="gradient_clipping=1.0"):
        configure_deepspeed(SimpleNamespace(config={"gradient_clipping": 1.0}, mismatches=[]), _ds_args(), dp_size=2)


def test_atomic_directory_publishes_only_complete_folders(tmp_path):
    target = tmp_path / "checkpoint-1"
    with atomic_directory(str(target), is_writer=True, run_id="run-a") as staging:
        assert staging.endswith(".checkpoint-1.tmp-run-a"), "staging folders are unique per run"
        (tmp_path / staging / "a").write_text("1")
        assert not target.exists()
    assert (target / "a").read_text() == "1" and (target / "manifest.json").is_file()
    with pytest.raises(RuntimeError):
        with atomic_directory(str(target), is_writer=True, run_id="run-b") as staging:
            (tmp_path / staging / "a").write_text("2")
            raise RuntimeError("crash mid-save")
    assert (target / "a").read_text() == "1", "a failed save must not touch the published folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"], "the failed save left its staging folder"
    with atomic_directory(str(target), is_writer=True, run_id="run-c") as staging:
        (tmp_path / staging / "b").write_text("3")
    assert sorted(p.name for p in target.iterdir()) == ["b", "manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


def test_a_failed_rename_into_place_moves_the_old_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "final"
    target.mkdir()
    (target / "a").write_text("old")
    real_replace = checkpoint_module.os.replace

    def failing_second_rename(source, destination):
        if str(destination) == str(target) and ".tmp-" in str(source):
            raise OSError(5, "I/O error")
        real_replace(source, destination)

    monkeypatch.setattr(checkpoint_module.os, "replace", failing_second_rename)
    with pytest.raises(OSError):
        with atomic_directory(str(target), is_writer=True, run_id="run-b") as staging:
            (tmp_path / staging / "a").write_text("new")
    monkeypatch.undo()
    assert (target / "a").read_text() == "old"
    assert not any(".old-" in p.name for p in tmp_path.iterdir())


def test_a_folder_moved_aside_by_a_killed_run_is_restored_not_deleted(tmp_path, caplog):
    """Killed between ``_replace``'s two renames: ``final`` is missing, ``.final.old-<run>`` holds it."""
    (tmp_path / ".final.old-killed").mkdir()
    (tmp_path / ".final.old-killed" / "a").write_text("old")
    (tmp_path / ".final.tmp-killed").mkdir()  # the new folder, never renamed
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / ".checkpoint-4.old-killed").mkdir()  # killed after the rename, before the deletion
    with caplog.at_level("WARNING"):
        removed = remove_stale_staging(str(tmp_path), "next-run")
    assert sorted(removed) == [".checkpoint-4.old-killed", ".final.tmp-killed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "final"]
    assert (tmp_path / "final" / "a").read_text() == "old"
    assert "restored" in caplog.text and ".final.old-killed" in caplog.text


def test_eval_shards_cover_the_set_once_and_pad_with_masked_items():
    dataset = [{"input_ids": [i, i], "labels": [i, i]} for i in range(5)]
    shards = [EvalShard(dataset, 2, rank) for rank in range(2)]
    assert [len(s) for s in shards] == [3, 3]
    real = [item["input_ids"][0] for s in shards for item in s if torch.as_tensor(item["labels"]).ne(-100).any()]
    assert sorted(real) == [0, 1, 2, 3, 4]
    assert torch.as_tensor(shards[1][2]["labels"]).eq(-100).all()
