"""Process groups: a ("pp", "dp", "tp") device mesh over the launched world, TP ranks adjacent.

World rank ``g`` sits at ``pp_rank = g // (dp_size tp_size)``, ``dp_rank = (g // tp_size) % dp_size``,
``tp_rank = g % tp_size``: the ranks of one tensor-parallel group are consecutive (on one node),
data-parallel peers are ``tp_size`` apart and pipeline stages ``dp_size x tp_size`` apart (across nodes).
At ``pp_size=1`` this is the (dp, tp) layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the (pp, dp, tp) mesh and the groups to communicate in.

    ``tp_group`` / ``dp_group`` / ``pp_group`` are ``None`` when that dimension has size 1 (no communication).
    """

    tp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    mesh: object | None = None
    pp_size: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None

    @property
    def is_distributed(self) -> bool:
        return self.tp_size * self.dp_size * self.pp_size > 1


_STATES: dict[tuple[int, int], ParallelState] = {}


def mesh_device_type() -> str:
    return "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"


def check_world(tp_size: int, pp_size: int = 1) -> None:
    """Raise ``ValueError`` (no collective) unless ``tp_size x pp_size`` fits the launched world."""
    ranks = tp_size * pp_size
    if not dist.is_available() or not dist.is_initialized():
        if ranks != 1:
            raise ValueError(
                f"tp_size={tp_size} x pp_size={pp_size} needs torch.distributed: launch with `torchrun --nproc-per-node "
                f"{ranks} ...` or `accelerate launch`, and call torch.distributed.init_process_group first."
            )
        return
    world = dist.get_world_size()
    if world % tp_size != 0:
        raise ValueError(
            f"tp_size ({tp_size}) does not divide the world size ({world}): launch a multiple of {tp_size} processes "
            "or choose a tp_size that divides the number of processes."
        )
    if world % ranks != 0:
        raise ValueError(
            f"pp_size ({pp_size}) x tp_size ({tp_size}) = {ranks} does not divide the world size ({world}): launch a "
            f"multiple of {ranks} processes or choose a pp_size that divides {world // tp_size}."
        )


def get_parallel_state(tp_size: int = 1, pp_size: int = 1) -> ParallelState:
    """Build (once per ``(tp_size, pp_size)``) and return this rank's :class:`ParallelState`.

    Raises ``ValueError`` before any collective when ``tp_size x pp_size`` does not divide the world size,
    or when it is above 1 and ``torch.distributed`` is not initialised.
    """
    check_world(tp_size, pp_size)
    if not dist.is_available() or not dist.is_initialized():
        return ParallelState()
    world = dist.get_world_size()
    if (tp_size, pp_size) in _STATES:
        return _STATES[tp_size, pp_size]
    from torch.distributed.device_mesh import init_device_mesh

    dp_size = world // (tp_size * pp_size)
    if pp_size == 1:
        mesh = init_device_mesh(mesh_device_type(), (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    else:
        mesh = init_device_mesh(mesh_device_type(), (pp_size, dp_size, tp_size), mesh_dim_names=("pp", "dp", "tp"))
    rank = dist.get_rank()
    state = ParallelState(
        tp_size=tp_size,
        dp_size=dp_size,
        tp_rank=rank % tp_size,
        dp_rank=(rank // tp_size) % dp_size,
        tp_group=mesh.get_group("tp") if tp_size > 1 else None,
        dp_group=mesh.get_group("dp") if dp_size > 1 else None,
        mesh=mesh,
        pp_size=pp_size,
        pp_rank=rank // (tp_size * dp_size),
        pp_group=mesh.get_group("pp") if pp_size > 1 else None,
    )
    _STATES[tp_size, pp_size] = state
    return state


def reset_parallel_states() -> None:
    """Forget cached groups (after ``destroy_process_group``)."""
    _STATES.clear()


__all__ = ["ParallelState", "check_world", "get_parallel_state", "reset_parallel_states"]
