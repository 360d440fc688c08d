"""The boost-hf LLaMA family: full-rank LLaMA and its low-rank bottleneck variants (svd, cola, lax, tt).

A single-device model that reads like ``transformers``' ``modeling_llama.py``: norm -> rotary ->
projections -> MLP -> attention -> decoder layer -> base model -> causal-LM head. It imports only
``torch``, ``transformers`` and its siblings (the configuration, the tensor-train projections and the weights'
initialisation and loading), so it is also what a saved checkpoint ships as remote code. With ``bottleneck=None``
it is exactly ``transformers.LlamaForCausalLM`` (same names, same logits).

Tensor parallelism is applied from outside (:func:`boost_hf.parallel.parallelize`), which swaps these
modules for sharded ones and keeps every parameter name.

Shapes: ``B`` batch, ``S`` sequence, ``d`` hidden size, ``r`` rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, eager_attention_forward
from transformers.utils import can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_boost_llama import BoostLlamaConfig
from .tensor_train_boost_llama import BoostLlamaTensorTrainCores, BoostLlamaTensorTrainLinear
from .weights_boost_llama import CheckedLoading, SeededInitialization

logger = logging.get_logger(__name__)

LATENT_NORM_EPS = 1e-6  # the LaX authors' latent LayerNorm
LAX_GATE_PARAMETERS = {"dense": ("gate", "gate_bias"), "kronecker": ("gate_left", "gate_right")}  # per lax_gate
IGNORE_INDEX = -100  # a label the loss skips (transformers' convention)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# The KV cache's name: transformers 5.24 renamed ``past_key_values`` to ``cache`` (the forward argument ``generate``
# passes, the output field, ``create_causal_mask``'s argument); 5.17-5.23 know only ``past_key_values``. The forwards
# take the cache under either name (:func:`one_cache`) and hand it on under the running release's (``CACHE_NAME``),
# so nothing warns and nothing is dropped into ``**kwargs``.
CACHE_NAME = "cache" if "cache" in {field.name for field in fields(BaseModelOutputWithPast)} else "past_key_values"


def one_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The KV cache passed as ``cache`` (transformers >= 5.24) or as ``past_key_values`` (earlier, and callers that
    still use the old name); both at once only if they are the same object."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("two KV caches were passed, as `cache` and as `past_key_values`: pass one, as `cache`")
    return cache if cache is not None else past_key_values


class BoostLlamaRMSNorm(nn.Module):
    """RMSNorm over the last dim, statistics in fp32 (as ``LlamaRMSNorm``); ``weight: [d]``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class BoostLlamaRotaryEmbedding(LlamaRotaryEmbedding):
    """RoPE exactly as ``transformers``' LLaMA (``cos, sin: [B, S, head_dim]``, in ``x``'s dtype).

    The angles are the fp32 outer product of positions and inverse frequencies, element-wise as transformers 5.23
    computes them (5.17 ran the same product as a batched fp32 GEMM: the same values, one GEMM more per forward).
    """

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class BoostLlamaLowRankLinear(nn.Module):
    """Bottleneck projection ``y = B act(A x) (+ bias)`` (svd: no ``act``; cola: ``act`` on the r-dim latent).

    ``A: [r, in_features]``, ``B: [out_features, r]``, ``bias: [out_features]`` (added after ``B``, as CoLA does,
    when the configuration asks for it); ``x: [..., in_features] -> y: [..., out_features]``.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, latent_activation: str | None, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.empty(out_features, rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.latent_activation = latent_activation
        self.act_fn = ACT2FN[latent_activation] if latent_activation else None

    def latent(self, z: torch.Tensor) -> torch.Tensor:
        """The function between the factors, on ``z = A x: [..., r]``."""
        return self.act_fn(z) if self.act_fn is not None else z

    def up(self, h: torch.Tensor) -> torch.Tensor:
        """``B h (+ bias)`` for the latent ``h: [..., r]`` fed to ``B``."""
        return F.linear(h, self.B, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.latent(F.linear(x, self.A)))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"latent_activation={self.latent_activation}, bias={self.bias is not None}"
        )


class BoostLlamaLaxLinear(BoostLlamaLowRankLinear):
    """LaX bottleneck projection (the authors' ``TensorizedLinear``, 2-core case): the latent crosses in the
    latent that the same projection of the previous block fed to its ``B``.

    Block 0 (``crossing=None``): ``h = act(A x)``. Block ``l > 0``: ``h = act(LayerNorm_r(A x + G h_prev))``
    (``G``: ``"dense"`` ``gate h + gate_bias`` with ``gate: [r, r]``, ``gate_bias: [r]``; ``"kronecker"``
    ``(L (x) R) h`` with ``gate_left: [a, a]``, ``gate_right: [b, b]``, ``a b = r``; ``"identity"`` ``h``). Then
    ``y = B h``. ``forward(x, h_prev) -> (y, h)``: ``h``, the latent fed to ``B`` (after norm and activation),
    is handed to the same projection of the next block.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        latent_activation: str | None,
        bias: bool = False,
        *,
        crossing: str | None,
        kronecker_factors: tuple[int, int],
        latent_norm: bool,
    ):
        super().__init__(in_features, out_features, rank, latent_activation, bias)
        self.crossing = crossing
        if crossing == "dense":
            self.gate = nn.Parameter(torch.empty(rank, rank))
            self.gate_bias = nn.Parameter(torch.empty(rank))
        elif crossing == "kronecker":
            a, b = kronecker_factors
            self.gate_left = nn.Parameter(torch.empty(a, a))
            self.gate_right = nn.Parameter(torch.empty(b, b))
        # the authors' first block has neither a crossing nor the latent LayerNorm
        self.latent_norm = nn.LayerNorm(rank, eps=LATENT_NORM_EPS) if latent_norm and crossing is not None else None

    def crossing_parameters(self) -> tuple[torch.Tensor, ...]:
        """The gate's parameters as :meth:`cross` reads them: ``(gate, gate_bias)`` (dense), ``(gate_left,
        gate_right)`` (kronecker), ``()`` (identity, block 0)."""
        return tuple(getattr(self, name) for name in LAX_GATE_PARAMETERS.get(self.crossing, ()))

    def cross(self, previous: torch.Tensor) -> torch.Tensor:
        """``G h_prev`` for ``h_prev: [..., r]``."""
        if self.crossing == "identity":
            return previous
        if self.crossing == "dense":
            gate, gate_bias = self.crossing_parameters()
            return F.linear(previous, gate, gate_bias)
        left, right = self.crossing_parameters()
        grid = previous.reshape(*previous.shape[:-1], left.shape[0], right.shape[0])
        # kron(L, R) vec(H) = vec(L H R^T) for a row-major H of shape [a, b]
        return (left @ grid @ right.T).reshape(previous.shape)

    def crossed_latent(self, z: torch.Tensor, previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, h)``: the latent fed to ``B``, which is also the one handed on, from ``z = A x: [..., r]``:
        ``act(norm(z + G h_prev))``, or ``act(z)`` in block 0."""
        if self.crossing is not None:
            if previous is None:
                raise ValueError("a LaX projection after block 0 needs the previous block's latent (h_prev)")
            z = z + self.cross(previous)
        if self.latent_norm is not None:
            z = self.latent_norm(z)
        h = self.latent(z)
        return h, h

    def forward(self, x: torch.Tensor, previous: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        fed, carried = self.crossed_latent(F.linear(x, self.A), previous)
        return self.up(fed), carried

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, crossing={self.crossing}"


def make_projection(config: BoostLlamaConfig, name: str, layer_idx: int) -> nn.Module:
    """Projection ``name`` (``q_proj`` ... ``down_proj``) of block ``layer_idx``: ``nn.Linear`` at full rank."""
    in_features, out_features = config.projection_shapes()[name]
    bias = config.attention_bias if name in ("q_proj", "k_proj", "v_proj", "o_proj") else config.mlp_bias
    if config.bottleneck is None:
        return nn.Linear(in_features, out_features, bias=bias)
    if config.bottleneck == "lax":
        return BoostLlamaLaxLinear(
            in_features,
            out_features,
            config.rank,
            config.latent_activation,
            bias,
            crossing=config.lax_gate if layer_idx > 0 else None,
            kronecker_factors=config.kronecker_factors,
            latent_norm=config.lax_latent_norm,
        )
    if config.bottleneck == "tt":
        return BoostLlamaTensorTrainLinear(in_features, out_features, config.tensor_train_shape(name), bias)
    return BoostLlamaLowRankLinear(in_features, out_features, config.rank, config.latent_activation, bias)


class LatentCrossing:
    """LaX's latents between blocks: reads each projection's latent of the previous block and records
    this block's (``{projection name: [B, S, r]}``)."""

    def __init__(self, previous: dict[str, torch.Tensor] | None):
        self.previous = previous or {}
        self.current: dict[str, torch.Tensor] = {}

    def project(self, name: str, projection: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y, self.current[name] = projection(x, self.previous.get(name))
        return y


def project(name: str, projection: nn.Module, x: torch.Tensor, crossing: LatentCrossing | None) -> torch.Tensor:
    """``projection(x)``, through the LaX ``crossing`` when the model has one."""
    return projection(x) if crossing is None else crossing.project(name, projection, x)


class BoostLlamaMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))``; CoLA with ``only_lr_act`` drops the outer ``act``."""

    def __init__(self, config: BoostLlamaConfig, layer_idx: int):
        super().__init__()
        self.gate_proj = make_projection(config, "gate_proj", layer_idx)
        self.up_proj = make_projection(config, "up_proj", layer_idx)
        self.down_proj = make_projection(config, "down_proj", layer_idx)
        self.act_fn = ACT2FN[config.mlp_activation] if config.mlp_activation else None

    def forward(self, x: torch.Tensor, crossing: LatentCrossing | None = None) -> torch.Tensor:
        gate = project("gate_proj", self.gate_proj, x, crossing)
        if self.act_fn is not None:
            gate = self.act_fn(gate)
        up = project("up_proj", self.up_proj, x, crossing)
        return project("down_proj", self.down_proj, gate * up, crossing)


class BoostLlamaAttention(nn.Module):
    """Causal self-attention with grouped-query heads; ``[B, S, d] -> [B, S, d]``."""

    def __init__(self, config: BoostLlamaConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_proj = make_projection(config, "q_proj", layer_idx)
        self.k_proj = make_projection(config, "k_proj", layer_idx)
        self.v_proj = make_projection(config, "v_proj", layer_idx)
        self.o_proj = make_projection(config, "o_proj", layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        crossing: LatentCrossing | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = project("q_proj", self.q_proj, hidden_states, crossing).view(hidden_shape).transpose(1, 2)
        key_states = project("k_proj", self.k_proj, hidden_states, crossing).view(hidden_shape).transpose(1, 2)
        value_states = project("v_proj", self.v_proj, hidden_states, crossing).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()  # [B, S, heads * head_dim]
        return project("o_proj", self.o_proj, attn_output, crossing), attn_weights


class CheckpointsItsOwnBlock(GradientCheckpointingLayer):
    """A ``GradientCheckpointingLayer`` (``gradient_checkpointing_enable`` sets its flag and counts it for
    ``every_n_layers``) whose subclasses checkpoint themselves, on positional tensors.

    transformers' own wrapper binds the keyword arguments into the checkpointed call, which re-entrant
    checkpointing cannot differentiate through (LaX's crossed latents). It wraps ``__call__`` up to transformers
    5.22 and each subclass's ``forward`` from 5.23 on: both are left out here, so the layer computes the same
    function, and checkpoints the same tensors, on every transformers version.
    """

    __call__ = nn.Module.__call__

    def __init_subclass__(cls, **kwargs):
        super(GradientCheckpointingLayer, cls).__init_subclass__(**kwargs)


class BoostLlamaDecoderLayer(CheckpointsItsOwnBlock):
    """Pre-norm decoder block. Returns ``(hidden_states, lax_latents)``; ``lax_latents`` (LaX only, else
    ``None``) are this block's latents, crossed into the next block.

    Under gradient checkpointing (``gradient_checkpointing_enable``) the block is checkpointed with the LaX
    latents as positional tensors in and out (:meth:`block`), so both re-entrant and non-re-entrant
    checkpointing carry their gradients between blocks.
    """

    def __init__(self, config: BoostLlamaConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = BoostLlamaAttention(config, layer_idx)
        self.mlp = BoostLlamaMLP(config, layer_idx)
        self.input_layernorm = BoostLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = BoostLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.crosses_latents = config.bottleneck == "lax"

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        lax_latents: dict[str, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        checkpointing = self.gradient_checkpointing and self.training
        if checkpointing and (use_cache or cache is not None):
            logger.warning_once("Caching is incompatible with gradient checkpointing: setting `use_cache=False`.")
            use_cache, cache = False, None  # the recomputation would append to the cache twice
        names = tuple(lax_latents or ())
        block = partial(
            self.block,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            latent_names=names,
            **kwargs,
        )
        previous = tuple(lax_latents[name] for name in names)
        if checkpointing:
            hidden_states, *crossed = self._gradient_checkpointing_func(block, hidden_states, *previous)
        else:
            hidden_states, *crossed = block(hidden_states, *previous)
        return hidden_states, (dict(zip(PROJECTIONS, crossed)) if self.crosses_latents else None)

    def block(
        self,
        hidden_states: torch.Tensor,
        *previous: torch.Tensor,
        latent_names: tuple[str, ...] = (),
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, ...]:
        """The block on positional tensors: ``(hidden_states, *previous latents) -> (hidden_states, *latents)``,
        the latents (LaX only) named by ``latent_names`` on the way in and in :data:`PROJECTIONS` order out."""
        kwargs.pop("position_ids", None)
        kwargs.pop("use_cache", None)
        crossing = LatentCrossing(dict(zip(latent_names, previous))) if self.crosses_latents else None
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            crossing=crossing,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + self.mlp(hidden_states, crossing=crossing)
        return (hidden_states, *(crossing.current[name] for name in PROJECTIONS)) if crossing is not None else (hidden_states,)


class BoostLlamaPreTrainedModel(SeededInitialization, PreTrainedModel):
    config_class = BoostLlamaConfig
    config: BoostLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BoostLlamaDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": BoostLlamaDecoderLayer, "attentions": BoostLlamaAttention}


def positions_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of ``hidden_states: [B, S, d]`` the LM head projects, as ``logits_to_keep`` names them (what
    ``generate`` passes): an int keeps the last that many (0: all), a 1-D tensor those positions of every sample, a
    2-D integer tensor ``[B, K]`` per-sample positions, a 2-D bool mask ``[B, S]`` its true positions (flattened to
    ``[n, d]``)."""
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    if logits_to_keep.ndim == 2 and logits_to_keep.dtype == torch.bool:
        return hidden_states[logits_to_keep]
    if logits_to_keep.ndim == 2:
        return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
    return hidden_states[:, logits_to_keep, :]


def check_token_ids(ids: torch.Tensor, vocab_size: int, where: str = "input_ids", ignore_index: int | None = None) -> None:
    """Raise if an entry of ``ids`` is outside ``[0, vocab_size)`` (``ignore_index`` allowed: labels). One min/max pass:
    on the CPU a ``ValueError`` naming the id; on an accelerator (and inside ``torch.compile``) a device-side assert
    (``torch._assert_async``, no host sync) with the same text, without the id. A model split over ranks would
    otherwise compute with such an id silently (a vocab-parallel embedding or loss counts it as another rank's)."""
    if ids.numel() == 0 or ids.is_meta:
        return
    if not torch.compiler.is_compiling() and torch._subclasses.fake_tensor.is_fake(ids):  # counted, not run: no values
        return
    valid = ids if ignore_index is None else ids.masked_fill(ids == ignore_index, 0)
    low, high = torch.aminmax(valid)
    outside = (f"outside the model's vocabulary [0, {vocab_size})" if ignore_index is None else
               f"neither in the model's vocabulary [0, {vocab_size}) nor the ignore index {ignore_index}")
    fix = "the data was tokenized with another tokenizer, or vocab_size is too small."
    if ids.device.type != "cpu" or torch.compiler.is_compiling():  # no host sync, no data-dependent branch
        torch._assert_async((low >= 0) & (high < vocab_size), f"a token id in {where} is {outside}: {fix}")
        return
    if low < 0 or high >= vocab_size:
        raise ValueError(f"token id {int(low) if low < 0 else int(high)} in {where} is {outside}: {fix}")


@dataclass
class BoostLlamaModelOutput(BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` and, from a model without its final norm (a pipeline stage that hands on), LaX's
    ``lax_latents``: the last block's latents ``{projection: [B, S, r]}``, which the next block crosses in."""

    lax_latents: dict[str, torch.Tensor] | None = None


class BoostLlamaModel(BoostLlamaPreTrainedModel):
    """Embedding -> decoder layers -> final norm; ``last_hidden_state: [B, S, d]``. ``input_ids`` outside the
    vocabulary raise (:func:`check_token_ids`).

    A pipeline stage is this model with what it lacks set to ``None`` (as torchtitan's): without ``embed_tokens``
    it takes ``inputs_embeds`` (the previous stage's hidden states, and its ``lax_latents``); without ``norm`` it
    returns the decoder stack's output and LaX's ``lax_latents`` for the next stage.

    ``residual_dtype``: the dtype of the residual stream between the decoder layers (``None``: the embedding's).
    ``torch.float32`` over bf16 weights keeps the residual additions in fp32 while the layers compute in bf16 under
    autocast (Megatron-LM's ``fp32_residual_connection``); a training precision policy sets it.
    """

    residual_dtype: torch.dtype | None = None

    def __init__(self, config: BoostLlamaConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(BoostLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = BoostLlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = BoostLlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        lax_latents: dict[str, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> BoostLlamaModelOutput:
        cache = one_cache(cache, past_key_values)
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is not None and self.embed_tokens is None:
            raise ValueError("this model holds no embedding (a pipeline stage after the first): pass inputs_embeds")
        if input_ids is not None:
            check_token_ids(input_ids, self.config.vocab_size)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        sequence = self.sequence_of(inputs_embeds)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(sequence.shape[1], device=sequence.device) + past_seen_tokens).unsqueeze(0)

        # (config, inputs_embeds, attention_mask, cache) by position: the cache's keyword differs between releases
        causal_mask = create_causal_mask(self.config, sequence, attention_mask, cache, position_ids=position_ids)
        hidden_states = inputs_embeds if self.residual_dtype is None else inputs_embeds.to(self.residual_dtype)
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, lax_latents = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                lax_latents=lax_latents,
                **kwargs,
            )
        if self.norm is None:  # a stage before the last: its output and LaX's latents go to the next stage
            return BoostLlamaModelOutput(last_hidden_state=hidden_states, **{CACHE_NAME: cache}, lax_latents=lax_latents)
        return BoostLlamaModelOutput(last_hidden_state=self.norm(hidden_states), **{CACHE_NAME: cache})

    def sequence_of(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """The tensor whose ``[B, S]`` the causal mask and the positions are built for: ``inputs_embeds`` (a
        tensor-parallel stage whose input is a token shard overrides this)."""
        return inputs_embeds


class BoostLlamaForCausalLM(CheckedLoading, BoostLlamaPreTrainedModel, GenerationMixin):
    """Causal LM: base model -> LM head ``[B, S, V]`` -> next-token cross-entropy (``labels`` outside the vocabulary,
    other than ``IGNORE_INDEX``, raise).

    ``BoostLlamaForCausalLM(config, parallel_config=ParallelConfig(tp_size=4))`` inside a launched process
    group builds this rank's shard (see :func:`boost_hf.parallel.parallelize`).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: BoostLlamaConfig, parallel_config=None):
        super().__init__(config)
        # A ParallelConfig (boost-hf) builds on the meta device and shards from outside; this file never
        # imports boost-hf, so a checkpoint's copy of it loads anywhere.
        with parallel_config.single_device_skeleton() if parallel_config is not None else contextlib.nullcontext():
            self.model = BoostLlamaModel(config)
            self.vocab_size = config.vocab_size
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()
        if parallel_config is not None:
            parallel_config.parallelize(self)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if labels is not None:  # before any work (or, split over ranks, any collective)
            check_token_ids(labels, self.config.vocab_size, "labels", ignore_index=IGNORE_INDEX)
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=one_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        if self.lm_head is None:  # a pipeline stage before the last: hidden states out
            if labels is not None:
                raise ValueError("this model holds no LM head (a pipeline stage before the last): it computes no loss")
            return outputs
        hidden_states = positions_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# Every saved model ships this file and its configuration and names them in ``auto_map``, so
# ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` works without boost-hf.
BoostLlamaModel.register_for_auto_class("AutoModel")
BoostLlamaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "IGNORE_INDEX",
    "check_token_ids",
    "BoostLlamaPreTrainedModel",
    "BoostLlamaModel",
    "BoostLlamaModelOutput",
    "BoostLlamaForCausalLM",
    "BoostLlamaRMSNorm",
    "BoostLlamaRotaryEmbedding",
    "BoostLlamaLowRankLinear",
    "BoostLlamaLaxLinear",
    "BoostLlamaTensorTrainCores",
    "BoostLlamaTensorTrainLinear",
    "BoostLlamaAttention",
    "BoostLlamaMLP",
    "BoostLlamaDecoderLayer",
]
