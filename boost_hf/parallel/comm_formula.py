"""How much each tensor-parallel layout communicates: the single source of truth.

The runtime communication counters, the benchmarks, the performance estimator
(:mod:`boost_hf.perf.estimator`) and the tests all call these functions; nothing else in boost-hf
re-derives a communication volume.

Notation: ``d`` hidden size, ``dq`` query width (heads x head_dim), ``dkv`` key/value width, ``f``
intermediate size, ``r`` bottleneck rank, ``N`` tokens in the micro-batch (batch x sequence), ``p``
tensor-parallel size, ``V`` vocabulary size, ``L`` decoder layers.

Two collective kinds are counted, per tensor-parallel rank and per micro-batch:

* ``"all_reduce"``: elements = size of the reduced tensor (input and output have the same size);
* ``"all_gather"``: elements = size of the *full gathered output*.

Per decoder layer (calls, elements):

* megatron (full rank): forward all-reduce after o_proj and down_proj, 2 calls, ``N (d + d)``;
  backward all-reduce of the input gradient shared by q/k/v and by gate/up, 2 calls, ``2 N d``.
* vanilla (low rank): forward all-reduce of each B's full-width output, 7 calls,
  ``N (dq + 2 dkv + d + 2f + d)`` (``N (5d + 2f)`` without GQA); backward all-reduce at the inputs of
  the A's: grouped 4 calls ``N (d + dq + d + f)``, ungrouped 7 calls ``N (3d + dq + 2d + f)``. LaX adds
  an all-gather of the latents to full ``r``, ``7 N r`` in 4 calls (grouped) or 7, forward and backward.
* btp (low rank): all-reduce of each row-split A's partial ``N x r`` output, ``7 N r`` in 4 calls
  (grouped) or 7 (ungrouped), mirrored in backward. RMSNorm statistics: ``online`` adds ``2N`` elements
  to the forward calls; ``sync`` adds 2 calls and ``2N`` elements forward and backward; ``local`` nothing.
* activation checkpointing: ``full`` repeats the forward's collectives in backward; ``lowrank`` repeats
  nothing under btp with the online norm (the sync norm's 2 statistics all-reduces are recomputed),
  and the forward all-reduces (not the LaX all-gathers) under vanilla.

Outside the layers (embedding, final gather, LM head, loss, logits): :func:`outside_layers_communication`.
With ``p == 1`` nothing is communicated at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from .config import ParallelConfig

CollectiveKind = Literal["all_reduce", "all_gather"]
COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "all_gather")


@dataclass(frozen=True)
class Collective:
    """A number of collective calls of one kind and the elements they move in total.

    ``elements`` is the size of the reduced tensor (all-reduce) or of the full gathered output
    (all-gather), summed over the calls.
    """

    calls: int = 0
    elements: int = 0

    def __add__(self, other: "Collective") -> "Collective":
        return Collective(self.calls + other.calls, self.elements + other.elements)

    def scaled(self, k: int) -> "Collective":
        """``k`` repetitions of these calls (e.g. ``k`` layers)."""
        return Collective(self.calls * k, self.elements * k)


def _clean(by_kind: Mapping[str, Collective]) -> dict[str, Collective]:
    unknown = set(by_kind) - set(COLLECTIVE_KINDS)
    if unknown:
        raise ValueError(f"Unknown collective kind(s) {sorted(unknown)}: use {COLLECTIVE_KINDS}.")
    return {kind: by_kind[kind] for kind in COLLECTIVE_KINDS if kind in by_kind and by_kind[kind] != Collective()}


@dataclass(frozen=True)
class Communication:
    """The collectives of one direction (forward or backward) on one tensor-parallel rank.

    Args:
        by_kind: ``"all_reduce"`` / ``"all_gather"`` -> :class:`Collective`. A missing kind is zero;
            zero entries are dropped and kinds are ordered, so equal communications compare equal.
            The dict is a private copy; treat it as read-only.
    """

    by_kind: dict[str, Collective] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_kind", _clean(self.by_kind))

    def __getitem__(self, kind: str) -> Collective:
        if kind not in COLLECTIVE_KINDS:
            raise KeyError(f"Unknown collective kind {kind!r}: use one of {COLLECTIVE_KINDS}.")
        return self.by_kind.get(kind, Collective())

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.by_kind.items())))

    @property
    def calls(self) -> int:
        """Collective calls of all kinds."""
        return sum(c.calls for c in self.by_kind.values())

    @property
    def elements(self) -> int:
        """Elements of all kinds (reduced tensor sizes plus gathered output sizes)."""
        return sum(c.elements for c in self.by_kind.values())

    def bytes(self, dtype_bytes: int = 2) -> int:
        """Communication volume in bytes: ``elements * dtype_bytes`` (2 for bf16)."""
        return self.elements * dtype_bytes

    def ring_traffic_bytes(self, tp_size: int, dtype_bytes: int = 2) -> float:
        """Bytes each rank sends with ring algorithms; see :func:`ring_traffic_bytes`."""
        return sum(ring_traffic_bytes(kind, c.elements * dtype_bytes, tp_size) for kind, c in self.by_kind.items())

    def __add__(self, other: "Communication") -> "Communication":
        kinds = set(self.by_kind) | set(other.by_kind)
        return Communication({kind: self[kind] + other[kind] for kind in kinds})

    def scaled(self, k: int) -> "Communication":
        """``k`` repetitions (e.g. the ``L`` decoder layers of a model)."""
        return Communication({kind: c.scaled(k) for kind, c in self.by_kind.items()})

    def only(self, kind: str) -> "Communication":
        """The part of this communication of one kind."""
        return Communication({kind: self[kind]})

    def to_dict(self) -> dict[str, dict[str, int]]:
        """JSON-ready ``{kind: {"calls": ..., "elements": ...}}``."""
        return {kind: {"calls": c.calls, "elements": c.elements} for kind, c in self.by_kind.items()}


NO_COMMUNICATION = Communication()


@dataclass(frozen=True)
class PassCommunication:
    """The collectives of one training step of one micro-batch: ``forward`` and ``backward``."""

    forward: Communication = NO_COMMUNICATION
    backward: Communication = NO_COMMUNICATION

    def __add__(self, other: "PassCommunication") -> "PassCommunication":
        return PassCommunication(self.forward + other.forward, self.backward + other.backward)

    def scaled(self, k: int) -> "PassCommunication":
        return PassCommunication(self.forward.scaled(k), self.backward.scaled(k))


def ring_traffic_bytes(kind: CollectiveKind, nbytes: float, tp_size: int) -> float:
    """Bytes one rank sends for a collective of ``nbytes`` (reduced tensor / gathered output) over ``tp_size``
    ranks with the bandwidth-optimal ring algorithm: ``2 (p-1)/p * nbytes`` for an all-reduce
    (reduce-scatter then all-gather), ``(p-1)/p * nbytes`` for an all-gather.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"Unknown collective kind {kind!r}: use one of {COLLECTIVE_KINDS}.")
    p = tp_size
    factor = 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p
    return factor * nbytes


