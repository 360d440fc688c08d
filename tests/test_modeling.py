"""``BoostLlamaForCausalLM`` on one device: equality with ``transformers.LlamaForCausalLM`` (full rank) and with a
hand-written reference of each bottleneck (BOOST.md section 1), gradients, parameter names, layout
invariance at tp_size=1, weight init, and generation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.activations import ACT2FN

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from boost_hf.configuration_boost_llama import tensor_train_shape
from boost_hf.parallel.sharding import ShardSpec

from .test_tensor_train import tensor_train_weight
from .tolerances import FP64, ONE_OPERATOR, TINY_BACKWARD, TINY_FORWARD, assert_scaled_close

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
LLAMA_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
)


def build(config: BoostLlamaConfig, parallel: ParallelConfig | None = None, seed: int = 0) -> BoostLlamaForCausalLM:
    torch.manual_seed(seed)
    return BoostLlamaForCausalLM(config, parallel).eval()


def batch(config, batch_size: int = 2, length: int = 7, seed: int = 1):
    """``input_ids [B, S]`` and an attention mask with 3 left-padding positions in row 0."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, config.vocab_size, (batch_size, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    return input_ids, attention_mask


def llama_twin(config: BoostLlamaConfig) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` of the same shape (full rank: it loads a boost-hf state dict as is)."""
    return LlamaForCausalLM(LlamaConfig(**{name: getattr(config, name) for name in LLAMA_FIELDS})).eval()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------- full rank == LLaMA
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_full_rank_loads_llama_state_dict_and_matches_logits_loss_and_grads(make_config, kv_heads):
    boost = build(make_config(num_key_value_heads=kv_heads))
    llama = llama_twin(boost.config)
    boost.load_state_dict(llama.state_dict(), strict=True)
    input_ids, attention_mask = batch(boost.config)
    labels = input_ids.masked_fill(attention_mask == 0, -100)

    ours = boost(input_ids, attention_mask=attention_mask, labels=labels)
    theirs = llama(input_ids, attention_mask=attention_mask, labels=labels)
    assert ours.logits.shape == (2, 7, boost.config.vocab_size)
    assert_scaled_close(ours.logits, theirs.logits, TINY_FORWARD, "logits")
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=0)  # a mean of 14 token losses ~4.6: no cancellation

    ours.loss.backward()
    theirs.loss.backward()
    llama_grads = grads(llama)
    for name, grad in grads(boost).items():
        assert_scaled_close(grad, llama_grads[name], TINY_BACKWARD, name)


def test_full_rank_loss_with_num_items_in_batch_matches_llama(make_config):
    boost = build(make_config())
    llama = llama_twin(boost.config)
    boost.load_state_dict(llama.state_dict(), strict=True)
    input_ids, _ = batch(boost.config)
    with torch.no_grad():
        ours = boost(input_ids, labels=input_ids, num_items_in_batch=5).loss
        theirs = llama(input_ids, labels=input_ids, num_items_in_batch=5).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_full_rank_state_dict_names_are_llamas(make_config):
    boost = build(make_config())
    assert list(boost.state_dict()) == list(llama_twin(boost.config).state_dict())


# ---------------------------------------------------------------------------------- low rank == reference
class ReferenceBottleneck(nn.Module):
    """One projection, written from the authors' definitions (BOOST.md section 1).

    svd / cola: ``y = B act(A x) (+ b)``. LaX (its authors' ``TensorizedLinear``): block 0 ``h = act(A x)``;
    block ``l > 0`` ``h = act(LayerNorm_r(A x + G h_prev))`` (LayerNorm eps 1e-6; ``G h`` is ``W h + c`` for the
    dense gate, ``kron(L, R) h`` or ``h``); ``y = B h (+ b)``; ``h_prev`` is the ``h`` that ``previous`` (the
    same projection of the previous block) fed to its ``B``. tt (the BOOST release's ``TensorTrainLinear``):
    ``y = x W (+ b)`` with ``W`` every core contracted (float64, ``tests/test_tensor_train.py``).
    """

    def __init__(self, config: BoostLlamaConfig, d_in: int, d_out: int, previous: "ReferenceBottleneck | None", bias: bool = False):
        super().__init__()
        r, lax = config.rank, config.bottleneck == "lax"
        if config.bottleneck == "tt":  # cores [r_i, m_i, r_i+1]; W = their full contraction (tests/test_tensor_train.py)
            shape = tensor_train_shape(d_in, d_out, config.tt_rank, config.tt_cores, config.tt_rank_ratio, config.tt_leading_mode_multiple)
            self.cores = nn.ParameterList(nn.Parameter(torch.empty(core)) for core in shape.core_shapes)
        else:
            self.A = nn.Parameter(torch.empty(r, d_in))
            self.B = nn.Parameter(torch.empty(d_out, r))
        self.bias = nn.Parameter(torch.empty(d_out)) if bias else None
        self.crossing = config.lax_gate if lax and previous is not None else None
        if self.crossing == "dense":
            self.gate, self.gate_bias = nn.Parameter(torch.empty(r, r)), nn.Parameter(torch.empty(r))
        elif self.crossing == "kronecker":
            a, b = config.kronecker_factors
            self.gate_left, self.gate_right = nn.Parameter(torch.empty(a, a)), nn.Parameter(torch.empty(b, b))
        self.latent_norm = nn.LayerNorm(r, eps=1e-6) if self.crossing is not None and config.lax_latent_norm else None
        self.act = ACT2FN[config.latent_activation] if config.latent_activation else nn.Identity()
        self._previous = [previous]  # not a submodule
        self.latent: torch.Tensor | None = None

    def gate_matrix(self) -> torch.Tensor:
        if self.crossing == "dense":
            return self.gate
        if self.crossing == "kronecker":
            return torch.kron(self.gate_left, self.gate_right)
        return torch.eye(self.A.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "cores"):
            y = (x.double() @ tensor_train_weight(list(self.cores), len(self.cores) // 2)).to(x.dtype)
            return y if self.bias is None else y + self.bias
        z = x @ self.A.T
        if self.crossing is not None:
            z = z + self._previous[0].latent @ self.gate_matrix().T
            if self.crossing == "dense":
                z = z + self.gate_bias
        if self.latent_norm is not None:
            z = self.latent_norm(z)
        self.latent = h = self.act(z)
        y = h @ self.B.T
        return y if self.bias is None else y + self.bias


def reference_model(config: BoostLlamaConfig) -> LlamaForCausalLM:
    """``LlamaForCausalLM`` with every projection replaced by :class:`ReferenceBottleneck` (and the SwiGLU
    SiLU dropped where ``only_lr_act`` says so); parameter names match the boost-hf model."""
    model = llama_twin(config)
    shapes = config.projection_shapes()
    previous: dict[str, ReferenceBottleneck | None] = {name: None for names in PROJECTIONS.values() for name in names}
    for layer in model.model.layers:
        for part, names in PROJECTIONS.items():
            for name in names:
                bias = config.attention_bias if part == "self_attn" else config.mlp_bias
                module = ReferenceBottleneck(config, *shapes[name], previous[name], bias)
                setattr(getattr(layer, part), name, module)
                previous[name] = module
        if config.mlp_activation is None:
            layer.mlp.act_fn = nn.Identity()
    return model.eval()


def assert_matches_reference(boost, config):
    """The reference written from the authors' definitions, given ``boost``'s weights, computes the same logits, loss
    (1e-6 relative) and every gradient on :func:`batch`, to what fp32 rounding allows relative to each tensor's scale
    (:mod:`tests.tolerances`)."""
    reference = reference_model(config)
    reference.load_state_dict(boost.state_dict(), strict=True)
    input_ids, attention_mask = batch(config)
    ours = boost(input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False)
    theirs = reference(input_ids, attention_mask=attention_mask, labels=input_ids, use_cache=False)
    assert_scaled_close(ours.logits, theirs.logits, TINY_FORWARD, "logits")
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-6, atol=0)  # a mean of 14 token losses: no cancellation
    ours.loss.backward()
    theirs.loss.backward()
    reference_grads = grads(reference)
    for name, grad in grads(boost).items():
        assert_scaled_close(grad, reference_grads[name], TINY_BACKWARD, name)


@pytest.mark.parametrize("group_linears", [True, False], ids=["grouped", "separate"])
def test_low_rank_matches_reference(make_config, low_rank_variant, group_linears):
    config = make_config(low_rank_variant)
    boost = build(config, ParallelConfig(group_linears=group_linears))
    assert_matches_reference(boost, config)


@pytest.mark.parametrize("variant_name", ["cola", "svd"])
def test_projection_latent_by_hand(make_config, variant_name):
    """One projection: ``B act(A x)`` (cola: SiLU, svd: none)."""
    config = make_config(variant_name)
    q0 = build(config).model.layers[0].self_attn.q_proj
    x = torch.randn(5, config.hidden_size)
    with torch.no_grad():
        expected = q0.B @ (F.silu(q0.A @ x.T) if variant_name == "cola" else q0.A @ x.T)
        assert_scaled_close(q0(x), expected.T, ONE_OPERATOR, variant_name)


BIASES = dict(attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("variant_name", ["cola", "svd", "lax-dense", "lax-kronecker"])
def test_bottleneck_biases_are_added_after_b(make_config, variant_name):
    """``attention_bias`` / ``mlp_bias`` on a bottleneck model: ``y = B h + b`` (as CoLA), initialised
    ``U(-out^(-1/2), out^(-1/2))`` (CoLA) and matching the reference in logits, loss and gradients."""
    config = make_config(variant_name, **BIASES)
    boost = build(config)
    bias = boost.model.layers[1].mlp.gate_proj.bias
    assert bias.shape == (config.intermediate_size,) and 0 < bias.abs().max() <= config.intermediate_size**-0.5
    assert_matches_reference(boost, config)
    input_ids, _ = batch(config)
    with torch.no_grad():  # the biases are used: zeroing them changes the logits
        plain = build(config)
        for name, param in plain.named_parameters():
            if name.endswith("_proj.bias"):
                param.zero_()
        assert (plain(input_ids).logits - boost.eval()(input_ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("variant_name", ["full", "cola", "lax-dense"])
def test_biases_under_every_grouping_and_checkpointing(make_config, variant_name):
    config = make_config(variant_name, **BIASES)
    layouts = LAYOUTS if config.is_low_rank else [layout for layout in LAYOUTS if layout[1] != "lowrank"]
    assert_layouts_agree(config, layouts)


def test_cola_only_lr_act_changes_only_the_mlp(make_config):
    plain, swiglu = build(make_config("cola")), build(make_config("cola", only_lr_act=False))
    assert plain.model.layers[0].mlp.act_fn is None and swiglu.model.layers[0].mlp.act_fn is not None
    for (name, a), (_, b) in zip(plain.state_dict().items(), swiglu.state_dict().items()):
        assert torch.equal(a, b), name
    input_ids, _ = batch(plain.config)
    with torch.no_grad():
        assert (plain(input_ids).logits - swiglu(input_ids).logits).abs().max() > 1e-3


# ---------------------------------------------------------------------------------- gradients and names
def test_forward_backward_every_parameter_gets_a_finite_gradient(make_config, variant):
    model = build(make_config(variant)).train()
    input_ids, attention_mask = batch(model.config)
    out = model(input_ids, attention_mask=attention_mask, labels=input_ids)
    assert out.logits.shape == (2, 7, model.config.vocab_size) and out.loss.shape == ()
    out.loss.backward()
    for name, grad in grads(model).items():
        assert grad is not None, name
        assert torch.isfinite(grad).all(), name
        assert grad.abs().sum() > 0, name


def expected_names(config: BoostLlamaConfig) -> dict[str, tuple[int, ...]]:
    """Canonical parameter names and shapes (BOOST.md section 1, boost_hf.parallel.layers)."""
    d, r, v = config.hidden_size, config.rank, config.vocab_size
    names = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    shapes = config.projection_shapes()
    for i in range(config.num_hidden_layers):
        block = f"model.layers.{i}"
        names[f"{block}.input_layernorm.weight"] = names[f"{block}.post_attention_layernorm.weight"] = (d,)
        for part, projections in PROJECTIONS.items():
            for name in projections:
                prefix, (d_in, d_out) = f"{block}.{part}.{name}", shapes[name]
                if config.bottleneck is None:
                    names[f"{prefix}.weight"] = (d_out, d_in)
                    continue
                if config.bottleneck == "tt":
                    for index, core in enumerate(config.tensor_train_shape(name).core_shapes):
                        names[f"{prefix}.cores.{index}"] = core
                    continue
                names[f"{prefix}.A"], names[f"{prefix}.B"] = (r, d_in), (d_out, r)
                if config.bottleneck != "lax":
                    continue
                if i > 0 and config.lax_latent_norm:  # the authors' block 0 has no latent norm
                    names[f"{prefix}.latent_norm.weight"] = names[f"{prefix}.latent_norm.bias"] = (r,)
                if i > 0 and config.lax_gate == "dense":
                    names[f"{prefix}.gate"], names[f"{prefix}.gate_bias"] = (r, r), (r,)
                if i > 0 and config.lax_gate == "kronecker":
                    a, b = config.kronecker_factors
                    names[f"{prefix}.gate_left"], names[f"{prefix}.gate_right"] = (a, a), (b, b)
    return names


@pytest.mark.parametrize("group_linears", [True, False], ids=["grouped", "separate"])
def test_canonical_parameter_names_and_shapes(make_config, variant, group_linears):
    config = make_config(variant)
    model = build(config, ParallelConfig(group_linears=group_linears))
    assert {name: tuple(p.shape) for name, p in model.named_parameters()} == expected_names(config)
    for name, param in model.named_parameters():
        assert param.shard_spec == ShardSpec(tuple(param.shape)), name


def test_canonical_names_spot_checks(make_config):
    lax = dict(build(make_config("lax-dense")).named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.A", "model.layers.0.self_attn.q_proj.B",
                 "model.layers.0.mlp.down_proj.A", "model.layers.1.self_attn.q_proj.gate",
                 "model.layers.1.mlp.down_proj.gate", "model.layers.1.mlp.down_proj.gate_bias",
                 "model.layers.1.mlp.up_proj.latent_norm.weight"):
        assert name in lax, name
    assert not any(name.startswith("model.layers.0.") and name.endswith((".gate", ".gate_bias", "latent_norm.weight")) for name in lax)
    kron = dict(build(make_config("lax-kronecker")).named_parameters())
    assert tuple(kron["model.layers.1.self_attn.k_proj.gate_left"].shape) == (2, 2)
    assert tuple(kron["model.layers.1.self_attn.k_proj.gate_right"].shape) == (4, 4)
    assert not any("gate_left" in name for name in kron if name.startswith("model.layers.0."))
    identity = dict(build(make_config("lax-identity")).named_parameters())
    assert not any(name.endswith((".gate", ".gate_left", ".gate_right")) for name in identity)


# ---------------------------------------------------------------------------------- layout invariance, tp_size=1
LAYOUTS = [(True, "none"), (False, "full"), (True, "full"), (False, "lowrank"), (True, "lowrank")]


def loss_and_grads(config, parallel: ParallelConfig, dtype: torch.dtype):
    model = build(config, parallel).train().to(dtype)
    input_ids, attention_mask = batch(config)
    loss = model(input_ids, attention_mask=attention_mask, labels=input_ids).loss
    loss.backward()
    return loss.detach(), grads(model)


def assert_layouts_agree(config, layouts):
    """Grouping and checkpointing are the same math: the fp32 loss agrees to 1e-6; gradients are compared
    in fp64 because in fp32 grouping legitimately reorders sums (``dY_qkv A_qkv`` vs ``sum_i dY_i A_i``),
    which moves e.g. the embedding gradient by ~3e-6 of its scale."""
    style = "btp" if config.is_low_rank else "megatron"
    base = ParallelConfig(tp_style=style, group_linears=False)
    loss, _ = loss_and_grads(config, base, torch.float32)
    _, reference = loss_and_grads(config, base, torch.float64)
    for group_linears, checkpointing in layouts:
        parallel = ParallelConfig(tp_style=style, group_linears=group_linears, activation_checkpointing=checkpointing)
        other_loss, _ = loss_and_grads(config, parallel, torch.float32)
        torch.testing.assert_close(other_loss, loss, rtol=1e-6, atol=0, msg=str(parallel))
        _, other = loss_and_grads(config, parallel, torch.float64)
        assert other.keys() == reference.keys()
        for name, grad in other.items():
            assert_scaled_close(grad, reference[name], FP64, f"{parallel}: {name}")


def test_grouping_and_checkpointing_do_not_change_loss_or_grads(make_config, low_rank_variant):
    assert_layouts_agree(make_config(low_rank_variant), LAYOUTS)


def test_full_rank_grouping_and_checkpointing(make_config):
    assert_layouts_agree(make_config(), [layout for layout in LAYOUTS if layout[1] != "lowrank"])


def saved_activation_elements(config, checkpointing: str) -> int:
    """Elements of the non-parameter tensors autograd keeps for backward during one training forward."""
    style = "btp" if config.is_low_rank else "megatron"
    model = build(config, ParallelConfig(tp_style=style, activation_checkpointing=checkpointing)).train()
    input_ids, _ = batch(config)
    saved = []

    def pack(tensor):
        if not isinstance(tensor, nn.Parameter):
            saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids, labels=input_ids)
    return sum(saved)


@pytest.mark.parametrize("variant_name", ["full", "svd", "lax-dense"])
def test_checkpointing_keeps_fewer_activations(make_config, variant_name):
    config = make_config(variant_name)
    none, full = saved_activation_elements(config, "none"), saved_activation_elements(config, "full")
    assert full < none
    if config.is_low_rank:
        assert full < saved_activation_elements(config, "lowrank") < none


def test_inputs_embeds_equal_input_ids(make_config):
    model = build(make_config("lax-dense"))
    input_ids, attention_mask = batch(model.config)
    with torch.no_grad():
        by_ids = model(input_ids, attention_mask=attention_mask).logits
        by_embeds = model(inputs_embeds=model.model.embed_tokens(input_ids), attention_mask=attention_mask).logits
    assert torch.equal(by_ids, by_embeds)


def test_input_ids_and_inputs_embeds_are_exclusive(make_config):
    model = build(make_config("cola"))
    input_ids, _ = batch(model.config)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids, inputs_embeds=model.model.embed_tokens(input_ids))


# ---------------------------------------------------------------------------------- a pipeline stage
def stage_of(model: BoostLlamaForCausalLM, layers: slice, *, embedding: bool, head: bool) -> BoostLlamaForCausalLM:
    """A copy of ``model`` running ``layers`` only, with what a pipeline stage lacks set to ``None``."""
    stage = copy.deepcopy(model)
    stage.model.layers = nn.ModuleList(stage.model.layers[layers])
    if not embedding:
        stage.model.embed_tokens = None
    if not head:
        stage.model.norm, stage.lm_head = None, None
    return stage


def test_model_without_embedding_and_norm_is_the_decoder_stack(make_config, variant):
    """torchtitan's pass-through: hidden states in, the decoder stack's output before the final norm out; the causal
    LM without its head likewise; two stages (LaX's latents handed from the first to the second) give the logits."""
    model = build(make_config(variant, num_hidden_layers=3))
    input_ids, attention_mask = batch(model.config)
    before_norm = []
    model.model.norm.register_forward_hook(lambda module, args, output: before_norm.append(args[0]))
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask).logits
        embeds = model.model.embed_tokens(input_ids)
        stack = stage_of(model, slice(None), embedding=False, head=False)
        assert torch.equal(stack.model(inputs_embeds=embeds, attention_mask=attention_mask).last_hidden_state, before_norm[0])
        out = stack(inputs_embeds=embeds, attention_mask=attention_mask)
        assert torch.equal(out.last_hidden_state, before_norm[0])
        assert (out.lax_latents is not None) == (model.config.bottleneck == "lax")
        first = stage_of(model, slice(0, 2), embedding=True, head=False)(input_ids, attention_mask=attention_mask)
        last = stage_of(model, slice(2, 3), embedding=False, head=True)
        staged = last(inputs_embeds=first.last_hidden_state, lax_latents=first.lax_latents, attention_mask=attention_mask)
    assert torch.equal(staged.logits, logits)


def test_a_stage_refuses_what_it_cannot_compute(make_config):
    model = build(make_config("cola"))
    input_ids, _ = batch(model.config)
    with pytest.raises(ValueError, match="holds no embedding"):
        stage_of(model, slice(None), embedding=False, head=True)(input_ids)
    with pytest.raises(ValueError, match="holds no LM head"):
        stage_of(model, slice(None), embedding=True, head=False)(input_ids, labels=input_ids)


# ---------------------------------------------------------------------------------- init
RANDOM_INIT = (".A", ".B", ".gate", ".gate_left", ".gate_right", "embed_tokens.weight", "lm_head.weight", "_proj.weight")


def test_init_same_seed_same_weights_different_seed_different(make_config, variant):
    config = make_config(variant)
    first, again, other = build(config, seed=3).state_dict(), build(config, seed=3).state_dict(), build(config, seed=4).state_dict()
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name]), name
        if name.endswith(RANDOM_INIT) or ".cores." in name:
            assert not torch.equal(tensor, other[name]), name


def test_init_is_a_pure_function_of_the_seed(make_config):
    torch.manual_seed(5)
    BoostLlamaForCausalLM(make_config("svd"))
    torch.rand(1000)
    after_other_work = BoostLlamaForCausalLM(make_config("lax-kronecker")).state_dict()
    alone = build(make_config("lax-kronecker"), seed=5).state_dict()
    for name, tensor in alone.items():
        assert torch.equal(tensor, after_other_work[name]), name


def test_init_does_not_depend_on_the_layout(make_config):
    config = make_config("lax-dense")
    grouped = build(config, ParallelConfig(group_linears=True, activation_checkpointing="lowrank")).state_dict()
    for name, tensor in build(config, ParallelConfig(group_linears=False)).state_dict().items():
        assert torch.equal(tensor, grouped[name]), name


def test_init_distributions():
    config = BoostLlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
        bottleneck="lax", rank=64, lax_gate="dense",
    )
    model = build(config)
    params = dict(model.named_parameters())
    for part, names in PROJECTIONS.items():
        for name in names:
            d_in, d_out = config.projection_shapes()[name]
            std = 64 ** -0.25 * (d_in + d_out) ** -0.25
            for factor in ("A", "B"):
                weight = params[f"model.layers.0.{part}.{name}.{factor}"]
                assert abs(weight.std().item() / std - 1) < 0.05, (name, factor)
                assert abs(weight.mean().item()) < 0.05 * std, (name, factor)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.gate"):
        assert abs(params[name].std().item() / 0.02 - 1) < 0.05, name
    assert torch.equal(params["model.layers.0.input_layernorm.weight"], torch.ones(256))
    assert torch.equal(params["model.layers.1.mlp.up_proj.latent_norm.weight"], torch.ones(64))
    assert torch.equal(params["model.layers.1.mlp.up_proj.latent_norm.bias"], torch.zeros(64))
    assert torch.equal(params["model.layers.1.mlp.up_proj.gate_bias"], torch.zeros(64))  # timm's nn.Linear init
    kron = dict(build(BoostLlamaConfig(**{**config.to_dict(), "lax_gate": "kronecker"})).named_parameters())
    for name in ("gate_left", "gate_right"):  # kaiming_uniform_ with its defaults: U(-sqrt(6/n), sqrt(6/n))
        factor = torch.cat([kron[f"model.layers.1.{part}.{p}.{name}"].flatten() for part, ps in PROJECTIONS.items() for p in ps])
        bound = (6 / kron[f"model.layers.1.mlp.up_proj.{name}"].shape[1]) ** 0.5
        assert factor.abs().max() <= bound and factor.abs().max() > 0.9 * bound, name
        assert abs(factor.std().item() / (bound / 3**0.5) - 1) < 0.2, name
    full = dict(build(BoostLlamaConfig(**{**config.to_dict(), "bottleneck": None})).named_parameters())
    assert abs(full["model.layers.0.mlp.up_proj.weight"].std().item() / 0.02 - 1) < 0.05


# ---------------------------------------------------------------------------------- generation
GREEDY = dict(do_sample=False, max_new_tokens=6, min_new_tokens=6, pad_token_id=0)


def test_greedy_generation_with_and_without_cache(make_config, variant):
    model = build(make_config(variant))
    input_ids, attention_mask = batch(model.config, length=5)
    cached = model.generate(input_ids, attention_mask=attention_mask, use_cache=True, **GREEDY)
    uncached = model.generate(input_ids, attention_mask=attention_mask, use_cache=False, **GREEDY)
    assert cached.shape == (2, 11)
    assert torch.equal(cached, uncached)


def test_full_rank_greedy_generation_equals_llama(make_config):
    boost = build(make_config())
    llama = llama_twin(boost.config)
    boost.load_state_dict(llama.state_dict(), strict=True)
    input_ids, attention_mask = batch(boost.config, length=5)
    for use_cache in (True, False):
        ours = boost.generate(input_ids, attention_mask=attention_mask, use_cache=use_cache, **GREEDY)
        theirs = llama.generate(input_ids, attention_mask=attention_mask, use_cache=use_cache, **GREEDY)
        assert torch.equal(ours, theirs)
