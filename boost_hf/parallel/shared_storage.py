"""One storage for the parameters a grouped GEMM reads together.

The projections of a group (:mod:`boost_hf.parallel.layouts.base`) run as one GEMM on their weights
stacked by rows: BTP's ``A_q, A_k, A_v`` (``[r, d/p]`` each) and ``A_gate, A_up``, the B's a group casts
together, Megatron's q/k/v and gate/up weights. Here those parameters are kept as consecutive row blocks of
**one buffer**, so the stacked weight is a view (:func:`joined_rows`) and no step concatenates them::

    buffer [r_q + r_k + r_v, d/p]  =  [ q_proj.A | k_proj.A | v_proj.A ]     (rows; one allocation)

Every parameter stays its own ``nn.Parameter`` under its canonical name, with its sharding metadata:
checkpoints, ``state_dict``, hooks, optimizers, DeepSpeed and the optimizer-state resharding see exactly
the parameters of the single-device model. Gradients computed for the stacked weight are split into
views, so each parameter's ``.grad`` is a row block of one gradient buffer too.

* :func:`share_storage` moves parameters into one buffer (values kept). The layouts call it when they
  parallelize a layer; :class:`SharedStorageOwner` calls it again after ``module.to(...)`` / ``.half()`` /
  ``to_empty``, which give every parameter storage of its own.
* :func:`cast_parameters` casts a model's parameters (not its buffers) to another dtype in place, as DeepSpeed's
  bf16 mode does, keeping the grouped ones stored together (a per-parameter ``p.data = p.data.to(dtype)``
  would give each its own storage).
* :func:`joined_rows` is the stacked view, or ``None`` when the parameters are not consecutive blocks of one
  storage (after ``load_state_dict(assign=True)``, under DeepSpeed ZeRO-3, which partitions them, ...). Callers
  then concatenate: the result is the same, one copy slower. (DeepSpeed's ZeRO-1/2 and bf16 flat buffers keep
  them consecutive: :mod:`boost_hf.training.deepspeed` orders the optimizer's parameters for that.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef


def joined_rows(tensors) -> torch.Tensor | None:
    """``tensors`` (``[rows_i, *rest]`` each, contiguous) as one ``[sum rows_i, *rest]`` view without a copy
    when they are consecutive row blocks of one storage, in order; else ``None``. The view does not track
    autograd (callers own the gradient)."""
    tensors = list(tensors)
    first = tensors[0]
    if len(tensors) == 1:
        return first.detach()
    storage, offset = StorageWeakRef(first.untyped_storage()), first.storage_offset()
    for tensor in tensors:
        if (
            tensor.shape[1:] != first.shape[1:] or tensor.dtype != first.dtype or tensor.device != first.device
            or not tensor.is_contiguous() or tensor.storage_offset() != offset
            or StorageWeakRef(tensor.untyped_storage()) != storage
        ):
            return None
        offset += tensor.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    return first.detach().as_strided(shape, first.stride(), first.storage_offset())


@torch.no_grad()
def share_storage(params: list[nn.Parameter], dtype: torch.dtype | None = None) -> None:
    """Re-home ``params`` (same dtype, device and trailing shape) as consecutive row blocks of one new buffer,
    in order, of ``dtype`` (default: theirs; values cast once); ``Parameter`` objects and their attributes are
    kept. Nothing to do if they already are, in that dtype."""
    first = params[0]
    dtype = first.dtype if dtype is None else dtype
    if (len(params) < 2 or joined_rows(params) is not None) and first.dtype == dtype:
        return
    if any(p.shape[1:] != first.shape[1:] or p.dtype != first.dtype or p.device != first.device for p in params):
        raise ValueError(
            "parameters stored as one must share dtype, device and trailing shape: got "
            + ", ".join(f"{tuple(p.shape)} {p.dtype} {p.device}" for p in params)
        )
    buffer = torch.empty((sum(p.shape[0] for p in params), *first.shape[1:]), dtype=dtype, device=first.device)
    for param, block in zip(params, buffer.split([p.shape[0] for p in params])):
        block.copy_(param)
        param.data = block


@torch.no_grad()
def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating-point parameter of ``module`` to ``dtype`` in place (``param.data``, as DeepSpeed's
    bf16 / fp16 modes do; buffers, e.g. the rotary ``inv_freq``, keep their dtype). Parameters stored together
    (:class:`SharedStorageOwner`) are cast into one new buffer each and stay stored together; the others are cast
    one by one. ``Parameter`` objects, their attributes and hooks are kept."""
    grouped = set()
    for owner in module.modules():
        if isinstance(owner, SharedStorageOwner):
            for params in owner.parameters_stored_together():
                if joined_rows(params) is not None and params[0].is_floating_point():
                    share_storage(params, dtype)
                    grouped.update(id(p) for p in params)
    for param in module.parameters():
        if id(param) not in grouped and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


class SharedStorageOwner:
    """A module (adopted mixin) whose submodules' parameters are stored together in row blocks:
    ``shared_storage`` lists ``(submodule names, parameter name)`` per buffer, e.g.
    ``(("q_proj", "k_proj", "v_proj"), "A")``.

    ``module.to(...)``, ``.half()``, ``.to_empty(...)`` etc. give every parameter new storage of its own;
    blocks that were stored together before are stored together again afterwards. Blocks that were not (a
    framework such as DeepSpeed ZeRO-3 had re-homed them) are left where they are."""

    shared_storage: tuple[tuple[tuple[str, ...], str], ...] = ()

    def parameters_stored_together(self) -> list[list[nn.Parameter]]:
        return [[getattr(getattr(self, module), name) for module in modules] for modules, name in self.shared_storage]

    def share_storage(self) -> None:
        for params in self.parameters_stored_together():
            share_storage(params)

    def _apply(self, fn, recurse=True):
        together = [joined_rows(params) is not None for params in self.parameters_stored_together()]
        super()._apply(fn, recurse)
        for was_together, params in zip(together, self.parameters_stored_together()):
            if was_together:
                share_storage(params)
        return self


__all__ = ["joined_rows", "share_storage", "cast_parameters", "SharedStorageOwner"]
