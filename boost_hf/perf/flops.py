"""Floating-point operations of the boost-hf LLaMA family, per token.

Conventions (one multiply-add = 2 FLOPs; forward pass unless stated):

* a projection ``d_in -> d_out`` costs ``2 d_in d_out`` (dense) or ``2 r (d_in + d_out)`` (bottleneck
  ``A: d_in -> r``, ``B: r -> d_out``); summed over the 7 projections this is
  ``2 (2 d dq + 2 d dkv + 3 d f)`` (``= 2 (4d^2 + 3 d f)`` without GQA) and ``2 r sum(d_in + d_out)``
  (``= 2 (8 d r + 3 r (d + f))``);
* a tensor-train projection (``tt``) costs ``2 r (d_in + d_out)`` per token as any bottleneck (``r`` its middle
  rank), and contracting its cores into the two factors once per forward pass, whatever the tokens
  (:func:`contraction_flops`; not in the per-token counts);
* a LaX crossing ``G h_prev`` costs ``2 r^2`` per projection with a dense gate, ``2 r (a + b)`` with a
  Kronecker gate ``G = L (a x a) kron R (b x b)``, nothing with the identity gate; block 0 has none;
* attention scores ``Q K^T`` and ``P V`` cost ``2 s dq`` each per token over a context of ``s`` keys,
  ``4 s dq`` in total; **causal** attention (the default) counts the ``s / 2`` keys a token sees on
  average (what a causal flash-attention kernel computes), i.e. ``2 s dq``. PaLM-style MFU counts the
  full ``4 s dq``: pass ``causal=False`` for that convention;
* the LM head costs ``2 d V``; embedding lookups, norms, activations and the loss are not counted;
* training = forward + backward = 3 x forward (the backward computes input and weight gradients,
  2 x forward). Recomputation under activation checkpointing is not model work and is not counted.
"""

from __future__ import annotations

from ..parallel.tensor_train import contraction_gemms


def projection_flops_per_token(config) -> dict[str, int]:
    """Forward FLOPs per token of each of the 7 projections of one decoder layer (no LaX crossing)."""
    if config.bottleneck is None:
        return {name: 2 * d_in * d_out for name, (d_in, d_out) in config.projection_shapes().items()}
    r = config.rank
    return {name: 2 * r * (d_in + d_out) for name, (d_in, d_out) in config.projection_shapes().items()}


def crossing_flops_per_token(config) -> int:
    """Forward FLOPs per token of the 7 LaX crossings ``G h_prev`` of one decoder layer (not block 0).

    Zero unless ``config.bottleneck == "lax"``.
    """
    if config.bottleneck != "lax" or config.lax_gate == "identity":
        return 0
    r = config.rank
    if config.lax_gate == "dense":
        return 7 * 2 * r * r
    a, b = config.kronecker_factors
    return 7 * 2 * r * (a + b)


def contraction_flops(config) -> int:
    """Forward FLOPs of contracting one decoder layer's tensor-train cores into their factors on one device, once
    per forward pass (per micro-batch, whatever its tokens). Zero unless ``config.bottleneck == "tt"``."""
    if config.bottleneck != "tt":
        return 0
    return sum(gemm.flops for gemm in contraction_gemms(config, lambda shape: {}, 1))


def linear_flops_per_token(config, *, crossing: bool = True) -> int:
    """Forward FLOPs per token of one decoder layer's linear layers: the 7 projections, plus the LaX
    crossings if ``crossing`` (every block but the first has them)."""
    total = sum(projection_flops_per_token(config).values())
    return total + (crossing_flops_per_token(config) if crossing else 0)


def attention_flops_per_token(config, seq_len: int, *, causal: bool = True) -> int:
    """Forward FLOPs per token of one layer's attention scores and weighted sum: ``4 s dq``, halved to
    ``2 s dq`` for causal attention (see the module docstring)."""
    full = 4 * seq_len * config.q_dim
    return full // 2 if causal else full


def lm_head_flops_per_token(config) -> int:
    """Forward FLOPs per token of the LM head, ``2 d V``."""
    return 2 * config.hidden_size * config.vocab_size


def forward_flops_per_token(config, seq_len: int, *, causal: bool = True) -> int:
    """Forward FLOPs per token of the whole model: ``L`` layers (``L - 1`` LaX crossings), attention,
    LM head."""
    layers = config.num_hidden_layers
    linear = layers * linear_flops_per_token(config, crossing=False) + (layers - 1) * crossing_flops_per_token(config)
    return linear + layers * attention_flops_per_token(config, seq_len, causal=causal) + lm_head_flops_per_token(config)


def training_flops_per_token(config, seq_len: int, *, causal: bool = True) -> int:
    """Model FLOPs per trained token (forward + backward = 3 x forward), the numerator of MFU."""
    return 3 * forward_flops_per_token(config, seq_len, causal=causal)


__all__ = [
    "attention_flops_per_token",
    "contraction_flops",
    "crossing_flops_per_token",
    "forward_flops_per_token",
    "linear_flops_per_token",
    "lm_head_flops_per_token",
    "projection_flops_per_token",
    "training_flops_per_token",
]
