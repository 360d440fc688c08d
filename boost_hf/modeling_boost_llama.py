"""The boost-hf LLaMA family: full-rank LLaMA and its low-rank bottleneck variants (svd, cola, lax, tt).

A single-device model that reads like ``transformers``' ``modeling_llama.py``: norm -> rotary ->
projections -> MLP -> attention -> decoder layer -> base model -> causal-LM head. It imports only
``torch``, ``transformers`` and its configuration, so it is also what a saved checkpoint ships as remote
code. With ``bottleneck=None`` it is exactly ``transformers.LlamaForCausalLM`` (same names, same logits).

Tensor parallelism is applied from outside (:func:`boost_hf.parallel.parallelize`), which swaps these
modules for sharded ones and keeps every parameter name.

Shapes: ``B`` batch, ``S`` sequence, ``d`` hidden size, ``r`` rank.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.core_model_loading import Transpose, WeightConverter
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, eager_attention_forward
from transformers.utils import can_return_tuple, logging
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_boost_llama import AUTHORS_COLA_MODEL_TYPE, BoostLlamaConfig, TensorTrainShape

logger = logging.get_logger(__name__)

LATENT_NORM_EPS = 1e-6  # the LaX authors' latent LayerNorm
IGNORE_INDEX = -100  # a label the loss skips (transformers' convention)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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

    def cross(self, previous: torch.Tensor) -> torch.Tensor:
        """``G h_prev`` for ``h_prev: [..., r]``."""
        if self.crossing == "identity":
            return previous
        if self.crossing == "dense":
            return F.linear(previous, self.gate, self.gate_bias)
        a, b = self.gate_left.shape[0], self.gate_right.shape[0]
        grid = previous.reshape(*previous.shape[:-1], a, b)
        # kron(L, R) vec(H) = vec(L H R^T) for a row-major H of shape [a, b]
        return (self.gate_left @ grid @ self.gate_right.T).reshape(previous.shape)

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


def contract_cores(cores: list[torch.Tensor]) -> torch.Tensor:
    """Consecutive tensor-train cores ``[r_0, m_0, r_1], ..., [r_{k-1}, m_{k-1}, r_k]`` contracted over their shared
    ranks: the matrix ``[r_0 m_0 ... m_{k-1}, r_k]``, rows indexed by ``(r_0, m_0, ..., m_{k-1})`` row-major."""
    matrix = cores[0].reshape(-1, cores[0].shape[-1])
    for core in cores[1:]:
        matrix = (matrix @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[-1])
    return matrix


class BoostLlamaTensorTrainCores(nn.Module):
    """The cores of one tensor-train projection, ``[rank_in, mode, rank_out]`` each: parameters ``0``, ``1``, ...
    (``<projection>.cores.<i>``, as the release names them).

    Module call ``cores(start, stop)``: cores ``start .. stop - 1`` contracted (:func:`contract_cores`). A module
    call, so that what gathers a module's parameters before its forward (DeepSpeed ZeRO-3) gathers the cores."""

    def __init__(self, shapes: list[tuple[int, int, int]]):
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(str(i), nn.Parameter(torch.empty(shape)))

    def __len__(self) -> int:
        return len(self._parameters)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._parameters[str(i)]

    def __iter__(self):
        return iter(self._parameters.values())

    def forward(self, start: int, stop: int) -> torch.Tensor:
        return contract_cores([self[i] for i in range(start, stop)])

    def extra_repr(self) -> str:
        return ", ".join(f"{name}: {tuple(core.shape)}" for name, core in self._parameters.items())


