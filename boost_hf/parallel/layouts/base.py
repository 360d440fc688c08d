"""What a tensor-parallel layout is: one object per style owns every fact about it.

A :class:`Layout` decides which dimension of which parameter each rank holds, builds the runtime
communication pattern of each projection group (:class:`ProjectionGroup`), and states the analytic
facts the tests, benchmarks and estimator ask for: collectives per layer (forward, backward and
recomputation), what low-rank checkpointing keeps, and the local GEMM shapes. Adding a layout is one
file in this folder plus one line in its registry.

A *projection group* is the set of projections reading one input: ``qkv`` (q, k, v), ``o``,
``gate_up`` (gate, up) and ``down``. Every group runs in three steps, so that the decoder layer (and
low-rank checkpointing) cuts between them:

1. ``down(x)``: local work up to the group's collective (the A GEMMs, or the input copy);
2. ``reduce(partials)``: that collective (identity where the layout has none here);
3. ``project(z, previous)``: the latent functions and each projection *called as a module*
   (``q_proj(latent)``), which applies B and any trailing collective.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
from torch import nn

from ..communication import NO_COMMUNICATION, Communication, PassCommunication
from ..decoder_layer import Latents, ParallelAttention, ParallelDecoderLayer, ParallelMLP, Tensors
from ..fused import weight_views
from ..modules import VocabParallelEmbedding, VocabParallelHead, adopt, compute_dtype, shard_parameter, shard_repr
from ..norms import FusedRMSNorm, GatheredRMSNorm
from ..rotary import ComputeDtypeRotaryEmbedding
from ..sequence_parallel import TokenGatheringRMSNorm, TokenShardedRMSNorm

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
READS_NORM = ("qkv", "gate_up")  # groups whose input is a normalised residual


class Gemm(NamedTuple):
    """One GEMM of a layer's forward on one rank: ``[m, k] x [k, n]``; ``role`` is ``dense``, ``A``, ``B``,
    ``crossing`` or ``contraction`` (of a tensor train's cores into its factors, whatever the tokens)."""

    name: str
    m: int
    k: int
    n: int
    role: str

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


class BackwardOverlap(NamedTuple):
    """Collectives of a layer's backward (part of :meth:`Layout.layer_communication`'s) that run beside GEMMs:
    ``communication``, and the forward ``gemms`` whose input-gradient GEMMs (the same shapes and FLOPs) run
    meanwhile."""

    communication: Communication
    gemms: list[Gemm]


@dataclass(frozen=True)
class ResidualWidths:
    """Per-rank widths a layer's element-wise work runs on: residual stream, local q and k widths,
    local MLP width and the r-dim latent as each rank holds it."""

    residual: int
    q: int
    k: int
    mlp: int
    latent: int


@dataclass(frozen=True)
class StageBoundary:
    """The tensors one TP rank sends the same TP rank of the next pipeline stage per micro-batch (forward; their
    gradients, the same shapes, come back in backward).

    ``residual``: the residual stream's shape as the layout holds it. ``latents``: LaX only, the handed-on latents
    of the 7 projections side by side, ``[rows, 7 r]`` (rows: the micro-batch's tokens, flattened). ``gathered``:
    elements of the all-gather over TP the boundary adds in each direction (``7 N r``) when the latents are
    replicated over TP and the rows are this rank's ``1/p`` share (:attr:`latents_shared`): the receiving stage
    all-gathers the ``p`` shares; in backward each rank sends back its share of the (replicated) gradient and the
    sending stage all-gathers it."""

    residual: tuple[int, ...]
    latents: tuple[int, ...] | None = None
    gathered: int = 0

    @property
    def latents_shared(self) -> bool:
        """Each TP rank sends a ``1/p`` share of the replicated latents (all-gathered over TP on arrival)."""
        return self.gathered > 0

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The shapes sent, in order: the residual, then the packed latents (LaX)."""
        return [self.residual] + ([self.latents] if self.latents is not None else [])

    @property
    def elements(self) -> int:
        """Elements sent in all."""
        return sum(math.prod(shape) for shape in self.shapes)


class ProjectionGroup:
    """Projections ``names`` of ``owner`` (attention or MLP) reading one input, and the layout's
    communication around them. The projections are looked up on ``owner`` at every call, so a module a
    tool puts in their place is the one that runs."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...], *, group, grouped: bool):
        self.owner, self.names, self.group, self.grouped = owner, names, group, grouped

    @property
    def projections(self) -> list[nn.Module]:
        return [getattr(self.owner, name) for name in self.names]

    @property
    def several_grouped(self) -> bool:
        """Grouping is on and the group has more than one projection (q/k/v, gate/up)."""
        return self.grouped and len(self.names) > 1

    @staticmethod
    def all_plain(projections: list[nn.Module], cls: type) -> bool:
        """Every projection is still this layout's ``cls`` with nothing acting before its forward (a forward
        pre-hook may change its input or gather its weight, e.g. DeepSpeed ZeRO-3), so the group may compute
        its output for it."""
        return all(isinstance(projection, cls) and not projection._forward_pre_hooks for projection in projections)

    def runs_together(self, projections: list[nn.Module], cls: type) -> bool:
        """Whether the group may run ``projections`` as one GEMM, or hand them one cast of their weights:
        grouped, and every projection plain (:meth:`all_plain`)."""
        return self.several_grouped and self.all_plain(projections, cls)

    def call_projections(self, projections: list[nn.Module], latents, cls: type) -> list[torch.Tensor]:
        """Each low-rank projection called as a module on its latent (B and any trailing collective); when the
        group runs together (:meth:`runs_together`), with its ``B`` from one cast of the group's B's
        (:func:`~boost_hf.parallel.fused.weight_views`) passed as ``weight``."""
        if self.runs_together(projections, cls):
            weights = weight_views([projection.B for projection in projections], compute_dtype(latents[0]))
            return [projection(latent, weight=w) for projection, latent, w in zip(projections, latents, weights)]
        return [projection(latent) for projection, latent in zip(projections, latents)]

    def down(self, x) -> Tensors:
        raise NotImplementedError

    def reduce(self, partials: Tensors) -> Tensors:
        return partials

    def project(self, z: Tensors, previous: Latents | None) -> tuple[list[torch.Tensor], Latents]:
        raise NotImplementedError


class Layout:
    """One tensor-parallel style. Subclasses set the class attributes and implement the methods."""

    name: ClassVar[str]
    #: the residual stream is split along d (each rank holds ``[..., d/p]``)
    residual_sharded: ClassVar[bool] = False
    #: attention runs on ``heads/p`` local heads (else every rank computes every head)
    heads_split: ClassVar[bool] = True
    #: the config dimensions the layout splits over ranks
    split_dimensions: ClassVar[tuple[str, ...]] = ()
    #: parameters of a grouped projection group's projections stored as one tensor (row blocks of one
    #: buffer, :mod:`boost_hf.parallel.shared_storage`), which the group's GEMM reads without a copy
    stored_together: ClassVar[tuple[str, ...]] = ()
    #: the dimension of the block norms' weight each rank holds a slice of (``None``: replicated)
    norm_split: ClassVar[int | None] = None
    #: what the embedding becomes at tp_size > 1 (its table split along :meth:`embedding_split`)
    embedding_class: ClassVar[type] = VocabParallelEmbedding

    def __init__(self, parallel):
        self.parallel = parallel

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism in effect: asked for (``ParallelConfig.sequence_parallel``) with more than one TP rank
        to split the tokens over. The one name of the concept below the flag: the plan, the projection groups, the
        layers and the collectives read it."""
        return self.parallel.sequence_parallel and self.parallel.tp_size > 1

    # ------------------------------------------------------------------ validation
    def check(self, config) -> None:
        """Raise ``ValueError`` naming the field to change if this layout cannot hold ``config``."""
        p = self.parallel.tp_size
        if p == 1:
            return
        for name in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(config, name)
            if value % p != 0:
                raise ValueError(f"{name} ({value}) is not divisible by tp_size ({p}): choose a tp_size that divides it.")
        if config.vocab_size % p != 0:
            raise ValueError(
                f"vocab_size ({config.vocab_size}) is not divisible by tp_size ({p}): pad the vocabulary "
                f"to a multiple of {p} (e.g. {-(-config.vocab_size // p) * p})."
            )
        for name in self.split_dimensions:
            value = getattr(config, name)
            if value % p != 0:
                raise ValueError(
                    f"{name} ({value}) is not divisible by tp_size ({p}), which tp_style={self.name!r} "
                    "splits: choose a tp_size that divides it."
                )

    # ------------------------------------------------------------------ runtime
    def module_plan(self, model: nn.Module, plan) -> dict[str, Callable[[nn.Module], None]]:
        """What each module of a causal LM becomes on this rank, by its path (``model.layers.*``: every decoder layer),
        in the order :func:`~boost_hf.parallel.parallelize` applies them, skipping the paths this rank does not hold
        (a pipeline stage's missing embedding, layers, final norm or head). At ``tp_size=1`` without recomputation the
        decoder layers, the rotary tables and the final norm stay the single-device modules."""
        split = plan.residual_split
        entries = {"model.embed_tokens": functools.partial(self.place_embedding, plan=plan)}
        if plan.tp_size > 1 or self.parallel.activation_checkpointing != "none":
            entries["model.layers.*"] = functools.partial(self.parallelize_layer, plan=plan)
            entries["model.rotary_emb"] = functools.partial(adopt, mixin=ComputeDtypeRotaryEmbedding)
            if split == "tokens":  # the first layer keeps this rank's token shard of the embedding's output
                entries["model.layers.0"] = functools.partial(adopt, mixin=ParallelDecoderLayer, sequence_parallel_entry=plan.group)
            if split is None:
                entries["model.norm"] = functools.partial(adopt, mixin=FusedRMSNorm)
            else:  # the final norm of a split residual gathers it for the head
                norm = GatheredRMSNorm if split == "hidden" else TokenGatheringRMSNorm
                entries["model.norm"] = functools.partial(adopt, mixin=norm, group=plan.group)
        entries["lm_head"] = functools.partial(self.place_head, plan=plan, model=model)
        return entries

    def place_embedding(self, embedding: nn.Module, plan) -> None:
        """The ``[V, d]`` table split along :meth:`embedding_split` (replicated at ``tp_size=1``), looked up by
        :attr:`embedding_class`."""
        split = self.embedding_split() if plan.tp_size > 1 else None
        shard_parameter(embedding, "weight", split, plan)
        if plan.tp_size > 1:
            adopt(embedding, self.embedding_class, group=plan.group, tp_rank=plan.tp_rank)

    def place_head(self, head: nn.Module, plan, model: nn.Module) -> None:
        """The vocab-parallel LM head ``[V/p, d]`` (the embedding's weight when tied), fed the gathered residual."""
        if model.config.tie_word_embeddings:
            head.weight = model.model.embed_tokens.weight
        else:
            shard_parameter(head, "weight", 0, plan)
        adopt(head, VocabParallelHead, group=plan.group, input_gathered=plan.residual_split == "tokens")

    def parallelize_layer(self, layer: nn.Module, plan) -> None:
        """Turn one single-device decoder layer into this rank's shard, in place (parameter names kept):
        every projection through :meth:`parallelize_projection`, every group's communication from
        :meth:`projection_group`; the attention, MLP and layer then run as the parallel modules. The block
        norms of a whole (unsharded) residual run fused (:class:`~boost_hf.parallel.norms.FusedRMSNorm`), on
        this rank's tokens under sequence parallelism."""
        if plan.residual_split != "hidden":
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                if self.sequence_parallel:
                    adopt(norm, TokenShardedRMSNorm, group=plan.group)
                else:
                    adopt(norm, FusedRMSNorm)
        for owner, mixin, group_names in ((layer.self_attn, ParallelAttention, ("qkv", "o")), (layer.mlp, ParallelMLP, ("gate_up", "down"))):
            stored_together = []
            for group_name in group_names:
                for name in GROUPS[group_name]:
                    self.parallelize_projection(getattr(owner, name), group_name, plan)
                group = self.projection_group(layer, owner, group_name, plan)
                setattr(owner, group_name, group)
                if group.several_grouped:  # (a tensor train's factors are contractions, not parameters)
                    stored_together += [(group.names, name) for name in self.stored_together
                                        if all(holds_parameter(p, name) for p in group.projections)]
            adopt(owner, mixin, shared_storage=tuple(stored_together))
            owner.share_storage()
        adopt(layer, ParallelDecoderLayer, checkpointing=self.parallel.activation_checkpointing)

    def parallelize_projection(self, projection: nn.Module, group_name: str, plan) -> None:
        """Shard one projection of group ``group_name`` in place (:meth:`shard_projection`) and adopt its parallel
        module class."""
        raise NotImplementedError

    def projection_splits(self, group_name: str) -> dict[str, int]:
        """The dimension each rank holds a slice of, per parameter of a projection of group ``group_name`` (by its
        name on the projection: ``A``, ``B``, ``weight``, ``bias``); a parameter not named (LaX's crossing gate and
        latent LayerNorm, a row-parallel bias) is replicated. :meth:`shard_projection` applies it; the memory model
        (:mod:`boost_hf.perf.memory`) counts each rank's parameters from it."""
        raise NotImplementedError

    def shard_projection(self, projection: nn.Module, group_name: str, plan) -> None:
        """Replace each parameter :meth:`projection_splits` names by this rank's slice."""
        for name, dim in self.projection_splits(group_name).items():
            if holds_parameter(projection, name):
                shard_parameter(projection, name, dim, plan)

    def tensor_train_splits(self, shape) -> dict[int, int]:
        """Which core of a tensor-train projection (:class:`~boost_hf.configuration_boost_llama.TensorTrainShape`)
        each rank holds a slice of, and along which dimension: ``{core index: dimension}``; the other cores are
        whole on every rank (:mod:`boost_hf.parallel.tensor_train`)."""
        raise NotImplementedError(f"tp_style={self.name!r} does not run tensor-train projections")

    def projection_group(self, layer: nn.Module, owner: nn.Module, group_name: str, plan) -> ProjectionGroup:
        """The communication of group ``group_name`` of ``owner`` (the attention or the MLP of ``layer``)."""
        raise NotImplementedError

    def embedding_split(self) -> int | None:
        """Dimension of the ``[V, d]`` embedding table each rank holds a slice of (``None``: replicated)."""
        return 0

    # ------------------------------------------------------------------ analysis
    def layer_communication(self, config, tokens: int) -> PassCommunication:
        """One decoder layer's collectives for ``tokens`` tokens, without recomputation."""
        raise NotImplementedError

    def parameter_gradient_communication(self, config, layer_idx: int) -> Communication:
        """Backward all-reduces of the gradients of replicated parameters that see only this rank's tokens in
        block ``layer_idx``, beyond :meth:`layer_communication` (LaX's crossing under latent sequence
        parallelism)."""
        return NO_COMMUNICATION

    def backward_overlaps(self, config, tokens: int) -> list[BackwardOverlap]:
        """The backward collectives that run beside input-gradient GEMMs (none by default)."""
        return []

    def recompute_communication(self, config, tokens: int) -> Communication:
        """Collectives re-issued in backward by ``activation_checkpointing``."""
        if self.parallel.activation_checkpointing == "full":
            return self.layer_communication(config, tokens).forward
        return NO_COMMUNICATION

    def outside_layers_communication(self, config, tokens: int) -> PassCommunication:
        """Collectives of the embedding, the final norm and the LM head (not the loss or logits)."""
        raise NotImplementedError

    def residual_elements(self, config, tokens: int) -> int:
        """Elements of the residual stream one rank holds: ``N d``, or ``N d / p`` when it is split along
        ``d`` (``residual_sharded``) or along tokens (sequence parallelism)."""
        split = self.parallel.tp_size > 1 and (self.residual_sharded or self.sequence_parallel)
        return tokens * config.hidden_size // (self.parallel.tp_size if split else 1)

    def saved_latent_elements(self, config, tokens: int) -> int:
        """Elements of the reduced latents low-rank checkpointing keeps per layer (all four groups)."""
        raise NotImplementedError

    def saved_bytes_without_checkpointing(self, config, tokens: int, *, activation_bytes: int, residual_bytes: int,
                                          weights_cast: bool) -> int | None:
        """Bytes one decoder layer's forward keeps for backward on one rank when nothing is checkpointed (also what a
        checkpointed layer holds while its backward recomputes it): activations at ``activation_bytes`` per element
        (the compute dtype), a saved residual at ``residual_bytes``, statistics in fp32; not the rotary tables (shared
        by the layers), nor the copies of the weights autocast makes (``weights_cast``: it makes them, so a weight
        the layout materialises itself is one of them). ``None`` where the layout does not model it (the memory
        model then does not claim a fit)."""
        return None

    def local_gemms(self, config, tokens: int) -> list[Gemm]:
        """The GEMMs of one layer's forward on one rank (without LaX crossings; with a tensor train's contractions)."""
        raise NotImplementedError

    def widths(self, config) -> ResidualWidths:
        """Per-rank widths of the element-wise work."""
        raise NotImplementedError

    def stage_boundary(self, config, microbatch: int, seq: int) -> StageBoundary:
        """What one TP rank hands the same TP rank of the next pipeline stage for a micro-batch of ``microbatch``
        sequences of ``seq`` tokens (their gradients come back in backward, the same shapes); see
        :class:`StageBoundary`. The residual stream as this layout holds it: ``[mb, S, d/p]`` when it is sharded
        along ``d`` (no gather at the boundary), ``[mb, S/p, d]`` under Megatron's sequence parallelism, else the
        replicated ``[mb, S, d]``. LaX also hands on the last block's latent of each of the 7 projections, packed
        ``[rows, 7 r]``: this rank's ``N/p`` token rows under latent sequence parallelism (they are token shards
        already); otherwise they are replicated over TP and each rank sends a ``1/p`` share of the ``N = mb S``
        rows (``latents_shared``; the whole ``N`` rows when ``p`` does not divide ``N``)."""
        p, d = self.parallel.tp_size, config.hidden_size
        if self.sequence_parallel and not self.residual_sharded:
            residual = (microbatch, seq // p, d)
        else:
            residual = (microbatch, seq, self.widths(config).residual)
        if config.bottleneck != "lax":
            return StageBoundary(residual)
        width, rows = len(config.projection_shapes()) * config.rank, microbatch * seq
        if self.sequence_parallel:
            return StageBoundary(residual, (rows // p, width))
        if p > 1 and rows % p == 0:
            return StageBoundary(residual, (rows // p, width), gathered=rows * width)
        return StageBoundary(residual, (rows, width))


def whole_norm_saved_bytes(rows: int, width: int, activation_bytes: int, residual_bytes: int) -> int:
    """What the RMSNorm of a whole residual (``[rows, width]``, the fused norm of
    :mod:`boost_hf.parallel.rmsnorm_op`) keeps for backward: its input, ``1/rms`` (fp32) and its output in the compute
    dtype (the next GEMM's input); a residual narrower than fp32 runs the unfused arithmetic, which keeps an fp32 copy
    of the input and the normalised values in the compute dtype as well."""
    kept = residual_bytes + activation_bytes if residual_bytes == 4 else 4 + 2 * activation_bytes
    return rows * width * kept + rows * 4


def holds_parameter(module: nn.Module, name: str) -> bool:
    """``module.<name>`` is one of its own parameters (a tensor-train projection's ``A`` and ``B`` are not)."""
    return name in dict(module.named_parameters(recurse=False))


def factor_shards_repr(projection: nn.Module) -> str:
    """``A``'s and ``B``'s shards where they are parameters (a tensor train's cores print their own)."""
    return ", ".join(f"{name} {shard_repr(getattr(projection, name))}" for name in ("A", "B") if holds_parameter(projection, name))


def split_latents(z: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """``count`` equal slices of the last dim (views, no copy)."""
    return z.chunk(count, dim=-1) if count > 1 else (z,)


def apply_latent_functions(projections: list[nn.Module], names, zs, previous: Latents | None) -> tuple[list[torch.Tensor], Latents]:
    """Each projection's function between its factors on its latent; LaX crosses in ``previous``.
    Returns ``(latents fed to the B's, {name: latent handed to the next block})`` (LaX hands on the very
    latent it feeds to ``B``). No communication."""
    fed, crossed = [], {}
    for name, projection, z in zip(names, projections, zs):
        if hasattr(projection, "crossed_latent"):
            latent, crossed[name] = projection.crossed_latent(z, (previous or {}).get(name))
        else:
            latent = projection.latent(z)
        fed.append(latent)
    return fed, crossed


def low_rank_a_gemms(config, n: int, r_local: int, local: dict[str, int], grouped: bool) -> list[Gemm]:
    """The A GEMMs of a low-rank layer: ``local`` widths of d, dq and f on this rank."""
    if grouped:
        return [
            Gemm("qkv_proj.A", n, local["d"], 3 * r_local, "A"),
            Gemm("o_proj.A", n, local["dq"], r_local, "A"),
            Gemm("gate_up_proj.A", n, local["d"], 2 * r_local, "A"),
            Gemm("down_proj.A", n, local["f"], r_local, "A"),
        ]
    inputs = {"q_proj": "d", "k_proj": "d", "v_proj": "d", "o_proj": "dq", "gate_proj": "d", "up_proj": "d", "down_proj": "f"}
    return [Gemm(f"{name}.A", n, local[width], r_local, "A") for name, width in inputs.items()]


__all__ = [
    "Layout", "BackwardOverlap", "ProjectionGroup", "StageBoundary", "Gemm", "ResidualWidths", "GROUPS", "READS_NORM",
    "factor_shards_repr", "holds_parameter", "whole_norm_saved_bytes", "split_latents", "apply_latent_functions", "low_rank_a_gemms",
]
