"""Pipeline-parallel runs of ``recipes/pretrain.py`` inside one ``accelerate launch`` of 4 CPU processes, and the
single-process reference they are compared with (``test_pipeline_training.py`` launches this):

    python tests/training/pipeline_cases.py single OUT RECIPE.yaml [ARGS]       # one process, pp 1 x tp 1
    accelerate launch --config_file accelerate_configs/cpu-4proc.yaml tests/training/pipeline_cases.py pipelines OUT RECIPE.yaml [ARGS]

``single`` trains ``OUT/single`` and evaluates ``OUT/single/final`` with ``compute_metrics``
(``OUT/metrics-single.json``); it also trains ``OUT/single-<model>`` for each of :data:`OTHER_MODELS` (LaX, and the
full-rank model, which runs under the megatron layout at tp > 1) and evaluates it the same way
(``OUT/metrics-single-<model>.json``). ``pipelines`` trains ``pp2-tp2`` (checkpoint at step 3), ``pp2-tp2-resumed``
(from it), ``pp2-dp2-interleaved`` (interleaved 1F1B, 2 stages per rank), ``pp2-tp2-compiled`` (``--torch_compile``),
``pp2-dp2-interleaved-compiled`` (``--torch_compile`` with the interleaved schedule and DDP over DP) and
``pp2-tp2-sp`` (``--sequence_parallel``: latent sequence parallelism, no end-of-training sample; ``--pp_layer_split
1,3``),
then evaluates ``OUT/single/final`` with the same ``compute_metrics`` at pp 2 x tp 2 and at pp 2 x dp 2 interleaved
(``OUT/metrics-pp2-tp2.json``, ``OUT/metrics-pp2-dp2-interleaved.json``: every rank's metrics), and each
``OUT/single-<model>/final`` at pp 2 x tp 2 (``OUT/metrics-pp2-tp2-<model>.json``).

Every run writes ``<run>/p2p.json``: per rank, the bytes of the tensors its pipeline stages handed to the engine's
sends in each training step (counted in ``PipelineStage.get_fwd_send_ops`` / ``get_bwd_send_ops``), the
``comm_p2p_bytes_per_step`` it logged, the graphs dynamo compiled during the run and the decoder layers of its stages; and ``<run>/sample.json``: the end-of-training sample (rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.pipelining.stage import _PipelineStageBase

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import pretrain  # noqa: E402

from boost_hf.training import BoostTrainer  # noqa: E402
from boost_hf.training.pretrain import build_trainer  # noqa: E402
from tests.training.launcher import every_rank  # noqa: E402

PIPELINE = ["--pp_size", "2", "--pp_microbatches", "2"]
PP_TP = [*PIPELINE, "--tp_size", "2", "--per_device_train_batch_size", "8"]
PP_DP_INTERLEAVED = [*PIPELINE, "--tp_size", "1", "--pp_schedule", "interleaved-1f1b", "--pp_microbatches", "4",
                     "--per_device_train_batch_size", "4"]  # global batch 4 x dp 2 = 8
# compute_metrics under PP also for LaX (btp: latents cross the stage boundary, a 1/tp share each) and for the
# full-rank model (the megatron layout: replicated residual, vocab-parallel head); trained briefly in one process
OTHER_MODELS = {"lax": ["--preset", "lax-60m"], "full-rank": ["--preset", "llama-60m"]}

SENT: list[int] = []  # per training step of the current run: bytes handed to the engine's sends
STAGE_LAYERS: list[list[int]] = []  # the decoder layers of each stage this rank ran in the current run
LOGGED: list[float] = []  # per log of the current run: comm_p2p_bytes_per_step
IN_TRAINING_STEP = [False]  # evaluation's forward sends are not counted


def _counting_sends(get_send_ops):
    def counted(self, chunk_id):
        ops = get_send_ops(self, chunk_id)
        if IN_TRAINING_STEP[0]:
            SENT[-1] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        return ops

    return counted


_PipelineStageBase.get_fwd_send_ops = _counting_sends(_PipelineStageBase.get_fwd_send_ops)
_PipelineStageBase.get_bwd_send_ops = _counting_sends(_PipelineStageBase.get_bwd_send_ops)
_training_step, _log, _generate_sample = BoostTrainer.training_step, BoostTrainer.log, BoostTrainer.generate_sample


def _counted_training_step(self, model, inputs, num_items_in_batch=None):
    pipeline = getattr(self.model, "pipeline", None)  # None in one process
    STAGE_LAYERS[:] = [list(layers) for layers in pipeline.placement.layers] if pipeline is not None else []
    SENT.append(0)
    IN_TRAINING_STEP[0] = True
    try:
        return _training_step(self, model, inputs, num_items_in_batch)
    finally:
        IN_TRAINING_STEP[0] = False


def _recorded_log(self, logs, start_time=None):
    _log(self, logs, start_time)  # merges the step metrics into logs
    if "comm_p2p_bytes_per_step" in logs:
        LOGGED.append(logs["comm_p2p_bytes_per_step"])


def _recorded_sample(self, *args, **kwargs):
    sample = _generate_sample(self, *args, **kwargs)
    if self.is_world_process_zero():
        (Path(self.args.output_dir) / "sample.json").write_text(json.dumps({"prompt": self.args.sample_prompt, "sample": sample}))
    return sample


BoostTrainer.training_step, BoostTrainer.log, BoostTrainer.generate_sample = _counted_training_step, _recorded_log, _recorded_sample


def train(argv: list[str]) -> None:
    SENT.clear()
    LOGGED.clear()
    STAGE_LAYERS.clear()
    graphs_before = counters["stats"]["unique_graphs"]
    pretrain.main(argv)
    counts = every_rank({"sent": list(SENT), "logged": list(LOGGED), "compiled_graphs": counters["stats"]["unique_graphs"] - graphs_before,
                         "stage_layers": list(STAGE_LAYERS)})
    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(argv[argv.index("--output_dir") + 1]) / "p2p.json").write_text(json.dumps(counts))


def logit_statistics(prediction) -> dict:
    """``compute_metrics`` on predictions ``[N, S, 2]`` (each token's argmax and logsumexp over the full vocabulary):
    statistics that depend on every block, on the pairing of predictions with labels and on every vocabulary shard."""
    argmax, logsumexp, labels = prediction.predictions[..., 0], prediction.predictions[..., 1], prediction.label_ids
    return {
        "accuracy": float((argmax[:, :-1] == labels[:, 1:]).mean()),
        "mean_logsumexp": float(logsumexp.mean()),
        "label_weighted_logsumexp": float((logsumexp * (labels % 7)).mean()),
        "blocks": int(labels.shape[0]),
    }


def argmax_and_logsumexp(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.stack([logits.argmax(-1).to(logits.dtype), logits.logsumexp(-1)], dim=-1)


def evaluate_with_metrics(argv: list[str], result: Path) -> None:
    """Evaluate the model ``argv`` builds with ``compute_metrics``; every rank's metrics into ``result``."""
    trainer = build_trainer(argv, compute_metrics=logit_statistics, preprocess_logits_for_metrics=argmax_and_logsumexp)
    metrics = every_rank(trainer.evaluate())
    if not dist.is_initialized() or dist.get_rank() == 0:
        result.write_text(json.dumps(metrics))


def main(mode: str, out: str, *common: str) -> None:
    out, common = Path(out), list(common)
    trained = ["--init_from", str(out / "single" / "final")]
    if mode == "single":
        single = [*common, "--tp_size", "1", "--per_device_train_batch_size", "8"]
        train([*single, "--output_dir", str(out / "single")])
        evaluate_with_metrics([*single, *trained, "--output_dir", str(out / "metrics-single")], out / "metrics-single.json")
        for model, flags in OTHER_MODELS.items():
            train([*single, *flags, "--eval_strategy", "no", "--sample_max_new_tokens", "0", "--output_dir", str(out / f"single-{model}")])
            evaluate_with_metrics([*single, *flags, "--init_from", str(out / f"single-{model}" / "final"), "--output_dir",
                                   str(out / f"metrics-single-{model}")], out / f"metrics-single-{model}.json")
        return
    train([*common, *PP_TP, "--output_dir", str(out / "pp2-tp2"), "--save_strategy", "steps", "--save_steps", "3"])
    train([*common, *PP_TP, "--output_dir", str(out / "pp2-tp2-resumed"), "--resume_from_checkpoint", str(out / "pp2-tp2" / "checkpoint-3")])
    train([*common, *PP_DP_INTERLEAVED, "--output_dir", str(out / "pp2-dp2-interleaved")])
    train([*common, *PP_TP, "--output_dir", str(out / "pp2-tp2-compiled"), "--torch_compile", "true"])
    train([*common, *PP_DP_INTERLEAVED, "--output_dir", str(out / "pp2-dp2-interleaved-compiled"), "--torch_compile", "true"])
    train([*common, *PP_TP, "--output_dir", str(out / "pp2-tp2-sp"), "--sequence_parallel", "true", "--sample_max_new_tokens", "0",
           "--pp_layer_split", "1,3"])
    evaluate_with_metrics([*common, *PP_TP, *trained, "--output_dir", str(out / "metrics-pp2-tp2")], out / "metrics-pp2-tp2.json")
    evaluate_with_metrics([*common, *PP_DP_INTERLEAVED, *trained, "--output_dir", str(out / "metrics-pp2-dp2-interleaved")],
                          out / "metrics-pp2-dp2-interleaved.json")
    for model, flags in OTHER_MODELS.items():
        evaluate_with_metrics([*common, *PP_TP, *flags, "--init_from", str(out / f"single-{model}" / "final"), "--output_dir",
                               str(out / f"metrics-pp2-tp2-{model}")], out / f"metrics-pp2-tp2-{model}.json")


if __name__ == "__main__":
    main(*sys.argv[1:])
