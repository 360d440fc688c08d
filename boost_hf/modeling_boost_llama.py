"""The boost-hf LLaMA family: full-rank LLaMA and its low-rank bottleneck variants (svd, cola, lax).

Reads like ``transformers``' ``modeling_llama.py``: norm -> rotary -> attention -> MLP -> decoder layer
-> base model -> causal-LM head. The tensor-parallel layout is decided outside, by a
:class:`~boost_hf.parallel.plan.TensorParallelPlan` built from a
:class:`~boost_hf.parallel.config.ParallelConfig`; with none (or ``tp_size=1``) this is a plain
single-device model, and with ``bottleneck=None`` it computes exactly ``transformers.LlamaForCausalLM``.

Shapes: ``B`` batch, ``S`` sequence, ``d`` hidden size, ``r`` rank, ``p`` tensor-parallel size. The
residual stream is ``[B, S, d]`` except under BTP, where each rank holds ``[B, S, d/p]``.

A decoder layer runs as five segments separated by the collectives of its projection groups (see
:mod:`boost_hf.parallel.groups`); ``activation_checkpointing="lowrank"`` recomputes each segment from
its inputs, which are only r-dim latents and the residual.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.initialization import no_init_weights
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, eager_attention_forward

from .configuration_boost_llama import BoostLlamaConfig
from .parallel.checkpoint_io import HUB_KWARGS, canonical_state_dict, load_canonical_checkpoint, resolve_checkpoint_files
from .parallel.checkpointing import run_segment
from .parallel.config import ParallelConfig
from .parallel.cross_entropy import vocab_parallel_causal_lm_loss
from .parallel.norms import rms_norm
from .parallel.plan import TensorParallelPlan
from .parallel.primitives import gather_from_tp, split_to_tp
from .parallel.sharding import constant_init, init_from_full, sharded_parameter


class BoostLlamaRMSNorm(nn.Module):
    """RMSNorm, ``weight: [d]`` (canonical); under BTP the block norms hold ``[d/p]`` and are applied by
    the projection group that reads them (online or sync statistics, :mod:`boost_hf.parallel.norms`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, split_dim: int | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.weight = sharded_parameter((hidden_size,), split_dim, tp_rank, tp_size, constant_init(1.0))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shard_spec.full_shape)}, local={tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class BoostLlamaRotaryEmbedding(LlamaRotaryEmbedding):
    """RoPE exactly as ``transformers``' LLaMA (``cos, sin: [B, S, head_dim]``)."""


class BoostLlamaAttention(nn.Module):
    """Causal self-attention with GQA on this rank's heads (all heads unless the plan splits them)."""

    def __init__(self, config: BoostLlamaConfig, layer_idx: int, plan: TensorParallelPlan):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.head_dim
        self.num_heads = plan.local_heads(config.num_attention_heads)
        self.num_key_value_heads = plan.local_heads(config.num_key_value_heads)
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_proj = plan.projection("q_proj", layer_idx)
        self.k_proj = plan.projection("k_proj", layer_idx)
        self.v_proj = plan.projection("v_proj", layer_idx)
        self.o_proj = plan.projection("o_proj", layer_idx)
        self.qkv = plan.projection_group([self.q_proj, self.k_proj, self.v_proj], row=False, reads_norm=True)
        self.o = plan.projection_group([self.o_proj], row=True, reads_norm=False)

    def attend(self, z_qkv, carries, position_embeddings, attention_mask, past_key_values, **kwargs):
        """``z_qkv`` (the qkv group's reduced latents) -> ``(o_proj partials, qkv carries)``.

        B_q, B_k, B_v -> RoPE -> attention over ``[B, heads, S, head_dim]`` -> A_o (local part)."""
        (q, k, v), carries = self.qkv.up(z_qkv, carries)
        input_shape = q.shape[:-1]
        q = q.view(*input_shape, -1, self.head_dim).transpose(1, 2)
        k = k.view(*input_shape, -1, self.head_dim).transpose(1, 2)
        v = v.view(*input_shape, -1, self.head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = attention(
            self, q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()  # [B, S, heads_local * head_dim]
        return self.o.down(out), carries


class BoostLlamaMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))``; CoLA with ``only_lr_act`` drops the outer ``act``."""

    def __init__(self, config: BoostLlamaConfig, layer_idx: int, plan: TensorParallelPlan):
        super().__init__()
        self.gate_proj = plan.projection("gate_proj", layer_idx)
        self.up_proj = plan.projection("up_proj", layer_idx)
        self.down_proj = plan.projection("down_proj", layer_idx)
        self.gate_up = plan.projection_group([self.gate_proj, self.up_proj], row=False, reads_norm=True)
        self.down = plan.projection_group([self.down_proj], row=True, reads_norm=False)
        self.act_fn = ACT2FN[config.mlp_activation] if config.mlp_activation else None

    def multiply(self, z_gate_up, carries):
        """``z_gate_up`` -> ``(down_proj partials, gate/up carries)``: B_gate, B_up, product, A_down (local)."""
        (gate, up), carries = self.gate_up.up(z_gate_up, carries)
        if self.act_fn is not None:
            gate = self.act_fn(gate)
        return self.down.down(gate * up), carries


class BoostLlamaDecoderLayer(nn.Module):
    """Pre-norm decoder block. ``hidden_states``: the residual stream (``[B, S, d/p]`` under BTP).

    ``carries`` are LaX's latents of this block's 7 projections, passed to the next block (empty otherwise).
    """

    def __init__(self, config: BoostLlamaConfig, layer_idx: int, plan: TensorParallelPlan):
        super().__init__()
        norm_split = dict(split_dim=plan.block_norm_split(), tp_rank=plan.tp_rank, tp_size=plan.tp_size)
        self.self_attn = BoostLlamaAttention(config, layer_idx, plan)
        self.mlp = BoostLlamaMLP(config, layer_idx, plan)
        self.input_layernorm = BoostLlamaRMSNorm(config.hidden_size, config.rms_norm_eps, **norm_split)
        self.post_attention_layernorm = BoostLlamaRMSNorm(config.hidden_size, config.rms_norm_eps, **norm_split)
        self.checkpointing = plan.parallel.activation_checkpointing
        # LaX latents handed to the next block, per group (qkv, o, gate_up, down)
        self.carry_counts = (3, 1, 2, 1) if config.bottleneck == "lax" else (0, 0, 0, 0)

    def forward(self, hidden_states, carries=(), position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        full = self.checkpointing == "full" and self.training
        run = lambda *t: self._segments(t[0], t[1:], position_embeddings, attention_mask, past_key_values, **kwargs)  # noqa: E731
        out = run_segment(run, hidden_states, *carries, recompute=full)
        return out[0], out[1:]

    def _segments(self, hidden_states, carries, position_embeddings, attention_mask, past_key_values, **kwargs):
        attn, mlp = self.self_attn, self.mlp
        lowrank = self.checkpointing == "lowrank" and self.training
        n_qkv, n_o, n_gate_up, n_down = self.carry_counts
        c_qkv, c_o, c_gate_up, c_down = _split(carries, self.carry_counts) if carries else ((),) * 4

        def segment(fn, *tensors):  # fn runs again in backward (lowrank): bind loop variables as defaults
            return run_segment(lambda *t: tuple(fn(*t)), *tensors, recompute=lowrank)

        # 1. input norm -> A_q, A_k, A_v (local part) | collective
        z = attn.qkv.reduce(segment(lambda x: attn.qkv.down(x, self.input_layernorm), hidden_states))
        # 2. latents -> B_q, B_k, B_v -> attention -> A_o (local part) | collective
        n = len(z)
        out = segment(
            lambda *t, n=n: _flat(*attn.attend(t[:n], t[n:], position_embeddings, attention_mask, past_key_values, **kwargs)),
            *z, *c_qkv,
        )
        partial_o, c_qkv = _tail(out, n_qkv)
        z = attn.o.reduce(partial_o)
        # 3. latent -> B_o, residual add -> post-attention norm -> A_gate, A_up (local part) | collective
        n = len(z)

        def attention_output_and_mlp_input(*t, n=n):
            (o,), carry = attn.o.up(t[:n], t[n + 1:])
            residual = t[n] + o
            return (residual, *mlp.gate_up.down(residual, self.post_attention_layernorm), *carry)

        out, c_o = _tail(segment(attention_output_and_mlp_input, *z, hidden_states, *c_o), n_o)
        hidden_states = out[0]
        z = mlp.gate_up.reduce(out[1:])
        # 4. latents -> B_gate, B_up -> product -> A_down (local part) | collective
        n = len(z)
        partial_down, c_gate_up = _tail(segment(lambda *t, n=n: _flat(*mlp.multiply(t[:n], t[n:])), *z, *c_gate_up), n_gate_up)
        z = mlp.down.reduce(partial_down)
        # 5. latent -> B_down, residual add
        n = len(z)

        def mlp_output(*t, n=n):
            (y,), carry = mlp.down.up(t[:n], t[n + 1:])
            return (t[n] + y, *carry)

        out, c_down = _tail(segment(mlp_output, *z, hidden_states, *c_down), n_down)
        return (out[0], *c_qkv, *c_o, *c_gate_up, *c_down)


def _split(items, counts):
    parts, start = [], 0
    for c in counts:
        parts.append(tuple(items[start: start + c]))
        start += c
    return parts


def _flat(first, second):
    return (*first, *second)


def _tail(items, count):
    """Split ``items`` into ``(head, last count items)``."""
    return tuple(items[: len(items) - count]), tuple(items[len(items) - count:])


class BoostLlamaPreTrainedModel(PreTrainedModel):
    config_class = BoostLlamaConfig
    config: BoostLlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["BoostLlamaDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        """Every parameter is drawn at its canonical (unsharded) shape from a generator seeded by
        ``(torch.initial_seed(), canonical name)`` and then sliced, so a sharded model holds exactly the
        slices of the single-device model built after the same ``torch.manual_seed``."""
        if isinstance(module, LlamaRotaryEmbedding):
            super()._init_weights(module)
            return
        seed = self.init_seed
        for param in module.parameters(recurse=False):
            if hasattr(param, "full_init") and hasattr(param, "canonical_name"):
                init.copy_(param, init_from_full(param, param.canonical_name, seed))

    @property
    def init_seed(self) -> int:
        """The seed every rank draws the initial weights from: ``torch.initial_seed()`` of global rank 0,
        broadcast once per model, so unseeded ranks never build inconsistent shards."""
        if getattr(self, "_init_seed", None) is None:
            seed = [torch.initial_seed()]
            if dist.is_available() and dist.is_initialized():
                dist.broadcast_object_list(seed, src=0)
            self._init_seed = seed[0]
        return self._init_seed

    def _name_parameters(self) -> None:
        """Give every parameter its canonical name (relative to the base model; ``lm_head.weight``)."""
        prefix = self.base_model_prefix + "."
        for name, param in self.named_parameters():
            if not hasattr(param, "canonical_name"):
                param.canonical_name = name[len(prefix):] if name.startswith(prefix) else name


class BoostLlamaModel(BoostLlamaPreTrainedModel):
    """Embedding -> decoder layers -> final norm. ``last_hidden_state``: ``[B, S, d]``, full width."""

    def __init__(self, config: BoostLlamaConfig, parallel_config: ParallelConfig | None = None, plan: TensorParallelPlan | None = None):
        super().__init__(config)
        self.plan = plan or TensorParallelPlan(config, parallel_config)
        self.embed_tokens = self.plan.embedding()
        self.layers = nn.ModuleList(BoostLlamaDecoderLayer(config, i, self.plan) for i in range(config.num_hidden_layers))
        self.norm = BoostLlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = BoostLlamaRotaryEmbedding(config=config)
        self._name_parameters()
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

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
        if inputs_embeds is None:
            hidden_states = self.embed_tokens(input_ids)  # [B, S, d] ([B, S, d/p] under BTP)
        else:
            hidden_states = split_to_tp(inputs_embeds, -1, self.plan.group) if self.plan.residual_sharded else inputs_embeds
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if self.training and self.plan.parallel.activation_checkpointing != "none":
            use_cache = False  # recomputed segments would append to the cache twice
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(hidden_states.shape[1], device=hidden_states.device) + past_seen).unsqueeze(0)
        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        carries = ()
        for layer in self.layers:
            hidden_states, carries = layer(
                hidden_states,
                carries,
                position_embeddings=position_embeddings,
                attention_mask=causal_mask,
                past_key_values=past_key_values,
                **kwargs,
            )
        if self.plan.residual_sharded:
            hidden_states = gather_from_tp(hidden_states, -1, self.plan.group)  # [B, S, d/p] -> [B, S, d]
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=past_key_values if use_cache else None)


class BoostLlamaForCausalLM(BoostLlamaPreTrainedModel, GenerationMixin):
    """Causal LM: base model -> vocab-parallel LM head -> vocab-parallel cross-entropy.

    ``BoostLlamaForCausalLM(config, parallel_config=ParallelConfig(tp_size=4))`` inside a launched process
    group builds this rank's shard. ``model(input_ids, labels=labels).loss`` is the same on every rank.
    ``.logits`` are full-vocab ``[B, S, V]`` when no labels are given (so ``generate()`` works under TP) or
    when ``return_logits=True``; with labels under TP they are omitted (never gathered for the loss).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: BoostLlamaConfig, parallel_config: ParallelConfig | None = None):
        super().__init__(config)
        self.model = BoostLlamaModel(config, parallel_config)
        self.plan = self.model.plan
        self.vocab_size = config.vocab_size
        self.lm_head = self.plan.lm_head()
        self._name_parameters()
        self.post_init()

    @property
    def parallel_config(self) -> ParallelConfig:
        return self.plan.parallel

    def get_output_embeddings(self):
        return self.lm_head

    def save_pretrained(self, save_directory, *args, is_main_process: bool | None = None, state_dict=None, **kwargs):
        """Write the canonical, unsharded checkpoint. Under tensor parallelism call it on every rank: the
        shards are all-gathered over the TP group and global rank 0 writes."""
        if self.plan.tp_size == 1 and state_dict is None:
            return super().save_pretrained(save_directory, *args, is_main_process=is_main_process is not False, **kwargs)
        if state_dict is None:
            state_dict = canonical_state_dict(self, self.plan.group)
        if is_main_process is None:
            is_main_process = not dist.is_initialized() or dist.get_rank() == 0
        if is_main_process:
            super().save_pretrained(save_directory, *args, is_main_process=True, state_dict=state_dict, **kwargs)
        if dist.is_initialized():
            dist.barrier()

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *model_args,
        parallel_config: ParallelConfig | None = None,
        config: BoostLlamaConfig | None = None,
        dtype=None,
        **kwargs,
    ):
        """Load a canonical checkpoint (local folder or Hub repo) into this rank's shard of the layout
        given by ``parallel_config`` (default: single device), reading only this rank's slices.

        Unlike a plain ``transformers`` load, missing, unexpected or wrongly-shaped weights raise a
        ``ValueError`` naming them (e.g. a checkpoint of another bottleneck), and every parameter keeps
        its sharding metadata. Accepts the usual Hub arguments (``revision``, ``cache_dir``, ``token``,
        ``local_files_only``, ``subfolder``), ``dtype`` / ``torch_dtype`` and ``attn_implementation``.
        """
        if model_args:
            raise ValueError("BoostLlamaForCausalLM.from_pretrained takes no positional model arguments")
        dtype = dtype if dtype is not None else kwargs.pop("torch_dtype", None)
        attn_implementation = kwargs.pop("attn_implementation", None)
        hub = {k: kwargs.pop(k) for k in HUB_KWARGS if k in kwargs}
        for ignored in [k for k in kwargs if k.startswith("_") or k in ("trust_remote_code", "low_cpu_mem_usage") or not kwargs[k]]:
            kwargs.pop(ignored)  # passed by the Auto classes (or empty); nothing to do for a local build
        if kwargs:
            raise ValueError(f"from_pretrained does not support {sorted(kwargs)} for boost-hf models")
        if config is None:
            config = cls.config_class.from_pretrained(pretrained_model_name_or_path, **hub)
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        with no_init_weights():
            model = cls(config, parallel_config)
        model.tie_weights()  # no_init_weights skips the tying done in post_init
        load_canonical_checkpoint(model, resolve_checkpoint_files(str(pretrained_model_name_or_path), **hub))
        if dtype is not None and dtype != "auto":
            model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        return model.eval()

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
        return_logits: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden_states = hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
        else:
            hidden_states = hidden_states[:, logits_to_keep, :]
        local_logits = self.lm_head(hidden_states)  # [B, S, V/p]
        loss = None
        if labels is not None:
            loss = vocab_parallel_causal_lm_loss(local_logits, labels, self.plan.group, num_items_in_batch=num_items_in_batch)
        if return_logits is None:
            return_logits = labels is None or self.plan.tp_size == 1
        logits = self.lm_head.gather_logits(local_logits) if return_logits else None
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values)


__all__ = [
    "BoostLlamaPreTrainedModel",
    "BoostLlamaModel",
    "BoostLlamaForCausalLM",
    "BoostLlamaRMSNorm",
    "BoostLlamaAttention",
    "BoostLlamaMLP",
    "BoostLlamaDecoderLayer",
]
