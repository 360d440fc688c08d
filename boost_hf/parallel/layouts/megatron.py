"""Megatron tensor parallelism of the full-rank model (the baseline).

q, k, v, gate, up are column-parallel (``W: [d_out/p, d_in]``), o and down row-parallel
(``W: [d_out, d_in/p]``); the residual stream is replicated and full width; attention runs on
``heads/p`` heads; the embedding and LM head are split along the vocabulary.

Per layer: forward all-reduce after o_proj and down_proj (2 calls, ``N (d + d)``); backward all-reduce
of the input gradient shared by q/k/v and by gate/up (2 calls, ``2 N d``; the input is cast to the compute
dtype and copied into the tensor-parallel region once per group, so the gradient is all-reduced in the
compute dtype, as in Megatron-LM). With ``sequence_parallel`` (:mod:`~boost_hf.parallel.sequence_parallel`)
the residual holds ``N/p`` tokens: each group's input copy becomes an all-gather along tokens (backward
reduce-scatter) and each row-parallel all-reduce a reduce-scatter along tokens (backward all-gather), plus
the all-reduce of the gradients of the replicated parameters that act on the token shard (2 norm weights,
row-parallel biases) in backward. As in Megatron-LM, each column group then keeps only its ``[N/p, d]`` token
shard for backward and all-gathers it again there for the weight gradients
(:func:`~boost_hf.parallel.sequence_parallel.gathered_linear`: 2 more backward all-gathers of ``N d``, overlapped
with the input-gradient GEMMs), instead of keeping the gathered ``[N, d]``. With ``group_linears`` (the
default), as in Megatron-LM, q/k/v and gate/up each run as one GEMM on their weights, which are stored as row
blocks of one tensor (:mod:`~boost_hf.parallel.shared_storage`) and cast to the compute dtype in one op
(:func:`~boost_hf.parallel.fused.weight_views`); each projection is still called as a module on its
columns of the output (under sequence parallelism with the token shard as its input, as Megatron-LM's
column-parallel linear takes it), so its hooks fire. A projection replaced by another module, or with forward
pre-hooks (which may change its input or gather its weight), runs its own GEMM instead, and the whole group
with it: under sequence parallelism on the gathered tokens, which autograd then keeps (``N d``, no re-gather).
In backward the group never concatenates its outputs' gradients (``[N, sum w_i]``): its input gradient is
``sum_i g_i W_i`` accumulated in one buffer and each weight gradient ``g_i^T x`` is written into its rows of the
stacked weights' gradient buffer (:func:`~boost_hf.parallel.fused.column_linear`), cast back in one op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..communication import PassCommunication, all_gather, all_reduce, reduce_scatter
from ..fused import column_linear, weight_views
from ..modules import add_bias, adopt, compute_dtype, shard_repr
from ..primitives import copy_to_tp, gather_tokens, reduce_from_tp, reduce_scatter_tokens
from ..sequence_parallel import gathered_linear, replicated_on_shard
from .base import GROUPS, BackwardOverlap, Gemm, Layout, ProjectionGroup, ResidualWidths, whole_norm_saved_bytes

COLUMN_GROUPS = ("qkv", "gate_up")


class ColumnParallel:
    """``nn.Linear`` split along its output (weight and bias): ``[B, S, d_in]`` (already in the TP region) ->
    ``[B, S, d_out/p]``. No communication (the group copies the shared input once). ``fused``: this
    projection's columns of its group's fused GEMM on ``x``, already computed; the call adds the bias."""

    def forward(self, x: torch.Tensor, fused: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if fused is None else add_bias(fused, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {shard_repr(self.weight)}"


class RowParallel:
    """``nn.Linear`` split along its input: ``[B, S, d_in/p]`` -> all-reduce -> ``+ bias`` (replicated, added
    once after the all-reduce) -> ``[B, S, d_out]``. ``sequence_parallel`` (sequence parallelism): reduce-scatter
    along tokens instead -> ``[B, S/p, d_out]`` (the bias gradient all-reduced in backward)."""

    group = None
    sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return add_bias(reduce_scatter_tokens(F.linear(x, self.weight), self.group), replicated_on_shard(self.bias, self.group))
        return add_bias(reduce_from_tp(F.linear(x, self.weight), self.group), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {shard_repr(self.weight)}"


class DenseGroup(ProjectionGroup):
    """``sequence_parallel``: a column group whose input is this rank's token shard (sequence parallelism).

    Column groups cast their shared input to the compute dtype; without sequence parallelism they copy it
    into the TP region once and (grouped) run one GEMM for all their projections
    (:func:`~boost_hf.parallel.fused.column_linear`). With ``sequence_parallel`` the
    input stays this rank's ``[B, S/p, d]`` tokens, and :func:`~boost_hf.parallel.sequence_parallel.gathered_linear`
    gathers them for the projections' GEMMs (one for the group when grouped, one per projection otherwise) and
    keeps only the shard for backward; a group with a replaced or pre-hooked projection all-gathers the tokens
    (``[B, S, d]``) and calls each projection on them. Row groups pass their input on to their one projection."""

    def __init__(self, owner, names, *, group, grouped, column: bool, sequence_parallel: bool):
        super().__init__(owner, names, group=group, grouped=grouped)
        self.column, self.sequence_parallel = column, sequence_parallel

    def down(self, x):
        if not self.column:
            return (x,)
        x = x.to(compute_dtype(x))
        return (x if self.sequence_parallel else copy_to_tp(x, self.group),)

    def project(self, z, previous=None):
        (h,) = z
        projections = self.projections
        gathers = self.sequence_parallel and self.all_plain(projections, ColumnParallel)
        if self.sequence_parallel and not gathers:
            h = gather_tokens(h, self.group)
        if not (gathers or self.runs_together(projections, ColumnParallel)):
            return [projection(h) for projection in projections], {}
        dtype, grouped = compute_dtype(h), self.several_grouped
        if grouped:
            weights = weight_views([projection.weight for projection in projections], dtype)
        else:
            weights = [projection.weight.to(dtype) for projection in projections]
        if gathers:
            outputs = gathered_linear(h, weights, self.group, grouped=grouped)
        else:
            outputs = column_linear(h, weights, grouped=grouped)
        return [projection(h, fused=out) for projection, out in zip(projections, outputs)], {}


class MegatronLayout(Layout):
    name = "megatron"
    split_dimensions = ("hidden_size", "intermediate_size")
    stored_together = ("weight",)

    def check(self, config) -> None:
        if config.bottleneck is not None:
            raise ValueError(
                f"tp_style='megatron' is the full-rank layout; for bottleneck={config.bottleneck!r} "
                "use tp_style='btp' (or 'vanilla' for the naive baseline)."
            )
        if self.parallel.activation_checkpointing == "lowrank":
            raise ValueError(
                "activation_checkpointing='lowrank' cuts at r-dim latents and needs a low-rank model; "
                "use 'full' for the full-rank model."
            )
        super().check(config)

    def projection_splits(self, group_name):
        # column-parallel q/k/v, gate/up (weight and bias by output); row-parallel o, down (a bias replicated)
        return {"weight": 0, "bias": 0} if group_name in COLUMN_GROUPS else {"weight": 1}

    def parallelize_projection(self, projection, group_name, plan) -> None:
        column = group_name in COLUMN_GROUPS
        self.shard_projection(projection, group_name, plan)
        if column:
            adopt(projection, ColumnParallel, group=plan.group)
        else:
            adopt(projection, RowParallel, group=plan.group, sequence_parallel=self.sequence_parallel)

    def projection_group(self, layer, owner, group_name, plan):
        column = group_name in COLUMN_GROUPS
        return DenseGroup(
            owner, GROUPS[group_name], group=plan.group, grouped=self.parallel.group_linears,
            column=column, sequence_parallel=column and self.sequence_parallel,
        )

    def layer_communication(self, config, tokens):
        n, d = tokens, config.hidden_size
        if not self.sequence_parallel:
            # Row-parallel o_proj and down_proj reduce their outputs; the column-parallel inputs of q/k/v
            # and gate/up reduce their input gradients.
            return PassCommunication(all_reduce(2, n * (d + d)), all_reduce(2, 2 * n * d))
        # Sequence parallelism: the inputs of q/k/v and gate/up are all-gathered along tokens (backward: gathered
        # again for the weight gradients, and their gradient reduce-scattered), the outputs of o_proj and
        # down_proj reduce-scattered (backward all-gather); the gradients of the two block norms' weights and of
        # the row-parallel biases are all-reduced.
        row_biases = int(config.attention_bias) + int(config.mlp_bias)
        forward = all_gather(2, 2 * n * d) + reduce_scatter(2, 2 * n * d)
        backward = reduce_scatter(2, 2 * n * d) + all_gather(4, 4 * n * d) + all_reduce(2 + row_biases, (2 + row_biases) * d)
        return PassCommunication(forward, backward)

    def backward_overlaps(self, config, tokens):
        """Sequence parallelism: each column group's re-gather of its input (``N d``) runs beside the group's
        input-gradient GEMMs (:func:`~boost_hf.parallel.sequence_parallel.gathered_linear`, as Megatron-LM)."""
        if not self.sequence_parallel:
            return []
        gemms = self.local_gemms(config, tokens)
        return [
            BackwardOverlap(all_gather(1, tokens * config.hidden_size),
                            [g for g in gemms if g.name in (f"{group}_proj", *GROUPS[group])])
            for group in COLUMN_GROUPS
        ]

    def outside_layers_communication(self, config, tokens):
        n, d = tokens, config.hidden_size
        if not self.sequence_parallel:
            # Vocab-parallel embedding (forward all-reduce); vocab-parallel LM head (backward all-reduce).
            return PassCommunication(all_reduce(1, n * d), all_reduce(1, n * d))
        # Sequence parallelism: the embedding's all-reduce, kept; the first layer keeps its token shard
        # (backward all-gather); the final norm all-gathers along tokens before the head (backward
        # reduce-scatter) and all-reduces its weight gradient.
        return PassCommunication(all_reduce(1, n * d) + all_gather(1, n * d), all_gather(1, n * d) + reduce_scatter(1, n * d) + all_reduce(1, d))

    def saved_latent_elements(self, config, tokens):
        raise ValueError("megatron has no low-rank checkpointing: it saves no latents")

    def saved_bytes_without_checkpointing(self, config, tokens, *, activation_bytes, residual_bytes, weights_cast):
        # modelled: q/k/v and gate/up grouped
        if not self.parallel.group_linears:
            return None
        p, n, a, d = self.parallel.tp_size, tokens, activation_bytes, config.hidden_size
        widths = self.widths(config)
        norms = 2 * whole_norm_saved_bytes(n // p if self.sequence_parallel else n, d, a, residual_bytes)
        if self.sequence_parallel:  # each norm of a token shard also keeps its weight (the residual's dtype)
            norms += 2 * d * residual_bytes
        heads = config.num_attention_heads // p
        # attention: the q/k/v GEMM output, the rotated q and k, the output; the log-sum-exp per head (fp32)
        attention = n * ((widths.q + 2 * widths.k) + (widths.q + widths.k) + widths.q) * a + n * heads * 4
        # MLP ([N, f/p]): gate and up (one GEMM output), the activated gate, their product
        mlp = n * widths.mlp * a * 4
        return norms + attention + mlp

    def local_gemms(self, config, tokens):
        p, n = self.parallel.tp_size, tokens
        d, dq, dkv, f = config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size
        if self.parallel.group_linears:
            column = [Gemm("qkv_proj", n, d, (dq + 2 * dkv) // p, "dense"), Gemm("gate_up_proj", n, d, 2 * f // p, "dense")]
        else:
            column = [Gemm(name, n, d, width // p, "dense") for name, width in
                      (("q_proj", dq), ("k_proj", dkv), ("v_proj", dkv), ("gate_proj", f), ("up_proj", f))]
        return column + [Gemm("o_proj", n, dq // p, d, "dense"), Gemm("down_proj", n, f // p, d, "dense")]

    def widths(self, config):
        p = self.parallel.tp_size
        return ResidualWidths(config.hidden_size, config.q_dim // p, config.kv_dim // p, config.intermediate_size // p, 0)


__all__ = ["MegatronLayout", "ColumnParallel", "RowParallel", "DenseGroup"]
