"""What a decoder layer keeps for backward under activation checkpointing (elements per rank).

Low-rank checkpointing (BOOST.md section 5) keeps only the inputs of the layer's five steps
(:mod:`boost_hf.parallel.decoder_layer`): the residual entering the layer and after attention (``N d``;
``N d / p`` where the layout shards it along ``d``, or along tokens under sequence parallelism), plus
the reduced latents of the four projection groups (as the layout holds them) and LaX's handed-on
latents of the previous block (for each of the 7 projections the latent ``h`` that block fed to its ``B``,
after crossing, LayerNorm and activation; ``[N, r]``, full r and replicated under every layout, ``[N/p, r]``
under BTP's latent sequence parallelism). Block 0
reads none. ``full`` keeps the layer's inputs only (the residual and, from block 1, the 7 handed-on latents). The tests measure the same
quantity with :class:`SavedTensorsProbe` and compare it with :func:`saved_elements_per_layer`.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..parallel.config import ParallelConfig
from ..parallel.layouts import layout_for


def saved_parts_per_layer(config, parallel: ParallelConfig, tokens: int, layer_idx: int = 1) -> tuple[int, int]:
    """``(residual, latent)`` elements saved for backward by one decoder layer (``layer_idx``) on one rank, for
    ``activation_checkpointing`` ``"full"`` or ``"lowrank"`` (``"none"`` keeps every intermediate: not
    modelled here): the residual stream's copies, and the latents (reduced, with the online norm's statistics,
    and LaX's handed-on ones)."""
    layout = layout_for(config, parallel)
    residual = layout.residual_elements(config, tokens)
    carries = 7 * tokens * config.rank if config.bottleneck == "lax" and layer_idx > 0 else 0
    if parallel.shards_tokens:
        carries //= parallel.tp_size  # BTP's latent sequence parallelism hands on token shards
    mode = parallel.activation_checkpointing
    if mode == "full":
        return residual, carries
    if mode != "lowrank":
        raise ValueError(f"saved_elements_per_layer models 'full' and 'lowrank' checkpointing, not {mode!r}")
    return 2 * residual, layout.saved_latent_elements(config, tokens) + carries


def saved_elements_per_layer(config, parallel: ParallelConfig, tokens: int, layer_idx: int = 1) -> int:
    """Elements saved for backward by one decoder layer (``layer_idx``) on one rank (:func:`saved_parts_per_layer`)."""
    return sum(saved_parts_per_layer(config, parallel, tokens, layer_idx))


def saved_bytes_per_layer(config, parallel: ParallelConfig, tokens: int, layer_idx: int = 1, *,
                          residual_bytes: int = 4, latent_bytes: int = 2) -> int:
    """Bytes saved for backward by one decoder layer on one rank: the residual at ``residual_bytes`` per element
    and the latents at ``latent_bytes``. The defaults are mixed-precision training (fp32 weights, bf16 autocast):
    the residual stream stays fp32, the latents are GEMM outputs in bf16."""
    residual, latent = saved_parts_per_layer(config, parallel, tokens, layer_idx)
    return residual * residual_bytes + latent * latent_bytes


class SavedTensorsProbe:
    """Measures what one module's forward saves for backward: the unique storages (parameters excluded)
    seen by ``saved_tensors_hooks`` between the module's forward pre-hook and forward hook (real or fake
    tensors: storages are told apart by identity, not by address)."""

    def __init__(self, module: torch.nn.Module):
        self.storages: dict[StorageWeakRef, int] = {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._handles = [module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._exit)]

    def _enter(self, *_) -> None:  # a hook's return value would replace the module's inputs/outputs
        self.hooks.__enter__()

    def _exit(self, *_) -> None:
        self.hooks.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            self.storages[StorageWeakRef(storage)] = storage.nbytes()
        return t

    @property
    def saved_bytes(self) -> int:
        return sum(self.storages.values())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


__all__ = ["saved_bytes_per_layer", "saved_elements_per_layer", "saved_parts_per_layer", "SavedTensorsProbe"]
