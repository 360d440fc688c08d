"""Counted communication as data: :class:`Collective` (calls and elements of one kind),
:class:`Communication` (one direction) and :class:`PassCommunication` (forward and backward).

Three collective kinds are counted, per tensor-parallel rank and per micro-batch:

* ``"all_reduce"``: elements = size of the reduced tensor (input and output have the same size);
* ``"all_gather"``: elements = size of the *full gathered output*;
* ``"reduce_scatter"``: elements = size of the *full input* (the tensor an all-reduce would have reduced;
  each rank keeps ``1/p`` of the sum). Sequence parallelism replaces an all-reduce of ``n`` elements by a
  reduce-scatter and an all-gather of ``n`` elements each: the same ring traffic.

Each :class:`~boost_hf.parallel.layouts.Layout` states its pattern with these types; the analysis in
:mod:`boost_hf.perf` adds them up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter"]
COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Collective:
    """A number of collective calls of one kind and the elements they move in total.

    ``elements`` is the size of the reduced tensor (all-reduce), of the full gathered output
    (all-gather) or of the full input (reduce-scatter), summed over the calls.
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
        by_kind: ``"all_reduce"`` / ``"all_gather"`` / ``"reduce_scatter"`` -> :class:`Collective`. A missing kind is zero;
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
        """Elements of all kinds (reduced tensor sizes, gathered output sizes, reduce-scattered input sizes)."""
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
    """Bytes one rank sends for a collective of ``nbytes`` (reduced tensor / gathered output / reduce-scattered
    input) over ``tp_size`` ranks with the bandwidth-optimal ring algorithm: ``2 (p-1)/p * nbytes`` for an
    all-reduce (reduce-scatter then all-gather), ``(p-1)/p * nbytes`` for an all-gather or a reduce-scatter.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"Unknown collective kind {kind!r}: use one of {COLLECTIVE_KINDS}.")
    p = tp_size
    factor = 2 * (p - 1) / p if kind == "all_reduce" else (p - 1) / p
    return factor * nbytes


def all_reduce(calls: int, elements: int) -> Communication:
    """``calls`` all-reduces moving ``elements`` in total."""
    return Communication({"all_reduce": Collective(calls, elements)})


def all_gather(calls: int, elements: int) -> Communication:
    """``calls`` all-gathers whose full outputs hold ``elements`` in total."""
    return Communication({"all_gather": Collective(calls, elements)})


def reduce_scatter(calls: int, elements: int) -> Communication:
    """``calls`` reduce-scatters whose full inputs hold ``elements`` in total."""
    return Communication({"reduce_scatter": Collective(calls, elements)})


__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveKind",
    "Collective",
    "Communication",
    "NO_COMMUNICATION",
    "PassCommunication",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "ring_traffic_bytes",
]
