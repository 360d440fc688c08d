"""Counting what the aten ops of a forward or backward cost, without running them.

:class:`OpCounter` is a ``TorchDispatchMode``: every aten op that reaches the dispatcher inside it is
classified and tallied. Under ``FakeTensorMode`` (tensors with shapes but no storage) nothing is computed,
so a real-size model is counted in seconds on any machine.

What is counted, per op reaching the dispatcher (``nn.functional.linear`` and ``torch.matmul`` are
decomposed before it, so they arrive as the ops below):

* GEMMs (``mm``, ``addmm``, ``bmm``, ``baddbmm`` and their in-place forms): ``2 m k n`` FLOPs per (batched) product;
  nothing else (their operand bytes are not counted).
* Fused attention (the ``scaled_dot_product_attention`` kernels: CPU flash, CUDA flash / efficient /
  cuDNN, forward and backward): the score and weighted-sum GEMMs, ``4 B H Sq Sk D`` forward (equal
  q/v head dims) and twice that backward (dQ, dK, dV and dP), halved when causal (what a causal kernel
  computes; the convention of :func:`boost_hf.perf.flops.attention_flops_per_token`). The backward's
  recomputation of the scores is not counted.
* Every other aten op: one op (a kernel launch in eager mode) and the bytes of all its tensor inputs and
  outputs (a lower bound on the memory traffic of an unfused kernel; an in-place op counts the tensor it
  writes as input and output, an ``out=`` op only as output). Ops that move no data are skipped: views
  and aliases (``op.is_view``), metadata queries and allocations without initialisation (:data:`FREE_OPS`).
* Collectives (``c10d`` ops) are not counted here: :class:`boost_hf.parallel.comm_counter.CommCounter`
  counts them from boost-hf's primitives.

:class:`DispatchCounter` counts instead how many ops of each kind a pass dispatches (the host's work in eager mode:
each op that launches work is a kernel launch or a collective call on a GPU), GEMMs, attention, collectives and views
included.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GEMM_OPS = ("mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_")
ATTENTION_FORWARD_OPS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
ATTENTION_BACKWARD_OPS = tuple(f"{name}_backward" for name in ATTENTION_FORWARD_OPS)
# Not views by schema, yet they move no data: a reshape of a fresh tensor, metadata queries, allocations.
FREE_OPS = frozenset({
    "_unsafe_view", "device", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "_local_scalar_dense",
})


def tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or a list / tuple of them; anything else is 0)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def gemm_flops(name: str, args) -> int:
    """``2 m k n`` (times the batch for ``bmm`` / ``baddbmm``) of one GEMM op's operands."""
    a, b = (args[1], args[2]) if name in ("addmm", "addmm_", "baddbmm", "baddbmm_") else (args[0], args[1])
    return 2 * a.numel() * b.shape[-1]


def attention_flops(func, args, kwargs, *, backward: bool) -> int:
    """FLOPs of one fused-attention op (see the module docstring): ``2 B H Sq Sk (D + Dv)`` forward,
    twice that backward, halved when causal."""
    named = dict(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    q, k, v = named["query"], named["key"], named["value"]
    batch_heads_q = q.numel() // q.shape[-1]  # B H Sq
    flops = 2 * batch_heads_q * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    if backward:
        flops *= 2
    return flops // 2 if named.get("is_causal", False) else flops


class OpCounter(TorchDispatchMode):
    """Dispatch mode tallying GEMM FLOPs, attention FLOPs and the non-GEMM ops and bytes inside it.

    ``counter.gemm_flops`` / ``counter.attention_flops``: FLOPs; ``counter.bytes_by_op`` /
    ``counter.ops_by_op``: per aten op name (overload packet, e.g. ``"mul"``) the bytes read and written
    and the number of calls of every non-GEMM op; ``non_gemm_bytes`` / ``non_gemm_ops`` are their sums.

    Example::

        with FakeTensorMode(), OpCounter() as ops:
            model(input_ids, labels=input_ids).loss.backward()
    """

    def __init__(self):
        super().__init__()
        self.gemm_flops = 0
        self.attention_flops = 0
        self.bytes_by_op: Counter[str] = Counter()
        self.ops_by_op: Counter[str] = Counter()

    @property
    def non_gemm_bytes(self) -> int:
        return sum(self.bytes_by_op.values())

    @property
    def non_gemm_ops(self) -> int:
        return sum(self.ops_by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.namespace == "c10d" or func.is_view or name in FREE_OPS:
            return out
        if name in GEMM_OPS:
            self.gemm_flops += gemm_flops(name, args)
        elif name in ATTENTION_FORWARD_OPS or name in ATTENTION_BACKWARD_OPS:
            self.attention_flops += attention_flops(func, args, kwargs, backward=name in ATTENTION_BACKWARD_OPS)
        else:
            written = {a.name for a in func._schema.arguments if a.is_out}  # ``out=`` tensors: written, not read
            read = tensor_bytes(list(args)) + tensor_bytes([v for k, v in kwargs.items() if k not in written])
            self.bytes_by_op[name] += read + tensor_bytes(out)
            self.ops_by_op[name] += 1
        return out


#: what :class:`DispatchCounter` calls each op that launches work (the rest: ``"view"`` and ``"free"``)
DISPATCH_KINDS = ("gemm", "attention", "collective", "other")


def dispatch_kind(func) -> str:
    """``"gemm"``, ``"attention"``, ``"collective"`` (``c10d`` and functional-collective ops), ``"other"`` (every other op
    that launches work: element-wise, reductions, copies, boost-hf's fused custom ops), ``"view"`` (an alias: no
    kernel) or ``"free"`` (:data:`FREE_OPS`: metadata, allocations without initialisation) of one aten op."""
    name = func._overloadpacket.__name__
    if func.namespace in ("c10d", "_c10d_functional"):
        return "collective"
    if func.is_view:
        return "view"
    if name in FREE_OPS:
        return "free"
    if name in GEMM_OPS:
        return "gemm"
    if name in ATTENTION_FORWARD_OPS or name in ATTENTION_BACKWARD_OPS:
        return "attention"
    return "other"


class DispatchCounter(TorchDispatchMode):
    """Dispatch mode counting every op that reaches the dispatcher inside it, by :func:`dispatch_kind` and by name:
    ``counter.by_kind["gemm"]``, ``counter.by_op[("other", "mul")]``; :attr:`launches` is the ops that launch work in
    eager mode (:data:`DISPATCH_KINDS`: one kernel each on a GPU, boost-hf's fused ops included, a collective one call).
    A composite op is counted as the ops it decomposes into (what reaches the dispatcher)."""

    def __init__(self):
        super().__init__()
        self.by_op: Counter[tuple[str, str]] = Counter()

    @property
    def by_kind(self) -> Counter[str]:
        kinds: Counter[str] = Counter()
        for (kind, _), n in self.by_op.items():
            kinds[kind] += n
        return kinds

    @property
    def launches(self) -> int:
        return sum(n for (kind, _), n in self.by_op.items() if kind in DISPATCH_KINDS)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_op[dispatch_kind(func), func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


__all__ = ["DISPATCH_KINDS", "DispatchCounter", "dispatch_kind", "ATTENTION_BACKWARD_OPS", "ATTENTION_FORWARD_OPS", "FREE_OPS", "GEMM_OPS", "OpCounter", "attention_flops", "gemm_flops", "tensor_bytes"]
