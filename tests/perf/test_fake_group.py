"""The fake process group that runs one rank alone (:mod:`boost_hf.perf.fake_group`) writes every collective's
output. torch 2.11's fake backend leaves a reduce-scatter's output unwritten, and one rank under sequence
parallelism then trained on uninitialised memory: ``gpu_check``'s megatron + SP and btp + SP steps had non-finite
gradients on torch 2.11 (fine on 2.13, whose fake backend writes this rank's block). These tests fail on torch 2.11
without the stand-in that :func:`~boost_hf.perf.fake_group.open_fake_process_group` installs there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from boost_hf.perf.rank_cost import fake_process_group

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_check  # noqa: E402

P = 4


def _blocks() -> torch.Tensor:
    return torch.arange(P * 3 * 2, dtype=torch.float32).view(P * 3, 2)


def test_a_reduce_scatter_writes_this_ranks_block_eager_functional_and_compiled():
    with fake_process_group(P):
        x = _blocks()
        mine = x[: 3]  # rank 0's block of rows
        out = torch.full((3, 2), float("nan"))
        dist.reduce_scatter_tensor(out, x)
        assert torch.equal(out, mine)
        assert torch.equal(funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD).wait(), mine)
        compiled = torch.compile(lambda t: funcol.reduce_scatter_tensor(t * 1, "sum", 0, dist.group.WORLD) + 0, backend="inductor")
        assert torch.equal(compiled(x), mine)
        torch._dynamo.reset()


def test_the_stand_in_is_gone_after_the_group_closes():
    """Nothing of the fake group outlives it: a later group's reduce-scatter runs the backend's own kernel."""
    with fake_process_group(P):
        pass
    from boost_hf.perf import fake_group

    assert not fake_group._stand_ins


@pytest.mark.parametrize("name", ["llama megatron+sp", "cola btp+sp"])
def test_one_sequence_parallel_rank_trains_with_finite_loss_and_gradients(name):
    case = next(c for c in gpu_check.cases() if c.name == name)
    with fake_process_group(gpu_check.FAKE_TP):
        row, problems = gpu_check.check_case(case, "autocast", seq=16, batch=1, device="cpu")
    assert not problems, row


def test_for_timings_the_reduce_scatter_can_run_without_the_stand_in():
    """``write_reduce_scatter=False`` (gpu_check's timings): the backend's own reduce-scatter, whatever it writes: no
    stand-in is installed (on torch 2.11 the output is left unwritten, and costs nothing)."""
    from boost_hf.perf import fake_group

    with fake_process_group(P, write_reduce_scatter=False):
        assert not fake_group._stand_ins
        out = torch.empty(3, 2)
        dist.reduce_scatter_tensor(out, _blocks())  # runs; its values are the backend's business
