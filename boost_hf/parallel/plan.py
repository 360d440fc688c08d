"""The tensor-parallel plan: which dimension of which parameter each rank holds, and which
communication pattern (:mod:`boost_hf.parallel.groups`) each group of projections runs.

The model file asks the plan for its layers; the layers never decide their own layout.

===========  ====================  ===========================  ==============================
layout       residual stream       projections                  embedding / norms
===========  ====================  ===========================  ==============================
single       full width            unsplit                      unsplit
megatron     replicated, full      W column (q,k,v,gate,up),    vocab-parallel embedding
                                   W row (o, down)
vanilla      replicated, full      A column (r), B row (r)      vocab-parallel embedding
btp          sharded along d       A row (input), B column      embedding table split along d;
                                   (output: d, d_ff or heads)   block norms' gamma split along d
===========  ====================  ===========================  ==============================

The LM head is vocab-parallel in every layout with ``tp_size > 1``; the final norm is replicated.
"""

from __future__ import annotations

from torch import nn

from .config import ParallelConfig
from .groups import BottleneckAwareGroup, DenseGroup, ProjectionGroup, ReplicatedLowRankGroup
from .layers import BottleneckProjection, DenseProjection, ParallelEmbedding, VocabParallelLMHead
from .state import ParallelState, check_world, get_parallel_state

OUTPUT_SPLIT_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # Megatron's column-parallel


class TensorParallelPlan:
    """Builds this rank's layers for ``config`` under ``parallel`` (a :class:`ParallelConfig`)."""

    def __init__(self, config, parallel: ParallelConfig | None = None):
        parallel = parallel or ParallelConfig(tp_style="btp" if config.bottleneck else "megatron")
        check_world(parallel.tp_size)
        parallel.check_model(config)
        self.config, self.parallel = config, parallel
        self.state: ParallelState = get_parallel_state(parallel.tp_size)
        self.layout = "single" if parallel.tp_size == 1 else parallel.tp_style

    # ------------------------------------------------------------------ facts about the layout
    @property
    def tp_size(self) -> int:
        return self.state.tp_size

    @property
    def tp_rank(self) -> int:
        return self.state.tp_rank

    @property
    def group(self):
        return self.state.tp_group

    @property
    def residual_sharded(self) -> bool:
        """BTP keeps the residual stream split along d (each rank holds ``[..., d/p]``)."""
        return self.layout == "btp"

    @property
    def heads_split(self) -> bool:
        """Whether attention runs on ``heads/p`` local heads (megatron, btp) or all heads (vanilla)."""
        return self.layout in ("btp", "megatron")

    def local_heads(self, heads: int) -> int:
        return heads // self.tp_size if self.heads_split else heads

    # ------------------------------------------------------------------ layers
    def _shard(self) -> dict:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size}

    def projection(self, name: str, layer_idx: int) -> nn.Module:
        cfg = self.config
        d_in, d_out = cfg.projection_shapes()[name]
        if cfg.bottleneck is None:
            split = None if self.layout == "single" else (0 if name in OUTPUT_SPLIT_PROJECTIONS else 1)
            return DenseProjection(d_in, d_out, split_dim=split, std=cfg.initializer_range, **self._shard())
        a_split, b_split = {"single": (None, None), "vanilla": (0, 1), "btp": (1, 0)}[self.layout]
        lax = cfg.bottleneck == "lax"
        return BottleneckProjection(
            d_in,
            d_out,
            cfg.rank,
            a_split_dim=a_split,
            b_split_dim=b_split,
            activation=cfg.latent_activation,
            crossing=cfg.lax_gate if lax and layer_idx > 0 else None,
            kronecker_factors=cfg.kronecker_factors if lax and cfg.lax_gate == "kronecker" else None,
            latent_norm=lax and cfg.lax_latent_norm,
            carries_latent=lax,
            **self._shard(),
        )

    def projection_group(self, projections: list[nn.Module], *, row: bool, reads_norm: bool) -> ProjectionGroup:
        """The runtime group of ``projections`` sharing one input. ``row``: the input is the attention
        output or the MLP product (o, down); ``reads_norm``: the input is the normalised residual."""
        common = dict(group=self.group, tp_size=self.tp_size, grouped=self.parallel.group_linears, hidden_size=self.config.hidden_size)
        if self.config.bottleneck is None:
            return DenseGroup(projections, row=row, **common)
        if self.layout == "btp":
            eps = self.config.rms_norm_eps if reads_norm else None
            return BottleneckAwareGroup(projections, rmsnorm=self.parallel.rmsnorm, norm_eps=eps, **common)
        return ReplicatedLowRankGroup(projections, gather_latent=self.config.bottleneck == "lax", **common)

    def block_norm_split(self) -> int | None:
        return 0 if self.residual_sharded else None

    def embedding(self) -> ParallelEmbedding:
        split = {"single": None, "btp": 1}.get(self.layout, 0)
        cfg = self.config
        return ParallelEmbedding(cfg.vocab_size, cfg.hidden_size, split_dim=split, std=cfg.initializer_range, group=self.group, **self._shard())

    def lm_head(self) -> VocabParallelLMHead:
        cfg = self.config
        return VocabParallelLMHead(cfg.hidden_size, cfg.vocab_size, std=cfg.initializer_range, group=self.group, **self._shard())


__all__ = ["TensorParallelPlan"]
