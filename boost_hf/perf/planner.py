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

The search is bounded before anything is evaluated (:func:`structures`, :func:`check_search`): the micro-batch splits
are divisors of the global batch, found once; more than :data:`MAX_LAYOUTS` structural layouts, sizes above
:data:`LARGEST_SIZE`, a cluster no tp x pp x dp splits and a ``dp_replicate_size`` that divides no data-parallel size
are refused naming why; a given setting that training takes for one backend narrows the backends
(:func:`data_parallel_options`), and a recipe's settings that plan does not search narrow it as training would
(:func:`search_of_recipe`). The memory model's work per layout does not grow with the data parallelism.

Each candidate's step time is :func:`~boost_hf.perf.estimator.estimate_layout`'s (DP all-reduce and ZeRO-1, or FSDP2's
all-gathers and reduce-scatters, included) and its memory :func:`~boost_hf.perf.memory.memory_per_gpu`'s (FSDP2's
shards and working set included); a candidate fits when its fullest GPU's peak is at most the GPU memory. Nothing is
built or run (the model's parameter shapes come from a meta-device skeleton). The report says by how much the best
FSDP2 and HSDP layouts win or lose against the best DDP / ZeRO-1 one (:func:`data_parallel_comparison`); the command
passes ``--data_parallel fsdp2`` and ``--dp_replicate_size`` as training takes them, and names every setting the plan
decided that the recipe it trains sets otherwise (:func:`training_arguments`): each command passes training's checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from math import isqrt

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
            spread = max(n for n in _divisors(self.gpus) if n < per_node)
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


LARGEST_SIZE = 2**31 - 1
"""The largest size a plan takes (GPUs, sequences, tokens, any layout size): torch.distributed numbers its ranks in 32
bits, and no batch or sequence of more is trained."""
MAX_LAYOUTS = 1000
"""The most structural layouts (tp x pp x schedule x micro-batch split x sequence parallelism, :func:`structures`) one
plan searches, each then with up to 3 checkpointing modes, 4 data-parallel options and the precision policies: a plan
answers in seconds (about 5 s of search at the bound). Global batches of a power of two up to 65,536 sequences have at
most 864 on 1 to 4,096 GPUs (cola-30b on 32 H100 for 512: 384); 3,072 on 64 GPUs 969; 720,720 (240 divisors) on 32
GPUs 6,331, refused."""


def check_positive(**sizes) -> None:
    """``ValueError`` naming the first of ``sizes`` (name -> value; ``None``: not given) that is not positive, or above
    :data:`LARGEST_SIZE`, with its command-line spelling."""
    for name, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not value > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}.")
        if value is not None and value > LARGEST_SIZE:
            raise ValueError(f"--{name.replace('_', '-')} {value} is more than a plan takes ({LARGEST_SIZE}, 2^31 - 1: "
                             "torch.distributed numbers its ranks in 32 bits, and no batch or sequence is that large).")


