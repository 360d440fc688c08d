"""LoRA from ``peft`` on boost-hf's bottleneck projections, through peft's custom module mapping.

A bottleneck projection ``y = B act(A x)`` (``BoostLlamaLowRankLinear``; LaX: ``BoostLlamaLaxLinear``, whose
crossing latent is passed through untouched; tensor train: ``BoostLlamaTensorTrainLinear``, ``A`` and ``B``
contracted from its cores) gets its adapter as a branch **parallel to the whole projection**::

    y = proj(x) + (alpha / r_l) * B_l A_l dropout(x)        A_l: [r_l, in], B_l: [out, r_l], B_l = 0 at init

so a LoRA adapter means the same thing on every architecture (full-rank ``nn.Linear`` projections get peft's
own LoRA layer, which computes the same formula), and ``B A`` plus the branch stay two separate paths.

**Merging is refused.** ``B act(A x) + s B_l A_l x`` has no weight matrix to add ``s B_l A_l`` to: with an
activation between the factors (cola, lax) no merge is exact; without one (svd) the exact merge
``[B, s B_l] [A; A_l]`` raises the rank of that projection to ``r + r_l``, which the checkpoint's single
``rank`` cannot describe; a tensor train (tt) would need larger bond ranks than its cores have. A silent approximation (or a silently dropped adapter in ``merge_and_unload``) is
never acceptable, so ``merge`` / ``merge_and_unload`` raise :class:`BottleneckMergeError` on these layers;
the un-merged adapter model computes the exact outputs (and ``unload()`` removes adapters without merging).
Full-rank models (``bottleneck=None``) merge as usual.

Usage (single device; not under tensor parallelism)::

    from peft import PeftModel, get_peft_model
    from boost_hf.peft_support import PROJECTIONS, lora_config, register_bottleneck_lora

    peft_model = get_peft_model(model, lora_config(r=8, lora_alpha=16, target_modules=list(PROJECTIONS)))
    peft_model.save_pretrained("adapter")
    loaded = PeftModel.from_pretrained(base, "adapter", config=register_bottleneck_lora(LoraConfig.from_pretrained("adapter")))

``target_modules="all-linear"`` in a plain ``LoraConfig`` is expanded by peft to ``nn.Linear`` layers only: on a
bottleneck model it finds nothing but the (excluded) LM head and peft refuses the config. :func:`lora_config`
maps ``"all-linear"`` to :data:`PROJECTIONS`, which is exactly what peft's expansion gives a full-rank model.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from peft import LoraConfig
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from .modeling_boost_llama import BoostLlamaLaxLinear, BoostLlamaLowRankLinear, BoostLlamaTensorTrainLinear

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The 7 projections of a decoder block: ``target_modules`` for LoRA on every projection."""


class BottleneckMergeError(ValueError):
    """A LoRA adapter cannot be merged exactly into a bottleneck projection (see the module docstring)."""


class BottleneckLoraLinear(nn.Module, LoraLayer):
    """LoRA around a bottleneck projection: ``proj(x) + scaling * lora_B(lora_A(dropout(x)))`` for every active
    adapter. ``x: [..., in_features] -> [..., out_features]`` (LaX: ``(y, crossing latent)``, the latent unchanged)."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0, lora_alpha: int = 1, **kwargs):
        super().__init__()
        with warnings.catch_warnings():  # peft warns that it cannot size an unknown layer; it is sized here
            warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
            LoraLayer.__init__(self, base_layer, **kwargs)
        projection = self.get_base_layer()
        self.in_features, self.out_features = projection.in_features, projection.out_features
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config, **kwargs)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any):
        if kwargs.pop("adapter_names", None) is not None:
            raise ValueError("mixed-adapter batches (adapter_names=...) are not supported on boost-hf bottleneck projections.")
        output = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return output
        crossing = isinstance(self.get_base_layer(), BoostLlamaLaxLinear)
        result, carried = output if crossing else (output, None)
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[adapter], self.lora_B[adapter]
            result = result + lora_B(lora_A(self.lora_dropout[adapter](x.to(lora_A.weight.dtype)))).to(result.dtype) * self.scaling[adapter]
        return (result, carried) if crossing else result

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        projection = self.get_base_layer()
        if isinstance(projection, BoostLlamaTensorTrainLinear):
            why = ("its weight is a tensor train of fixed bond ranks, and B_l A_l added to it is in general not one of "
                   "those ranks (the config cannot describe larger ones)")
        else:
            why = ("y = B act(A x) has no weight matrix to add B_l A_l to (exact only for svd, by raising the rank to "
                   "r + r_l, which the config cannot describe)")
        raise BottleneckMergeError(
            f"cannot merge a LoRA adapter into a bottleneck projection ({projection.extra_repr()}): {why}. Keep the "
            "adapter unmerged (PeftModel's outputs are exact), or unload() it."
        )

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        raise BottleneckMergeError("a bottleneck projection has no dense weight: the LoRA branch cannot be expressed as a delta weight.")

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def register_bottleneck_lora(config: LoraConfig) -> LoraConfig:
    """Map boost-hf's bottleneck projections (LaX and tensor train included) to :class:`BottleneckLoraLinear` in ``config``
    (peft's custom module mapping); returns ``config``. Needed again when loading a saved adapter, because
    peft does not save the mapping."""
    config._register_custom_module({BoostLlamaLowRankLinear: BottleneckLoraLinear, BoostLlamaTensorTrainLinear: BottleneckLoraLinear})
    return config


def lora_config(**kwargs) -> LoraConfig:
    """``LoraConfig(task_type="CAUSAL_LM", target_modules=PROJECTIONS, **kwargs)`` with the bottleneck mapping
    registered. ``target_modules="all-linear"`` means the 7 projections of every block (what peft's expansion
    gives a full-rank LLaMA: every linear layer but the LM head)."""
    kwargs.setdefault("task_type", "CAUSAL_LM")
    if kwargs.get("target_modules", "all-linear") == "all-linear":
        kwargs["target_modules"] = list(PROJECTIONS)
    return register_bottleneck_lora(LoraConfig(**kwargs))


__all__ = ["PROJECTIONS", "BottleneckLoraLinear", "BottleneckMergeError", "register_bottleneck_lora", "lora_config"]
