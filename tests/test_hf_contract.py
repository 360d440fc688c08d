"""The Hugging Face contract on one device: what a ``LlamaForCausalLM`` user relies on works the same on
every bottleneck (hidden states and attentions, hooks, gradient checkpointing through the HF API,
``from_pretrained`` arguments, ``resize_token_embeddings``, beam search with dict outputs, static
cache, remote code). transformers' own common model tests are run against these classes separately
(see ``tests/hf_common_tests.md``)."""

from __future__ import annotations

import ast
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from boost_hf.modeling_boost_llama import CACHE_NAME
from .tolerances import TINY_BACKWARD, assert_scaled_close

BOTTLENECKS = [None, "svd", "cola", "lax", "tt"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny(bottleneck, **overrides) -> BoostLlamaConfig:
    fields = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rank=8, bottleneck=bottleneck, pad_token_id=0)
    return BoostLlamaConfig(**{**fields, **overrides})


def build(bottleneck, **overrides) -> BoostLlamaForCausalLM:
    torch.manual_seed(0)
    return BoostLlamaForCausalLM(tiny(bottleneck, **overrides)).eval()


def ids(batch: int = 2, length: int = 6) -> torch.Tensor:
    return torch.randint(1, 96, (batch, length), generator=torch.Generator().manual_seed(1))


@pytest.fixture(params=BOTTLENECKS, ids=lambda b: str(b))
def bottleneck(request):
    return request.param


def test_hidden_states_and_attentions(bottleneck):
    model = build(bottleneck, attn_implementation="eager")
    out = model(ids(), output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and all(h.shape == (2, 6, 32) for h in out.hidden_states)
    assert len(out.attentions) == 2 and all(a.shape == (2, 4, 6, 6) for a in out.attentions)
    # the last hidden state is the final norm's output, as in LlamaModel
    base = model.model(ids(), output_hidden_states=True)
    torch.testing.assert_close(base.hidden_states[-1], base.last_hidden_state)


def test_return_dict_false_and_shift_labels(bottleneck):
    model = build(bottleneck)
    x = ids()
    as_tuple = model(x, labels=x, return_dict=False)
    loss = model(x, labels=x).loss
    torch.testing.assert_close(as_tuple[0], loss)
    shifted = torch.nn.functional.pad(x, (0, 1), value=-100)[..., 1:].contiguous()
    torch.testing.assert_close(model(x, shift_labels=shifted, labels=x).loss, loss)
    kept = model(x, logits_to_keep=1).logits
    assert kept.shape == (2, 1, 96)


def _record_hooks(model):
    calls: list[str] = []
    for name, module in model.named_modules():
        if name.endswith(PROJECTIONS + ("self_attn", "mlp")):
            module.register_forward_hook(lambda m, i, o, name=name: calls.append(name))
    return calls


@pytest.mark.parametrize("parallel", [None, ParallelConfig(activation_checkpointing="lowrank")], ids=["plain", "tp1-lowrank"])
def test_forward_hooks_fire_on_every_projection_attention_and_mlp(bottleneck, parallel):
    if bottleneck is None and parallel is not None:
        parallel = ParallelConfig(tp_style="megatron", activation_checkpointing="full")
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(tiny(bottleneck))
    calls = _record_hooks(model)  # registered on the single-device modules, before any layout is applied
    if parallel is not None:
        parallel.parallelize(model)
    model(ids())
    expected = {f"model.layers.{i}.{owner}.{p}" for i in range(2) for owner, p in
                [("self_attn", p) for p in PROJECTIONS[:4]] + [("mlp", p) for p in PROJECTIONS[4:]]}
    expected |= {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")}
    assert set(calls) == expected


def enable_activation_checkpointing(model, kwargs=None):
    """transformers' checkpointing switch: ``activation_checkpointing_enable`` from 5.23, before it
    ``gradient_checkpointing_enable`` (still there, deprecated)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": False}, {"use_reentrant": True}], ids=["default", "non-reentrant", "reentrant"])
def test_gradient_checkpointing_through_the_hf_api(bottleneck, kwargs):
    """Same loss and gradients (LaX's crossed latents included, re-entrant or not) as without checkpointing."""
    plain, checkpointed = build(bottleneck).train(), build(bottleneck).train()
    enable_activation_checkpointing(checkpointed, kwargs)
    assert checkpointed.is_gradient_checkpointing
    x = ids()
    losses = []
    for model in (plain, checkpointed):
        loss = model(x, labels=x).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1])
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        assert_scaled_close(a.grad, b.grad, TINY_BACKWARD, name)


def test_from_pretrained_accepts_transformers_arguments(bottleneck, tmp_path):
    build(bottleneck).save_pretrained(tmp_path)
    model, info = BoostLlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True, device_map="cpu")
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]
    auto = AutoModelForCausalLM.from_pretrained(tmp_path, adapter_kwargs={}, low_cpu_mem_usage=True, dtype=torch.float32)
    assert torch.equal(auto(ids()).logits, model(ids()).logits)


