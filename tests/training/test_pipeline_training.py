"""``recipes/demo.yaml`` (shrunk, see ``launcher.TINY``, with 4 layers) trained through pipeline stages under
``accelerate launch`` on 4 CPU processes computes what one process computes with the same global batch:
pp 2 x tp 2 (1F1B, checkpoint saved at step 3 and resumed at the same layout; eager and ``--torch_compile``) and
pp 2 x dp 2 with the interleaved 1F1B schedule (2 stages per rank; eager and ``--torch_compile``, each stage in DDP);
the validation loss through the pipeline is the single process's, and so are ``compute_metrics``'s metrics (the same
on every rank; also for LaX and for the full-rank model under the megatron layout); the logged point-to-point bytes
are the formula's and what the stages handed to the engine's sends; the end-of-training sample is the final model's
greedy continuation; ``final/`` loads in plain ``transformers``. See ``pipeline_cases.py``.

Two launches (about 4 minutes on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .launcher import DEMO_RECIPE, TINY, accelerate_command, python_command, run_command
from .run_outputs import log_history, losses

RELATIVE_TOLERANCE = 1e-4
FOUR_LAYERS = ["--num_hidden_layers", "4", "--eval_strategy", "steps", "--eval_steps", "3"]


@pytest.fixture(scope="module")
def runs(training_env, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline_runs")
    common = [DEMO_RECIPE, *TINY, *FOUR_LAYERS, "--dataset", training_env["CORPUS"]]
    run_command(python_command("tests/training/pipeline_cases.py", "single", out, *common), training_env, timeout=300)
    run_command(accelerate_command("cpu-4proc.yaml", "tests/training/pipeline_cases.py", "pipelines", out, *common),
                training_env, timeout=1200)
    return out


def eval_losses(run: Path) -> dict[int, float]:
    return {entry["step"]: entry["eval_loss"] for entry in log_history(run) if "eval_loss" in entry}


def assert_close(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for step, value in expected.items():
        assert abs(actual[step] - value) <= RELATIVE_TOLERANCE * abs(value), (step, actual[step], value)


@pytest.mark.parametrize("run", ["pp2-tp2", "pp2-dp2-interleaved", "pp2-tp2-compiled", "pp2-dp2-interleaved-compiled", "pp2-tp2-sp"])
def test_pipeline_losses_match_one_process(runs, run):
    assert len(losses(runs / "single")) == 6
    assert_close(losses(runs / run), losses(runs / "single"))
    assert_close(eval_losses(runs / run), eval_losses(runs / "single"))


@pytest.mark.parametrize("run, stage_layers", [
    ("pp2-tp2", [[[0, 1]]] * 2 + [[[2, 3]]] * 2),  # the even split
    ("pp2-dp2-interleaved", [[[0], [2]]] * 2 + [[[1], [3]]] * 2),  # ranks (pp, dp, tp): stages 0 and 2 on pp rank 0
    ("pp2-tp2-sp", [[[0]]] * 2 + [[[1, 2, 3]]] * 2),  # --pp_layer_split 1,3 (its losses: the test above)
])
def test_runs_get_their_stage_layers(runs, run, stage_layers):
    assert [rank["stage_layers"] for rank in json.loads((runs / run / "p2p.json").read_text())] == stage_layers


@pytest.mark.parametrize("run", ["pp2-tp2", "pp2-dp2-interleaved"])
def test_compiled_pipeline_run_compiled_every_ranks_decoder_layers(runs, run):
    """``--torch_compile`` at pp 2 x tp 2 (1F1B) and at pp 2 x dp 2 (interleaved, 2 stages per rank, each in DDP) ran
    compiled graphs on every rank (its losses: the test above); the eager run none."""
    assert all(rank["compiled_graphs"] > 0 for rank in json.loads((runs / f"{run}-compiled" / "p2p.json").read_text()))
    assert all(rank["compiled_graphs"] == 0 for rank in json.loads((runs / run / "p2p.json").read_text()))


def test_resumed_pipeline_run_continues_the_same_run(runs):
    """The resumed run's log holds the checkpoint's steps 1-3 and its own steps 4-6: all the single process's."""
    assert_close(losses(runs / "pp2-tp2-resumed"), losses(runs / "single"))
    assert_close(eval_losses(runs / "pp2-tp2-resumed"), eval_losses(runs / "single"))


