"""A function of plain PyTorch ops as one generated CUDA kernel: the implementation of boost-hf's fused custom ops.

The fused ops (:mod:`boost_hf.parallel.latent_op`, :mod:`boost_hf.parallel.statistics_op`) are ``torch.library``
custom ops: they reach the dispatcher (and :class:`~boost_hf.perf.op_counter.OpCounter`) as one op each. Their CUDA
kernel is their arithmetic, a function of plain ops, compiled by inductor (:func:`compiled`); on other devices the
same function runs as eager ops. Each function is written so that inductor generates **one** kernel for it
(``tests/generated_kernels.py`` counts the Triton kernels it generates on a CPU-only machine; ``make gpu-check`` the
CUDA kernels that run).
"""

from __future__ import annotations

import functools
import warnings

import torch

KERNEL_NAMES: dict = {}
"""function -> the op whose CUDA kernel it is (for the warning of :func:`compiled`)."""


def compiler_unavailable(error: BaseException) -> bool:
    """Whether ``error`` says inductor cannot generate kernels here (no working Triton, a GPU too old for it, a
    compiler that failed), as opposed to an error of the arithmetic itself (shapes, dtypes) or out of memory."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import GPUTooOldForTriton, TritonMissing

    if isinstance(error, (TritonMissing, GPUTooOldForTriton)):
        return True
    return isinstance(error, BackendCompilerFailed) and not isinstance(error.inner_exception, torch.OutOfMemoryError)


@functools.cache
def compiled(function):
    """``function`` compiled by inductor (dynamic shapes: one graph per set of non-tensor arguments), or, where inductor
    cannot compile for this device (:func:`compiler_unavailable`), ``function`` itself (its eager ops) with a warning
    naming the op and the fallback. Any other error (out of memory, a shape error) is raised."""
    kernel = torch.compile(function, dynamic=True, fullgraph=True)

    def run(*args):
        nonlocal kernel
        try:
            return kernel(*args)
        except Exception as error:
            if kernel is function or not compiler_unavailable(error):
                raise
            name = KERNEL_NAMES.get(function, function.__name__)
            warnings.warn(f"boost_hf: the fused CUDA kernel of {name} could not be compiled by inductor "
                          f"({type(error).__name__}: {str(error).splitlines()[0][:200]}); {name} falls back to its eager "
                          f"arithmetic ({function.__module__}.{function.__name__}: separate PyTorch ops, several passes over "
                          "its tensors instead of one) for the rest of this process.")
            kernel = function
            return function(*args)

    return run


__all__ = ["KERNEL_NAMES", "compiled", "compiler_unavailable"]
