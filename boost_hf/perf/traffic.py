"""Time of the collectives an iteration runs: the tensor-parallel ones of :mod:`boost_hf.perf.comm_formula`, the
data-parallel gradient all-reduce with ZeRO-1's broadcast, and FSDP2's all-gathers, reduce-scatters and HSDP's
all-reduce (formulas in :mod:`boost_hf.perf.estimator`'s docstring)."""

from __future__ import annotations

from ..parallel.communication import ring_traffic_bytes
from ..parallel.config import ParallelConfig
from .comm_formula import Communication, DataParallelTraffic, fully_shard_communication
from .hardware import Hardware
from .memory import PartUnits, RankParameters, precision_bytes
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


def fully_shard_traffic(parallel: ParallelConfig, workload: Workload, rank_units: list[list[PartUnits]]
                        ) -> list[DataParallelTraffic]:
    """Per pipeline rank, FSDP2's collectives in one step
    (:func:`~boost_hf.perf.comm_formula.fully_shard_communication` over the units of its parts, gathered in the
    policy's parameter dtype and reduced in its reduce dtype)."""
    data_parallel = workload.data_parallel
    policy = precision_bytes(workload.precision or "autocast", workload.grad_reduce_dtype)
    return [fully_shard_communication([u for part in parts for u in part.units], data_parallel.shard_size(workload.dp_size),
                                      data_parallel.dp_replicate_size, micro_batches=workload.num_micro_batches,
                                      pipeline=parallel.pp_size > 1, param_bytes=policy.parameter,
                                      reduce_bytes=policy.reduce)
            for parts in rank_units]


def fully_shard_time(parallel: ParallelConfig, workload: Workload, hardware: Hardware,
                     rank_units: list[list[PartUnits]], ranks: list[dict[str, float]]) -> float:
    """The exposed time of FSDP2's collectives in one step (module docstring of :mod:`boost_hf.perf.estimator`): on
    the pipeline rank where it is largest, the all-gathers beyond the compute they overlap (at least the first unit's
    of each forward, which nothing precedes) plus the reductions beyond the backward they overlap (at least the root's,
    which comes last; under pipeline parallelism all of them, which torch's schedule runs after the stage's last
    backward)."""
    data_parallel, dp, tp = workload.data_parallel, workload.dp_size, parallel.tp_size
    shard, replicas = data_parallel.shard_size(dp), data_parallel.dp_replicate_size
    per_node, latency = hardware.gpus_per_node, hardware.latency_us * 1e-6
    bandwidth = {  # the shard group: adjacent DP ranks, tp GPUs apart; the replicas: the whole DP group's span
        "all_gather": hardware.collective_gbps(shard) if tp * shard <= per_node else hardware.inter_node_gbps,
        "reduce_scatter": hardware.collective_gbps(shard) if tp * shard <= per_node else hardware.inter_node_gbps,
        "all_reduce": hardware.collective_gbps(replicas) if tp * dp <= per_node else hardware.inter_node_gbps,
    }
    group = {"all_gather": shard, "reduce_scatter": shard, "all_reduce": replicas}
    policy = precision_bytes(workload.precision or "autocast", workload.grad_reduce_dtype)
    byte_size = {"all_gather": policy.parameter, "reduce_scatter": policy.reduce, "all_reduce": policy.reduce}

    def seconds(kind: str, calls: int, elements: int) -> float:
        if group[kind] == 1 or calls == 0:
            return 0.0
        return latency * calls + ring_traffic_bytes(kind, elements * byte_size[kind], group[kind]) / (bandwidth[kind] * 1e9)

    pipeline, m = parallel.pp_size > 1, workload.num_micro_batches
    exposed = 0.0
    for parts, rank, traffic in zip(rank_units, ranks, fully_shard_traffic(parallel, workload, rank_units)):
        if not parts or not any(part.units for part in parts):
            continue
        kinds = traffic.collectives.by_kind
        gathers = seconds("all_gather", kinds["all_gather"].calls, kinds["all_gather"].elements) if "all_gather" in kinds else 0.0
        reductions = sum(seconds(kind, kinds[kind].calls, kinds[kind].elements) for kind in ("reduce_scatter", "all_reduce")
                         if kind in kinds)
        first = parts[0].root if parts[0].root is not None else parts[0].units[0]  # the root gathers first
        first_gather = seconds("all_gather", 1, first.padded_elements(shard))
        last = next((part.root for part in parts if part.root is not None), parts[-1].units[-1])
        last_reduction = (seconds("reduce_scatter", 1, last.padded_elements(shard))
                          + seconds("all_reduce", 1, last.padded_elements(shard) // shard))
        compute = sum(t for c, t in rank.items() if c != "pp_comm")  # one micro-batch's forward and backward
        if pipeline:
            rank_exposed = max(gathers - compute / 3, first_gather) + reductions
        else:
            rank_exposed = max(gathers - m * compute, m * first_gather) + max(reductions - 2 / 3 * compute, last_reduction)
        exposed = max(exposed, rank_exposed)
    return exposed


__all__ = ["DP_BUCKET_BYTES", "data_parallel_time", "fully_shard_time", "fully_shard_traffic", "tp_collective_time"]
