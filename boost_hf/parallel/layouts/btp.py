"""Bottleneck-aware tensor parallelism (BTP), BOOST's layout.

``A`` is row-parallel (``[r, d_in/p]``), ``B`` column-parallel (``[d_out/p, r]``); the residual stream is
sharded along ``d`` (each rank holds ``[..., d/p]``), the r-dim latents are replicated, attention runs
on ``heads/p`` heads, the embedding table is split along ``d`` (no collective) and the block norms'
``gamma`` along ``d`` (online or sync statistics, :mod:`boost_hf.parallel.norms`).

Per layer: all-reduce of each A's partial ``N x r`` output, ``7 N r`` in 4 calls (grouped) or 7
(ungrouped), mirrored in backward at the input gradients of the B's. RMSNorm statistics: ``online``
adds ``2N`` elements to the forward calls; ``sync`` adds 2 calls and ``2N`` elements forward and
backward; ``local`` nothing. Low-rank checkpointing recomputes no collective with the online norm.

Tensor train: the factors are contracted from cores; a rank holds the slice of the first input core along its mode
(its rows of ``A^T``) and of the first output core along its mode (its columns of ``B^T``), the other cores whole, their
gradients all-reduced in backward, one all-reduce per factor (:mod:`boost_hf.parallel.tensor_train`). The first input
and output modes must be divisible by ``p``.

LaX: each rank computes the crossing ``h = act(LayerNorm_r(z + G h_prev))`` on the replicated reduced latent
``z`` and the replicated ``h_prev``, so ``h`` (fed to this rank's ``B`` shard and handed to the next block) is
replicated too: no communication. Its gradient is the next block's (replicated) plus the B input gradients,
all-reduced by the copy into the TP region as for any latent. A bias after ``B`` is split with ``B``'s output.

Latent sequence parallelism (``sequence_parallel=True``): each A's partial output is
reduce-scattered over tokens instead of all-reduced (the online norm's statistics in the same collective), the
latent element-wise work (``1/rms`` scale, activation) runs on this rank's ``N/p`` tokens, and the latents are
all-gathered over tokens before the B's (backward: the mirror image, reduce-scatter of the B's input gradients,
all-gather of the A outputs' gradients). LaX's crossing and latent LayerNorm run on those tokens too (the
handed-on latents are token shards); the gradients of their replicated parameters are all-reduced in backward.
The residual stays sharded along ``d``; low-rank checkpointing keeps ``1/p`` of the latents and re-issues the
all-gathers when it recomputes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..communication import Communication, PassCommunication, all_gather, all_reduce, reduce_scatter
from ..modules import add_bias, adopt, compute_dtype, shard_parameter, shard_repr
from ..fused import STATISTICS_WIDTH, batched_latent_linear, down_projection, latent_linear, scale_latents, split_latent, weight_views
from ..latent_op import ACTIVATIONS, scale_activate
from ..norms import RMSNORM_MODES
from ..primitives import copy_to_tp, gather_tokens, reduce_from_tp, reduce_scatter_tokens
from ..sequence_parallel import reduce_gradients_over_tokens
from ..tensor_train import check_btp_modes, contraction_gemms, gradient_communication, is_tensor_train, shard_tensor_train
from .base import (
    GROUPS, READS_NORM, Gemm, Layout, ProjectionGroup, ResidualWidths, apply_latent_functions, factor_shards_repr, low_rank_a_gemms,
    split_latents, whole_norm_saved_bytes,
)


class BottleneckAwareProjection:
    """Bottleneck projection with ``A: [r, d_in/p]`` (applied by its group), ``B: [d_out/p, r]`` and, when the
    configuration asks for one, the bias after ``B`` split with ``B``'s output (``[d_out/p]``).
    Module call: the replicated latent ``[B, S, r]`` -> this rank's output ``[B, S, d_out/p]``; ``weight``:
    ``B`` as its group already cast it (see :meth:`ProjectionGroup.call_projections`); ``fused``: this projection's
    output of its group's batched B GEMM, already computed (the call adds the bias). No communication."""

    def forward(self, latent: torch.Tensor, weight: torch.Tensor | None = None, fused: torch.Tensor | None = None) -> torch.Tensor:
        if fused is not None:  # B already applied by the group's batched GEMM
            return add_bias(fused, self.bias)
        return add_bias(latent_linear(latent, self.B if weight is None else weight), self.bias)

    def extra_repr(self) -> str:
        return ", ".join(part for part in (super().extra_repr(), factor_shards_repr(self)) if part)


