"""Pipeline schedules as the estimator models them: layer split, critical path, bubble and the
micro-batches each rank keeps in flight (torch.distributed.pipelining's schedules).

Notation: ``p`` pipeline ranks, ``m`` micro-batches per step, ``v`` stages (model chunks) per rank
(``interleaved-1f1b``; 1 otherwise). The ``p v`` stages split the decoder layers evenly, earlier stages
taking the remainder; rank ``i`` holds stages ``i, i + p, ..., i + (v - 1) p``.

* **Critical path**: with ``T_i`` rank ``i``'s forward + backward time for one micro-batch (all its
  stages), one step takes ``m max_i T_i + (sum_i T_i - max_i T_i) / v``: the slowest rank works on every
  micro-batch, and the pipeline fills and drains through the other ranks once, one stage (``1/v`` of a
  rank) at a time. For equal ranks the bubble is ``(p - 1) T / v`` out of ``(m + (p - 1)/v) T``, the
  fraction :func:`ideal_bubble_fraction`: ``(p-1)/(m+p-1)`` for 1F1B and GPipe (same bubble; GPipe keeps
  more in flight), ``(p-1)/(v m + p - 1)`` interleaved.
* **In flight** (:func:`micro_batches_in_flight`): micro-batches whose forward activations a rank holds
  at its peak. 1F1B: ``min(m, p - i)`` on rank ``i`` (the first rank holds ``p``); GPipe: all ``m``;
  interleaved 1F1B: torch's warm-up ``min((v - 1) m_r + 2 (p - 1 - i), v m)`` stage-forwards plus the one
  its steady state runs before each backward (``m_r`` micro-batches per round), counted in whole ranks
  (``/ v``).
"""

from __future__ import annotations

PP_SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe", "interleaved-1f1b")
INTERLEAVED = "interleaved-1f1b"


def check_schedule(schedule: str, stages_per_rank: int | None) -> int:
    """Validate ``schedule`` and return its stages per rank (``stages_per_rank``, default 2 interleaved and
    1 otherwise); raise ``ValueError`` naming the fix."""
    if schedule not in PP_SCHEDULES:
        raise ValueError(
            f"Unknown or unmodelled pp_schedule {schedule!r}: the estimator models {', '.join(PP_SCHEDULES)}."
        )
    if stages_per_rank is None:
        return 2 if schedule == INTERLEAVED else 1
    if schedule != INTERLEAVED and stages_per_rank != 1:
        raise ValueError(
            f"pp_schedule={schedule!r} runs one stage per rank, got stages_per_rank={stages_per_rank}: use "
            f"pp_schedule={INTERLEAVED!r} for several stages per rank."
        )
    if stages_per_rank < 1:
        raise ValueError(f"stages_per_rank must be a positive integer, got {stages_per_rank!r}.")
    return stages_per_rank


def stage_layer_counts(num_layers: int, num_stages: int, split: tuple[int, ...] | None = None) -> list[int]:
    """Decoder layers of each of ``num_stages`` stages, first to last: ``split`` (a ``pp_layer_split``, checked
    against the model by ``ParallelConfig.check_model``) or an even split, earlier stages taking the remainder."""
    if num_stages > num_layers:
        raise ValueError(
            f"pp x stages per rank ({num_stages}) exceeds num_hidden_layers ({num_layers}): use at most one "
            "stage per layer."
        )
    if split is not None:
        return list(split)
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


def critical_path_weights(rank_times: list[float], num_micro_batches: int, stages_per_rank: int) -> list[float]:
    """Weights ``w_i`` with ``step = sum_i w_i T_i`` (module docstring): ``m`` on the slowest rank, ``1/v`` on
    the others."""
    slowest = rank_times.index(max(rank_times))
    weights = [1 / stages_per_rank] * len(rank_times)
    weights[slowest] += num_micro_batches - 1 / stages_per_rank
    return weights


def ideal_bubble_fraction(pp: int, num_micro_batches: int, stages_per_rank: int = 1) -> float:
    """Idle share of a step with equal ranks: ``(p - 1) / (v m + p - 1)``."""
    return (pp - 1) / (stages_per_rank * num_micro_batches + pp - 1)


def micro_batches_in_flight(schedule: str, pp: int, num_micro_batches: int, stages_per_rank: int, rank: int) -> float:
    """Micro-batches (in units of all of the rank's layers) whose activations ``rank`` keeps at its peak."""
    m, v = num_micro_batches, stages_per_rank
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(m, pp - rank)
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), v * m)
    return min(warmup + 1, v * m) / v


def engine_refusal(schedule: str, pp: int, num_micro_batches: int) -> str | None:
    """Why torch's schedule refuses ``num_micro_batches`` at ``pp`` ranks (``None``: it runs it)."""
    m = num_micro_batches
    if schedule == "1f1b" and m < pp:
        return f"1F1B needs at least as many micro-batches as stages ({pp}), got {m}"
    rounds = max(1, m // pp)
    if schedule == INTERLEAVED and m % rounds:
        return f"interleaved 1F1B needs the micro-batches ({m}) to be a multiple of its rounds ({rounds})"
    return None


__all__ = [
    "PP_SCHEDULES",
    "check_schedule",
    "critical_path_weights",
    "engine_refusal",
    "ideal_bubble_fraction",
    "micro_batches_in_flight",
    "stage_layer_counts",
]
