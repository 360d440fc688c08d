"""``boost-hf plan``: the fastest layout that fits a cluster, predicted by the estimator and the memory model.

The search space is :class:`~boost_hf.parallel.config.ParallelConfig`'s fields (any of them given fixes it):

* ``tp_size``: the divisors of the GPUs per node that the model's heads, vocabulary and split widths allow (TP
  stays on a node's NVLink); ``tp_style``: the model's (btp for a low-rank model, megatron for a full-rank one;
  vanilla only when asked, it is slower than btp in every case the estimator models);
* ``pp_size``: the divisors of ``gpus / tp`` up to the layer count; ``dp = gpus / (tp pp)`` must divide the global
  batch; ``pp_schedule``: ``1f1b`` and ``interleaved-1f1b`` (2 stages per rank; GPipe has 1F1B's bubble and keeps
  every micro-batch in flight, so it never wins); ``pp_microbatches`` (at ``pp_size`` 1, the gradient accumulation
  steps): every split of the replica's batch into equal micro-batches that torch's schedule runs;
* ``sequence_parallel`` (tp > 1, not vanilla), ``activation_checkpointing`` (``none``, ``lowrank`` for a low-rank
  model, ``full``: tried fastest first, the first that fits is kept for each layout), ``--zero1_optimizer`` (dp > 1)
  and the precision policy (:data:`~boost_hf.perf.memory.PRECISION_BYTES`: ``autocast`` and ``bf16_params`` on GPUs,
  ``fp32`` on CPU).

Each candidate's step time is :func:`~boost_hf.perf.estimator.estimate_layout`'s (DP all-reduce and ZeRO-1 included)
and its memory :func:`~boost_hf.perf.memory.memory_per_gpu`'s; a candidate fits when its fullest GPU's peak is at
most the GPU memory. Nothing is built or run (the model's parameter shapes come from a meta-device skeleton).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..parallel.config import ParallelConfig
from .estimator import CALIBRATED_EFFICIENCY, KernelEfficiency, LayoutEstimate, estimate_layout
from .hardware import Hardware
from .memory import GIB, MemoryBreakdown, fits, memory_per_gpu
from .pipeline import engine_refusal

CHECKPOINTING_ORDER = ("none", "lowrank", "full")  # fastest first
PLANNED_SCHEDULES = ("1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Cluster:
    """``gpus`` devices of ``hardware`` (whose ``gpus_per_node`` is the node size), ``memory_bytes`` each."""

    gpus: int
    hardware: Hardware
    memory_bytes: int

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.hardware.gpus_per_node)


@dataclass(frozen=True)
class Candidate:
    """One layout of the search: the ``parallel`` config (``pp_microbatches`` set under PP), ``dp`` replicas, each
    step ``num_micro_batches`` micro-batches of ``micro_batch`` sequences per replica (at ``pp_size`` 1 they are
    gradient accumulation steps), ``zero1`` and the ``precision`` policy."""

    parallel: ParallelConfig
    dp: int
    micro_batch: int
    num_micro_batches: int
    zero1: bool
    precision: str

    @property
    def replica_batch(self) -> int:
        return self.micro_batch * self.num_micro_batches

    def describe(self) -> str:
        p = self.parallel
        parts = [f"tp {p.tp_size}", f"pp {p.pp_size}", f"dp {self.dp}"]
        if p.pp_size > 1:
            parts.append(f"{p.pp_schedule}" + (f" (v {p.stages_per_rank})" if p.stages_per_rank > 1 else ""))
        parts.append(f"{self.num_micro_batches} x {self.micro_batch} seq")
        if p.sequence_parallel:
            parts.append("SP")
        parts.append(f"ckpt {p.activation_checkpointing}")
        if self.zero1:
            parts.append("ZeRO-1")
        parts.append(self.precision)
        return ", ".join(parts)


@dataclass(frozen=True)
class Evaluated:
    """A candidate with its predicted time (``None`` when it does not fit) and memory per pipeline rank."""

    candidate: Candidate
    memory: list[MemoryBreakdown]
    peak_bytes: int | None
    fits: bool | None
    estimate: LayoutEstimate | None = None

    @property
    def step_s(self) -> float | None:
        return None if self.estimate is None else self.estimate.step_time_s

    @property
    def fullest(self) -> MemoryBreakdown:
        return max(self.memory, key=lambda b: b.total or 0)


@dataclass
class PlanResult:
    """The fitting candidates fastest first; the best candidate of each (tp, pp) and what each needs; how many
    candidates were tried."""

    ranked: list[Evaluated]
    smallest: list[Evaluated]  # the least memory of each (tp, pp) that fits nowhere, least first
    unmodelled: list[Candidate] = field(default_factory=list)
    tried: int = 0


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_sizes(config, style: str, cluster: Cluster, parallel_fixed: dict) -> list[int]:
    if "tp_size" in parallel_fixed:
        return [parallel_fixed["tp_size"]]
    out = []
    for tp in _divisors(min(cluster.hardware.gpus_per_node, cluster.gpus)):
        if cluster.gpus % tp:
            continue
        try:
            ParallelConfig(tp_size=tp, tp_style=style).check_model(config)
        except ValueError:
            continue
        out.append(tp)
    return out


def candidates(config, cluster: Cluster, seq_len: int, global_batch: int, fixed: dict):
    """Every structural candidate (the checkpointing mode, ZeRO-1 and precision are varied by :func:`plan`), as
    ``(parallel without checkpointing, dp, micro_batch, num_micro_batches)``."""
    style = fixed.get("tp_style") or ("megatron" if config.bottleneck is None else "btp")
    layers = config.num_hidden_layers
    for tp in _tp_sizes(config, style, cluster, fixed):
        for pp in ([fixed["pp_size"]] if "pp_size" in fixed else _divisors(cluster.gpus // tp)):
            if pp > layers or cluster.gpus % (tp * pp):
                continue
            dp = cluster.gpus // (tp * pp)
            if global_batch % dp:
                continue
            replica = global_batch // dp
            schedules = [fixed["pp_schedule"]] if "pp_schedule" in fixed else (PLANNED_SCHEDULES if pp > 1 else ("1f1b",))
            for schedule in schedules:
                per_rank = fixed.get("pp_stages_per_rank") or (2 if schedule != "1f1b" and pp > 1 else 1)
                if pp * per_rank > layers:
                    continue
                splits = [fixed["pp_microbatches"]] if "pp_microbatches" in fixed else _divisors(replica)
                for m in splits:
                    if replica % m or (pp > 1 and engine_refusal(schedule, pp, m)):
                        continue
                    sp_options = [fixed["sequence_parallel"]] if "sequence_parallel" in fixed else (
                        [False, True] if tp > 1 and style != "vanilla" and seq_len % tp == 0 else [False])
                    for sp in sp_options:
                        try:
                            parallel = ParallelConfig(
                                tp_size=tp, tp_style=style, sequence_parallel=sp and tp > 1, pp_size=pp,
                                pp_schedule=schedule if pp > 1 else "1f1b", pp_microbatches=m if pp > 1 else None,
                                pp_stages_per_rank=per_rank if pp > 1 and schedule != "1f1b" else None,
                                pp_layer_split=fixed.get("pp_layer_split"),
                                rmsnorm=fixed.get("rmsnorm", "online"), group_linears=fixed.get("group_linears", True),
                            )
                            parallel.check_model(config)
                        except ValueError:
                            continue
                        yield parallel, dp, replica // m, m


def plan(config, cluster: Cluster, *, seq_len: int, global_batch: int, fixed: dict | None = None,
         precisions: tuple[str, ...] = ("autocast",), zero1_options: tuple[bool, ...] | None = None,
         efficiency: KernelEfficiency = CALIBRATED_EFFICIENCY) -> PlanResult:
    """Search every layout of ``config`` on ``cluster`` for steps of ``global_batch`` sequences of ``seq_len`` tokens
    (module docstring); ``fixed``: ``ParallelConfig`` field -> value the search keeps (``zero1`` too)."""
    fixed = dict(fixed or {})
    cache: dict = {}
    low_rank = config.bottleneck is not None
    modes = [fixed["activation_checkpointing"]] if "activation_checkpointing" in fixed else \
        [m for m in CHECKPOINTING_ORDER if low_rank or m != "lowrank"]
    ranked, unmodelled, tried = [], [], 0
    smallest: dict[tuple[int, int], Evaluated] = {}
    for parallel, dp, micro_batch, m in candidates(config, cluster, seq_len, global_batch, fixed):
        zero1s = zero1_options if zero1_options is not None else ((False, True) if dp > 1 else (False,))
        for mode in modes:
            layout = replace(parallel, activation_checkpointing=mode)
            try:
                layout.check_model(config)
            except ValueError:
                continue
            fitting = []
            for precision in precisions:
                for zero1 in zero1s:
                    tried += 1
                    candidate = Candidate(layout, dp, micro_batch, m, zero1 and dp > 1, precision)
                    memory = memory_per_gpu(config, layout, micro_batch=micro_batch, seq_len=seq_len, num_micro_batches=m,
                                            dp_size=dp, precision=precision, zero1=candidate.zero1)
                    ok, peak = fits(memory, cluster.memory_bytes)
                    evaluated = Evaluated(candidate, memory, peak, ok)
                    if ok is None:
                        unmodelled.append(candidate)
                    elif ok:
                        fitting.append(evaluated)
                    else:
                        key = (layout.tp_size, layout.pp_size)
                        if key not in smallest or peak < smallest[key].peak_bytes:
                            smallest[key] = evaluated
            if fitting:
                ranked += [replace(e, estimate=_estimate(config, e.candidate, seq_len, cluster, efficiency, cache)) for e in fitting]
                break  # a slower checkpointing mode of the same layout only loses
    ranked.sort(key=lambda e: (e.step_s, e.peak_bytes))
    fitting_keys = {(e.candidate.parallel.tp_size, e.candidate.parallel.pp_size) for e in ranked}
    never = sorted((e for key, e in smallest.items() if key not in fitting_keys), key=lambda e: e.peak_bytes)
    return PlanResult(ranked, never, unmodelled, tried)


def _estimate(config, candidate: Candidate, seq_len: int, cluster: Cluster, efficiency: KernelEfficiency,
              cache: dict) -> LayoutEstimate:
    from .estimator import Workload

    parallel = candidate.parallel
    workload = Workload(replace(parallel, pp_microbatches=None), micro_batch=candidate.micro_batch, seq_len=seq_len,
                        num_micro_batches=candidate.num_micro_batches, dp_size=candidate.dp,
                        zero1_optimizer=candidate.zero1, precision=candidate.precision,
                        dtype_bytes=4 if candidate.precision == "fp32" else 2)
    return estimate_layout(config, parallel.tp_style, workload, cluster.hardware, efficiency, cache=cache)


def why_slower(winner: Evaluated, other: Evaluated) -> str:
    """What makes ``other`` slower than ``winner``: its step time relative to the winner's and the components of the
    step (``estimate.breakdown_s``, the pipeline bubble apart) that grew the most."""
    a, b = winner.estimate, other.estimate
    deltas = {c: b.breakdown_s[c] - a.breakdown_s[c] for c in a.breakdown_s}
    deltas["pipeline bubble"] = b.bubble_s - a.bubble_s
    grown = sorted(((d, c) for c, d in deltas.items() if d > 0.0005 * a.step_time_s), reverse=True)[:2]
    names = {"tp_comm": "TP communication", "pp_comm": "stage transfers", "dp_comm": "DP all-reduce", "gemm": "GEMMs",
             "memory": "element-wise traffic", "attention": "attention", "optimizer": "optimizer step"}
    detail = ", ".join(f"{names.get(c, c)} +{d * 1e3:.0f} ms" for d, c in grown)
    return f"{b.step_time_s / a.step_time_s - 1:+.1%}" + (f" ({detail})" if detail else "")


def training_arguments(candidate: Candidate, *, seq_len: int) -> list[str]:
    """The ``boost-hf train`` overrides that run ``candidate`` (the training arguments' names of
    :mod:`boost_hf.parallel.settings`): every layout field the search decided, the batch split, the sequence length,
    ZeRO-1 and the precision (``--bf16``; ``--precision_policy`` where the trainer has it)."""
    from ..parallel.settings import TRAINING_NAMES

    p = candidate.parallel

    def name(field_name: str) -> str:
        return "--" + TRAINING_NAMES.get(field_name, field_name)

    args = [name("tp_size"), str(p.tp_size), name("pp_size"), str(p.pp_size)]
    if p.tp_style == "vanilla":
        args += [name("tp_style"), p.tp_style]
    if p.pp_size > 1:
        args += [name("pp_schedule"), p.pp_schedule, name("pp_microbatches"), str(candidate.num_micro_batches)]
        if p.pp_schedule != "1f1b":
            args += [name("pp_stages_per_rank"), str(p.stages_per_rank)]
        if p.pp_layer_split is not None:
            args += [name("pp_layer_split"), ",".join(map(str, p.pp_layer_split))]
    args += [name("sequence_parallel"), str(p.sequence_parallel).lower(),
             name("activation_checkpointing"), p.activation_checkpointing]
    if p.rmsnorm != "online":
        args += [name("rmsnorm"), p.rmsnorm]
    if not p.group_linears:
        args += [name("group_linears"), "false"]
    per_device = candidate.replica_batch if p.pp_size > 1 else candidate.micro_batch
    accumulation = 1 if p.pp_size > 1 else candidate.num_micro_batches
    args += ["--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accumulation),
             "--block_size", str(seq_len), "--zero1_optimizer", str(candidate.zero1).lower(),
             "--bf16", str(candidate.precision != "fp32").lower()]
    if candidate.precision == "bf16_params":
        args += ["--precision_policy", "bf16_params"]
    if p.sequence_parallel:
        args += ["--sample_max_new_tokens", "0"]  # generation feeds one token per step, which SP cannot split
    return args


def accelerate_config(cluster: Cluster, *, cpu: bool, mixed_precision: str) -> str:
    """An ``accelerate`` configuration (YAML) for ``cluster``: ``torchrun`` underneath (``MULTI_GPU``; with ``use_cpu``
    on CPU processes, gloo), one process per GPU, every node running the same file with its ``--machine_rank``."""
    nodes = cluster.nodes
    lines = [
        "# written by boost-hf plan: " + (f"{cluster.gpus} CPU processes" if cpu else
                                         f"{cluster.gpus} GPUs, {nodes} node(s) of {cluster.hardware.gpus_per_node}"),
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: MULTI_GPU",
        *(["use_cpu: true"] if cpu else ["gpu_ids: all"]),
        f"num_machines: {nodes}",
        f"num_processes: {cluster.gpus}",
        "machine_rank: 0",
        *(["main_process_port: 29500"] if nodes > 1 else []),
        f"mixed_precision: '{mixed_precision}'",
        f"rdzv_backend: {'c10d' if nodes > 1 else 'static'}",
        f"same_network: {'false' if nodes > 1 else 'true'}",
        "main_training_function: main",
    ]
    return "\n".join(lines) + "\n"


def launch_command(cluster: Cluster, config_path: str, recipe: str, train_args: list[str]) -> str:
    """The ``accelerate launch`` line that runs ``recipe`` with ``train_args`` (on every node of a multi-node cluster,
    with its ``NODE_RANK`` and the first node's ``MASTER_ADDR``)."""
    launch = ["accelerate", "launch", "--config_file", config_path]
    if cluster.nodes > 1:
        launch += ["--num_machines", str(cluster.nodes), "--num_processes", str(cluster.gpus),
                   "--machine_rank", "$NODE_RANK", "--main_process_ip", "$MASTER_ADDR"]
    return " ".join([*launch, "-m", "boost_hf.cli", "train", recipe, *train_args])


__all__ = ["CHECKPOINTING_ORDER", "accelerate_config", "launch_command", "training_arguments", "Candidate", "Cluster", "Evaluated", "PlanResult", "candidates", "plan", "why_slower"]
