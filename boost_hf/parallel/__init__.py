"""Tensor parallelism applied from outside: :func:`parallelize`, :class:`ParallelConfig` and one
:class:`~boost_hf.parallel.layouts.Layout` per style (megatron, vanilla, btp). A model given a ``ParallelConfig``
builds, loads and saves its shard through :mod:`~boost_hf.checkpoint.model_hooks` (loaded with ``boost_hf``)."""

from .config import ParallelConfig
from .layouts import layout_for
from .parallelize import TensorParallelPlan, parallelize

__all__ = ["ParallelConfig", "TensorParallelPlan", "layout_for", "parallelize"]
