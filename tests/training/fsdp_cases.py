"""Training runs of ``recipes/pretrain.py`` under FSDP2 asked for by an accelerate config, for
``test_fully_shard_training.py``:

    accelerate launch --config_file accelerate_configs/cpu-4proc-fsdp2.yaml tests/training/fsdp_cases.py four OUT RECIPE [ARGS]
    accelerate launch --config_file accelerate_configs/cpu-4proc-fsdp2.yaml --num_processes 8 tests/training/fsdp_cases.py eight OUT RECIPE [ARGS]
    python tests/training/fsdp_cases.py one OUT RECIPE [ARGS]

Every run trains 6 steps of the same global batch of 8 sequences and writes ``OUT/<run>`` (the trainer's state, the
checkpoints, ``final/``) and ``OUT/<run>/grads-pp<q>.pt``: the canonical gradient of every parameter of pipeline
rank ``q`` at the first step, after the reduction over DP and before clipping (FSDP2's shards gathered over DP, then
the TP shards over TP).

* ``four`` (FSDP2 from the accelerate config): ``tp2-dp2`` and ``pp2-dp2`` (1F1B, 2 micro-batches), a checkpoint at
  step 3; ``hsdp`` (tp 1, 2 replicas x 2 shards) and ``dp4-accumulation`` (tp 1 x dp 4, 2 micro-batches of 1 per
  step), a checkpoint at step 3 each; each checkpoint-3 resumed at tp 1 x dp 4 with FSDP2 (``tp1-dp4-from-tp2-dp2``,
  ``tp1-dp4-from-pp2-dp2``);
  ``tp2-dp2``'s resumed without FSDP2, at tp 2 x dp 2 under DDP with ZeRO-1 (``zero1-from-tp2-dp2``: the accelerate
  config's FSDP variables removed for that run); a ZeRO-1 run at tp 2 x dp 2 (``zero1``, checkpoint at 3) whose
  checkpoint-3 resumes under FSDP2 at tp 1 x dp 4 (``tp1-dp4-from-zero1``); ``tp2-dp2-bf16`` and ``pp2-dp2-bf16``
  (``--precision_policy bf16_params``: FSDP2's mixed precision, a checkpoint at step 3);
* ``eight``: ``tp2-pp2-dp2`` (FSDP2 from the accelerate config, 8 processes);
* ``one`` (no FSDP2): ``single`` (checkpoint at 3), and the FSDP2 and HSDP checkpoint-3s resumed in one process
  (``one-from-tp2-dp2``, ``one-from-pp2-dp2``, ``one-from-hsdp``).

Every run without a pipeline also writes ``OUT/<run>/final-logits.pt``, the trained model's logits
(:mod:`tests.training.final_logits`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import pretrain  # noqa: E402

from boost_hf.parallel.sharding import gather_full_many, shard_spec_of  # noqa: E402
from boost_hf.training import BoostTrainer  # noqa: E402
from tests.training.final_logits import record_final_logits  # noqa: E402

FSDP_VARIABLES = {name: value for name, value in os.environ.items() if name == "ACCELERATE_USE_FSDP"}
_clip_grad_norm = BoostTrainer._clip_grad_norm


def _recording_clip_grad_norm(self, model):
    """At the first step: every rank's canonical gradients (collective over DP and TP), saved by DP rank 0 and TP rank
    0 of each pipeline rank; then the trainer's own clipping."""
    if self.state.global_step == 0:
        state = self.parallel_state
        names, params = zip(*((n, p) for n, p in self.model.named_parameters() if p.grad is not None))
        local = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
        full = gather_full_many([g.detach() for g in local], [shard_spec_of(p) for p in params], state.tp_group)
        if state.dp_rank == 0 and state.tp_rank == 0:
            torch.save(dict(zip(names, full)), Path(self.args.output_dir) / f"grads-pp{state.pp_rank}.pt")
    return _clip_grad_norm(self, model)


BoostTrainer._clip_grad_norm = _recording_clip_grad_norm
record_final_logits()


def train(argv: list[str], fsdp: bool = True) -> None:
    """One run of the recipe; ``fsdp=False``: without the accelerate config's FSDP (its variable removed)."""
    os.environ.pop("ACCELERATE_USE_FSDP", None)
    if fsdp:
        os.environ.update(FSDP_VARIABLES)
    pretrain.main(argv)
    if dist.is_initialized():
        dist.barrier()


def main(mode: str, out: str, *common: str) -> None:
    out, common = Path(out), list(common)
    saving = ["--save_strategy", "steps", "--save_steps", "3"]
    tp2_dp2 = ["--tp_size", "2", "--per_device_train_batch_size", "4"]
    pp2_dp2 = ["--pp_size", "2", "--tp_size", "1", "--pp_microbatches", "2", "--per_device_train_batch_size", "4"]
    tp1_dp4 = ["--tp_size", "1", "--per_device_train_batch_size", "2"]
    hsdp = [*tp1_dp4, "--dp_replicate_size", "2"]
    one = ["--tp_size", "1", "--per_device_train_batch_size", "8"]

    def run(name: str, layout: list[str], *extra: str, fsdp: bool = True) -> None:
        train([*common, *layout, *extra, "--output_dir", str(out / name)], fsdp)

    def resume(source: str) -> list[str]:
        return ["--resume_from_checkpoint", str(out / source / "checkpoint-3")]

    if mode == "four":
        if not FSDP_VARIABLES:
            raise RuntimeError("launch with an accelerate config with FSDP (accelerate_configs/cpu-4proc-fsdp2.yaml)")
        run("tp2-dp2", tp2_dp2, *saving)
        run("pp2-dp2", pp2_dp2, *saving)
        run("hsdp", hsdp, *saving)
        run("dp4-accumulation", ["--tp_size", "1", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "2"],
            *saving)
        run("tp1-dp4-from-tp2-dp2", tp1_dp4, *resume("tp2-dp2"))
        run("tp1-dp4-from-pp2-dp2", tp1_dp4, *resume("pp2-dp2"))
        run("zero1-from-tp2-dp2", tp2_dp2, "--zero1_optimizer", "true", *resume("tp2-dp2"), fsdp=False)
        run("zero1", tp2_dp2, "--zero1_optimizer", "true", *saving, fsdp=False)
        run("tp1-dp4-from-zero1", tp1_dp4, *resume("zero1"))
        bf16 = ["--bf16", "true", "--precision_policy", "bf16_params", *saving]
        run("tp2-dp2-bf16", tp2_dp2, *bf16)
        run("pp2-dp2-bf16", pp2_dp2, *bf16)
    elif mode == "eight":
        run("tp2-pp2-dp2", ["--tp_size", "2", "--pp_size", "2", "--pp_microbatches", "2", "--per_device_train_batch_size", "4"])
    elif mode == "one":
        run("single", one, *saving)
        run("one-from-tp2-dp2", one, *resume("tp2-dp2"))
        run("one-from-pp2-dp2", one, *resume("pp2-dp2"))
        run("one-from-hsdp", one, *resume("hsdp"))
    else:
        raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