class HiddenShardedEmbedding:
    """``nn.Embedding`` whose table ``[V, d/p]`` is split along ``d``: each rank looks up its own slice
    of the residual stream; no communication."""

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {shard_repr(self.weight)}"


def _fusable_activation(projections) -> str | None:
    """The latent function every one of ``projections`` applies, as :func:`~boost_hf.parallel.latent_op.scale_activate`
    names it (``"identity"`` or ``"silu"``), when it can run fused with the online norm's scale: the same for all,
    one of :data:`~boost_hf.parallel.latent_op.ACTIVATIONS`, and no hook on the activation module; else ``None``."""
    names = {getattr(p, "latent_activation", "unknown") or "identity" for p in projections}
    if len(names) != 1 or not names <= set(ACTIVATIONS):
        return None
    act_fns = [getattr(p, "act_fn", None) for p in projections]
    if any(a is not None and (a._forward_hooks or a._forward_pre_hooks) for a in act_fns):
        return None
    return names.pop()


class BottleneckAwareGroup(ProjectionGroup):
    """``down``: this rank's partial A output ``[..., k r]`` from its ``[..., d_in/p]`` input (one GEMM on
    the A's, stored as one tensor, written into one buffer when grouped); with the online norm ``gamma`` is folded into the A's
    and the buffer gains the norm statistics (:mod:`boost_hf.parallel.fused`); ``reduce``: all-reduce it
    in place; ``project``: scale by the global ``1/rms`` (online), latent functions (grouped, SiLU or none: both in
    one kernel each way, :mod:`boost_hf.parallel.latent_op`), copy into the TP region (one collective in backward
    when grouped) and the B's (grouped: q's and k's, and gate's and up's, as one batched GEMM each when their output
    widths agree, :func:`~boost_hf.parallel.fused.batched_latent_linear`; v's apart). ``sequence_parallel`` (latent sequence
    parallelism): ``reduce`` reduce-scatters over tokens (``[B, S/p, k r (+ statistics)]``), ``project`` runs
    the latent functions on those tokens and all-gathers the latents instead of the copy."""

    def __init__(self, owner, names, *, group, grouped, statistics: bool, hidden_size: int, eps: float, sequence_parallel: bool):
        super().__init__(owner, names, group=group, grouped=grouped)
        self.statistics, self.hidden_size, self.eps = statistics, hidden_size, eps
        self.sequence_parallel = sequence_parallel

    def _to_b(self, latent: torch.Tensor) -> torch.Tensor:
        """The latents the B's read, from this rank's: copied into the TP region, or gathered over tokens."""
        return gather_tokens(latent, self.group) if self.sequence_parallel else copy_to_tp(latent, self.group)

    def down(self, x):
        factors = [p.A for p in self.projections]
        if self.statistics:
            return down_projection(x.hidden, factors, gamma=x.weight, statistics=True, grouped=self.grouped)
        if len(factors) == 1:
            return (F.linear(x, factors[0]),)
        return down_projection(x, factors, grouped=self.grouped)

    def reduce(self, partials):
        reduce = reduce_scatter_tokens if self.sequence_parallel else reduce_from_tp
        return tuple(reduce(partial, self.group) for partial in partials)

    def project(self, z, previous=None):
        z = list(z)
        projections = self.projections
        k = len(projections)
        crosses = any(hasattr(p, "crossed_latent") for p in projections)
        activation = _fusable_activation(projections) if self.statistics and len(z) == 1 and not crosses else None
        if activation is not None:
            # the 1/rms scale and the latent function (the same for every projection) in one kernel each way, copy once
            width = z[0].shape[-1] - STATISTICS_WIDTH
            return self._project_latent(projections, self._to_b(scale_activate(z[0], width, self.hidden_size, self.eps, activation))), {}
        if self.statistics:
            z = scale_latents(z, self.hidden_size, self.eps)
        if len(z) == 1 and not crosses:
            # every projection has the same element-wise latent function: apply it once, copy once
            return self._project_latent(projections, self._to_b(projections[0].latent(z[0]))), {}
        zs = split_latents(z[0], k) if len(z) == 1 else z
        latents, crossed = apply_latent_functions(projections, self.names, zs, previous)
        if self.several_grouped:
            return self._project_latent(projections, self._to_b(torch.cat(latents, dim=-1))), crossed
        return self.call_projections(projections, [self._to_b(latent) for latent in latents], BottleneckAwareProjection), crossed

    def _project_latent(self, projections, latent):
        """Each projection's B on its ``r`` columns of ``latent [..., k r]`` (the latents the B's read, side by side).
        In a group that runs together (:meth:`runs_together`), the leading projections whose outputs nothing keeps for
        backward (:data:`BATCHED`: q and k, which RoPE consumes; gate and up, kept together by the gated product; not v,
        which attention keeps: a block of a batched output keeps all of it) and whose B's have one output width run as
        one batched GEMM (:func:`~boost_hf.parallel.fused.batched_latent_linear`), each then called as a module with its
        output (``fused``: it adds its bias); the others (and every other group) each on its view of the latent
        (:func:`~boost_hf.parallel.fused.split_latent`, :meth:`call_projections`)."""
        k = len(projections)
        batched = BATCHED.get(self.names, 0)
        if (batched < 2 or not self.runs_together(projections, BottleneckAwareProjection)
                or len({p.B.shape[0] for p in projections[:batched]}) > 1):
            return self.call_projections(projections, split_latent(latent, k), BottleneckAwareProjection)
        rank = latent.shape[-1] // k
        weights = weight_views([projection.B for projection in projections], compute_dtype(latent))
        parts = split_latent(latent, 2, [batched * rank, (k - batched) * rank]) if batched < k else (latent,)
        outputs = batched_latent_linear(parts[0], weights[:batched])
        inputs = parts[0].split(rank, dim=-1)
        called = [projection(x, fused=out) for projection, x, out in zip(projections, inputs, outputs)]
        rest = split_latent(parts[1], k - batched) if batched < k else ()
        return called + [projection(x, weight=w) for projection, x, w in zip(projections[batched:], rest, weights[batched:])]