def test_final_model_is_canonical_and_loads_in_plain_transformers(runs):
    from transformers import AutoModelForCausalLM

    single = AutoModelForCausalLM.from_pretrained(runs / "single" / "final", trust_remote_code=True)
    piped = AutoModelForCausalLM.from_pretrained(runs / "pp2-tp2" / "final", trust_remote_code=True)
    reference = dict(single.named_parameters())
    assert sorted(reference) == sorted(n for n, _ in piped.named_parameters())
    for name, param in piped.named_parameters():
        rel = (param - reference[name]).norm() / reference[name].norm()
        assert rel <= RELATIVE_TOLERANCE, (name, float(rel))
    layout = json.loads((runs / "pp2-tp2" / "checkpoint-3" / "training_layout.json").read_text())
    assert layout["pp_size"] == 2 and layout["tp_size"] == 2
    assert sorted(p.name for p in (runs / "pp2-tp2" / "checkpoint-3" / "dcp").glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert torch.isfinite(torch.tensor(list(losses(runs / "pp2-tp2").values()))).all()


@pytest.mark.parametrize("fields, words", [
    ({"deepspeed": {"zero_optimization": {"stage": 2}}}, "DeepSpeed cannot run with pp_size=2"),
    ({"deepspeed": {"zero_optimization": {"stage": 3}}}, "Drop --deepspeed"),
    ({"gradient_accumulation_steps": 2}, "raise per_device_train_batch_size"),
])
def test_pipeline_refuses_deepspeed_and_gradient_accumulation(tmp_path, fields, words):
    from boost_hf.training import BoostTrainingArguments

    with pytest.raises(ValueError, match=words):
        BoostTrainingArguments(output_dir=str(tmp_path), pp_size=2, report_to="none", **fields)


@pytest.mark.parametrize("run, reference, bottleneck", [
    ("pp2-tp2", "single", "cola"),
    ("pp2-dp2-interleaved", "single", "cola"),
    ("pp2-tp2-lax", "single-lax", "lax"),  # btp: LaX's latents cross the stage boundary
    ("pp2-tp2-full-rank", "single-full-rank", None),  # the megatron layout (replicated residual, its vocab-parallel head)
])
def test_compute_metrics_under_pipeline_match_one_process(runs, run, reference, bottleneck):
    """``compute_metrics`` on the last stage's full-vocabulary logits (gathered over TP; of both DP replicas, the
    interleaved schedule's 4 micro-batches in order) gives the single process's metrics of the same trained model,
    and every rank (first stage included) returns the same ones."""
    single = json.loads((runs / f"metrics-{reference}.json").read_text())[0]
    every_rank = json.loads((runs / f"metrics-{run}.json").read_text())
    keys = ["eval_accuracy", "eval_mean_logsumexp", "eval_label_weighted_logsumexp", "eval_blocks", "eval_loss"]
    assert json.loads((runs / reference / "final" / "config.json").read_text())["bottleneck"] == bottleneck
    assert single["eval_blocks"] == 24 and single["eval_accuracy"] > 0
    assert len(every_rank) == 4 and all({k: m[k] for k in keys} == {k: every_rank[0][k] for k in keys} for m in every_rank)
    for key in keys:
        assert every_rank[0][key] == pytest.approx(single[key], rel=RELATIVE_TOLERANCE), key


@pytest.mark.parametrize("run, tp_size, rows, microbatches, crossings_per_microbatch", [
    ("pp2-tp2", 2, 8, 2, 1),  # one stage per rank: the first sends activations, the last gradients
    ("pp2-dp2-interleaved", 1, 4, 4, 3),  # rank 0 runs stages 0 and 2 of 4 (1 + 2 sends), rank 1 stages 1 and 3 (2 + 1)
    ("pp2-tp2-sp", 2, 8, 2, 1),  # latent sequence parallelism
])
def test_logged_p2p_bytes_are_the_formula_and_the_engines_sends(runs, run, tp_size, rows, microbatches, crossings_per_microbatch):
    """Every rank logs, each step, the bytes its stages handed to the engine's sends: the formula's per crossing
    (``rows / microbatches`` blocks of 32 tokens) times the micro-batches times its stages' crossings."""
    from boost_hf import BoostLlamaConfig, ParallelConfig
    from boost_hf.perf.comm_formula import stage_boundary_communication

    config = BoostLlamaConfig.from_pretrained(runs / run / "final")
    tokens = rows // microbatches * 32
    crossing = stage_boundary_communication(config, ParallelConfig(tp_size=tp_size, sequence_parallel=run.endswith("-sp")), tokens).bytes(dtype_bytes=4)  # fp32
    expected = crossings_per_microbatch * microbatches * crossing
    ranks = json.loads((runs / run / "p2p.json").read_text())
    assert len(ranks) == 4
    for rank in ranks:
        assert rank["sent"] == [expected] * 6 and rank["logged"] == [expected] * 6, (rank, expected)
    (single,) = json.loads((runs / "single" / "p2p.json").read_text())
    assert single["sent"] == [0] * 6 and single["logged"] == [0] * 6


@pytest.mark.parametrize("run", ["single", "pp2-tp2", "pp2-dp2-interleaved"])
def test_end_of_training_sample_is_the_final_models_greedy_continuation(runs, run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recorded = json.loads((runs / run / "sample.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(runs / run / "final", trust_remote_code=True)
    tokenizer = AutoTokenizer.from_pretrained(runs / run / "final")
    ids = tokenizer(recorded["prompt"], return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
    assert recorded["sample"] == tokenizer.decode(output[0], skip_special_tokens=True)
    assert len(output[0]) > len(ids[0])
