"""The pipeline-schedule model: layer split, critical path and bubble, micro-batches in flight (against the
op lists of torch's interleaved schedule), and what torch's schedules refuse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from boost_hf.perf.pipeline import (
    check_schedule,
    critical_path_weights,
    engine_refusal,
    ideal_bubble_fraction,
    micro_batches_in_flight,
    stage_layer_counts,
)


def test_layer_split_is_even_with_the_remainder_first():
    assert stage_layer_counts(40, 2) == [20, 20]
    assert stage_layer_counts(10, 4) == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="exceeds num_hidden_layers"):
        stage_layer_counts(3, 4)


@pytest.mark.parametrize("pp, m, v", [(2, 1, 1), (2, 8, 1), (4, 8, 1), (4, 4, 2), (2, 8, 3)])
def test_equal_ranks_give_the_textbook_bubble(pp, m, v):
    rank_time = 1.5
    step = sum(w * rank_time for w in critical_path_weights([rank_time] * pp, m, v))
    assert step == pytest.approx((m + (pp - 1) / v) * rank_time)
    bubble = step - m * rank_time
    assert bubble / step == pytest.approx(ideal_bubble_fraction(pp, m, v))


def test_bubble_fractions_by_hand():
    assert ideal_bubble_fraction(2, 8) == pytest.approx(1 / 9)  # 1F1B and GPipe: (p-1)/(m+p-1)
    assert ideal_bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)  # interleaved: (p-1)/(v m+p-1)


def test_unequal_ranks_wait_on_the_slowest():
    # slowest rank works on every micro-batch; the others fill and drain the pipe once
    weights = critical_path_weights([1.0, 3.0, 2.0], 4, 1)
    assert weights == [1.0, 4.0, 1.0]
    assert sum(w * t for w, t in zip(weights, [1.0, 3.0, 2.0])) == 1 + 2 + 4 * 3


@pytest.mark.parametrize("pp, m", [(2, 1), (2, 8), (4, 8), (4, 2)])
def test_one_f_one_b_and_gpipe_in_flight(pp, m):
    # torch's Schedule1F1B runs min(m, p - i) forwards on stage i before its first backward; GPipe all m
    assert [micro_batches_in_flight("1f1b", pp, m, 1, i) for i in range(pp)] == [min(m, pp - i) for i in range(pp)]
    assert [micro_batches_in_flight("gpipe", pp, m, 1, i) for i in range(pp)] == [m] * pp


def _torch_interleaved_peak(pp: int, m: int, v: int, rank: int) -> int:
    """Stage-forwards alive at once on ``rank`` in torch's own ScheduleInterleaved1F1B op list."""
    rounds = max(1, m // pp)
    schedule = SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=pp, _n_microbatches=m)
    live = peak = 0
    for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(schedule, rank):
        if action is not None:
            live += {_ComputationType.FORWARD: 1, _ComputationType.FULL_BACKWARD: -1}.get(action.computation_type, 0)
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("pp, m, v", [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 4, 3), (2, 1, 2), (4, 10, 2), (4, 3, 2), (2, 2, 4)])
def test_interleaved_in_flight_matches_torchs_schedule(pp, m, v):
    for rank in range(pp):
        assert micro_batches_in_flight("interleaved-1f1b", pp, m, v, rank) * v == _torch_interleaved_peak(pp, m, v, rank)


def test_what_torch_refuses():
    assert "at least as many micro-batches as stages (4)" in engine_refusal("1f1b", 4, 3)
    assert engine_refusal("1f1b", 4, 4) is None and engine_refusal("gpipe", 4, 1) is None
    assert "multiple of its rounds (2)" in engine_refusal("interleaved-1f1b", 4, 9)
    assert engine_refusal("interleaved-1f1b", 4, 10) is None and engine_refusal("interleaved-1f1b", 4, 3) is None


def test_schedule_validation():
    assert check_schedule("interleaved-1f1b", None) == 2 and check_schedule("1f1b", None) == 1
    assert check_schedule("interleaved-1f1b", 3) == 3
    with pytest.raises(ValueError, match="estimator models 1f1b, gpipe, interleaved-1f1b"):
        check_schedule("zbv", None)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        check_schedule("1f1b", 2)
    with pytest.raises(ValueError, match="stages_per_rank"):
        check_schedule("interleaved-1f1b", 0)
