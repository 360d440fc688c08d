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

from dataclasses import replace

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
    if layout.sequence_parallel:
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


def runs_single_device_layers(parallel: ParallelConfig) -> bool:
    """Whether the decoder layers run as the single-device model's (``parallelize`` adopts none at ``tp_size`` 1
    without checkpointing)."""
    return parallel.tp_size == 1 and parallel.activation_checkpointing == "none"


def saved_bytes_without_checkpointing(config, parallel: ParallelConfig, tokens: int, *, activation_bytes: int = 2,
                                      residual_bytes: int = 4, casts_inputs: bool = True) -> int | None:
    """Bytes one decoder layer keeps for backward on one rank when it is not checkpointed (under checkpointing, what
    it holds while its backward recomputes it, as the parallel layer runs it): activations at ``activation_bytes``,
    the residual at ``residual_bytes``, statistics in fp32; ``casts_inputs``: autocast casts each GEMM's input
    itself (the single-device projections sharing an input then keep one copy each). Neither the rotary tables
    (:func:`rotary_saved_bytes`) nor autocast's weight copies are included (``casts_inputs`` also says autocast copies
    the weights: where a layout materialises weights itself, BTP's A's with the norm's gamma folded in, those copies
    are counted here only without autocast). ``None`` where not modelled (LaX,
    vanilla, ungrouped projections, the sync and local norms)."""
    if config.bottleneck == "lax":
        return None
    if runs_single_device_layers(parallel):
        return _single_device_saved_bytes(config, tokens, activation_bytes, residual_bytes, casts_inputs)
    parallel = replace(parallel, activation_checkpointing="none")
    return layout_for(config, parallel).saved_bytes_without_checkpointing(
        config, tokens, activation_bytes=activation_bytes, residual_bytes=residual_bytes, weights_cast=casts_inputs)


def _single_device_saved_bytes(config, n: int, a: int, residual_bytes: int, casts_inputs: bool) -> int:
    """:func:`saved_bytes_without_checkpointing` of the single-device layer (``modeling_boost_llama``)."""
    d, dq, dkv, f = config.hidden_size, config.q_dim, config.kv_dim, config.intermediate_size
    # each RMSNorm computes in fp32: its input in fp32, 1/rms, and the normalised values in the residual's dtype
    norms = 2 * (n * d * 4 + n * 4 + n * d * residual_bytes)
    # the input of q/k/v and of gate/up: one copy per projection when autocast casts each GEMM's input
    inputs = n * d * a * ((3 + 2) if casts_inputs else 2)
    latents = 0
    if config.bottleneck is not None:  # each projection's latent, and its activation (what B reads)
        latents = 7 * n * config.rank * a * (2 if config.latent_activation is not None else 1)
    attention = n * (2 * dq + 2 * dkv) * a + n * config.num_attention_heads * 4
    mlp = n * f * a * (4 if config.mlp_activation is not None else 3)
    return norms + inputs + latents + attention + mlp


def rotary_saved_bytes(config, parallel: ParallelConfig, seq_len: int, *, activation_bytes: int = 2,
                       residual_bytes: int = 4) -> int:
    """The rotary tables (cos and sin, ``[S, head_dim]``) every layer's attention keeps for backward, once per
    micro-batch: in the residual's dtype in the single-device layers, in the compute dtype in the parallel ones."""
    per_element = residual_bytes if runs_single_device_layers(parallel) else activation_bytes
    return 2 * seq_len * config.head_dim * per_element


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


__all__ = ["rotary_saved_bytes", "runs_single_device_layers", "saved_bytes_without_checkpointing", "saved_bytes_per_layer", "saved_elements_per_layer", "saved_parts_per_layer", "SavedTensorsProbe"]
