"""Process groups: a ("pp", "dp", "tp") device mesh over the launched world, TP ranks adjacent.

World rank ``g`` sits at ``pp_rank = g // (dp_size tp_size)``, ``dp_rank = (g // tp_size) % dp_size``,
``tp_rank = g % tp_size``: the ranks of one tensor-parallel group are consecutive (on one node),
data-parallel peers are ``tp_size`` apart and pipeline stages ``dp_size x tp_size`` apart (across nodes).
At ``pp_size=1`` this is the (dp, tp) layout.

Every group is created by :func:`new_group_with_timeout`, which gives it the run's collective timeout
(:func:`collective_timeout`, the default group's: ``init_process_group(timeout=...)``, under the trainer
``--ddp_timeout``). ``dist.new_group()`` without ``timeout`` does not inherit it (torch 2.13: gloo's 30-minute
default), so a collective in a group made otherwise could wait half an hour for a peer that never comes.
:func:`describe_group` names a group ("the TP group (ranks [0, 1])") in error messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

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
_GROUP_DESCRIPTIONS: dict[str, str] = {}
"""``group_name`` -> what the group is, for :func:`describe_group`."""


def collective_timeout() -> timedelta:
    """The run's bound on one collective: the default process group's timeout (``init_process_group(timeout=...)``;
    ``--ddp_timeout`` under :class:`~boost_hf.training.BoostTrainer`)."""
    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):  # a backend without readable options
        return dist.default_pg_timeout


def new_group_with_timeout(ranks: list[int], description: str, **kwargs) -> dist.ProcessGroup | None:
    """``dist.new_group(ranks, timeout=collective_timeout(), **kwargs)``, remembered as ``description`` (e.g. "the
    TP group") for :func:`describe_group`. Collective like ``new_group``: every rank calls it for every group, in
    the same order. Use it for every process group boost-hf creates (TP, DP, PP)."""
    group = dist.new_group(ranks, timeout=collective_timeout(), **kwargs)
    if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
        _GROUP_DESCRIPTIONS[group.group_name] = f"{description} (ranks {sorted(ranks)})"
    return group


def describe_group(group: dist.ProcessGroup | None) -> str:
    """What ``group`` is, for messages: "the TP group (ranks [0, 1])", "the default group (all 4 ranks)", ..."""
    if group is None or group is dist.GroupMember.WORLD or group is dist.distributed_c10d._get_default_group():
        return f"the default group (all {dist.get_world_size()} ranks)"
    name = getattr(group, "group_name", None)
    if name in _GROUP_DESCRIPTIONS:
        return _GROUP_DESCRIPTIONS[name]
    return f"a process group not made by boost-hf (ranks {dist.get_process_group_ranks(group)})"


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
    or when it is above 1 and ``torch.distributed`` is not initialised. Every group is made by
    :func:`new_group_with_timeout` (the run's collective timeout), in the same order on every rank.
    """
    check_world(tp_size, pp_size)
    if not dist.is_available() or not dist.is_initialized():
        return ParallelState()
    world = dist.get_world_size()
    if (tp_size, pp_size) in _STATES:
        return _STATES[tp_size, pp_size]
    from torch.distributed.device_mesh import DeviceMesh

    dp_size = world // (tp_size * pp_size)
    rank = dist.get_rank()
    pp_rank, dp_rank, tp_rank = rank // (dp_size * tp_size), (rank // tp_size) % dp_size, rank % tp_size
    layout = torch.arange(world, device="cpu").view(pp_size, dp_size, tp_size)  # also inside a meta-device context
    tp_groups = {(p, d): new_group_with_timeout(layout[p, d, :].tolist(), "the TP group")
                 for p in range(pp_size) for d in range(dp_size)}
    dp_groups = {(p, t): new_group_with_timeout(layout[p, :, t].tolist(), "the DP group")
                 for p in range(pp_size) for t in range(tp_size)}
    tp_group, dp_group = tp_groups[pp_rank, dp_rank], dp_groups[pp_rank, tp_rank]
    if pp_size == 1:
        mesh = DeviceMesh.from_group([dp_group, tp_group], mesh_device_type(), layout[0], mesh_dim_names=("dp", "tp"))
        pp_group = None
    else:
        pp_groups = {(d, t): new_group_with_timeout(layout[:, d, t].tolist(), "the PP group")
                     for d in range(dp_size) for t in range(tp_size)}
        pp_group = pp_groups[dp_rank, tp_rank]
        mesh = DeviceMesh.from_group(
            [pp_group, dp_group, tp_group], mesh_device_type(), layout, mesh_dim_names=("pp", "dp", "tp")
        )
    state = ParallelState(
        tp_size=tp_size,
        dp_size=dp_size,
        tp_rank=tp_rank,
        dp_rank=dp_rank,
        tp_group=tp_group if tp_size > 1 else None,
        dp_group=dp_group if dp_size > 1 else None,
        mesh=mesh,
        pp_size=pp_size,
        pp_rank=pp_rank,
        pp_group=pp_group,
    )
    _STATES[tp_size, pp_size] = state
    return state


_DATA_PARALLEL_MESHES: dict[tuple[int, int, int], object] = {}


def data_parallel_mesh(state: ParallelState, replicate_size: int = 1):
    """The ``DeviceMesh`` over this rank's data-parallel group (the ranks of its pipeline and TP coordinates), what
    FSDP2 shards over: 1-D (``("dp_shard",)``, the DP group itself) or, with ``replicate_size`` R > 1, 2-D HSDP
    ``("dp_replicate", "dp_shard")``: DP rank ``d`` in replica ``d // S`` at shard index ``d % S``, ``S = dp / R`` (the
    ranks sharing a shard group are adjacent DP ranks). Collective the first time (the replica and shard groups are
    made by :func:`new_group_with_timeout` on every rank, in the same order); cached."""
    from torch.distributed.device_mesh import DeviceMesh

    key = (state.tp_size, state.pp_size, replicate_size)
    if key in _DATA_PARALLEL_MESHES:
        return _DATA_PARALLEL_MESHES[key]
    dp, tp, pp = state.dp_size, state.tp_size, state.pp_size
    if dp % replicate_size:
        raise ValueError(f"dp_replicate_size={replicate_size} does not divide the data-parallel size {dp}.")
    world = pp * dp * tp
    layout = torch.arange(world, device="cpu").view(pp, dp, tp)
    ours = layout[state.pp_rank, :, state.tp_rank]
    if state.dp_group is None:
        raise ValueError("there is no data-parallel group to shard over (dp_size 1).")
    if replicate_size == 1:
        mesh = DeviceMesh.from_group(state.dp_group, mesh_device_type(), ours, mesh_dim_names=("dp_shard",))
    else:
        shard = dp // replicate_size
        shard_groups = {(p, t, r): new_group_with_timeout(layout[p, r * shard:(r + 1) * shard, t].tolist(), "the DP shard group")
                        for p in range(pp) for t in range(tp) for r in range(replicate_size)}
        replicate_groups = {(p, t, s): new_group_with_timeout(layout[p, s::shard, t].tolist(), "the DP replicate group")
                            for p in range(pp) for t in range(tp) for s in range(shard)}
        replica, index = state.dp_rank // shard, state.dp_rank % shard
        groups = [replicate_groups[state.pp_rank, state.tp_rank, index], shard_groups[state.pp_rank, state.tp_rank, replica]]
        mesh = DeviceMesh.from_group(groups, mesh_device_type(), ours.view(replicate_size, shard),
                                     mesh_dim_names=("dp_replicate", "dp_shard"))
    _DATA_PARALLEL_MESHES[key] = mesh
    return mesh


def tp_and_data_parallel_mesh(state: ParallelState, dp_mesh):
    """``("tp", *dp_mesh's dims)`` over this pipeline rank's TP x DP ranks (no new group: the TP group and ``dp_mesh``'s,
    :func:`data_parallel_mesh`): the mesh on which an FSDP2-sharded parameter is the canonical tensor, split along its
    TP dimension over ``"tp"`` (outermost) and each TP shard's dim 0 over ``"dp_shard"`` (what a checkpoint saves);
    cached."""
    from torch.distributed.device_mesh import DeviceMesh

    key = ("tp x dp", state.tp_size, state.pp_size, tuple(dp_mesh.mesh.shape))
    if key not in _DATA_PARALLEL_MESHES:
        layout = torch.arange(state.pp_size * state.dp_size * state.tp_size, device="cpu").view(state.pp_size, state.dp_size, state.tp_size)
        ranks = layout[state.pp_rank].t().reshape(state.tp_size, *dp_mesh.mesh.shape)
        groups = [state.tp_group, *(dp_mesh.get_group(dim) for dim in range(dp_mesh.ndim))]
        _DATA_PARALLEL_MESHES[key] = DeviceMesh.from_group(groups, mesh_device_type(), ranks,
                                                           mesh_dim_names=("tp", *dp_mesh.mesh_dim_names))
    return _DATA_PARALLEL_MESHES[key]


def reset_parallel_states() -> None:
    """Forget cached groups (after ``destroy_process_group``)."""
    _STATES.clear()
    _DATA_PARALLEL_MESHES.clear()
    _GROUP_DESCRIPTIONS.clear()


__all__ = [
    "ParallelState",
    "check_world",
    "collective_timeout",
    "data_parallel_mesh",
    "new_group_with_timeout",
    "describe_group",
    "get_parallel_state",
    "reset_parallel_states",
    "tp_and_data_parallel_mesh",
]
