"""A fake process group for running one rank alone: every collective returns at once and writes its output.

torch's fake backend (``torch.testing._internal.distributed.fake_pg``) moves no data: an all-reduce leaves its
input as it is and an all-gather writes its input into every block. Its reduce-scatter, however, writes nothing
into its output on torch 2.11 (the output keeps whatever memory it was given: on the CPU, values such as 1.5e27 or
NaN), and writes this rank's block of its input from torch 2.13 on. One rank under sequence parallelism
reduce-scatters every layer's output, so on torch 2.11 its loss and gradients came out non-finite: the
measurement tool's fault, not the layout's (the same layouts on gloo equal one process on both versions).

:func:`open_fake_process_group` probes the backend once; where a reduce-scatter leaves its output unwritten it
installs, until :func:`close_fake_process_group`, a stand-in for the two reduce-scatter operators the code runs
(``c10d::_reduce_scatter_base_``, eager, and ``_c10d_functional::reduce_scatter_tensor``, under
``torch.compile``) that writes this rank's block of the input, as torch 2.13's fake backend does. No other
process group exists while a fake one is open (:func:`boost_hf.perf.rank_cost.fake_process_group` refuses a real
one), so the stand-in touches nothing else; it costs one copy of the output, as 2.13's fake backend does.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

_stand_ins: list[torch.library.Library] = []


def reduce_scatter_writes_output() -> bool:
    """Whether the open process group's reduce-scatter writes its output (probed on 4 NaN elements per rank)."""
    p = dist.get_world_size()
    output = torch.full((1,), float("nan"))
    dist.reduce_scatter_tensor(output, torch.zeros(p))
    return not bool(output.isnan().item())


def _own_block(group: dist.ProcessGroup, input: torch.Tensor, rows: int) -> torch.Tensor:
    """This rank's block of ``input``'s first dimension, ``rows`` rows of it."""
    return input.reshape(group.size(), rows, *input.shape[1:])[group.rank()]


def _reduce_scatter_base(output, input, process_group, reduce_op, async_op=True, timeout=-1):
    group = dist.ProcessGroup.unbox(process_group)
    output.copy_(_own_block(group, input, output.shape[0]).view_as(output))
    done = torch.futures.Future()
    done.set_result([output])
    return output, torch._C._distributed_c10d._create_work_from_future(done).boxed()


def _reduce_scatter_tensor(input, reduce_op, group_size, group_name):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _own_block(_resolve_process_group(group_name), input, input.shape[0] // group_size).clone()


def open_fake_process_group(world_size: int, *, write_reduce_scatter: bool = True) -> None:
    """Open a fake process group of ``world_size`` ranks, this process rank 0; see the module docstring.
    ``write_reduce_scatter=False`` (for timings, whose values do not matter): no stand-in, the backend's own
    reduce-scatter as it is (torch 2.11: it writes nothing and costs nothing; from 2.13 it copies this rank's block)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    if not write_reduce_scatter or reduce_scatter_writes_output():
        return
    eager, functional = torch.library.Library("c10d", "IMPL"), torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered kernel.*")
        for device in ("CPU", "CUDA"):
            eager.impl("_reduce_scatter_base_", _reduce_scatter_base, device)
            functional.impl("reduce_scatter_tensor", _reduce_scatter_tensor, device)
    _stand_ins.extend((eager, functional))


def close_fake_process_group() -> None:
    """Close the fake process group and remove the reduce-scatter stand-in, if one was installed."""
    dist.destroy_process_group()
    while _stand_ins:
        _stand_ins.pop()._destroy()


__all__ = ["open_fake_process_group", "close_fake_process_group", "reduce_scatter_writes_output"]
