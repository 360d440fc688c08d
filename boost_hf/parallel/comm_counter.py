"""Counting collectives: how many calls and how many elements each kind moves, per region.

Every primitive in :mod:`boost_hf.parallel.primitives` reports here before it communicates, and so does FSDP2 over
the data-parallel group (its all-gathers, reduce-scatters and HSDP's all-reduces, through the communication hooks
:mod:`boost_hf.parallel.fully_shard` installs), so a ``CommCounter`` around one forward (or one backward, or one
training step) gives the measured volume that the tests, benchmarks and metrics compare with
:mod:`boost_hf.perf.comm_formula`. ``CommCounter(groups=...)`` counts only the collectives over those process groups
(e.g. FSDP2's over the DP group apart from TP's).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_ACTIVE: list["CommCounter"] = []


@dataclass(eq=False)
class _Source:
    """Collectives of ``owner`` (held weakly) over ``groups`` that report only while ``install(owner)`` is in effect;
    it returns what undoes it (``uninstall``, set while installed)."""

    owner: weakref.ref
    groups: tuple
    install: Callable[[object], Callable[[], None]]
    uninstall: Callable[[], None] | None = None


_SOURCES: list[_Source] = []


def report_while_counted(owner, groups, install: Callable[[object], Callable[[], None]]) -> None:
    """Register collectives of ``owner`` over ``groups`` that need ``install(owner)`` to report to the counters
    (:func:`record_collective`): installed when a counter of any of ``groups`` (or of every group) becomes active,
    undone (by what ``install`` returned) when the last one exits; forgotten with ``owner``."""
    _SOURCES.append(_Source(weakref.ref(owner), tuple(groups), install))


def _counts(counter: "CommCounter", source: _Source) -> bool:
    return not counter.groups or any(g is h for g in counter.groups for h in source.groups)


def _update_sources() -> None:
    """Install the sources some active counter counts, undo the others'; forget those whose owner is gone."""
    for source in list(_SOURCES):
        owner = source.owner()
        if owner is None:
            _SOURCES.remove(source)
            continue
        wanted = any(_counts(counter, source) for counter in _ACTIVE)
        if wanted and source.uninstall is None:
            source.uninstall = source.install(owner)
        elif not wanted and source.uninstall is not None:
            source.uninstall()
            source.uninstall = None


@dataclass
class CollectiveRecord:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


@dataclass
class CommCounter:
    """Context manager recording collectives issued inside it (on this rank).

    ``counter.by_kind["all_reduce"].elements`` is the number of elements of the tensors all-reduced;
    for an all-gather it is the size of the gathered (full) output.

    Example::

        with CommCounter() as fwd:
            loss = model(input_ids, labels=labels).loss
        with CommCounter() as bwd:
            loss.backward()
    """

    by_kind: dict[str, CollectiveRecord] = field(default_factory=lambda: defaultdict(CollectiveRecord))
    groups: tuple = ()  # count only the collectives over these process groups (empty: every collective)

    def __enter__(self) -> "CommCounter":
        _ACTIVE.append(self)
        _update_sources()
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        _update_sources()

    @property
    def calls(self) -> int:
        return sum(r.calls for r in self.by_kind.values())

    @property
    def elements(self) -> int:
        return sum(r.elements for r in self.by_kind.values())

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.by_kind.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: {"calls": r.calls, "elements": r.elements, "bytes": r.bytes} for k, r in sorted(self.by_kind.items())}

    def counts(self) -> dict[str, dict[str, int]]:
        """``{kind: {"calls", "elements"}}``: comparable with ``comm_formula``'s ``Communication.to_dict()``."""
        return {k: {"calls": r.calls, "elements": r.elements} for k, r in sorted(self.by_kind.items())}

    def reset(self) -> None:
        self.by_kind.clear()


def counts_difference(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``a - b`` of two :meth:`CommCounter.counts` (kinds that cancel are dropped), e.g. one layer's
    collectives as a 2-layer model's minus a 1-layer model's."""
    out = {}
    for kind in sorted(set(a) | set(b)):
        calls = a.get(kind, {}).get("calls", 0) - b.get(kind, {}).get("calls", 0)
        elements = a.get(kind, {}).get("elements", 0) - b.get(kind, {}).get("elements", 0)
        if calls or elements:
            out[kind] = {"calls": calls, "elements": elements}
    return out


def count_training_step(model, input_ids) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Collectives (:meth:`CommCounter.counts`) of one forward with labels and of its backward."""
    with CommCounter() as forward:
        loss = model(input_ids, labels=input_ids).loss
    with CommCounter() as backward:
        loss.backward()
    return forward.counts(), backward.counts()


def record_collective(kind: str, tensor: torch.Tensor, group=None) -> None:
    """Report one collective of ``kind`` over ``tensor`` (the full output for all-gathers, the full input for
    reduce-scatters) in process group ``group`` to active counters."""
    if not _ACTIVE:
        return
    numel = tensor.numel()
    nbytes = numel * tensor.element_size()
    for counter in _ACTIVE:
        if counter.groups and not any(group is g for g in counter.groups):
            continue
        record = counter.by_kind[kind]
        record.calls += 1
        record.elements += numel
        record.bytes += nbytes


__all__ = ["CommCounter", "CollectiveRecord", "counts_difference", "count_training_step", "record_collective", "report_while_counted"]