def _all_reduce(calls: int, elements: int) -> Communication:
    return Communication({"all_reduce": Collective(calls, elements)})


def _all_gather(calls: int, elements: int) -> Communication:
    return Communication({"all_gather": Collective(calls, elements)})


def _layer_without_recompute(config, parallel: ParallelConfig, n: int) -> PassCommunication:
    """One decoder layer's collectives, ignoring activation checkpointing."""
    d, dq, dkv, f, r = config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size, config.rank
    grouped = parallel.group_linears
    if parallel.tp_style == "megatron":
        # Row-parallel o_proj and down_proj reduce their outputs; the column-parallel inputs of
        # q/k/v and gate/up reduce their input gradients.
        return PassCommunication(_all_reduce(2, n * (d + d)), _all_reduce(2, 2 * n * d))
    if parallel.tp_style == "vanilla":
        # Each B is row-parallel and all-reduces its full-width output.
        forward = _all_reduce(7, n * (dq + 2 * dkv + d + 2 * f + d))
        # Each A is column-parallel (split along r): its input gradient is all-reduced; A's sharing an
        # input (q/k/v, gate/up) share one all-reduce when grouped.
        if grouped:
            backward = _all_reduce(4, n * (d + dq + d + f))
        else:
            backward = _all_reduce(7, n * (3 * d + dq + 2 * d + f))
        if config.bottleneck == "lax":
            # The r/p latent shards are gathered to full r for the crossing and the latent LayerNorm.
            gathers = 4 if parallel.group_linears else 7  # one per group of A's sharing an input when grouped
            forward = forward + _all_gather(gathers, 7 * n * r)
            backward = backward + _all_gather(gathers, 7 * n * r)
        return PassCommunication(forward, backward)
    # btp: each A is row-parallel and all-reduces its partial N x r output (A_qkv: 3r, A_o: r,
    # A_gate_up: 2r, A_down: r); backward mirrors it at the input gradient of each column-parallel B.
    calls = 4 if grouped else 7
    forward = _all_reduce(calls, 7 * n * r)
    backward = _all_reduce(calls, 7 * n * r)
    if parallel.rmsnorm == "online":
        # The N partial sums of squares of each of the 2 norms ride in the next A's all-reduce.
        forward = forward + _all_reduce(0, 2 * n)
    elif parallel.rmsnorm == "sync":
        # One separate all-reduce of N statistics per norm, whose backward is an all-reduce too.
        forward = forward + _all_reduce(2, 2 * n)
        backward = backward + _all_reduce(2, 2 * n)
    return PassCommunication(forward, backward)


