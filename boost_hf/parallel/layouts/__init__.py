"""One :class:`~.base.Layout` per tensor-parallel style; ``LAYOUTS`` is the registry, :func:`layout_for` the lookup."""

from ..config import ParallelConfig
from .base import BackwardOverlap, Gemm, Layout, ProjectionGroup, ResidualWidths, StageBoundary
from .btp import BottleneckAwareLayout
from .megatron import MegatronLayout
from .vanilla import VanillaLayout

LAYOUTS: dict[str, type[Layout]] = {
    MegatronLayout.name: MegatronLayout,
    VanillaLayout.name: VanillaLayout,
    BottleneckAwareLayout.name: BottleneckAwareLayout,
}


def layout_for(config, parallel: ParallelConfig) -> Layout:
    """The :class:`Layout` running ``config`` under ``parallel`` (the full-rank model always runs Megatron's); raises ``ValueError`` naming the field to change when they do not fit."""
    style = parallel.tp_style
    if config.bottleneck is None and parallel.tp_size == 1:
        style = "megatron"
    layout = LAYOUTS[style](parallel)
    layout.check(config)
    return layout


__all__ = ["LAYOUTS", "layout_for", "Layout", "BackwardOverlap", "ProjectionGroup", "Gemm", "ResidualWidths", "StageBoundary", "MegatronLayout", "VanillaLayout", "BottleneckAwareLayout"]
