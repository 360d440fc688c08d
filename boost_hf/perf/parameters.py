"""The parameter count of a boost-hf LLaMA config, from its shapes (no model built, no torch).

Equal to ``sum(p.numel() for p in BoostLlamaForCausalLM(config).parameters())`` for every bottleneck (a test
builds the model and compares): the estimator sizes optimizer state with it, the model card prints it.
"""

from __future__ import annotations

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def parameter_count(config) -> int:
    """Trainable parameters: per layer the 7 projections (dense ``d_in d_out``, bottleneck ``r (d_in + d_out)``, or the
    tensor-train cores) with their biases (``attention_bias``, ``mlp_bias``) and 2 RMSNorm weights; LaX's crossing in
    layers 1..L-1 (dense gate ``r^2 + r``, Kronecker ``a^2 + b^2``, identity nothing; the latent LayerNorm's weight
    and bias, ``2 r``, with ``lax_latent_norm``); the final norm, the embedding and the LM head (one matrix when
    ``tie_word_embeddings``)."""
    d, layers = config.hidden_size, config.num_hidden_layers
    shapes = config.projection_shapes()
    if config.bottleneck is None:
        block = sum(d_in * d_out for d_in, d_out in shapes.values())
    elif config.bottleneck == "tt":
        block = sum(config.tensor_train_shape(name).parameters for name in shapes)
    else:
        block = sum(config.rank * (d_in + d_out) for d_in, d_out in shapes.values())
    block += sum(d_out for name, (_, d_out) in shapes.items()
                 if (config.attention_bias if name in ATTENTION_PROJECTIONS else config.mlp_bias))
    crossing = 0
    if config.bottleneck == "lax":
        r = config.rank
        if config.lax_gate == "dense":
            crossing += r * r + r
        elif config.lax_gate == "kronecker":
            a, b = config.kronecker_factors
            crossing += a * a + b * b
        if config.lax_latent_norm:
            crossing += 2 * r
    embeddings = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    return layers * (block + 2 * d) + (layers - 1) * len(shapes) * crossing + d + embeddings


__all__ = ["parameter_count"]
