"""The split of a pipeline replica's batch into micro-batches: every split torch's schedule runs, predicted by
:func:`~boost_hf.perf.estimator.estimate_layout`, and the fastest of them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .estimator import estimate_layout, layout_model
from .hardware import Hardware, get_hardware
from .kernels import CALIBRATED_EFFICIENCY, KernelEfficiency
from .pipeline import engine_refusal
from .workload import Workload


@dataclass(frozen=True)
class MicroBatchOption:
    """One split of a pipeline replica's batch into ``num_micro_batches`` micro-batches of ``micro_batch``
    sequences, as predicted; ``peak_activation_bytes`` is the fullest pipeline rank's (``None`` without
    activation checkpointing)."""

    num_micro_batches: int
    micro_batch: int
    step_time_s: float
    tokens_per_s: float
    bubble_fraction: float
    peak_activation_bytes: int | None


def micro_batch_options(
    config,
    workload: Workload,
    hardware: Hardware | str = "a100",
    efficiency: KernelEfficiency = CALIBRATED_EFFICIENCY,
    layout: str = "btp",
) -> list[MicroBatchOption]:
    """Every split of the replica's ``micro_batch x num_micro_batches`` sequences into equal micro-batches
    that torch's ``pp_schedule`` runs, fewest micro-batches first, predicted for ``layout`` (empty when none
    does: 1F1B needs at least ``pp`` sequences)."""
    if isinstance(hardware, str):
        hardware = get_hardware(hardware)
    model = layout_model(config, layout)
    sequences = workload.micro_batch * workload.num_micro_batches
    options = []
    for m in range(1, sequences + 1):
        if sequences % m or engine_refusal(workload.parallel_config.pp_schedule, workload.parallel_config.pp_size, m):
            continue
        split = replace(workload, micro_batch=sequences // m, num_micro_batches=m)
        e = estimate_layout(model, layout, split, hardware, efficiency)
        peak = None if e.peak_activation_bytes is None else max(e.peak_activation_bytes)
        options.append(MicroBatchOption(m, split.micro_batch, e.step_time_s, e.tokens_per_s, e.bubble_fraction, peak))
    return options


def recommend_micro_batches(options: list[MicroBatchOption]) -> MicroBatchOption | None:
    """The fastest of ``options`` (on equal times, the one with fewer micro-batches); ``None`` if there is none."""
    return min(options, key=lambda option: (option.step_time_s, option.num_micro_batches), default=None)


__all__ = ["MicroBatchOption", "micro_batch_options", "recommend_micro_batches"]
