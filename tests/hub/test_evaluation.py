"""The local ``evaluate`` metric (perplexity, bits per byte from summed NLL and byte counts): loadable offline
with ``evaluate.load(path)``, exact under any split of the sums, and the same numbers from ``boost-hf eval`` and
from the trainer's evaluation."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from boost_hf.data import causal_lm_collator
from boost_hf.evaluation import METRIC_PATH, load_metric, metrics_from_sums, sums_of_batch, target_bytes


def test_metric_loads_offline_and_computes_from_sums():
    import evaluate

    metric = evaluate.load(METRIC_PATH)  # a local folder: no hub access (tests run with HF_HUB_OFFLINE=1)
    result = metric.compute(nll_sum=[10 * math.log(2)], token_count=[10], byte_count=[5])
    assert result["perplexity"] == pytest.approx(2.0) and result["bits_per_byte"] == pytest.approx(2.0)
    assert result["tokens"] == 10 and result["bytes"] == 5
    assert load_metric().compute(nll_sum=[1.0], token_count=[1], byte_count=[0])["bits_per_byte"] is None
    with pytest.raises(ValueError, match="token_count sums to 0"):
        load_metric().compute(nll_sum=[0.0], token_count=[0], byte_count=[1])


def test_sums_split_over_shards_equal_the_whole(trained_run):
    """What DP ranks do: each sums its shard, the sums are added (all-reduce), the metric runs once."""
    trainer, _ = trained_run
    model, tokenizer = trainer.model.eval(), trainer.processing_class
    batch = causal_lm_collator([trainer.eval_dataset[i] for i in range(8)])  # blocks hold ids; labels derived
    halves = [{name: value[i::2] for name, value in batch.items()} for i in range(2)]
    with torch.no_grad():
        whole = sums_of_batch(model, batch, tokenizer)
        split = sum(sums_of_batch(model, half, tokenizer) for half in halves)
    assert whole[1] == 8 * 31 and whole[2] == target_bytes(tokenizer, batch["labels"]) > 0
    assert torch.equal(split[1:], whole[1:])  # token and byte counts: exact
    torch.testing.assert_close(split[0], whole[0], rtol=1e-6, atol=0)  # each batch's NLL sum is an fp32 reduction
    with torch.no_grad():
        mean_loss = model(**batch).loss.item()
    assert metrics_from_sums(whole)["eval_loss"] == pytest.approx(mean_loss, rel=1e-5)


def test_boost_hf_eval_matches_the_trainers_evaluation(trained_run, hub_texts, tmp_path):
    trainer, final = trained_run
    data = tmp_path / "validation.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in hub_texts["validation"]))
    result = subprocess.run([sys.executable, "-m", "boost_hf.cli", "eval", str(final), "--data", str(data), "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cli = json.loads(result.stdout[result.stdout.index("{"):])
    last = [log for log in trainer.state.log_history if "eval_bits_per_byte" in log][-1]
    assert cli["eval_blocks"] == len(trainer.eval_dataset)
    for name in ("eval_loss", "eval_perplexity", "eval_bits_per_byte"):
        assert cli[name] == pytest.approx(last[name], rel=1e-6), name
