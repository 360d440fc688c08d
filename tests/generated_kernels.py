"""The Triton kernels inductor generates for a function, on a machine without a GPU.

The fused ops whose CUDA implementation is a function compiled by inductor (:mod:`boost_hf.parallel.latent_op`,
:mod:`boost_hf.parallel.statistics_op`) are counted as one op each by the op counters; each must be one CUDA kernel. A GPU
counts the kernels that run (``make gpu-check``); here inductor's Triton backend generates them for CPU tensors
(``cpu_backend="triton"``: the scheduler and fusion rules of the CUDA backend), and the kernels are recorded instead of
compiled: no Triton driver is needed (nothing is run: the outputs are left unwritten). The first GPU run found the
latent op's backward to be 2 CUDA kernels; this reproduces those 2 on the CPU (the same kernel names, on torch 2.11
and 2.14), so it stands in for the GPU's count between GPU runs. Test code: it patches inductor's private hooks, and
needs the ``triton`` package (which CUDA builds of torch install).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch


class _Recorded:
    """What a kernel compiled by ``AsyncCompile.triton`` is, here: callable, doing nothing."""

    def __call__(self, *args, **kwargs):
        return None

    run = __call__


@contextlib.contextmanager
def _recording(names: list[str]):
    import torch._inductor.config as inductor_config
    import torch.utils._triton as triton_utils
    from torch._inductor import async_compile

    def record(self, kernel_name, source_code, *args, **kwargs):
        names.append(kernel_name)
        return _Recorded()

    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(cpu_backend="triton", compile_threads=1, force_disable_caches=True))
        stack.enter_context(mock.patch.object(async_compile.AsyncCompile, "triton", record))
        # the backend's hash names the active driver; there is none without a GPU
        stack.enter_context(mock.patch.object(triton_utils, "triton_hash_with_backend", lambda: "0" * 64))
        yield


def generated_triton_kernels(function, *args, dynamic: bool = True) -> list[str]:
    """The names of the Triton kernels inductor generates for ``function(*args)`` (CPU tensors), compiled as the fused
    ops compile it (``fullgraph=True``; ``dynamic`` shapes by default)."""
    names: list[str] = []
    torch._dynamo.reset()
    try:
        with _recording(names):
            torch.compile(function, dynamic=dynamic, fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()
    return names
