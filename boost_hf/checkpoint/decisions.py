"""One decision, broadcast: the choices that lead to collectives, made by global rank 0 and sent to every rank.

A rank that decides from its own view of the file system can disagree with the others: a shared file system's
listing is stale on one node, a checkpoint is renamed while the ranks look. Ranks then resume different checkpoints,
or one rank saves (a collective) while the others do not, and the run hangs or mixes states. As Megatron reads its
tracker file on rank 0 and broadcasts it, these are decided once:

* :func:`decided_on_rank_zero`: ``decide()`` on global rank 0, its result (or its error, raised on every rank with
  the same type and message) on every rank: one ``broadcast_object_list`` of a few bytes;
* :func:`on_every_rank`: work every rank does (a phase of a save), then one ``all_gather_object`` of the outcomes:
  an error on one rank (a full disk, a failed rename) is raised on every rank before the next collective, instead
  of leaving the others waiting in it until ``--ddp_timeout``;

the decisions about a run folder's checkpoints are :mod:`boost_hf.checkpoint.resume_point`'s.

Each is collective when ``torch.distributed`` is initialised with more than one rank (every rank calls it at the
same point), and a plain function call in one process.
"""

from __future__ import annotations

import os

import torch.distributed as dist

_RAISED_AS_THEMSELVES = (FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError, ValueError, TypeError,
                         KeyError, RuntimeError, OSError)
"""Errors raised on every rank with their own type (another: ``RuntimeError`` naming it)."""


def _launched(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _outcome(error: Exception) -> tuple[str, int | None, str]:
    """What another rank needs to raise ``error`` again: its type's name, its ``errno`` and its message."""
    return type(error).__name__, getattr(error, "errno", None) if isinstance(error, OSError) else None, str(error)


def _raised(outcome: tuple[str, int | None, str], where: str, kinds: tuple[type, ...]) -> Exception:
    """The error of :func:`_outcome` ``outcome`` on this rank: its type if one of ``kinds`` or
    :data:`_RAISED_AS_THEMSELVES` (else ``RuntimeError`` naming it), its message followed by ``(where)``, its
    ``errno`` kept."""
    name, number, message = outcome
    kind = next((kind for kind in (*kinds, *_RAISED_AS_THEMSELVES) if kind.__name__ == name), None)
    error = kind(f"{message} ({where})") if kind is not None else RuntimeError(f"{name}: {message} ({where})")
    if number is not None and isinstance(error, OSError):
        error.errno = number
    return error


def decided_on_rank_zero(decide, group=None, kinds: tuple[type, ...] = ()):
    """``decide()`` run on rank 0 of ``group`` (default: every rank) only; its result (picklable) returned on every
    rank. An error of ``decide()`` is raised on every rank: its type if one of ``kinds`` or
    :data:`_RAISED_AS_THEMSELVES` (else ``RuntimeError``), its message followed by "(decided on rank 0)". Collective
    when launched."""
    if not _launched(group):
        return decide()
    outcome = [None, None]  # [result, _outcome of its error]
    if dist.get_rank(group) == 0:
        try:
            outcome[0] = decide()
        except Exception as error:  # noqa: BLE001 (raised on every rank below)
            outcome[1] = _outcome(error)
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if outcome[1] is not None:
        raise _raised(outcome[1], "decided on rank 0", kinds)
    return outcome[0]


def on_every_rank(work, group=None, kinds: tuple[type, ...] = ()) -> list:
    """``work()`` on every rank of ``group`` (default: every rank), then one ``all_gather_object`` of what each
    returned (picklable) or raised: the list of the results, in rank order, on every rank; if ``work()`` failed on any
    rank, every rank raises instead, a failed rank its own error, the others the first failed rank's (its type if one
    of ``kinds`` or :data:`_RAISED_AS_THEMSELVES`, its message followed by "(on rank <global rank>)"). A phase of
    work that one rank may fail (a write, a rename) ends so, before the next collective: no rank waits in it for a
    rank that left. Collective when launched."""
    if not _launched(group):
        return [work()]
    result, error = None, None
    try:
        result = work()
    except Exception as raised:  # noqa: BLE001 (raised on every rank below)
        error = raised
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (result, None if error is None else _outcome(error)), group=group)
    if error is not None:
        raise error
    failed = next(((rank, outcome) for rank, (_, outcome) in enumerate(gathered) if outcome is not None), None)
    if failed is not None:
        rank = dist.get_global_rank(group, failed[0]) if group is not None else failed[0]
        raise _raised(failed[1], f"on rank {rank}", kinds)
    return [value for value, _ in gathered]


__all__ = ["decided_on_rank_zero", "on_every_rank"]
