"""Training throughput, MFU and communication, reported with every training log.

One component, one ``log()``: :class:`TrainingMetrics` is a ``TrainerCallback`` that times optimizer
steps, and :class:`~boost_hf.training.trainer.BoostTrainer` feeds it the tokens and collectives of each
micro-batch and merges :meth:`TrainingMetrics.pop_logs` into the logs that go to the progress bar,
``trainer_state.json`` and the ``report_to`` integrations (tensorboard, ...).

=============================  ============================================================================
key                            meaning (averaged over the optimizer steps since the previous log)
=============================  ============================================================================
``step_time``                  seconds per optimizer step (data loading included; evaluation, checkpoints
                               and logging excluded)
``tokens_per_second``          trained tokens per second, whole job (a TP group's shared batch counts once)
``tokens_per_second_per_device``  the same divided by the number of processes (pp x dp x tp)
``mfu``                        model FLOPs utilisation: ``training_flops_per_token x tokens/s /
                               (processes x peak_tflops)``, analytic FLOPs of the (low-rank) model
                               (:func:`boost_hf.perf.flops.training_flops_per_token`)
``comm_tp_bytes_per_step``     bytes of tensor-parallel collectives issued by this rank (measured,
                               :class:`~boost_hf.parallel.comm_counter.CommCounter` over the TP group;
                               activations, forward + backward)
``comm_tp_calls_per_step``     number of those collectives
``comm_dp_grad_bytes_per_step``  payload of the data-parallel gradient reduction of this rank (its local
                               gradients once per step, in the dtype the precision policy reduces them in: 4
                               bytes per element in fp32, 2 with ``--grad_reduce_dtype bf16`` and DeepSpeed's
                               bf16; 0 without data parallelism). Ring all-reduce moves about twice this over
                               the wire; ZeRO-3's parameter all-gathers come on top. Under FSDP2 its
                               reduce-scatters' inputs (and HSDP's all-reduces), by
                               :func:`~boost_hf.perf.comm_formula.fully_shard_communication`
``comm_dp_param_bytes_per_step``  FSDP2 only: the bytes its parameter all-gathers return to this rank in one
                               step (each unit before its forward, again before its backward when it reshards
                               after forward), by the same formula (absent where it is not modelled: a pipeline
                               whose units reshard after forward)
``comm_p2p_bytes_per_step``     bytes this rank sends to its pipeline neighbours (each micro-batch's stage
                               output forward, its input gradient backward; it receives as much), counted
                               from :func:`~boost_hf.perf.comm_formula.stage_boundary_communication` for the
                               schedule's micro-batches, in the policy's boundary dtype (2 bytes per element in
                               bf16; 0 without pipeline parallelism)
=============================  ============================================================================
"""

from __future__ import annotations

import time

import torch
from transformers import TrainerCallback

from ..parallel.comm_counter import CommCounter
from ..perf.flops import training_flops_per_token


class TrainingMetrics(TrainerCallback):
    """Accumulates the steps since the last log; :meth:`pop_logs` turns them into metrics and resets.

    Args:
        model_config: the model's ``BoostLlamaConfig`` (for the analytic FLOPs per token).
        world_size: processes of the job (pp x dp x tp).
        dp_size: data-parallel ranks (distinct micro-batches per micro-step).
        peak_tflops: dense peak of one device.
        dp_grad_bytes: bytes of this rank's trainable gradients, reduced over DP each step (0 if dp == 1).
        dp_param_bytes: FSDP2's parameter all-gather bytes per step (``None``: none, or not modelled).
        tp_group: the TP group, whose collectives are counted (``None``: none, at tp 1).
    """

    def __init__(self, model_config, *, world_size: int, dp_size: int, peak_tflops: float, dp_grad_bytes: int,
                 dp_param_bytes: int | None = None, tp_group=None):
        self.model_config = model_config
        self.world_size, self.dp_size = world_size, dp_size
        self.peak_flops = peak_tflops * 1e12
        self.dp_grad_bytes, self.dp_param_bytes = dp_grad_bytes, dp_param_bytes
        self.comm = CommCounter(groups=(tp_group,))  # (FSDP2's collectives over the DP group are not TP's)
        self._clock: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.steps, self.seconds, self.tokens, self.flops = 0, 0.0, 0, 0.0
        self.p2p_bytes = 0
        self.comm.reset()

    def count_micro_batch(self, input_ids: torch.Tensor) -> None:
        """Record one micro-batch ``[B, S]`` of this rank (the same on its TP peers)."""
        tokens = input_ids.numel() * self.dp_size
        self.tokens += tokens
        self.flops += tokens * training_flops_per_token(self.model_config, input_ids.shape[-1])

    def count_p2p_bytes(self, sent: int) -> None:
        """Record the bytes this rank sent to its pipeline neighbours in one step."""
        self.p2p_bytes += sent

    def pop_logs(self) -> dict[str, float]:
        """Metrics of the steps since the previous call (empty if none)."""
        if self.steps == 0:
            return {}
        seconds = max(self.seconds, 1e-9)
        tokens_per_second = self.tokens / seconds
        logs = {
            "step_time": seconds / self.steps,
            "tokens_per_second": tokens_per_second,
            "tokens_per_second_per_device": tokens_per_second / self.world_size,
            "mfu": self.flops / seconds / (self.world_size * self.peak_flops),
            "comm_tp_bytes_per_step": self.comm.bytes / self.steps,
            "comm_tp_calls_per_step": self.comm.calls / self.steps,
            "comm_dp_grad_bytes_per_step": float(self.dp_grad_bytes),
            "comm_p2p_bytes_per_step": self.p2p_bytes / self.steps,
        }
        if self.dp_param_bytes is not None:
            logs["comm_dp_param_bytes_per_step"] = float(self.dp_param_bytes)
        self._reset()
        return logs

    # -- timing: the clock restarts after anything that is not training (evaluation, saving, logging)
    def _restart(self, *args, **kwargs) -> None:
        self._clock = time.perf_counter()

    on_train_begin = on_evaluate = on_save = on_log = _restart

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self._clock is not None:
            self.seconds += now - self._clock
            self.steps += 1
        self._clock = now


__all__ = ["TrainingMetrics"]
