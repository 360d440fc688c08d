"""Process groups: a ("dp", "tp") device mesh over the launched world, TP ranks adjacent.

World rank ``g`` sits at ``dp_rank = g // tp_size``, ``tp_rank = g % tp_size``: the ranks of one
tensor-parallel group are consecutive (on one node), data-parallel peers are ``tp_size`` apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the (dp, tp) mesh and the groups to communicate in.

    ``tp_group`` / ``dp_group`` are ``None`` when that dimension has size 1 (no communication).
    """

    tp_size: int = 1
    dp_size: int = 1
    tp_rank: int = 0
    dp_rank: int = 0
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    mesh: object | None = None

    @property
    def is_distributed(self) -> bool:
        return self.tp_size * self.dp_size > 1


_STATES: dict[int, ParallelState] = {}


def mesh_device_type() -> str:
    return "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"


def check_world(tp_size: int) -> None:
    """Raise ``ValueError`` (no collective) unless ``tp_size`` fits the launched world."""
    if not dist.is_available() or not dist.is_initialized():
        if tp_size != 1:
            raise ValueError(
                f"tp_size={tp_size} needs torch.distributed: launch with `torchrun --nproc-per-node {tp_size} ...` "
                "or `accelerate launch`, and call torch.distributed.init_process_group first."
            )
        return
    world = dist.get_world_size()
    if world % tp_size != 0:
        raise ValueError(
            f"tp_size ({tp_size}) does not divide the world size ({world}): launch a multiple of {tp_size} processes "
            "or choose a tp_size that divides the number of processes."
        )


def get_parallel_state(tp_size: int = 1) -> ParallelState:
    """Build (once per ``tp_size``) and return this rank's :class:`ParallelState`.

    Raises ``ValueError`` before any collective when ``tp_size`` does not divide the world size, or when
    ``tp_size > 1`` and ``torch.distributed`` is not initialised.
    """
    check_world(tp_size)
    if not dist.is_available() or not dist.is_initialized():
        return ParallelState()
    world = dist.get_world_size()
    if tp_size in _STATES:
        return _STATES[tp_size]
    from torch.distributed.device_mesh import init_device_mesh

    dp_size = world // tp_size
    mesh = init_device_mesh(mesh_device_type(), (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    state = ParallelState(
        tp_size=tp_size,
        dp_size=dp_size,
        tp_rank=rank % tp_size,
        dp_rank=rank // tp_size,
        tp_group=mesh.get_group("tp") if tp_size > 1 else None,
        dp_group=mesh.get_group("dp") if dp_size > 1 else None,
        mesh=mesh,
    )
    _STATES[tp_size] = state
    return state


def reset_parallel_states() -> None:
    """Forget cached groups (after ``destroy_process_group``)."""
    _STATES.clear()


__all__ = ["ParallelState", "check_world", "get_parallel_state", "reset_parallel_states"]
