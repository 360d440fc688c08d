"""Vanilla low-rank tensor parallelism (the paper's naive baseline).

Each bottleneck pair is a Megatron MLP: ``A`` column-parallel along the rank (``[r/p, d_in]``), ``B``
row-parallel (``[d_out, r/p]``) followed by a full-width all-reduce of its output. The residual stream
is replicated and full width, and the norms, RoPE, attention (every head) and the MLP product run
redundantly on every rank. LaX's crossing and latent LayerNorm need the full r-dim latent: it is
all-gathered after A and each rank takes its ``r/p`` slice again before B. Tensor train: a rank holds the slice of
the last input core along its output rank and of the first output core along its input rank (the ``r/p`` columns of
``A^T`` and rows of ``B^T``), the other cores whole, their gradients all-reduced in backward, one all-reduce per
factor (:mod:`boost_hf.parallel.tensor_train`). Block 0 has neither, but the latent
it hands on must be whole for block 1's crossing, so it gathers too (every layer gathers the same).

Per layer: forward all-reduce of each B's full-width output, 7 calls, ``N (dq + 2 dkv + d + 2f + d)``;
backward all-reduce at the inputs of the A's: grouped 4 calls ``N (d + dq + d + f)``, ungrouped 7 calls
``N (3d + dq + 2d + f)``. LaX adds an all-gather of the latents to full ``r``, ``7 N r`` in 4 calls
(grouped) or 7, forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..communication import Communication, PassCommunication, all_gather, all_reduce
from ..fused import latent_linear, split_latent, stacked_weight
from ..modules import add_bias, adopt, compute_dtype
from ..primitives import copy_to_tp, gather_from_tp, reduce_from_tp, split_to_tp
from ..tensor_train import contraction_gemms, gradient_communication, is_tensor_train, shard_tensor_train
from .base import (
    GROUPS, Gemm, Layout, ProjectionGroup, ResidualWidths, apply_latent_functions, factor_shards_repr, low_rank_a_gemms, split_latents,
)


class VanillaProjection:
    """Bottleneck projection with ``A: [r/p, d_in]``, ``B: [d_out, r/p]`` and the replicated bias after ``B``
    (``[d_out]``, when the configuration asks for one). Module call: this rank's latent ``[B, S, r/p]`` -> ``B``
    -> all-reduce -> ``+ bias`` (once, after the all-reduce) -> ``[B, S, d_out]``; ``weight``: ``B`` as its
    group already cast it (see :meth:`ProjectionGroup.call_projections`)."""

    group = None

    def forward(self, latent: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return add_bias(reduce_from_tp(latent_linear(latent, self.B if weight is None else weight), self.group), self.bias)

    def extra_repr(self) -> str:
        return ", ".join(part for part in (super().extra_repr(), factor_shards_repr(self)) if part)


class ReplicatedLowRankGroup(ProjectionGroup):
    """``down``: cast the replicated input to the compute dtype, copy it into the TP region and apply the
    A's (grouped: once, and one GEMM on the A's, stored as one tensor and cast in one op; ungrouped: once per
    projection); ``reduce``: LaX only, all-gather the latents to full r;
    ``project``: latent functions (once on a grouped latent without LaX), then each projection (B and its
    all-reduce)."""

    def __init__(self, owner, names, *, group, grouped, gather_latent: bool, tp_size: int):
        super().__init__(owner, names, group=group, grouped=grouped)
        self.gather_latent, self.tp_size = gather_latent and tp_size > 1, tp_size

    def down(self, x):
        factors = [p.A for p in self.projections]
        x = x.to(compute_dtype(x))  # once per group, before the copy: input gradients are all-reduced in it
        if self.several_grouped:
            return (F.linear(copy_to_tp(x, self.group), stacked_weight(factors, x.dtype)),)
        return tuple(F.linear(copy_to_tp(x, self.group), a) for a in factors)  # one input-gradient all-reduce each

    def reduce(self, partials):
        if not self.gather_latent:
            return partials
        if len(partials) == len(self.names):
            return tuple(gather_from_tp(z, -1, self.group) for z in partials)
        # one gather of the grouped [..., k r/p] latents, laid out [rank][projection][r/p] -> [projection][r]
        z = gather_from_tp(partials[0], -1, self.group)
        k, p = len(self.names), self.tp_size
        z = z.reshape(*z.shape[:-1], p, k, -1).transpose(-3, -2)
        return (z.reshape(*z.shape[:-3], -1),)

    def project(self, z, previous=None):
        projections = self.projections
        if len(z) == 1 and not any(hasattr(p, "crossed_latent") for p in projections):
            # one grouped latent and one element-wise latent function for every projection: apply it once
            latents = split_latent(projections[0].latent(z[0]), len(projections))
            return self.call_projections(projections, latents, VanillaProjection), {}
        zs = split_latents(z[0], len(projections)) if len(z) == 1 else z
        latents, crossed = apply_latent_functions(projections, self.names, zs, previous)
        if self.gather_latent:
            if self.several_grouped:
                latents = list(split_to_tp(torch.stack(latents), -1, self.group).unbind(0))
            else:
                latents = [split_to_tp(latent, -1, self.group) for latent in latents]
        return [projection(latent) for projection, latent in zip(projections, latents)], crossed


class VanillaLayout(Layout):
    name = "vanilla"
    heads_split = False
    split_dimensions = ("rank",)
    stored_together = ("A", "B")

    def check(self, config) -> None:
        if config.bottleneck is None and self.parallel.tp_size > 1:
            raise ValueError(
                "tp_style='vanilla' needs a low-rank model (bottleneck svd/cola/lax); "
                "the full-rank model (bottleneck=None) uses tp_style='megatron'."
            )
        super().check(config)

    def projection_splits(self, group_name):
        return {"A": 0, "B": 1}  # A column-parallel (along r), B row-parallel; a bias is replicated

    def tensor_train_splits(self, shape) -> dict[int, int]:
        # the last input core along its output rank (columns of A^T), the first output core along its input rank
        return {shape.split - 1: 2, shape.split: 0}

    def parallelize_projection(self, projection, group_name, plan) -> None:
        if is_tensor_train(projection):
            shard_tensor_train(projection, self.tensor_train_splits(projection.tensor_train), plan)
        self.shard_projection(projection, group_name, plan)  # A and B where they are parameters
        adopt(projection, VanillaProjection, group=plan.group)

    def projection_group(self, layer, owner, group_name, plan):
        return ReplicatedLowRankGroup(
            owner, GROUPS[group_name], group=plan.group, grouped=self.parallel.group_linears,
            gather_latent=layer.crosses_latents, tp_size=plan.tp_size,
        )

    def layer_communication(self, config, tokens):
        n, d, dq, dkv, f, r = tokens, config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size, config.rank
        # Each B is row-parallel and all-reduces its full-width output.
        forward = all_reduce(7, n * (dq + 2 * dkv + d + 2 * f + d))
        # Each A is column-parallel (split along r): its input gradient is all-reduced; A's sharing an
        # input (q/k/v, gate/up) share one all-reduce when grouped.
        if self.parallel.group_linears:
            backward = all_reduce(4, n * (d + dq + d + f))
        else:
            backward = all_reduce(7, n * (3 * d + dq + 2 * d + f))
        if config.bottleneck == "lax":
            # The r/p latent shards are gathered to full r for the crossing and the latent LayerNorm.
            gathers = 4 if self.parallel.group_linears else 7
            forward = forward + all_gather(gathers, 7 * n * r)
            backward = backward + all_gather(gathers, 7 * n * r)
        return PassCommunication(forward, backward)

    def parameter_gradient_communication(self, config, layer_idx: int) -> Communication:
        return gradient_communication(config, self.tensor_train_splits) if config.bottleneck == "tt" else Communication()

    def recompute_communication(self, config, tokens) -> Communication:
        if self.parallel.activation_checkpointing == "lowrank":
            # the B all-reduces sit inside recomputed steps; the LaX all-gathers sit between steps
            return self.layer_communication(config, tokens).forward.only("all_reduce")
        return super().recompute_communication(config, tokens)

    def outside_layers_communication(self, config, tokens):
        n, d = tokens, config.hidden_size
        # Vocab-parallel embedding (forward all-reduce); vocab-parallel LM head (backward all-reduce).
        return PassCommunication(all_reduce(1, n * d), all_reduce(1, n * d))

    def saved_latent_elements(self, config, tokens):
        r, p = config.rank, self.parallel.tp_size
        if config.bottleneck == "lax" and p > 1:
            return 7 * tokens * r  # the latents gathered to full r
        return 7 * tokens * r // p  # the A outputs, split along r

    def local_gemms(self, config, tokens):
        p, n = self.parallel.tp_size, tokens
        r = config.rank // p
        a_gemms = low_rank_a_gemms(config, n, r, {"d": config.hidden_size, "dq": config.q_dim, "f": config.intermediate_size}, self.parallel.group_linears)
        b_gemms = [Gemm(f"{name}.B", n, r, d_out, "B") for name, (_, d_out) in config.projection_shapes().items()]
        contractions = contraction_gemms(config, self.tensor_train_splits, p) if config.bottleneck == "tt" else []
        return a_gemms + b_gemms + contractions

    def widths(self, config):
        return ResidualWidths(config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size, config.rank // self.parallel.tp_size)


__all__ = ["VanillaLayout", "VanillaProjection", "ReplicatedLowRankGroup"]
