"""Time of the collectives an iteration runs: the tensor-parallel ones of :mod:`boost_hf.perf.comm_formula`, and the
data-parallel gradient all-reduce with ZeRO-1's broadcast (formulas in :mod:`boost_hf.perf.estimator`'s docstring)."""

from __future__ import annotations

from ..parallel.config import ParallelConfig
from .comm_formula import Communication
from .hardware import Hardware
from .memory import RankParameters, precision_bytes
from .workload import Workload

DP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default, and the bf16_params policy's buckets


def tp_collective_time(comm: Communication, workload: Workload, hardware: Hardware) -> float:
    """``latency * calls + ring traffic / bandwidth`` of the TP collectives ``comm``."""
    p = workload.parallel_config.tp_size
    if p == 1:
        return 0.0
    traffic = comm.ring_traffic_bytes(p, workload.dtype_bytes)
    return comm.calls * hardware.latency_us * 1e-6 + traffic / (hardware.collective_gbps(p) * 1e9)


def data_parallel_time(parallel: ParallelConfig, workload: Workload, hardware: Hardware,
                        rank_params: list[RankParameters] | None, ranks: list[dict[str, float]]) -> float:
    """The exposed time of the DP gradient all-reduce (and of ZeRO-1's parameter broadcast), module docstring."""
    dp = workload.dp_size
    if dp == 1:
        return 0.0
    reduce_bytes = precision_bytes(workload.precision or "autocast", workload.grad_reduce_dtype).reduce
    same_node = parallel.tp_size * dp <= hardware.gpus_per_node
    bandwidth = (hardware.collective_gbps(dp) if same_node else hardware.inter_node_gbps) * 1e9
    latency = hardware.latency_us * 1e-6
    exposed = 0.0
    for params, rank in zip(rank_params, ranks):
        nbytes = params.elements * reduce_bytes
        buckets = -(-nbytes // DP_BUCKET_BYTES)
        all_reduce = latency * buckets + 2 * (dp - 1) / dp * nbytes / bandwidth
        one_bucket = latency + 2 * (dp - 1) / dp * min(nbytes, DP_BUCKET_BYTES) / bandwidth
        backward = 2 / 3 * sum(t for c, t in rank.items() if c != "pp_comm")  # the last micro-batch's backward
        broadcast = 0.0
        if workload.zero1_optimizer:
            broadcast = latency * params.tensors + (dp - 1) / dp * params.elements * 4 / bandwidth
        exposed = max(exposed, max(all_reduce - backward, one_bucket) + broadcast)
    return exposed


__all__ = ["DP_BUCKET_BYTES", "data_parallel_time", "tp_collective_time"]