class BoostLlamaTensorTrainLinear(nn.Module):
    """Tensor-train projection (the BOOST release's ``TensorTrainLinear``): ``y = (x A^T) B^T (+ bias)``.

    ``cores``: the input cores (modes of ``in_features``) then the output cores (modes of ``out_features``), see
    :class:`~.configuration_boost_llama.TensorTrainShape`. The input cores contract into ``A^T: [in_features, r]``,
    the output cores into ``B^T: [r, out_features]`` (``r`` the middle rank), both at every call, and the tokens
    go through two GEMMs, as the release's half reconstruction; nothing between the factors. ``A: [r, in_features]``
    and ``B: [out_features, r]`` are these reconstructions (properties, not parameters), so the tensor-parallel
    layouts run it as any bottleneck. ``bias: [out_features]`` after ``B``.
    """

    def __init__(self, in_features: int, out_features: int, tensor_train: TensorTrainShape, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.tensor_train = in_features, out_features, tensor_train
        self.rank = tensor_train.middle_rank
        self.cores = BoostLlamaTensorTrainCores(tensor_train.core_shapes)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def A(self) -> torch.Tensor:
        """``[r, in_features]``: the input cores contracted (rows of ``A^T`` indexed by the input modes)."""
        return self.cores(0, self.tensor_train.split).T

    @property
    def B(self) -> torch.Tensor:
        """``[out_features, r]``: the output cores contracted (columns of ``B^T`` indexed by the output modes)."""
        split = self.tensor_train.split
        rank = self.cores[split].shape[0]  # r, or the slice of it that a tensor-parallel rank holds
        return self.cores(split, len(self.cores)).reshape(rank, -1).T

    def latent(self, z: torch.Tensor) -> torch.Tensor:
        """The function between the factors: none."""
        return z

    def up(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.B, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.linear(x, self.A))

    def extra_repr(self) -> str:
        tt = self.tensor_train
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"modes={list(tt.input_modes)}x{list(tt.output_modes)}, ranks={list(tt.ranks)}, bias={self.bias is not None}"
        )


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
        past_key_values: Cache | None = None,
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
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)

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
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        lax_latents: dict[str, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        checkpointing = self.gradient_checkpointing and self.training
        if checkpointing and (use_cache or past_key_values is not None):
            logger.warning_once("Caching is incompatible with gradient checkpointing: setting `use_cache=False`.")
            use_cache, past_key_values = False, None  # the recomputation would append to the cache twice
        names = tuple(lax_latents or ())
        block = partial(
            self.block,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
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
        past_key_values: Cache | None = None,
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
            past_key_values=past_key_values,
            crossing=crossing,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + self.mlp(hidden_states, crossing=crossing)
        return (hidden_states, *(crossing.current[name] for name in PROJECTIONS)) if crossing is not None else (hidden_states,)


def name_seed(seed: int, name: str) -> int:
    """A per-parameter seed from the global seed and the parameter's name (the same at every TP size)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class BoostLlamaPreTrainedModel(PreTrainedModel):
    config_class = BoostLlamaConfig
    config: BoostLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BoostLlamaDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": BoostLlamaDecoderLayer, "attentions": BoostLlamaAttention}

    def initial_value(self, module: nn.Module, name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor | None:
        """The initial value of parameter ``name`` of ``module`` at its full ``shape`` (``None``: not ours).

        Dense weights ``N(0, initializer_range^2)``; bottleneck factors ``N(0, s^2)`` with
        ``s = r^(-1/4) (in + out)^(-1/4)`` (CoLA; ``factor_init="xavier"``: ``s = sqrt(2 / (rows + columns))`` of each
        factor's own shape) and the bias after ``B`` ``U(-out^(-1/2), out^(-1/2))`` (CoLA); LaX
        gates as their authors initialise them: the dense gate ``N(0, 0.02^2)`` with a zero bias (timm's
        ``nn.Linear`` init), each Kronecker factor ``[n, n]`` Kaiming-uniform ``U(-sqrt(6/n), sqrt(6/n))``;
        tensor-train cores ``[r_in, m, r_out]`` as the BOOST release initialises them, ``N(0, s^2)`` with
        ``s = (r_in r_out)^(-1/4) initializer_range^(1 / tt_cores)`` (their product has std about
        ``initializer_range``), and a zero bias; norm weights 1 and other biases 0.
        """
        if isinstance(module, BoostLlamaLowRankLinear) and name in ("A", "B") and self.config.factor_init == "xavier":
            std = (2.0 / (shape[0] + shape[1])) ** 0.5
        elif isinstance(module, BoostLlamaLowRankLinear) and name in ("A", "B"):
            std = (module.rank**-0.25) * ((module.in_features + module.out_features) ** -0.25)
        elif isinstance(module, BoostLlamaLowRankLinear) and name == "bias":
            bound = module.out_features**-0.5
            return torch.empty(shape).uniform_(-bound, bound, generator=generator)
        elif isinstance(module, BoostLlamaLaxLinear) and name == "gate":
            std = 0.02
        elif isinstance(module, BoostLlamaTensorTrainCores):
            rank_in, _, rank_out = shape
            std = (rank_in * rank_out) ** -0.25 * self.config.initializer_range ** (1.0 / self.config.tt_cores)
        elif isinstance(module, BoostLlamaLaxLinear) and name in ("gate_left", "gate_right"):
            bound = (6.0 / shape[1]) ** 0.5  # torch.nn.init.kaiming_uniform_ with its defaults (fan_in, a=0)
            return torch.empty(shape).uniform_(-bound, bound, generator=generator)
        elif isinstance(module, (nn.Linear, nn.Embedding)) and name == "weight":
            std = self.config.initializer_range
        elif name in ("bias", "gate_bias"):
            return torch.zeros(shape)
        elif isinstance(module, (BoostLlamaRMSNorm, nn.LayerNorm)) and name == "weight":
            return torch.ones(shape)
        else:
            return None
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    def parameter_name(self, module: nn.Module, name: str) -> str:
        """The checkpoint name of ``module``'s parameter ``name``, relative to the base model (``lm_head.weight``)."""
        names = self.__dict__.get("_module_names")
        if names is None or module not in names:
            names = self.__dict__["_module_names"] = {m: n for n, m in self.named_modules()}
        full = f"{names[module]}.{name}" if names[module] else name
        prefix = self.base_model_prefix + "."
        return full[len(prefix):] if full.startswith(prefix) else full

    def _init_weights(self, module: nn.Module) -> None:
        """Every parameter is drawn from a generator seeded by ``(torch.initial_seed(), its name)``: the
        model is reproducible from the seed alone and independent of how it is later sharded."""
        if isinstance(module, BoostLlamaRotaryEmbedding):
            super()._init_weights(module)
        for name, param in module.named_parameters(recurse=False):
            generator = torch.Generator().manual_seed(name_seed(torch.initial_seed(), self.parameter_name(module, name)))
            value = self.initial_value(module, name, tuple(param.shape), generator)
            if value is None:
                continue  # not a parameter of this model's own modules (e.g. an adapter added later)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                value[module.padding_idx] = 0.0
            init.copy_(param, value)


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


class BoostLlamaModel(BoostLlamaPreTrainedModel):
    """Embedding -> decoder layers -> final norm; ``last_hidden_state: [B, S, d]``. ``input_ids`` outside the
    vocabulary raise (:func:`check_token_ids`).

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
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            check_token_ids(input_ids, self.config.vocab_size)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens).unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        hidden_states = inputs_embeds if self.residual_dtype is None else inputs_embeds.to(self.residual_dtype)
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        lax_latents = None
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, lax_latents = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
                lax_latents=lax_latents,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values)


HUB_KWARGS = ("cache_dir", "revision", "token", "local_files_only", "force_download", "subfolder", "proxies")


def is_authors_cola_checkpoint(pretrained_model_name_or_path, kwargs: dict) -> bool:
    """Whether the checkpoint's ``config.json`` was written by the CoLA authors' code (``model_type: "cola"``)."""
    hub = {name: kwargs[name] for name in HUB_KWARGS if name in kwargs}
    try:
        config_dict, _ = PretrainedConfig.get_config_dict(pretrained_model_name_or_path, **hub)
    except OSError:
        return False  # no config to read: the ordinary load reports it
    return config_dict.get("model_type") == AUTHORS_COLA_MODEL_TYPE


def authors_cola_weight_conversions() -> list[WeightConverter]:
    """transformers' checkpoint conversions from the CoLA authors' parameters: ``*.cola_a [in, r]`` -> ``A``
    (transposed), ``*.cola_b [r, out]`` -> ``B`` (transposed); every other name (embedding, norms, biases after
    ``B``, LM head) is already ours."""
    return [
        WeightConverter(source_patterns="cola_a", target_patterns="A", operations=[Transpose(0, 1)]),
        WeightConverter(source_patterns="cola_b", target_patterns="B", operations=[Transpose(0, 1)]),
    ]


@contextlib.contextmanager
def converting_authors_cola(class_name: str):
    """Within: ``from_pretrained`` of ``class_name`` applies :func:`authors_cola_weight_conversions` (registered
    with transformers' conversion mapping for that class only while loading, then restored)."""
    previous = get_checkpoint_conversion_mapping(class_name)
    register_checkpoint_conversion_mapping(class_name, authors_cola_weight_conversions(), overwrite=True)
    try:
        yield
    finally:
        register_checkpoint_conversion_mapping(class_name, previous or [], overwrite=True)


class BoostLlamaForCausalLM(BoostLlamaPreTrainedModel, GenerationMixin):
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

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, parallel_config=None, check_architecture=True, **kwargs):
        """``PreTrainedModel.from_pretrained``; with a boost-hf ``parallel_config``, this rank's shard of the
        given tensor-parallel layout, reading only this rank's slices of the checkpoint.

        A checkpoint (folder or Hub id) must match the model exactly: missing, unexpected or wrongly-shaped
        weights raise, unless ``output_loading_info=True`` (the report is returned instead) or
        ``ignore_mismatched_sizes=True`` (sizes only). ``from_pretrained(None, config=..., state_dict=...)``
        reads no checkpoint and behaves as in transformers (missing weights are initialised). A checkpoint records the
        architecture its weights were trained as (boost-hf's ``manifest.json``, else its saved ``config.json``): a config
        that computes another function (see :meth:`_check_saved_architecture`) raises unless ``check_architecture=False``.

        A checkpoint written by the CoLA authors' code (``model_type: "cola"``) is converted while it loads
        (:meth:`from_authors_cola`)."""
        if check_architecture and pretrained_model_name_or_path is not None:
            cls._check_saved_architecture(str(pretrained_model_name_or_path), kwargs)
        if pretrained_model_name_or_path is not None and is_authors_cola_checkpoint(pretrained_model_name_or_path, kwargs):
            return cls.from_authors_cola(pretrained_model_name_or_path, *model_args, parallel_config=parallel_config, **kwargs)
        if parallel_config is not None:  # the architecture was checked above
            return parallel_config.load_pretrained(cls, pretrained_model_name_or_path, *model_args, check_architecture=False, **kwargs)
        return cls._from_pretrained_checked(pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def from_authors_cola(cls, pretrained_model_name_or_path, *model_args, parallel_config=None, **kwargs):
        """A checkpoint written by the CoLA authors' code (``alvin-zyl/CoLA``), loaded as it is: its
        ``config.json`` read as ours (``BoostLlamaConfig.get_config_dict``), its ``*.cola_a`` / ``*.cola_b``
        transposed into ``A`` / ``B`` by transformers' checkpoint conversion (:func:`authors_cola_weight_conversions`).
        The model saves in the canonical format. With a ``parallel_config`` the whole checkpoint is converted on
        each rank, then sliced into this rank's shard (no collective but the layout's checks)."""
        with converting_authors_cola(cls.__name__):
            loaded = cls._from_pretrained_checked(pretrained_model_name_or_path, *model_args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        model._weight_conversions = []  # converted once: save_pretrained writes our names, not the authors'
        if parallel_config is not None:
            parallel_config.parallelize(model)
        return loaded

    @classmethod
    def _from_pretrained_checked(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``PreTrainedModel.from_pretrained`` that raises on any mismatch between checkpoint and model."""
        if pretrained_model_name_or_path is None:
            # No checkpoint to check (weights from ``state_dict=`` and ``config=`` only): exactly transformers'
            # behaviour, missing weights initialised and reported with ``output_loading_info``.
            return super().from_pretrained(None, *model_args, **kwargs)
        # Unlike a plain transformers load, a checkpoint of another architecture (missing, unexpected or
        # wrongly-shaped weights) is an error, unless the caller asks for the loading report or to ignore sizes.
        wants_report = kwargs.pop("output_loading_info", False)
        tolerate_sizes = kwargs.get("ignore_mismatched_sizes", False)
        kwargs["ignore_mismatched_sizes"] = True
        model, report = super().from_pretrained(pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs)
        if wants_report:
            return model, report
        order = {name: i for i, name in enumerate(model.state_dict())}
        mismatched = [] if tolerate_sizes else sorted(report.get("mismatched_keys", ()), key=lambda m: order.get(m[0], -1))
        problems = {
            "missing": sorted(report.get("missing_keys", ()), key=lambda name: order.get(name, -1)),
            "unexpected": sorted(report.get("unexpected_keys", ())),
            "shape mismatch": [f"{name}: checkpoint {tuple(saved)} vs model {tuple(ours)}" for name, saved, ours in mismatched],
        }
        if any(problems.values()):
            earlier_lax = any(name.endswith(".gate_bias") for name in problems["missing"]) or any(
                ".layers.0." in name and ".latent_norm." in name for name in problems["unexpected"]
            )
            raise ValueError(
                "checkpoint does not match this model's architecture (was it saved from another bottleneck, rank "
                "or size? load it with its own config.json): "
                + "; ".join(f"{kind} {names[:5]}{'...' if len(names) > 5 else ''}" for kind, names in problems.items() if names)
                + (
                    ". These are LaX weights of boost-hf's earlier LaX (a latent LayerNorm in block 0, a dense gate "
                    "without bias), which computes another function than the LaX authors' definition used now."
                    if earlier_lax else ""
                )
            )
        return model

    @classmethod
    def _check_saved_architecture(cls, pretrained_model_name_or_path: str, kwargs: dict) -> None:
        """Raise ``ValueError`` naming the fields where the config used to load a checkpoint (``config=``, keyword
        overrides such as ``only_lr_act=False``, or an edited ``config.json``) differs from the architecture the
        checkpoint records: the same tensors would compute another function (a cola checkpoint read as svd,
        ``only_lr_act`` or the LaX base flipped, ...). The record is the folder's ``manifest.json`` (written by
        boost-hf's trainer) or else its saved ``config.json`` (``save_pretrained``; local or on the Hub); a checkpoint
        of another model type (e.g. ``LlamaForCausalLM``) has none here."""
        config = kwargs.get("config")
        if config is not None and not isinstance(config, cls.config_class):
            return
        record = cls._saved_architecture(pretrained_model_name_or_path, kwargs)
        if record is None:
            return
        if config is None:
            config, _ = cls.config_class.from_pretrained(pretrained_model_name_or_path, return_unused_kwargs=True, **kwargs)
        different = config.architecture_differences(record)
        if different:
            raise ValueError(
                f"{pretrained_model_name_or_path!r} was saved from another architecture than the config used to load it "
                f"({'; '.join(different)}): its weights would compute another function. Load it with its own config.json "
                "(no config= or overrides), or pass check_architecture=False to load the tensors anyway."
            )

    @classmethod
    def _saved_architecture(cls, pretrained_model_name_or_path: str, kwargs: dict) -> dict | None:
        """The architecture record of a checkpoint: its ``manifest.json``'s, else that of its ``config.json`` when it
        is a config of this model type; ``None`` when there is neither."""
        manifest = os.path.join(pretrained_model_name_or_path, kwargs.get("subfolder") or "", "manifest.json")
        if os.path.isfile(manifest):
            with open(manifest) as f:
                record = json.load(f).get("architecture")
            if record is not None:
                return record
        hub = {name: kwargs[name] for name in HUB_KWARGS if name in kwargs}
        try:
            saved, _ = cls.config_class.get_config_dict(pretrained_model_name_or_path, **hub)
        except OSError:
            return None  # no config to read: the ordinary load reports it
        if saved.get("model_type") != cls.config_class.model_type:
            return None
        return cls.config_class.from_dict(saved).architecture_record()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        if labels is not None:  # before any work (or, split over ranks, any collective)
            check_token_ids(labels, self.config.vocab_size, "labels", ignore_index=IGNORE_INDEX)
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = positions_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
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
