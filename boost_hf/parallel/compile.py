"""``torch.compile`` per decoder layer (torchtitan's recipe), for any tensor-parallel layout.

Each decoder layer is compiled *in place* (``nn.Module.compile``): parameter names, hooks and checkpoints
are unchanged, the layers share one compiled graph (dynamo treats their parameters as inputs), and the
collectives between a layer's steps are traced as functional collectives
(:mod:`boost_hf.parallel.primitives`), so a whole tensor-parallel layer is one graph, forward and
backward. Embedding, LM head and loss stay eager (the vocabulary-parallel loss holds a few small ops).
"""

from __future__ import annotations

from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList | nn.ModuleDict:
    """The decoder layers of a ``BoostLlamaForCausalLM`` / ``BoostLlamaModel`` (or any HF causal LM whose
    base model keeps them in ``.layers``)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):  # a ModuleDict: a pipeline rank's layers by index
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers to compile per layer.")
    return layers


def compile_decoder_layers(model: nn.Module, **compile_kwargs) -> nn.Module:
    """Compile every decoder layer of ``model`` in place with ``torch.compile(**compile_kwargs)``; returns
    ``model``. Idempotent."""
    for layer in decoder_layers(model):
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(**compile_kwargs)
    return model


__all__ = ["compile_decoder_layers", "decoder_layers"]
