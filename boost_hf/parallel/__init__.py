"""Tensor parallelism applied from outside: :func:`parallelize`, :class:`ParallelConfig` and one
:class:`~boost_hf.parallel.layouts.Layout` per style (megatron, vanilla, btp)."""

from .config import ParallelConfig
from .parallelize import TensorParallelPlan, layout_for, parallelize

__all__ = ["ParallelConfig", "TensorParallelPlan", "layout_for", "parallelize"]
