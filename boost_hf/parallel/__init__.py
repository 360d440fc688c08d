"""Tensor parallelism applied from outside: :func:`parallelize`, :class:`ParallelConfig` and one
:class:`~boost_hf.parallel.layouts.Layout` per style (megatron, vanilla, btp). Importing this package loads
:mod:`~boost_hf.parallel.model_hooks`, through which a model given a ``ParallelConfig`` builds and loads its shard."""

from . import model_hooks
from .config import ParallelConfig
from .layouts import layout_for
from .parallelize import TensorParallelPlan, parallelize

__all__ = ["ParallelConfig", "TensorParallelPlan", "layout_for", "model_hooks", "parallelize"]
