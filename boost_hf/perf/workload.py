"""What the estimator times: one data-parallel replica's training iteration (:class:`Workload`), and the model each
layout runs for a size (megatron the full-rank one, vanilla and btp the low-rank one)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..data_parallel_config import DataParallelConfig
from ..parallel.config import SEQUENCE_PARALLEL_STYLES, ParallelConfig
from ..parallel.sequence_parallel import check_sequence_length
from ..parallel.settings import field_of
from .memory import precision_bytes
from .pipeline import check_schedule


def full_rank_counterpart(config):
    """The full-rank LLaMA of the same size (megatron's model)."""
    if config.bottleneck is None:
        return config
    return type(config).from_dict({**config.to_dict(), "bottleneck": None})


def low_rank_counterpart(config):
    """The low-rank model of the same size (vanilla's and btp's model): ``config`` itself, or CoLA at
    ``config.rank`` for a full-rank config."""
    if config.bottleneck is not None:
        return config
    return type(config).from_dict({**config.to_dict(), "bottleneck": "cola"})


@dataclass(frozen=True, init=False)
class Workload:
    """What one training iteration runs on one data-parallel replica (``tp_size * pp_size`` GPUs).

    Args:
        parallel_config: the layout (:class:`ParallelConfig`); its ``tp_style`` is replaced by each estimated layout's
            (:meth:`parallel`). The layout fields may also be given as keywords, by field name or by the short names
            of :data:`~boost_hf.parallel.settings.SHORT_NAMES` (``Workload(tp=4, pp=2)``), over ``parallel_config``.
        micro_batch: sequences per micro-batch. seq_len: tokens per sequence.
        num_micro_batches: micro-batches per iteration: the pipeline's ``m`` (gradient accumulation at pp 1),
            default 1. ``pp_microbatches`` (of ``parallel_config`` or as a keyword) gives it too, and is kept here, the
            config's field cleared: the estimate also times counts that torch's schedule refuses, which a
            ``ParallelConfig`` does not hold (noted in :attr:`~boost_hf.perf.estimator.Estimate.notes`).
        dtype_bytes: bytes per activation element (2: bf16); the saved residual stream is counted in fp32, as
            mixed precision (fp32 weights, bf16 autocast) keeps it.
        dp_size: data-parallel ranks (1: no gradient reduction). zero1_optimizer: the optimizer state sharded
            over them (torch's ``ZeroRedundancyOptimizer``: ``1/dp`` of the step, then a broadcast of the parameters).
        data_parallel: how the DP ranks hold the model (:class:`~boost_hf.data_parallel_config.DataParallelConfig`,
            the training arguments' ``--data_parallel``, ``--dp_replicate_size``, ...): DDP's all-reduce (the default),
            or FSDP2's all-gathers and reduce-scatters (HSDP's all-reduce across replicas); FSDP2 runs without
            ``zero1_optimizer``, as training refuses it.
        precision: the precision policy whose casts are timed (``"autocast"``, ``"bf16_params"``, ``"fp32"``; ``None``:
            not modelled, as the calibration ran). grad_reduce_dtype: ``"bf16"`` halves the DP all-reduce's bytes
            (``bf16_params`` only, ``--grad_reduce_dtype``); ``None``/``"fp32"``: the policy's.

    The schedules modelled are ``"1f1b"``, ``"gpipe"`` and ``"interleaved-1f1b"`` (:mod:`boost_hf.perf.pipeline`).
    Sequence parallelism applies to the layouts that have it (megatron: Megatron-LM's; btp: latent sequence
    parallelism); vanilla, which has none, is estimated without it. It needs ``seq_len`` divisible by ``tp_size``;
    under ``pp_size > 1`` stages send their token shards (``Layout.stage_boundary``).
    """

    parallel_config: ParallelConfig
    micro_batch: int
    seq_len: int
    num_micro_batches: int
    dtype_bytes: int
    dp_size: int
    zero1_optimizer: bool
    precision: str | None
    grad_reduce_dtype: str | None
    data_parallel: DataParallelConfig

    def __init__(self, parallel_config: ParallelConfig | None = None, *, micro_batch: int = 4, seq_len: int = 4096,
                 num_micro_batches: int | None = None, dtype_bytes: int = 2, dp_size: int = 1,
                 zero1_optimizer: bool = False, precision: str | None = None, grad_reduce_dtype: str | None = None,
                 data_parallel: DataParallelConfig | None = None, **layout) -> None:
        parallel = parallel_config or ParallelConfig()
        layout = {field_of(name): value for name, value in layout.items()}
        given = {m for m in (num_micro_batches, layout.pop("pp_microbatches", None), parallel.pp_microbatches) if m is not None}
        if len(given) > 1:
            raise ValueError(f"Workload: micro-batches per iteration given as {sorted(given)}: give one number.")
        num_micro_batches = given.pop() if given else 1
        parallel = replace(parallel, pp_microbatches=None, **layout)
        values = dict(parallel_config=parallel, micro_batch=micro_batch, seq_len=seq_len,
                      num_micro_batches=num_micro_batches, dtype_bytes=dtype_bytes, dp_size=dp_size)
        for name, value in values.items():
            if name != "parallel_config" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Workload.{name} must be a positive integer, got {value!r}.")
            object.__setattr__(self, name, value)
        if precision is not None or grad_reduce_dtype is not None:
            precision_bytes(precision or "autocast", grad_reduce_dtype)  # a known policy (and reduction)
        data_parallel = data_parallel or DataParallelConfig()
        if data_parallel.fully_sharded:
            if zero1_optimizer:
                raise ValueError("Workload: FSDP2 shards the optimizer state itself; zero1_optimizer is refused with it "
                                 "(as training refuses --zero1_optimizer with --data_parallel fsdp2).")
            data_parallel.shard_size(dp_size)  # dp_replicate_size divides dp_size
        object.__setattr__(self, "zero1_optimizer", bool(zero1_optimizer))
        object.__setattr__(self, "precision", precision)
        object.__setattr__(self, "grad_reduce_dtype", grad_reduce_dtype)
        object.__setattr__(self, "data_parallel", data_parallel)
        check_schedule(parallel.pp_schedule, parallel.pp_stages_per_rank)
        if parallel.sequence_parallel:  # (at tp_size 1 every length splits)
            check_sequence_length(seq_len, parallel.tp_size)

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch, ``N``."""
        return self.micro_batch * self.seq_len

    @property
    def stages_per_rank(self) -> int:
        """Model chunks per pipeline rank as the estimator models the schedule (default 2 interleaved, else 1)."""
        return check_schedule(self.parallel_config.pp_schedule, self.parallel_config.pp_stages_per_rank)

    def parallel(self, layout: str) -> ParallelConfig:
        """The :class:`ParallelConfig` of ``layout`` (megatron turns ``"lowrank"`` checkpointing, which it
        cannot do, into ``"full"``; vanilla runs without ``sequence_parallel``, which it does not have)."""
        checkpointing = self.parallel_config.activation_checkpointing
        if layout == "megatron" and checkpointing == "lowrank":
            checkpointing = "full"
        return replace(
            self.parallel_config,
            tp_style=layout,
            activation_checkpointing=checkpointing,
            sequence_parallel=self.parallel_config.sequence_parallel and layout in SEQUENCE_PARALLEL_STYLES,
        )

    def assumptions(self) -> dict:
        """The workload as the estimate's JSON records it: the layout fields (but ``tp_style``, which each estimated
        layout sets, and ``pp_microbatches``, which is ``num_micro_batches`` here) and the workload's own."""
        layout = {k: v for k, v in self.parallel_config.to_dict().items() if k not in ("tp_style", "pp_microbatches")}
        return {**layout, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
                "num_micro_batches": self.num_micro_batches, "stages_per_rank": self.stages_per_rank,
                "dtype_bytes": self.dtype_bytes, "tokens_per_micro_batch": self.tokens, "dp_size": self.dp_size,
                "zero1_optimizer": self.zero1_optimizer, "precision": self.precision,
                "grad_reduce_dtype": self.grad_reduce_dtype, **asdict(self.data_parallel)}


__all__ = ["Workload", "full_rank_counterpart", "low_rank_counterpart"]