def _divisors(n: int) -> list[int]:
    """The divisors of ``n``, smallest first (``sqrt(n)`` trials)."""
    small = [d for d in range(1, isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


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


@dataclass(frozen=True)
class Structure:
    """The sizes of a group of structural candidates, before any config is built: ``tp`` x ``pp`` x ``dp``, the
    pipeline ``schedule`` with ``stages_per_rank``, the micro-batch counts ``splits`` of each replica's
    ``replica_batch`` sequences and the sequence-parallel options ``sp``: ``len(splits) * len(sp)`` candidates."""

    tp: int
    pp: int
    dp: int
    schedule: str
    stages_per_rank: int
    replica_batch: int
    splits: tuple[int, ...]
    sp: tuple[bool, ...]

    @property
    def count(self) -> int:
        return len(self.splits) * len(self.sp)


def structures(config, cluster: Cluster, seq_len: int, global_batch: int, fixed: dict) -> list[Structure]:
    """Every tp x pp x dp, schedule and micro-batch split of ``global_batch`` on ``cluster`` that the search tries
    (``fixed``: the :class:`~boost_hf.parallel.config.ParallelConfig` fields given), by arithmetic alone: the replica
    batches' splits are divisors of the global batch's, found once."""
    style = fixed.get("tp_style") or ("megatron" if config.bottleneck is None else "btp")
    layers = config.num_hidden_layers
    batch_divisors = _divisors(global_batch)
    out = []
    for tp in _tp_sizes(config, style, cluster, fixed):
        for pp in ([fixed["pp_size"]] if "pp_size" in fixed else range(1, min(layers, cluster.gpus // tp) + 1)):
            if pp > layers or cluster.gpus % (tp * pp):
                continue
            dp = cluster.gpus // (tp * pp)
            if global_batch % dp:
                continue
            replica = global_batch // dp
            schedules = [fixed["pp_schedule"]] if "pp_schedule" in fixed else (PLANNED_SCHEDULES if pp > 1 else ("1f1b",))
            sp = (fixed["sequence_parallel"],) if "sequence_parallel" in fixed else (
                (False, True) if tp > 1 and style != "vanilla" and seq_len % tp == 0 else (False,))
            for schedule in schedules:
                per_rank = fixed.get("pp_stages_per_rank") or (2 if schedule != "1f1b" and pp > 1 else 1)
                if pp * per_rank > layers:
                    continue
                splits = [fixed["pp_microbatches"]] if "pp_microbatches" in fixed else \
                    [m for m in batch_divisors if replica % m == 0]
                splits = tuple(m for m in splits if replica % m == 0 and not (pp > 1 and engine_refusal(schedule, pp, m)))
                if splits:
                    out.append(Structure(tp, pp, dp, schedule, per_rank, replica, splits, sp))
    return out


def candidates(config, cluster: Cluster, seq_len: int, global_batch: int, fixed: dict,
               found: list[Structure] | None = None):
    """Every structural candidate (the checkpointing mode, ZeRO-1 and precision are varied by :func:`plan`), as
    ``(parallel without checkpointing, dp, micro_batch, num_micro_batches)``; ``found``: :func:`structures` already
    found."""
    style = fixed.get("tp_style") or ("megatron" if config.bottleneck is None else "btp")
    for group in structures(config, cluster, seq_len, global_batch, fixed) if found is None else found:
        tp, pp, schedule, per_rank = group.tp, group.pp, group.schedule, group.stages_per_rank
        for m in group.splits:
            for sp in group.sp:
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
                yield parallel, group.dp, group.replica_batch // m, m


def replica_sizes(parallel: ParallelConfig, dp: int, cluster: Cluster, given: int | None = None) -> list[int]:
    """The ``dp_replicate_size`` values FSDP2 is tried with: ``given`` (where it divides ``dp``), else 1 (FSDP2 over
    the whole DP group) and, when the DP group spans several nodes, one replica per node it spans (HSDP: each shard
    group inside a node, only the replicas' all-reduce across nodes; the DP group is ``tp * dp`` adjacent GPUs)."""
    if given is not None:
        return [given] if dp % given == 0 else []
    spanned = -(-parallel.tp_size * dp // cluster.hardware.gpus_per_node)
    return [1] + ([spanned] if 1 < spanned < dp and dp % spanned == 0 else [])


FSDP2_ONLY = ("fsdp_reshard_after_forward", "fsdp_units")  # DataParallelConfig's settings of FSDP2 alone


def _searched_backends(fixed: dict, zero1_options: tuple[bool, ...] | None) -> tuple[str, ...]:
    """The data-parallel backends a plan tries: those given (``fixed["data_parallel"]``, default both) that agree with
    the other settings given, as training takes them: HSDP's ``dp_replicate_size`` above 1 and FSDP2's own settings
    are FSDP2's (under DDP training refuses them), ``--zero1 true`` DDP's (with FSDP2 training refuses it).
    ``ValueError`` naming both when the settings given leave no backend."""
    backends = tuple(fixed.get("data_parallel") or DATA_PARALLEL_BACKENDS)
    fsdp2_settings = [f"--{name} {fixed[name]}" for name in FSDP2_ONLY if fixed.get(name) is not None]
    if (fixed.get("dp_replicate_size") or 1) > 1:
        fsdp2_settings.insert(0, f"--dp_replicate_size {fixed['dp_replicate_size']}")
    zero1 = zero1_options == (True,)
    if fsdp2_settings and zero1:
        raise ValueError(f"{' '.join(fsdp2_settings)} sets how FSDP2 shards, and --zero1 true keeps --zero1_optimizer, "
                         "which training refuses with FSDP2 (it shards the optimizer state itself): drop one of them.")
    if fsdp2_settings and "fsdp2" not in backends:
        raise ValueError(f"{' '.join(fsdp2_settings)} sets how FSDP2 shards, but --data_parallel {' '.join(backends)} "
                         "searches no FSDP2 layout (training refuses it under DDP): add --data_parallel fsdp2, or drop it.")
    if zero1 and "ddp" not in backends:
        raise ValueError("--zero1 true keeps --zero1_optimizer, which training refuses with --data_parallel fsdp2 (FSDP2 "
                         "shards the optimizer state over the data-parallel group already): drop --zero1 true, or search "
                         "--data_parallel ddp.")
    if fsdp2_settings:
        return ("fsdp2",)
    return tuple(b for b in backends if not (zero1 and b == "fsdp2"))


def data_parallel_options(parallel: ParallelConfig, dp: int, cluster: Cluster, fixed: dict,
                          zero1_options: tuple[bool, ...] | None) -> list[tuple[DataParallelConfig, bool]]:
    """How the ``dp`` ranks of a layout may hold the model, as ``(DataParallelConfig, zero1)``: DDP without and with
    ZeRO-1 (``zero1_options``), FSDP2 and HSDP (:func:`replica_sizes`; dp > 1; never with ZeRO-1, which training
    refuses). ``fixed``: the :class:`~boost_hf.data_parallel_config.DataParallelConfig` fields the user gave
    (``data_parallel`` a tuple of backends; what else is given narrows them, :func:`_searched_backends`)."""
    backends = _searched_backends(fixed, zero1_options)
    out: list[tuple[DataParallelConfig, bool]] = []
    if "ddp" in backends:
        zero1s = zero1_options if zero1_options is not None else ((False, True) if dp > 1 else (False,))
        out += [(DDP, zero1) for zero1 in dict.fromkeys(z and dp > 1 for z in zero1s)]
    settings = {name: fixed[name] for name in FSDP2_ONLY if fixed.get(name) is not None}
    if "fsdp2" in backends and dp > 1 and not (parallel.pp_size > 1 and settings.get("fsdp_reshard_after_forward") == "always"):
        out += [(DataParallelConfig("fsdp2", replicas, **settings), False)
                for replicas in replica_sizes(parallel, dp, cluster, fixed.get("dp_replicate_size"))]
    return out


def check_search(found: list[Structure], config, cluster: Cluster, global_batch: int, fixed: dict,
                 data_parallel: dict) -> None:
    """``ValueError`` naming why, before anything is evaluated, when the structural layouts :func:`structures` found
    are none (no tp x pp x dp splits the GPUs and the global batch, or none takes the sizes given), more than
    :data:`MAX_LAYOUTS`, or none has a data-parallel size that a ``dp_replicate_size`` given divides."""
    gpus, layers = cluster.gpus, config.num_hidden_layers
    given = ", ".join(f"--{name} {value}" for name, value in fixed.items())
    if not found:
        tps = _tp_sizes(config, fixed.get("tp_style") or ("megatron" if config.bottleneck is None else "btp"), cluster, fixed)
        pps = [fixed["pp_size"]] if "pp_size" in fixed else range(1, layers + 1)
        dps = sorted({gpus // (tp * pp) for tp in tps for pp in pps if gpus % (tp * pp) == 0 and pp <= layers})
        if not tps or not dps:
            raise ValueError(f"no tp x pp splits {gpus} GPUs for this model (tp: a divisor of the {cluster.hardware.gpus_per_node} "
                             f"GPUs per node its heads and widths allow{', ' + given if given else ''}; pp at most its "
                             f"{layers} layers): plan another number of GPUs.")
        if not any(global_batch % dp == 0 for dp in dps):
            fewest = dps[0]
            raise ValueError(
                f"the global batch of {global_batch} sequences does not split over the data-parallel ranks of any layout of "
                f"{gpus} GPUs (dp = GPUs / (tp x pp): {', '.join(map(str, dps[:8]))}{', ...' if len(dps) > 8 else ''}; tp "
                f"at most {max(tps)}, pp at most the model's {layers} layers): give a global batch that one of them divides "
                f"(e.g. --global-batch {-(-global_batch // fewest) * fewest}), or plan fewer GPUs.")
        raise ValueError(f"no layout of {gpus} GPUs for {global_batch} sequences per step takes {given}: torch's pipeline "
                         "schedules, the micro-batch splits of each replica's batch or the model refuse them; change or "
                         "drop them.")
    count = sum(group.count for group in found)
    if count > MAX_LAYOUTS:
        splits = max(len(group.splits) for group in found)
        raise ValueError(
            f"this plan has {count:,} layouts to search (tp x pp x schedule x micro-batch split x sequence parallelism, "
            f"before checkpointing, data parallelism and precision), more than the {MAX_LAYOUTS:,} one plan searches: each "
            f"replica's batch splits into up to {splits} micro-batch counts (the divisors of the global batch of "
            f"{global_batch}). Fix some of them (--tp_size, --pp_size, --pp_schedule, --pp_microbatches, "
            "--sequence_parallel), or plan a global batch with fewer divisors (a power of two).")
    replicas = data_parallel.get("dp_replicate_size")
    if replicas is not None and not any(group.dp % replicas == 0 for group in found):
        dps = sorted({group.dp for group in found})
        raise ValueError(
            f"--dp_replicate_size {replicas} divides the data-parallel size of no layout of {gpus} GPUs (dp = GPUs / (tp x "
            f"pp): {', '.join(map(str, dps))}): HSDP's replicas each shard over dp / dp_replicate_size ranks. Give one "
            "that divides a data-parallel size above, or plan GPUs whose data parallelism it divides.")


def search_of_recipe(recipe: dict, name: str, *, fixed: dict, data_parallel: dict,
                     zero1_options: tuple[bool, ...] | None, precisions: tuple[str, ...],
                     grad_reduce_dtype: str | None) -> tuple[dict, dict, tuple[bool, ...] | None, tuple[str, ...], str | None]:
    """What the training settings of recipe ``name`` that plan does not search (``recipe``: its training section; its
    command keeps them) leave of the search given (``fixed``, ``data_parallel``, ``zero1_options``, ``precisions``,
    ``grad_reduce_dtype``, as :func:`plan` takes them), returned in the same order: ``lowrank_optimizer: loro`` trains
    under DDP without ZeRO-1; ``pp_layer_split`` fixes the stages; ``grad_reduce_dtype`` and ``fp32_residual`` (kept;
    the memory model counts a bf16 residual) are ``bf16_params``' settings. ``ValueError`` naming the recipe's setting
    where an option given contradicts it, and for what plan does not model: DeepSpeed (``deepspeed:``) and
    transformers' FSDP (``fsdp:``; written as ``--data_parallel fsdp2`` it is searched)."""
    fixed, data_parallel = dict(fixed), dict(data_parallel)
    for key, what in (("deepspeed", "DeepSpeed"), ("fsdp", "transformers' FSDP")):
        if recipe.get(key):
            raise ValueError(f"the recipe {name} trains with {what} ({key}: {recipe[key]!r}), which plan does not model "
                             "(it searches DDP, ZeRO-1, FSDP2 and HSDP, written as --data_parallel settings): plan a recipe "
                             f"without {key}:, and train the plan's layout with it.")
    if recipe.get("lowrank_optimizer") == "loro":
        if (data_parallel.get("data_parallel") and "ddp" not in data_parallel["data_parallel"]) or zero1_options == (True,):
            raise ValueError(f"the recipe {name} trains with lowrank_optimizer: loro, which runs under DDP without ZeRO-1 "
                             "(training refuses FSDP2 and --zero1_optimizer with it): drop --data_parallel fsdp2 / --zero1 "
                             "true.")
        data_parallel["data_parallel"], zero1_options = ("ddp",), (False,)
    if recipe.get("pp_layer_split") is not None:
        from ..parallel.settings import parse_layer_split

        split = parse_layer_split(recipe["pp_layer_split"])
        if fixed.get("pp_size", len(split)) != len(split):
            raise ValueError(f"the recipe {name} sets pp_layer_split: {list(split)} ({len(split)} stages), but --pp_size "
                             f"{fixed['pp_size']} was given: drop one of them.")
        fixed.update(pp_layer_split=split, pp_size=len(split))
    bf16_only = [key for key in ("grad_reduce_dtype", "fp32_residual") if recipe.get(key)]
    if bf16_only:
        if "bf16_params" not in precisions:
            raise ValueError(f"the recipe {name} sets {', '.join(bf16_only)}, the bf16_params precision policy's, which plan "
                             f"does not search here ({', '.join(precisions)}): plan --precision_policy bf16_params, or "
                             "remove them from the recipe.")
        precisions = ("bf16_params",)
        grad_reduce_dtype = grad_reduce_dtype or recipe.get("grad_reduce_dtype")
    return fixed, data_parallel, zero1_options, precisions, grad_reduce_dtype


def plan(config, cluster: Cluster, *, seq_len: int, global_batch: int, fixed: dict | None = None,
         precisions: tuple[str, ...] = ("autocast",), zero1_options: tuple[bool, ...] | None = None,
         data_parallel: dict | None = None, grad_reduce_dtype: str | None = None,
         efficiency: KernelEfficiency = CALIBRATED_EFFICIENCY) -> PlanResult:
    """Search every layout of ``config`` on ``cluster`` for steps of ``global_batch`` sequences of ``seq_len`` tokens
    (module docstring); ``fixed``: ``ParallelConfig`` field -> value the search keeps; ``data_parallel``:
    ``DataParallelConfig`` field -> value it keeps (``data_parallel``: the backends to try, a tuple). For each
    structural layout and data-parallel option (:func:`data_parallel_options`) the checkpointing modes are tried
    fastest first and the first that fits is kept. ``grad_reduce_dtype`` (``"bf16"``) applies to the ``bf16_params``
    candidates: it changes the gradients' rounding, so it is the user's choice, not searched. ``ValueError`` before
    anything is evaluated for a search :func:`check_search` refuses and for data-parallel settings that contradict each
    other."""
    fixed, data_parallel = dict(fixed or {}), dict(data_parallel or {})
    check_positive(seq_len=seq_len, global_batch=global_batch,
                   **{name: value for name, value in {**fixed, **data_parallel}.items()
                      if isinstance(value, int) and not isinstance(value, bool)})
    _searched_backends(data_parallel, zero1_options)
    found = structures(config, cluster, seq_len, global_batch, fixed)
    check_search(found, config, cluster, global_batch, fixed, data_parallel)
    cache: dict = {}
    low_rank = config.bottleneck is not None
    modes = [fixed["activation_checkpointing"]] if "activation_checkpointing" in fixed else \
        [m for m in CHECKPOINTING_ORDER if low_rank or m != "lowrank"]
    ranked, unmodelled, evaluated, tried = [], [], [], 0
    smallest: dict[tuple[int, int], Evaluated] = {}
    for parallel, dp, micro_batch, m in candidates(config, cluster, seq_len, global_batch, fixed, found):
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


def training_arguments(candidate: Candidate, *, seq_len: int, recipe: dict | None = None) -> list[str]:
    """The ``boost-hf train`` overrides that run ``candidate`` (the training arguments' names of
    :mod:`boost_hf.parallel.settings` and :mod:`boost_hf.data_parallel_config`): every layout field the search
    decided, the batch split, the sequence length, ZeRO-1, the precision (``--bf16``; ``--precision_policy`` where the
    trainer has it) and FSDP2's settings (``--data_parallel fsdp2``, ``--dp_replicate_size`` for HSDP). A decided
    setting left at the trainer's default is written too where ``recipe`` (the training section of the recipe the
    command trains) sets it otherwise, so that the command, not the recipe, says what the plan decided."""
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
    written = {arg[2:] for arg in args if arg.startswith("--")}
    for field_name, value in _decided_defaults(candidate).items():
        given = (recipe or {}).get(field_name)
        if field_name not in written and given is not None and given != value and not (
                field_name == "tp_style" and given == "auto"):  # auto: the style plan takes, the model's
            args += [f"--{field_name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def _decided_defaults(candidate: Candidate) -> dict:
    """The training arguments ``candidate`` decides that :func:`training_arguments` writes only where a recipe sets them
    otherwise (under their training names), with the value that runs ``candidate``."""
    from ..parallel.settings import TRAINING_NAMES

    p, sharding = candidate.parallel, candidate.data_parallel
    decided = {TRAINING_NAMES.get(name, name): value for name, value in (
        ("tp_style", p.tp_style), ("rmsnorm", p.rmsnorm), ("group_linears", p.group_linears),
        ("pp_stages_per_rank", p.stages_per_rank))}
    decided.update({f.name: getattr(sharding, f.name) for f in fields(sharding)})
    decided.update(precision_policy=candidate.precision, fp16=False, activation_checkpointing=False,
                   gradient_checkpointing=False)
    if candidate.precision == "bf16_params":  # None there is fp32
        decided["grad_reduce_dtype"] = candidate.grad_reduce_dtype or "fp32"
    return decided


def accelerate_config(cluster: Cluster, *, cpu: bool) -> str:
    """An ``accelerate`` configuration (YAML) for ``cluster``: ``torchrun`` underneath (``MULTI_GPU``; with ``use_cpu``
    on CPU processes, gloo), one process per GPU, every node running the same file with its ``--machine_rank``. It sets
    no precision (``mixed_precision: 'no'``, accelerate's default, which sets nothing): each command's ``--bf16`` is
    the one source of it, whichever layout of the plan it runs."""
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
        "mixed_precision: 'no'  # the command's --bf16 says it",
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
    own layout (its training fields, when planning a recipe), notes on what was assumed and ``recipe_training``: the
    training section of the recipe the command trains (``{}`` for ``RECIPE.yaml``), which the command overrides where
    the plan decides otherwise (:func:`training_arguments`, :func:`search_of_recipe`)."""

    config: object
    name: str
    seq_len: int
    global_batch: int
    recipe: str
    recipe_layout: dict | None = None
    notes: tuple[str, ...] = ()
    recipe_training: dict = field(default_factory=dict)


RECIPE_LAYOUT_FIELDS = ("tp_size", "pp_size", "pp_schedule", "pp_microbatches", "sequence_parallel",
                        "activation_checkpointing_mode", "zero1_optimizer", "per_device_train_batch_size",
                        "gradient_accumulation_steps", "bf16")


def plan_inputs(*, recipe: str | None = None, preset: str | None = None, config_path: str | None = None, gpus: int,
                seq_len: int | None = None, global_batch: int | None = None) -> PlanInputs:
    """The model and workload of a plan: from a recipe (its model, ``block_size`` and global batch on ``gpus``), a
    preset, or a ``config.json``; ``seq_len`` and ``global_batch`` override (defaults without a recipe: 512 sequences
    of 4096 tokens, or of the model's ``max_position_embeddings`` where it holds fewer). A sequence longer than the
    model's positions is refused, as training refuses its ``block_size``."""
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
        seq_len = _sequence_length(config, seq_len, data.get("block_size", 256), f"the recipe {path}'s block_size")
        return PlanInputs(config, Path(path).stem, seq_len, global_batch or recipe_batch, recipe, layout, tuple(notes),
                          training)
    training = {}
    if preset is not None:
        from ..shipped import resolve_recipe, shipped_recipes

        config = BoostLlamaConfig.from_preset(preset)
        name, command_recipe = preset, preset if preset in shipped_recipes() else "RECIPE.yaml"
        if command_recipe != "RECIPE.yaml":
            training = (yaml.safe_load(Path(resolve_recipe(preset)).read_text()) or {}).get("training") or {}
    else:
        config = BoostLlamaConfig.from_dict(json.loads(Path(config_path).read_text()))
        name, command_recipe = Path(config_path).parent.name or config_path, "RECIPE.yaml"
    if command_recipe == "RECIPE.yaml":
        notes.append("no shipped recipe trains this model: RECIPE.yaml in the command is yours to write")
    if seq_len is None and config.max_position_embeddings < 4096:
        notes.append(f"sequences of {config.max_position_embeddings} tokens, the model's max_position_embeddings (4096 "
                     "where it holds more)")
    seq_len = _sequence_length(config, seq_len, min(4096, config.max_position_embeddings), "the default")
    return PlanInputs(config, name, seq_len, global_batch or 512, command_recipe, None, tuple(notes), training)


def _sequence_length(config, given: int | None, default: int, what: str) -> int:
    """``given`` (``--seq-len``) or ``default`` (``what``: where it comes from), refused when the model has fewer
    positions (training refuses a ``block_size`` above ``max_position_embeddings``)."""
    seq_len = given or default
    if seq_len > config.max_position_embeddings:
        source = "--seq-len" if given else what
        raise ValueError(f"sequences of {seq_len} tokens ({source}) are longer than the model's max_position_embeddings "
                         f"({config.max_position_embeddings}), and training refuses a block_size above it: plan --seq-len "
                         f"{config.max_position_embeddings} or less, or a model with more positions.")
    return seq_len


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
        args = training_arguments(e.candidate, seq_len=inputs.seq_len, recipe=inputs.recipe_training)
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
    text_config = accelerate_config(cluster, cpu=cpu)
    lines += ["", f"accelerate config written to {accelerate_config_path}; run #1"
              + (f" on every node (NODE_RANK 0..{cluster.nodes - 1}, MASTER_ADDR the first node's):" if cluster.nodes > 1 else ":"),
              f"  {layouts[0]['command']}"]
    return PlanReport("\n".join(lines), layouts, text_config)


__all__ = ["CHECKPOINTING_ORDER", "PlanInputs", "PlanReport", "plan_inputs", "plan_report", "accelerate_config", "launch_command", "search_of_recipe", "structures", "Structure", "training_arguments", "Candidate", "Cluster", "Evaluated", "PlanResult", "candidates", "data_parallel_comparison", "data_parallel_options", "plan", "check_search", "replica_sizes", "why_slower", "LARGEST_SIZE", "MAX_LAYOUTS"]
