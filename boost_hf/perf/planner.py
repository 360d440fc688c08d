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
  model, ``full``: tried fastest first, for each layout and data-parallel option the first that fits is kept) and the
  precision policy (:data:`~boost_hf.perf.memory.PRECISION_BYTES`: ``autocast`` and ``bf16_params`` on GPUs, ``fp32``
  on CPU); ``--grad_reduce_dtype bf16`` is the user's to give (it rounds the gradients' sum), not searched;
* how the DP ranks hold the model (:class:`~boost_hf.data_parallel_config.DataParallelConfig`'s fields, any given
  fixes it; :func:`data_parallel_options`): DDP, DDP with ``--zero1_optimizer`` (dp > 1), FSDP2 over the whole DP
  group and, when the DP group (``tp * dp`` adjacent GPUs) spans several nodes, HSDP with one replica per node it
  spans (``dp_replicate_size`` = those nodes, each shard group inside a node, only HSDP's all-reduce of ``1/S`` of
  the gradients across nodes; :func:`replica_sizes`); FSDP2 only at dp > 1, never with ZeRO-1 (training refuses it),
  with torchtitan's reshard policy and one unit per decoder layer unless given.

Each candidate's step time is :func:`~boost_hf.perf.estimator.estimate_layout`'s (DP all-reduce and ZeRO-1, or FSDP2's
all-gathers and reduce-scatters, included) and its memory :func:`~boost_hf.perf.memory.memory_per_gpu`'s (FSDP2's
shards and working set included); a candidate fits when its fullest GPU's peak is at most the GPU memory. Nothing is
built or run (the model's parameter shapes come from a meta-device skeleton). The report says by how much the best
FSDP2 and HSDP layouts win or lose against the best DDP / ZeRO-1 one (:func:`data_parallel_comparison`); the command
passes ``--data_parallel fsdp2`` and ``--dp_replicate_size`` as training takes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ..data_parallel_config import DATA_PARALLEL_BACKENDS, DataParallelConfig
from ..parallel.config import ParallelConfig
from .estimator import LayoutEstimate, estimate_layout
from .hardware import Hardware
from .kernels import CALIBRATED_EFFICIENCY, KernelEfficiency
from .memory import DDP, GIB, MemoryBreakdown, fits, memory_per_gpu
from .pipeline import engine_refusal
from .workload import Workload

CHECKPOINTING_ORDER = ("none", "lowrank", "full")  # fastest first
PLANNED_SCHEDULES = ("1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Cluster:
    """``gpus`` devices of ``hardware`` (whose ``gpus_per_node`` is the node size), ``memory_bytes`` each."""

    gpus: int
    hardware: Hardware
    memory_bytes: int

    def __post_init__(self) -> None:
        per_node = self.hardware.gpus_per_node
        check_positive(gpus=self.gpus, gpus_per_node=per_node)
        if self.gpus > per_node and self.gpus % per_node:
            fewer, more = self.gpus - self.gpus % per_node, self.gpus - self.gpus % per_node + per_node
            spread = [n for n in range(per_node - 1, 0, -1) if self.gpus % n == 0][0]
            raise ValueError(
                f"{self.gpus} GPUs do not fill nodes of {per_node} evenly: accelerate launch starts the same number of "
                f"processes on every node, and {self.gpus} over {self.nodes} nodes is not a whole number per node. Plan a "
                f"multiple of {per_node} (--gpus {fewer} or {more}), or {spread} GPU{'s' if spread > 1 else ''} on each of "
                f"{self.gpus // spread} nodes (--gpus-per-node {spread})."
            )

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.hardware.gpus_per_node)


@dataclass(frozen=True)
class Candidate:
    """One layout of the search: the ``parallel`` config (``pp_microbatches`` set under PP), ``dp`` data-parallel
    ranks, each step ``num_micro_batches`` micro-batches of ``micro_batch`` sequences per DP rank (at ``pp_size`` 1
    they are gradient accumulation steps), ``zero1``, the ``precision`` policy and how the DP ranks hold the model
    (``data_parallel``: DDP, or FSDP2 / HSDP)."""

    parallel: ParallelConfig
    dp: int
    micro_batch: int
    num_micro_batches: int
    zero1: bool
    precision: str
    grad_reduce_dtype: str | None = None  # "bf16": bf16_params' DP all-reduce in bf16
    data_parallel: DataParallelConfig = DDP

    @property
    def replica_batch(self) -> int:
        return self.micro_batch * self.num_micro_batches

    @property
    def family(self) -> str:
        """How the DP ranks hold the model: ``ddp``, ``zero1`` (DDP with ZeRO-1), ``fsdp2`` (sharded over every DP
        rank) or ``hsdp`` (replicas of FSDP2)."""
        if self.data_parallel.fully_sharded:
            return "hsdp" if self.data_parallel.dp_replicate_size > 1 else "fsdp2"
        return "zero1" if self.zero1 else "ddp"

    def describe_data_parallel(self) -> str:
        dp = self.data_parallel
        if self.family == "fsdp2":
            return "FSDP2"
        if self.family == "hsdp":
            return f"HSDP {dp.dp_replicate_size}x{dp.shard_size(self.dp)}"
        return "ZeRO-1" if self.zero1 else ""

    def describe(self) -> str:
        p = self.parallel
        parts = [f"tp {p.tp_size}", f"pp {p.pp_size}", f"dp {self.dp}"]
        if p.pp_size > 1:
            parts.append(f"{p.pp_schedule}" + (f" (v {p.stages_per_rank})" if p.stages_per_rank > 1 else ""))
        parts.append(f"{self.num_micro_batches} micro-batch{'es' if self.num_micro_batches > 1 else ''} of {self.micro_batch}")
        if p.sequence_parallel:
            parts.append("SP")
        parts.append(f"ckpt {p.activation_checkpointing}")
        if data_parallel := self.describe_data_parallel():
            parts.append(data_parallel)
        parts.append(self.precision + (" (bf16 grad reduce)" if self.grad_reduce_dtype == "bf16" else ""))
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
    candidates were tried; ``evaluated``: every candidate whose memory was modelled, in the order tried."""

    ranked: list[Evaluated]
    smallest: list[Evaluated]  # the least memory of each (tp, pp) that fits nowhere, least first
    unmodelled: list[Candidate] = field(default_factory=list)
    tried: int = 0
    evaluated: list[Evaluated] = field(default_factory=list)

    def best_of_each_family(self) -> dict[str, Evaluated]:
        """The fastest fitting candidate of each data-parallel family (:attr:`Candidate.family`) that has one."""
        best: dict[str, Evaluated] = {}
        for e in self.ranked:
            best.setdefault(e.candidate.family, e)
        return best


def check_positive(**sizes) -> None:
    """``ValueError`` naming the first of ``sizes`` (name -> value; ``None``: not given) that is not positive, with its
    command-line spelling."""
    for name, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}.")


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


def replica_sizes(parallel: ParallelConfig, dp: int, cluster: Cluster, given: int | None = None) -> list[int]:
    """The ``dp_replicate_size`` values FSDP2 is tried with: ``given`` (where it divides ``dp``), else 1 (FSDP2 over
    the whole DP group) and, when the DP group spans several nodes, one replica per node it spans (HSDP: each shard
    group inside a node, only the replicas' all-reduce across nodes; the DP group is ``tp * dp`` adjacent GPUs)."""
    if given is not None:
        return [given] if dp % given == 0 else []
    spanned = -(-parallel.tp_size * dp // cluster.hardware.gpus_per_node)
    return [1] + ([spanned] if 1 < spanned < dp and dp % spanned == 0 else [])


def data_parallel_options(parallel: ParallelConfig, dp: int, cluster: Cluster, fixed: dict,
                          zero1_options: tuple[bool, ...] | None) -> list[tuple[DataParallelConfig, bool]]:
    """How the ``dp`` ranks of a layout may hold the model, as ``(DataParallelConfig, zero1)``: DDP without and with
    ZeRO-1 (``zero1_options``), FSDP2 and HSDP (:func:`replica_sizes`; dp > 1; never with ZeRO-1, which training
    refuses). ``fixed``: the :class:`~boost_hf.data_parallel_config.DataParallelConfig` fields the user gave
    (``data_parallel`` a tuple of backends)."""
    backends = fixed.get("data_parallel") or DATA_PARALLEL_BACKENDS
    out: list[tuple[DataParallelConfig, bool]] = []
    if "ddp" in backends:
        zero1s = zero1_options if zero1_options is not None else ((False, True) if dp > 1 else (False,))
        out += [(DDP, zero1) for zero1 in dict.fromkeys(z and dp > 1 for z in zero1s)]
    settings = {name: fixed[name] for name in ("fsdp_reshard_after_forward", "fsdp_units") if fixed.get(name) is not None}
    if "fsdp2" in backends and dp > 1 and not (parallel.pp_size > 1 and settings.get("fsdp_reshard_after_forward") == "always"):
        out += [(DataParallelConfig("fsdp2", replicas, **settings), False)
                for replicas in replica_sizes(parallel, dp, cluster, fixed.get("dp_replicate_size"))]
    return out


def plan(config, cluster: Cluster, *, seq_len: int, global_batch: int, fixed: dict | None = None,
         precisions: tuple[str, ...] = ("autocast",), zero1_options: tuple[bool, ...] | None = None,
         data_parallel: dict | None = None, grad_reduce_dtype: str | None = None,
         efficiency: KernelEfficiency = CALIBRATED_EFFICIENCY) -> PlanResult:
    """Search every layout of ``config`` on ``cluster`` for steps of ``global_batch`` sequences of ``seq_len`` tokens
    (module docstring); ``fixed``: ``ParallelConfig`` field -> value the search keeps; ``data_parallel``:
    ``DataParallelConfig`` field -> value it keeps (``data_parallel``: the backends to try, a tuple). For each
    structural layout and data-parallel option (:func:`data_parallel_options`) the checkpointing modes are tried
    fastest first and the first that fits is kept. ``grad_reduce_dtype`` (``"bf16"``) applies to the ``bf16_params``
    candidates: it changes the gradients' rounding, so it is the user's choice, not searched."""
    fixed, data_parallel = dict(fixed or {}), dict(data_parallel or {})
    check_positive(seq_len=seq_len, global_batch=global_batch,
                   **{name: value for name, value in {**fixed, **data_parallel}.items()
                      if isinstance(value, int) and not isinstance(value, bool)})
    cache: dict = {}
    low_rank = config.bottleneck is not None
    modes = [fixed["activation_checkpointing"]] if "activation_checkpointing" in fixed else \
        [m for m in CHECKPOINTING_ORDER if low_rank or m != "lowrank"]
    ranked, unmodelled, evaluated, tried = [], [], [], 0
    smallest: dict[tuple[int, int], Evaluated] = {}
    for parallel, dp, micro_batch, m in candidates(config, cluster, seq_len, global_batch, fixed):
        layouts = []
        for mode in modes:
            layout = replace(parallel, activation_checkpointing=mode)
            try:
                layout.check_model(config)
            except ValueError:
                continue
            layouts.append(layout)
        for sharding, zero1 in data_parallel_options(parallel, dp, cluster, data_parallel, zero1_options):
            for layout in layouts:
                fitting = []
                for precision in precisions:
                    tried += 1
                    reduce = grad_reduce_dtype if precision == "bf16_params" and dp > 1 else None
                    candidate = Candidate(layout, dp, micro_batch, m, zero1, precision, reduce, sharding)
                    memory = memory_per_gpu(config, layout, micro_batch=micro_batch, seq_len=seq_len, num_micro_batches=m,
                                            dp_size=dp, precision=precision, zero1=zero1, data_parallel=sharding)
                    ok, peak = fits(memory, cluster.memory_bytes)
                    result = Evaluated(candidate, memory, peak, ok)
                    if ok is None:
                        unmodelled.append(candidate)
                    elif ok:
                        fitting.append(result)
                    else:
                        evaluated.append(result)
                        key = (layout.tp_size, layout.pp_size)
                        if key not in smallest or peak < smallest[key].peak_bytes:
                            smallest[key] = result
                if fitting:
                    timed = [replace(e, estimate=_estimate(config, e.candidate, seq_len, cluster, efficiency, cache)) for e in fitting]
                    ranked += timed
                    evaluated += timed
                    break  # a slower checkpointing mode of the same layout only loses
    ranked.sort(key=lambda e: (e.step_s, e.peak_bytes))
    fitting_keys = {(e.candidate.parallel.tp_size, e.candidate.parallel.pp_size) for e in ranked}
    never = sorted((e for key, e in smallest.items() if key not in fitting_keys), key=lambda e: e.peak_bytes)
    return PlanResult(ranked, never, unmodelled, tried, evaluated)


def _estimate(config, candidate: Candidate, seq_len: int, cluster: Cluster, efficiency: KernelEfficiency,
              cache: dict) -> LayoutEstimate:
    parallel = candidate.parallel
    workload = Workload(replace(parallel, pp_microbatches=None), micro_batch=candidate.micro_batch, seq_len=seq_len,
                        num_micro_batches=candidate.num_micro_batches, dp_size=candidate.dp,
                        zero1_optimizer=candidate.zero1, precision=candidate.precision,
                        grad_reduce_dtype=candidate.grad_reduce_dtype, data_parallel=candidate.data_parallel,
                        dtype_bytes=4 if candidate.precision == "fp32" else 2)
    return estimate_layout(config, parallel.tp_style, workload, cluster.hardware, efficiency, cache=cache)


def why_slower(winner: Evaluated, other: Evaluated) -> str:
    """What makes ``other`` slower than ``winner``: its step time relative to the winner's and the components of the
    step (``estimate.breakdown_s``, the pipeline bubble apart) that grew the most."""
    a, b = winner.estimate, other.estimate
    deltas = {c: b.breakdown_s[c] - a.breakdown_s[c] for c in a.breakdown_s}
    deltas["pipeline bubble"] = b.bubble_s - a.bubble_s
    grown = sorted(((d, c) for c, d in deltas.items() if d > 0.0005 * a.step_time_s), reverse=True)[:2]
    names = {"tp_comm": "TP communication", "pp_comm": "stage transfers", "dp_comm": "DP communication", "gemm": "GEMMs",
             "memory": "element-wise traffic", "attention": "attention", "optimizer": "optimizer step"}
    detail = ", ".join(f"{names.get(c, c)} +{d * 1e3:.0f} ms" for d, c in grown)
    return f"{b.step_time_s / a.step_time_s - 1:+.1%}" + (f" ({detail})" if detail else "")


def training_arguments(candidate: Candidate, *, seq_len: int) -> list[str]:
    """The ``boost-hf train`` overrides that run ``candidate`` (the training arguments' names of
    :mod:`boost_hf.parallel.settings` and :mod:`boost_hf.data_parallel_config`): every layout field the search
    decided, the batch split, the sequence length, ZeRO-1, the precision (``--bf16``; ``--precision_policy`` where the
    trainer has it) and FSDP2's settings (``--data_parallel fsdp2``, ``--dp_replicate_size`` for HSDP)."""
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
    if candidate.precision != "fp32":  # named, whichever policy is the trainer's default with bf16
        args += ["--precision_policy", candidate.precision]
    sharding = candidate.data_parallel
    if sharding.fully_sharded:  # the DataParallelConfig fields that are not the default, under their own names
        args += [arg for f in fields(sharding) if getattr(sharding, f.name) != f.default
                 for arg in (f"--{f.name}", str(getattr(sharding, f.name)))]
    if candidate.grad_reduce_dtype == "bf16":
        args += ["--grad_reduce_dtype", "bf16"]
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


@dataclass(frozen=True)
class PlanInputs:
    """What is planned: the model ``config`` (``name`` to show), steps of ``global_batch`` sequences of ``seq_len``
    tokens, the ``recipe`` the command trains (a shipped name, a path, or ``RECIPE.yaml`` to fill in), the recipe's
    own layout (its training fields, when planning a recipe) and notes on what was assumed."""

    config: object
    name: str
    seq_len: int
    global_batch: int
    recipe: str
    recipe_layout: dict | None = None
    notes: tuple[str, ...] = ()


RECIPE_LAYOUT_FIELDS = ("tp_size", "pp_size", "pp_schedule", "pp_microbatches", "sequence_parallel",
                        "activation_checkpointing_mode", "zero1_optimizer", "per_device_train_batch_size",
                        "gradient_accumulation_steps", "bf16")


def plan_inputs(*, recipe: str | None = None, preset: str | None = None, config_path: str | None = None, gpus: int,
                seq_len: int | None = None, global_batch: int | None = None) -> PlanInputs:
    """The model and workload of a plan: from a recipe (its model, ``block_size`` and global batch on ``gpus``), a
    preset, or a ``config.json``; ``seq_len`` and ``global_batch`` override (defaults 4096 and 512 without a recipe)."""
    import json
    from pathlib import Path

    import yaml

    from ..configuration_boost_llama import BoostLlamaConfig

    if sum(x is not None for x in (recipe, preset, config_path)) != 1:
        raise ValueError("plan needs exactly one model: --recipe NAME|PATH, --preset NAME or --config config.json.")
    check_positive(gpus=gpus, seq_len=seq_len, global_batch=global_batch)
    notes = []
    if recipe is not None:
        from ..shipped import VOCAB_MULTIPLE, recipe_model_config, resolve_recipe

        path = resolve_recipe(recipe)
        sections = yaml.safe_load(Path(path).read_text()) or {}
        model = {k: v for k, v in (sections.get("model") or {}).items() if k != "init_from"}
        data, training = sections.get("data") or {}, sections.get("training") or {}
        tokenizer = str(data.get("tokenizer", "bpe"))
        if "vocab_size" not in model and tokenizer.startswith("bpe-") and tokenizer[4:].isdigit():
            model["vocab_size"] = -(-int(tokenizer[4:]) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        elif "vocab_size" not in model:
            notes.append(f"vocab_size from the preset (the recipe's tokenizer {tokenizer!r} sets it when loaded)")
        config = recipe_model_config(model.pop("preset", "cola-60m"), model)
        for section, name in (("training", "tp_size"), ("training", "pp_size"), ("training", "per_device_train_batch_size"),
                              ("training", "gradient_accumulation_steps"), ("data", "block_size")):
            value = (training if section == "training" else data).get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"the recipe {path} sets {section}.{name}: {value!r}, which must be a positive whole "
                                 "number: correct it in the recipe (or plan with --preset and the sizes as options).")
        tp, pp = training.get("tp_size") or 1, training.get("pp_size") or 1
        if gpus % (tp * pp):
            raise ValueError(f"the recipe's tp_size x pp_size ({tp} x {pp}) does not divide --gpus {gpus}: give --global-batch.")
        recipe_batch = training.get("per_device_train_batch_size", 8) * training.get("gradient_accumulation_steps", 1) * (gpus // (tp * pp))
        layout = {name: training.get(name) for name in RECIPE_LAYOUT_FIELDS}
        return PlanInputs(config, Path(path).stem, seq_len or data.get("block_size", 256), global_batch or recipe_batch,
                          recipe, layout, tuple(notes))
    if preset is not None:
        from ..shipped import shipped_recipes

        config = BoostLlamaConfig.from_preset(preset)
        name, command_recipe = preset, preset if preset in shipped_recipes() else "RECIPE.yaml"
    else:
        config = BoostLlamaConfig.from_dict(json.loads(Path(config_path).read_text()))
        name, command_recipe = Path(config_path).parent.name or config_path, "RECIPE.yaml"
    if command_recipe == "RECIPE.yaml":
        notes.append("no shipped recipe trains this model: RECIPE.yaml in the command is yours to write")
    return PlanInputs(config, name, seq_len or 4096, global_batch or 512, command_recipe, None, tuple(notes))


@dataclass(frozen=True)
class PlanReport:
    """What ``boost-hf plan`` prints: ``text``, ``layouts`` (the ``--json`` list, best first) and the winner's
    ``accelerate_config`` (``None`` when nothing fits)."""

    text: str
    layouts: list[dict]
    accelerate_config: str | None


def _gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 2)


def _record(evaluated: Evaluated, inputs: PlanInputs, cluster: Cluster, command: str | None, best: Evaluated | None,
            listed: str) -> dict:
    c, p = evaluated.candidate, evaluated.candidate.parallel
    e = evaluated.estimate
    fullest = evaluated.fullest
    sharding = c.data_parallel
    record = {
        "listed": listed,
        "tp": p.tp_size, "pp": p.pp_size, "dp": c.dp, "tp_style": p.tp_style,
        "pp_schedule": p.pp_schedule if p.pp_size > 1 else None,
        "pp_stages_per_rank": p.stages_per_rank if p.pp_size > 1 else None,
        "pp_microbatches": c.num_micro_batches if p.pp_size > 1 else None,
        "micro_batch": c.micro_batch,
        "gradient_accumulation_steps": 1 if p.pp_size > 1 else c.num_micro_batches,
        "sequence_parallel": p.sequence_parallel, "activation_checkpointing": p.activation_checkpointing,
        "zero1": c.zero1, "precision": c.precision, "grad_reduce_dtype": c.grad_reduce_dtype,
        "data_parallel": sharding.data_parallel, "data_parallel_family": c.family,
        "dp_replicate_size": sharding.dp_replicate_size if sharding.fully_sharded else None,
        "dp_shard_size": sharding.shard_size(c.dp) if sharding.fully_sharded else None,
        "memory_gb_per_gpu": _gib(evaluated.peak_bytes),
        "memory_gb_by_pipeline_rank": [_gib(b.total) for b in evaluated.memory],
        "memory_breakdown_gb": {k: _gib(v) for k, v in fullest.parts().items()},
        "margin_gb": None if evaluated.peak_bytes is None else _gib(cluster.memory_bytes - evaluated.peak_bytes),
        "fits": evaluated.fits,
        "step_s": None if e is None else round(e.step_time_s, 4),
        "tokens_per_s": None if e is None else round(e.tokens_per_s * c.dp),
        "tokens_per_s_per_gpu": None if e is None else round(e.tokens_per_s * c.dp / cluster.gpus),
        "mfu": None if e is None else round(e.mfu, 4),
        "bubble_fraction": None if e is None else round(e.bubble_fraction, 4),
        "breakdown_s": None if e is None else {k: round(v, 4) for k, v in e.breakdown_s.items() if v},
        "vs_best": None if best is None or e is None or evaluated is best else why_slower(best, evaluated),
        "command": command,
    }
    if not evaluated.fits:
        record["reason"] = (f"needs {_gib(evaluated.peak_bytes)} GiB on its fullest GPU (pipeline rank {fullest.pp_rank}), "
                            f"the GPUs have {_gib(cluster.memory_bytes)}")
    return record


PART_LABELS = {
    "parameters": "parameters", "masters": "fp32 master weights", "gradients": "gradients",
    "gradient_buckets": "DDP gradient buckets", "optimizer_states": "AdamW state", "activations": "activations kept",
    "gathered_parameters": "FSDP2 gathered parameters", "unsharded_gradients": "FSDP2 unsharded gradients",
    "weight_copies": "autocast weight copies", "transient": "backward working set", "framework": "CUDA/NCCL/allocator",
}
FAMILY_NAMES = {"ddp": "DDP", "zero1": "DDP + ZeRO-1", "fsdp2": "FSDP2", "hsdp": "HSDP"}


def data_parallel_comparison(result: PlanResult) -> list[str]:
    """Lines saying by how much the best FSDP2 and HSDP layouts win or lose against the best DDP / ZeRO-1 one (step
    time and memory per GPU), and what FSDP2 changes at that very layout; ``[]`` when either side has no fitting
    layout."""
    best = result.best_of_each_family()
    unsharded = [best[f] for f in ("ddp", "zero1") if f in best]
    sharded = [best[f] for f in ("fsdp2", "hsdp") if f in best]
    if not unsharded or not sharded:
        return []
    reference = min(unsharded, key=lambda e: (e.step_s, e.peak_bytes))

    def versus(e: Evaluated) -> str:
        return (f"{e.step_s:.3f} s ({e.step_s / reference.step_s - 1:+.1%}), {e.peak_bytes / GIB:.1f} GiB per GPU "
                f"({(e.peak_bytes - reference.peak_bytes) / GIB:+.1f} GiB)")

    name = FAMILY_NAMES[reference.candidate.family]
    lines = ["", f"FSDP2 / HSDP against the best {name} layout ({reference.candidate.describe()}: {reference.step_s:.3f} s, "
                 f"{reference.peak_bytes / GIB:.1f} GiB per GPU):"]
    lines += [f"  best {FAMILY_NAMES[e.candidate.family]}: {e.candidate.describe()}: {versus(e)}" for e in sharded]

    def structure(c: Candidate) -> tuple:  # the layout but its data parallelism and checkpointing
        return (replace(c.parallel, activation_checkpointing="none"), c.dp, c.micro_batch, c.num_micro_batches, c.precision)

    def preference(e: Evaluated) -> tuple:  # the fastest that fits, else the smallest
        return (0, e.step_s) if e.fits else (1, e.peak_bytes)

    at_reference: dict[str, Evaluated] = {}
    for e in result.evaluated:  # FSDP2 / HSDP at the reference's layout
        family = e.candidate.family
        if family in ("fsdp2", "hsdp") and structure(e.candidate) == structure(reference.candidate):
            if family not in at_reference or preference(e) < preference(at_reference[family]):
                at_reference[family] = e
    for family, e in sorted(at_reference.items()):
        label = f"{e.candidate.describe_data_parallel()} at that layout" + (
            f" (ckpt {e.candidate.parallel.activation_checkpointing})"
            if e.candidate.parallel.activation_checkpointing != reference.candidate.parallel.activation_checkpointing else "")
        if e.fits:
            lines.append(f"  {label}: {versus(e)}")
        else:
            lines.append(f"  {label}: does not fit, {e.peak_bytes / GIB:.1f} GiB per GPU "
                         f"({(e.peak_bytes - reference.peak_bytes) / GIB:+.1f} GiB)")
    return lines


def plan_report(result: PlanResult, inputs: PlanInputs, cluster: Cluster, *, accelerate_config_path: str,
                top: int = 5, every: bool = False) -> PlanReport:
    """The text and JSON of a plan, the winner's accelerate config and the command that runs each layout. The JSON
    lists the ``top`` fitting layouts, the best of each data-parallel family (DDP, ZeRO-1, FSDP2, HSDP) not among
    them and the least memory of each tp x pp that fits nowhere; ``every``: every evaluated candidate instead (the
    fitting ones fastest first, each with its time, then the others, least memory first)."""
    cpu = cluster.hardware.name == "cpu"
    config, hw = inputs.config, cluster.hardware
    best = result.ranked[0] if result.ranked else None

    def command(e: Evaluated) -> str:
        args = training_arguments(e.candidate, seq_len=inputs.seq_len)
        return launch_command(cluster, accelerate_config_path, inputs.recipe, args)

    shown = result.ranked[:top]
    layouts = [_record(e, inputs, cluster, command(e), best, "top") for e in shown]
    if every:
        layouts += [_record(e, inputs, cluster, command(e), best, "fits") for e in result.ranked[top:]]
        layouts += [_record(e, inputs, cluster, None, None, "does not fit")
                    for e in sorted((e for e in result.evaluated if not e.fits), key=lambda e: e.peak_bytes)]
    else:
        layouts += [_record(e, inputs, cluster, command(e), best, f"best {family}")
                    for family, e in result.best_of_each_family().items() if all(e is not s for s in shown)]
        layouts += [_record(e, inputs, cluster, None, None, "smallest of its tp x pp") for e in result.smallest[:top]]
    kind = "CPU processes" if cpu else f"{hw.name} ({hw.memory_gb:g} GiB, {hw.gpus_per_node} per node, {cluster.nodes} node(s))"
    model = (f"{inputs.name} ({config.num_hidden_layers} layers, d {config.hidden_size}, "
             + (f"r {config.rank}" if config.bottleneck else "full rank") + ")")
    lines = [
        f"boost-hf plan: {model} on {cluster.gpus} x {kind}; {inputs.global_batch} sequences of {inputs.seq_len} tokens "
        "per step",
        f"{result.tried} layouts evaluated, {len(result.ranked)} fit"
        + (f"; {len(result.unmodelled)} not modelled (activations without checkpointing of this layout)" if result.unmodelled else ""),
        *(f"note: {note}" for note in inputs.notes),
        "",
    ]
    if best is None:
        smallest = result.smallest[0] if result.smallest else None
        lines.append(f"nothing fits in {cluster.memory_bytes / GIB:g} GiB per GPU."
                     + (f" The smallest needs {smallest.peak_bytes / GIB:.1f} GiB: {smallest.candidate.describe()}." if smallest else ""))
        for e in result.smallest[1:top]:
            lines.append(f"  {e.candidate.describe()}: needs {e.peak_bytes / GIB:.1f} GiB")
        return PlanReport("\n".join(lines), layouts, None)
    lines.append(f"{'#':>2}  {'layout':<72} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>6} {'GiB/GPU':>8} {'margin':>7}")
    for i, (e, record) in enumerate(zip(shown, layouts), 1):
        lines.append(f"{i:>2}  {e.candidate.describe():<72} {e.step_s:>8.3f} {record['tokens_per_s_per_gpu']:>10,} "
                     f"{e.estimate.mfu:>6.1%} {e.peak_bytes / GIB:>8.1f} {record['margin_gb']:>7.1f}")
        if i > 1:
            lines.append(f"{'':4}loses by {record['vs_best']}")
    lines += ["", f"memory per GPU of #1, GiB, by pipeline rank ({', '.join(str(b.pp_rank) for b in best.memory)}):"]
    for part, label in PART_LABELS.items():
        values = [b.parts()[part] for b in best.memory]
        if any(values):
            lines.append(f"  {label:<28}" + "".join(f"{v / GIB:>8.2f}" for v in values))
    lines.append(f"  {'total':<28}" + "".join(f"{b.total / GIB:>8.2f}" for b in best.memory)
                 + f"   of {cluster.memory_bytes / GIB:g}")
    lines.append(f"  a checkpoint save adds no GPU memory; with --save_async it holds "
                 f"{max(b.save_host for b in best.memory) / GIB:.1f} GiB of host memory per GPU (its shards)")
    families = {}
    for e in result.ranked:
        families.setdefault((e.candidate.parallel.tp_size, e.candidate.parallel.pp_size), e)
    others = [e for e in families.values() if e is not best]
    if others or result.smallest:
        lines += ["", "the best of each other tp x pp, and why it loses:"]
        lines += [f"  {e.candidate.describe()}: {e.step_s:.3f} s, {why_slower(best, e)}" for e in others]
        lines += [f"  {e.candidate.describe()}: does not fit, needs {e.peak_bytes / GIB:.1f} GiB" for e in result.smallest[:top]]
    lines += data_parallel_comparison(result)
    mixed = "no" if best.candidate.precision == "fp32" else "bf16"
    text_config = accelerate_config(cluster, cpu=cpu, mixed_precision=mixed)
    lines += ["", f"accelerate config written to {accelerate_config_path}; run #1"
              + (f" on every node (NODE_RANK 0..{cluster.nodes - 1}, MASTER_ADDR the first node's):" if cluster.nodes > 1 else ":"),
              f"  {layouts[0]['command']}"]
    return PlanReport("\n".join(lines), layouts, text_config)


__all__ = ["CHECKPOINTING_ORDER", "PlanInputs", "PlanReport", "plan_inputs", "plan_report", "accelerate_config", "launch_command", "training_arguments", "Candidate", "Cluster", "Evaluated", "PlanResult", "candidates", "data_parallel_comparison", "data_parallel_options", "plan", "replica_sizes", "why_slower"]
