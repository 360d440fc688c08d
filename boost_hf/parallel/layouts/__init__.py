"""One :class:`~.base.Layout` per tensor-parallel style; ``LAYOUTS`` is the registry."""

from .base import BackwardOverlap, Gemm, Layout, ProjectionGroup, ResidualWidths, StageBoundary
from .btp import BottleneckAwareLayout
from .megatron import MegatronLayout
from .vanilla import VanillaLayout

LAYOUTS: dict[str, type[Layout]] = {
    MegatronLayout.name: MegatronLayout,
    VanillaLayout.name: VanillaLayout,
    BottleneckAwareLayout.name: BottleneckAwareLayout,
}

__all__ = ["LAYOUTS", "Layout", "BackwardOverlap", "ProjectionGroup", "Gemm", "ResidualWidths", "StageBoundary", "MegatronLayout", "VanillaLayout", "BottleneckAwareLayout"]
