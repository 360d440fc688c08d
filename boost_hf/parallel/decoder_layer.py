"""The tensor-parallel decoder layer: the single-device block run as named steps between collectives.

Every layout runs a block as five steps, separated by the collectives of its four projection groups
(:mod:`boost_hf.parallel.layouts.base`). The step boundaries are the cut points of low-rank activation
checkpointing: each step's inputs are only the residual and reduced r-dim latents.

==  =====================================================  ====================================
#   step (local work, no collective)                       then
==  =====================================================  ====================================
1   input norm -> A_q, A_k, A_v                            ``qkv`` collective
2   ``self_attn``: B_q, B_k, B_v -> RoPE -> attention      ``o`` collective
    -> A_o
3   ``o_proj`` (B_o), residual add -> post-attention       ``gate_up`` collective
    norm -> A_gate, A_up
4   ``mlp``: B_gate, B_up -> gated product -> A_down        ``down`` collective
5   ``down_proj`` (B_down), residual add
==  =====================================================  ====================================

For the full-rank Megatron layout "A" is the input copy and "B" the whole weight. The attention, the
MLP and every projection are *called as modules* (``self.self_attn(...)``, ``q_proj(latent)``), so
hooks registered on them fire; under TP a projection's module call is the part after its group's
collective (B and any trailing collective). RoPE runs in the compute dtype on the ``[B, S, heads,
head_dim]`` layout the projections produce (:mod:`boost_hf.parallel.rotary`).
"""

from __future__ import annotations

from functools import partial

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from .fused import gated_product, stacked_slot
from .recompute import run_step
from .rotary import apply_rotary
from .sequence_parallel import enter_token_shard
from .shared_storage import SharedStorageOwner

Tensors = tuple[torch.Tensor, ...]
Latents = dict[str, torch.Tensor]  # LaX: {projection name: [B, S, r] latent}


def _merge(*parts: Latents | None) -> Latents:
    return {name: latent for part in parts if part for name, latent in part.items()}


class ParallelAttention(SharedStorageOwner):
    """Attention on this rank's heads between the ``qkv`` and ``o`` collectives:
    ``z`` (reduced qkv latents) -> ``(o partial, attention weights, crossed LaX latents)``."""

    qkv = o = None  # ProjectionGroup, set by the layout

    def forward(
        self,
        z: Tensors,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache=None,
        previous: Latents | None = None,
        **kwargs,
    ):
        (query, key, value), crossed = self.qkv.project(z, previous)
        input_shape = query.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)  # [B, S, local heads, head_dim]
        slots = (stacked_slot(query), stacked_slot(key))  # BTP's batched B's: RoPE's backward writes into their buffer
        query, key = apply_rotary(query.view(hidden_shape), key.view(hidden_shape), *position_embeddings, slots=slots)
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.view(hidden_shape).transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = attention(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1)  # [B, S, local heads * head_dim]
        return self.o.down(out), weights, crossed


class ParallelMLP(SharedStorageOwner):
    """Gated MLP between the ``gate_up`` and ``down`` collectives:
    ``z`` (reduced gate/up latents) -> ``(down partial, crossed LaX latents)``."""

    gate_up = down = None  # ProjectionGroup, set by the layout

    def forward(self, z: Tensors, previous: Latents | None = None):
        (gate, up), crossed = self.gate_up.project(z, previous)
        return self.down.down(gated_product(gate, up, self.act_fn)), crossed


class ParallelDecoderLayer:
    """A decoder block of any layout as five named steps (see the module docstring).

    ``hidden_states``: the residual stream as the layout holds it (``[B, S, d/p]`` under BTP).
    ``checkpointing``: ``"none"``, ``"full"`` (the block is one recomputed step) or ``"lowrank"``
    (each step recomputed from its inputs).
    ``sequence_parallel_entry``: under sequence parallelism, the group of the first layer, which keeps its
    ``[B, S/p, d]`` token shard of the replicated ``[B, S, d]`` input (backward: all-gather).
    """

    checkpointing = "none"
    sequence_parallel_entry = None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        lax_latents: Latents | None = None,
        **kwargs,
    ):
        if self.sequence_parallel_entry is not None:
            hidden_states = enter_token_shard(hidden_states, self.sequence_parallel_entry)
        training = self.training and torch.is_grad_enabled()
        recomputing = self.checkpointing != "none" and training
        hf_checkpointing = self.gradient_checkpointing and training  # transformers' gradient_checkpointing_enable
        if recomputing or hf_checkpointing:
            cache = None  # a recomputed step would append to the cache twice
        attention = partial(
            self.attention, position_embeddings=position_embeddings, attention_mask=attention_mask,
            cache=cache, **kwargs,
        )
        steps = partial(self.steps, attention=attention, recompute_steps=recomputing and self.checkpointing == "lowrank")
        layer = partial(run_step, steps, recompute=recomputing and self.checkpointing == "full")
        if hf_checkpointing:  # the whole layer once more, through transformers' checkpoint function, on positional tensors
            return run_step(layer, hidden_states, lax_latents, recompute=True, checkpoint=self._gradient_checkpointing_func)
        return layer(hidden_states, lax_latents)

    def steps(self, hidden_states, previous: Latents | None, *, attention, recompute_steps: bool):
        step = partial(run_step, recompute=recompute_steps)
        attn, mlp = self.self_attn, self.mlp
        z = attn.qkv.reduce(step(self.attention_input, hidden_states))
        partial_o, crossed_qkv = step(attention, z, previous)
        z = attn.o.reduce(partial_o)
        hidden_states, partial_gate_up, crossed_o = step(self.attention_output_and_mlp_input, z, hidden_states, previous)
        z = mlp.gate_up.reduce(partial_gate_up)
        partial_down, crossed_gate_up = step(self.mlp, z, previous)
        z = mlp.down.reduce(partial_down)
        hidden_states, crossed_down = step(self.mlp_output, z, hidden_states, previous)
        latents = _merge(crossed_qkv, crossed_o, crossed_gate_up, crossed_down) if self.crosses_latents else None
        return hidden_states, latents

    # ---------------------------------------------------------------- the steps
    def attention_input(self, hidden_states: torch.Tensor) -> Tensors:
        """1. input norm -> A_q, A_k, A_v (this rank's partial latents)."""
        return self.self_attn.qkv.down(self.input_layernorm(hidden_states))

    def attention(self, z: Tensors, previous: Latents | None, **context) -> tuple[Tensors, Latents]:
        """2. B_q, B_k, B_v -> RoPE -> attention -> A_o (partial)."""
        partial_o, _, crossed = self.self_attn(z, previous=previous, **context)
        return partial_o, crossed

    def attention_output_and_mlp_input(self, z: Tensors, residual: torch.Tensor, previous: Latents | None):
        """3. B_o, residual add -> post-attention norm -> A_gate, A_up (partial)."""
        (attention_output,), crossed = self.self_attn.o.project(z, previous)
        hidden_states = residual + attention_output
        return hidden_states, self.mlp.gate_up.down(self.post_attention_layernorm(hidden_states)), crossed

    def mlp_output(self, z: Tensors, residual: torch.Tensor, previous: Latents | None):
        """5. B_down, residual add."""
        (mlp_output,), crossed = self.mlp.down.project(z, previous)
        return residual + mlp_output, crossed


__all__ = ["ParallelAttention", "ParallelMLP", "ParallelDecoderLayer"]