#: projection group -> how many of its leading projections run as one batched B GEMM (see ``_project_latent``)
BATCHED = {GROUPS["qkv"]: 2, GROUPS["gate_up"]: 2}


class BottleneckAwareLayout(Layout):
    name = "btp"
    residual_sharded = True
    embedding_class = HiddenShardedEmbedding
    split_dimensions = ("hidden_size", "intermediate_size")
    stored_together = ("A", "B")
    norm_split = 0

    def check(self, config) -> None:
        p = self.parallel.tp_size
        if config.bottleneck is None and p > 1:
            raise ValueError(
                "tp_style='btp' needs a low-rank model (bottleneck svd/cola/lax); "
                "the full-rank model (bottleneck=None) uses tp_style='megatron'."
            )
        if config.tie_word_embeddings and p > 1:
            raise ValueError(
                "tie_word_embeddings=True cannot be combined with tp_style='btp' at tp_size > 1 (the embedding is "
                "split along d, the LM head along the vocabulary): set tie_word_embeddings=False."
            )
        super().check(config)
        if config.bottleneck == "tt" and p > 1:
            check_btp_modes(config, p)

    def embedding_split(self) -> int | None:
        return 1

    def parallelize_layer(self, layer, plan) -> None:
        # at tp_size=1 the residual is whole: the block norms stay the single-device norm
        rmsnorm = self.parallel.rmsnorm if plan.tp_size > 1 else None
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            shard_parameter(norm, "weight", self.norm_split, plan)
            if rmsnorm is not None:
                adopt(norm, RMSNORM_MODES[rmsnorm], group=plan.group, hidden_size=layer.self_attn.config.hidden_size)
        super().parallelize_layer(layer, plan)

    def projection_splits(self, group_name):
        return {"A": 1, "B": 0, "bias": 0}  # A row-parallel, B (and its bias) column-parallel

    def tensor_train_splits(self, shape) -> dict[int, int]:
        # the first input core along its mode (rows of A^T), the first output core along its mode (columns of B^T)
        return {0: 1, shape.split: 1}

    def parallelize_projection(self, projection, group_name, plan) -> None:
        if is_tensor_train(projection):
            shard_tensor_train(projection, self.tensor_train_splits(projection.tensor_train), plan)
        self.shard_projection(projection, group_name, plan)  # A and B where they are parameters, the bias
        if self.sequence_parallel and hasattr(projection, "crossed_latent"):
            # LaX's crossing gate and latent LayerNorm run on this rank's tokens
            latent_parameters = [name for name, _ in projection.named_parameters() if name not in ("A", "B", "bias")]
            reduce_gradients_over_tokens(projection, latent_parameters, plan)
        adopt(projection, BottleneckAwareProjection)

    def projection_group(self, layer, owner, group_name, plan):
        config = layer.self_attn.config
        online = plan.tp_size > 1 and self.parallel.rmsnorm == "online"
        return BottleneckAwareGroup(
            owner, GROUPS[group_name], group=plan.group, grouped=self.parallel.group_linears,
            statistics=group_name in READS_NORM and online, hidden_size=config.hidden_size, eps=config.rms_norm_eps,
            sequence_parallel=self.sequence_parallel,
        )

    def layer_communication(self, config, tokens):
        n, r = tokens, config.rank
        # each A is row-parallel and all-reduces its partial N x r output (A_qkv: 3r, A_o: r,
        # A_gate_up: 2r, A_down: r); backward mirrors it at the input gradient of each B
        calls = 4 if self.parallel.group_linears else 7
        # the N partial sums of squares of each of the 2 norms ride in the next A's collective (in
        # STATISTICS_WIDTH columns: one used, the rest keep the GEMM output rows 16-byte aligned)
        statistics = 2 * n * STATISTICS_WIDTH if self.parallel.rmsnorm == "online" else 0
        if self.sequence_parallel:
            # latent sequence parallelism: reduce-scatter of the A outputs (with the statistics), all-gather of
            # the latents before the B's; backward the mirror image
            forward = reduce_scatter(calls, 7 * n * r + statistics) + all_gather(calls, 7 * n * r)
            backward = reduce_scatter(calls, 7 * n * r) + all_gather(calls, 7 * n * r + statistics)
        else:
            forward, backward = all_reduce(calls, 7 * n * r + statistics), all_reduce(calls, 7 * n * r)
        if self.parallel.rmsnorm == "sync":
            # one separate all-reduce of N statistics per norm, whose backward is an all-reduce too
            forward, backward = forward + all_reduce(2, 2 * n), backward + all_reduce(2, 2 * n)
        return PassCommunication(forward, backward)

    def parameter_gradient_communication(self, config, layer_idx: int) -> Communication:
        if config.bottleneck == "tt":
            return gradient_communication(config, self.tensor_train_splits)
        if not (self.sequence_parallel and config.bottleneck == "lax" and layer_idx > 0):
            return Communication()
        # one all-reduce per crossing-gate and latent-LayerNorm parameter of each of the 7 projections
        r, (a, b) = config.rank, config.kronecker_factors
        sizes = {"dense": [r * r, r], "kronecker": [a * a, b * b], "identity": []}[config.lax_gate]
        sizes = sizes + ([r, r] if config.lax_latent_norm else [])
        return all_reduce(7 * len(sizes), 7 * sum(sizes))

    def recompute_communication(self, config, tokens) -> Communication:
        if self.parallel.activation_checkpointing != "lowrank":
            return super().recompute_communication(config, tokens)
        recomputed = Communication()
        if self.parallel.rmsnorm == "sync":
            recomputed = recomputed + all_reduce(2, 2 * tokens)  # the statistics all-reduces sit inside the norms' steps
        if self.sequence_parallel:
            # the all-gathers of the latents sit inside the steps that apply the B's
            recomputed = recomputed + all_gather(4 if self.parallel.group_linears else 7, 7 * tokens * config.rank)
        return recomputed

    def outside_layers_communication(self, config, tokens):
        n, d = tokens, config.hidden_size
        # the embedding is sharded along d (no collective); the d-sharded residual is all-gathered to full
        # d before the final norm; the vocab-parallel LM head all-reduces its input gradient
        return PassCommunication(all_gather(1, n * d), all_reduce(1, n * d))

    def saved_latent_elements(self, config, tokens):
        latents = 7 * tokens * config.rank + (2 * tokens * STATISTICS_WIDTH if self.parallel.rmsnorm == "online" else 0)
        return latents // self.parallel.tp_size if self.sequence_parallel else latents

    def saved_bytes_without_checkpointing(self, config, tokens, *, activation_bytes, residual_bytes, weights_cast):
        # modelled: the grouped projections with the online norm, without LaX
        if config.bottleneck == "lax" or not self.parallel.group_linears or self.parallel.rmsnorm != "online":
            return None
        p, n, a, r = self.parallel.tp_size, tokens, activation_bytes, config.rank
        shard = n // p if self.sequence_parallel else n  # tokens of the token-sharded latent work
        widths = self.widths(config)
        if p > 1:  # each online norm: its output in the compute dtype (the A's input, [N, d/p]) and 4 fp32 per token
            # (1/rms and the statistics the fused scale-and-activation op keeps: measured by the saved-tensor probe)
            norms = 2 * (n * widths.residual * a + shard * 16)
        else:  # the norms of a whole residual
            norms = 2 * whole_norm_saved_bytes(n, config.hidden_size, a, residual_bytes)
        # each group (3r, r, 2r, r): the latent the B's read (all tokens) and, when it differs, the reduced A output
        # it comes from (this rank's tokens under SP): the activated latent's input, the online norm's scaled latent
        latents = 0
        for group, w in zip(("qkv", "o", "gate_up", "down"), (3 * r, r, 2 * r, r)):
            reduced_apart = config.latent_activation is not None or (self.sequence_parallel and group in READS_NORM)
            latents += n * w + (shard * w if reduced_apart else 0)
        # attention: rotated q and k, v, the output ([N, heads/p x head_dim]) and the log-sum-exp per head (fp32)
        heads = config.num_attention_heads // p
        attention = n * (2 * widths.q + 2 * widths.k) * a + n * heads * 4
        # MLP ([N, f/p]): gate, up, their product (and the activated gate when the MLP keeps its activation)
        mlp = n * widths.mlp * a * (4 if config.mlp_activation is not None else 3)
        # the A's reading an online norm (A_qkv, A_gate_up: [5 r, d/p]) with the norm's gamma folded in, made each
        # forward (under autocast that is their bf16 copy, counted with the others)
        folded = 0 if weights_cast or p == 1 else 5 * r * widths.residual * a
        return norms + latents * a + attention + mlp + folded

    def local_gemms(self, config, tokens):
        p, n, r = self.parallel.tp_size, tokens, config.rank
        local = {"d": config.hidden_size // p, "dq": config.q_dim // p, "f": config.intermediate_size // p}
        a_gemms = low_rank_a_gemms(config, n, r, local, self.parallel.group_linears)
        b_gemms = [Gemm(f"{name}.B", n, r, d_out // p, "B") for name, (_, d_out) in config.projection_shapes().items()]
        contractions = contraction_gemms(config, self.tensor_train_splits, p) if config.bottleneck == "tt" else []
        return a_gemms + b_gemms + contractions

    def widths(self, config):
        p = self.parallel.tp_size
        return ResidualWidths(config.hidden_size // p, config.q_dim // p, config.kv_dim // p, config.intermediate_size // p, config.rank)


__all__ = ["BottleneckAwareLayout", "BottleneckAwareProjection", "BottleneckAwareGroup", "HiddenShardedEmbedding"]