def test_from_pretrained_without_a_checkpoint_initialises_what_the_state_dict_lacks(bottleneck, tmp_path):
    """``from_pretrained(None, config=..., state_dict=...)`` reads no checkpoint: as in transformers, missing
    weights are initialised (the same values as the constructor's under the same seed) and reported; a
    checkpoint folder with missing weights still raises."""
    config = tiny(bottleneck)
    torch.manual_seed(0)
    built = BoostLlamaForCausalLM(config)
    torch.manual_seed(0)
    loaded, info = BoostLlamaForCausalLM.from_pretrained(None, config=config, state_dict={}, output_loading_info=True)
    assert set(info["missing_keys"]) == set(built.state_dict())
    assert not any(p.device.type == "meta" for p in loaded.parameters())
    for name, value in built.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    full = {name: torch.randn_like(value) for name, value in built.state_dict().items()}
    given = BoostLlamaForCausalLM.from_pretrained(None, config=config, state_dict=full)
    assert all(torch.equal(full[name], value) for name, value in given.state_dict().items())

    partial = {name: value for name, value in built.state_dict().items() if ".layers.1." not in name}
    built.save_pretrained(tmp_path, state_dict=partial)
    with pytest.raises(ValueError, match=r"architecture.*missing \['model\.layers\.1\."):
        BoostLlamaForCausalLM.from_pretrained(tmp_path)


def test_from_pretrained_under_tensor_parallelism_names_arguments_it_cannot_apply(tmp_path):
    build("cola").save_pretrained(tmp_path)
    lowrank = ParallelConfig(activation_checkpointing="lowrank")
    with pytest.raises(ValueError, match=r"\['quantization_config'\] cannot apply under tensor parallelism"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, parallel_config=lowrank, quantization_config={"x": 1})
    with pytest.raises(ValueError, match=r"\['device_map'\]"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path, parallel_config=lowrank, device_map="auto")
    model, info = BoostLlamaForCausalLM.from_pretrained(tmp_path, parallel_config=lowrank, output_loading_info=True, device_map="cpu")
    assert info["missing_keys"] == [] and hasattr(model, "plan")


def test_resize_token_embeddings(bottleneck):
    model = build(bottleneck)
    before = model(ids()).logits
    model.resize_token_embeddings(128)
    assert model.config.vocab_size == 128
    after = model(ids()).logits
    assert after.shape[-1] == 128
    torch.testing.assert_close(after[..., :96], before)


def test_beam_search_with_dict_outputs(bottleneck):
    model = build(bottleneck)
    config = GenerationConfig(max_new_tokens=4, num_beams=2, do_sample=False, return_dict_in_generate=True,
                              output_scores=True, output_hidden_states=True, pad_token_id=0)
    out = model.generate(ids(), generation_config=config)
    assert out.sequences.shape == (2, 10)
    assert len(out.scores) == 4 and out.hidden_states is not None


def test_static_cache_generation_equals_dynamic(bottleneck):
    model = build(bottleneck)
    dynamic = model.generate(ids(), max_new_tokens=5, do_sample=False, pad_token_id=0)
    static = model.generate(ids(), max_new_tokens=5, do_sample=False, cache_implementation="static", pad_token_id=0)
    no_cache = model.generate(ids(), max_new_tokens=5, do_sample=False, use_cache=False, pad_token_id=0)
    assert torch.equal(dynamic, static) and torch.equal(dynamic, no_cache)


def test_checkpointed_layers_recompute_and_drop_the_cache(bottleneck):
    """Each decoder layer runs through the checkpoint function (and is recomputed in backward); a cache
    asked for during checkpointed training is dropped rather than filled twice."""
    model = build(bottleneck).train()
    enable_activation_checkpointing(model)
    calls = []
    for layer in model.model.layers:
        checkpoint = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda fn, *args, _c=checkpoint: calls.append(fn) or _c(fn, *args)
    out = model(ids(), labels=ids(), use_cache=True)
    assert len(calls) == len(model.model.layers)
    cache = getattr(out, CACHE_NAME)  # the running transformers' name for it
    assert cache is None or cache.get_seq_length() == 0
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_remote_code_files_import_nothing_from_boost_hf(tmp_path):
    model = build("cola")
    model.save_pretrained(tmp_path)  # registered for the Auto classes by default
    files = sorted(p.name for p in tmp_path.glob("*.py"))
    assert files == ["configuration_boost_llama.py", "modeling_boost_llama.py", "tensor_train_boost_llama.py",
                     "weights_boost_llama.py"]
    for path in tmp_path.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.module in ("configuration_boost_llama", "modeling_boost_llama", "tensor_train_boost_llama",
                                       "weights_boost_llama"), (path.name, node.module)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                top = {n.split(".")[0] for n in names}
                assert top <= {"torch", "transformers"} | sys.stdlib_module_names, names
    assert model.config.auto_map["AutoModelForCausalLM"] == "modeling_boost_llama.BoostLlamaForCausalLM"