def layer_communication(config, parallel: ParallelConfig, tokens: int) -> PassCommunication:
    """Collectives of one decoder layer for a micro-batch of ``tokens`` tokens on one TP rank.

    Args:
        config: a :class:`~boost_hf.configuration_boost_llama.BoostLlamaConfig`.
        parallel: the layout; ``parallel.check_model(config)`` must pass.
        tokens: ``N = batch * seq_len``.

    Activation checkpointing adds recomputation collectives to the backward: ``"full"`` re-runs all of
    the forward's collectives; ``"lowrank"`` re-runs none under btp with the online (or local) norm
    (segments end at already-reduced latents), the 2 norm-statistics all-reduces under btp with the
    sync norm (they sit inside the norm's segment), and the 7 B-output all-reduces (not the LaX
    all-gathers) under vanilla.
    """
    parallel.check_model(config)
    if parallel.tp_size == 1:
        return PassCommunication()
    layer = _layer_without_recompute(config, parallel, tokens)
    if parallel.activation_checkpointing == "full":
        recompute = layer.forward
    elif parallel.activation_checkpointing == "lowrank" and parallel.tp_style == "vanilla":
        recompute = layer.forward.only("all_reduce")
    elif parallel.activation_checkpointing == "lowrank" and parallel.rmsnorm == "sync":
        recompute = _all_reduce(2, 2 * tokens)
    else:
        recompute = NO_COMMUNICATION
    return PassCommunication(layer.forward, layer.backward + recompute)


def outside_layers_communication(
    config, parallel: ParallelConfig, tokens: int, *, with_loss: bool = True, with_logits: bool = False
) -> PassCommunication:
    """Collectives outside the decoder layers, once per micro-batch of ``tokens`` tokens.

    * embedding: btp shards the table along d (no collective); megatron/vanilla use a vocab-parallel
      lookup: forward all-reduce ``N d``;
    * btp only: all-gather of the sharded residual to full ``d`` before the final norm, ``N d``;
    * vocab-parallel (column) LM head: backward all-reduce of its input gradient, ``N d``;
    * vocab-parallel cross-entropy (``with_loss``): forward all-reduces of the max (``N``) and of
      [sum-exp, target logit] fused (``2N``): 2 calls, ``3N``;
    * full logits (``with_logits``): forward all-gather of ``N V``.
    """
    parallel.check_model(config)
    if parallel.tp_size == 1:
        return PassCommunication()
    n, d = tokens, config.hidden_size
    if parallel.tp_style == "btp":
        # The embedding table is sharded along d (no collective); the d-sharded residual is
        # all-gathered to full d before the final norm.
        forward = _all_gather(1, n * d)
    else:
        # Vocab-parallel embedding lookup: the partial embeddings are all-reduced.
        forward = _all_reduce(1, n * d)
    # Column (vocab) parallel LM head: the gradient of its replicated input is all-reduced.
    backward = _all_reduce(1, n * d)
    if with_loss:
        forward = forward + _all_reduce(2, 3 * n)
    if with_logits:
        forward = forward + _all_gather(1, n * config.vocab_size)
    return PassCommunication(forward, backward)


def model_communication(
    config, parallel: ParallelConfig, tokens: int, *, with_loss: bool = True, with_logits: bool = False
) -> PassCommunication:
    """Collectives of a whole model (``L`` decoder layers plus embedding, final norm, LM head and loss)
    for one micro-batch of ``tokens`` tokens on one TP rank. See :func:`layer_communication` and
    :func:`outside_layers_communication`.
    """
    layers = layer_communication(config, parallel, tokens).scaled(config.num_hidden_layers)
    return layers + outside_layers_communication(
        config, parallel, tokens, with_loss=with_loss, with_logits=with_logits
    )


__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveKind",
    "Collective",
    "Communication",
    "PassCommunication",
    "layer_communication",
    "model_communication",
    "outside_layers_communication",
    "ring_traffic_bytes",
]
