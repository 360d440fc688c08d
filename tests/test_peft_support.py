"""LoRA from peft on every architecture: an adapter per projection (a branch parallel to the whole projection
on bottlenecks), gradients on the adapters only, the loss falls, save / load round trip, and merging (exact at
full rank, refused on bottleneck projections)."""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM  # noqa: E402
from boost_hf.peft_support import PROJECTIONS, BottleneckLoraLinear, BottleneckMergeError, lora_config, register_bottleneck_lora  # noqa: E402

VARIANTS = {"full": dict(bottleneck=None), "svd": dict(bottleneck="svd"), "cola": dict(bottleneck="cola"),
            "lax": dict(bottleneck="lax"), "lax-kronecker": dict(bottleneck="lax", lax_gate="kronecker"), "tt": dict(bottleneck="tt")}


def base_model(variant: str) -> BoostLlamaForCausalLM:
    torch.manual_seed(0)
    config = BoostLlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=64, rank=8, **VARIANTS[variant])
    return BoostLlamaForCausalLM(config)


def batch() -> torch.Tensor:
    return torch.randint(0, 96, (4, 12), generator=torch.Generator().manual_seed(2))


def trained_adapter(variant: str, steps: int = 12):
    model = get_peft_model(base_model(variant), lora_config(r=4, lora_alpha=8, lora_dropout=0.0))
    ids = batch()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return model, losses


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lora_on_every_projection_trains_only_adapters(variant):
    model = get_peft_model(base_model(variant), lora_config(r=4, lora_alpha=8))
    wrapped = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A") and module.lora_A}
    assert wrapped == set(PROJECTIONS)
    if variant != "full":
        assert all(isinstance(m, BottleneckLoraLinear) for n, m in model.named_modules() if n.endswith(PROJECTIONS))
    ids = batch()
    # B_l = 0 at init: the adapted model computes its (frozen) base model exactly. The reference is frozen too:
    # torch.matmul folds a broadcast product differently when the weight requires grad (LaX's Kronecker
    # crossing), which moves results by an ulp.
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base_model(variant).requires_grad_(False)(ids).logits)
    model(input_ids=ids, labels=ids).loss.backward()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A_l and B_l for 7 projections x 2 layers
    assert all(p.grad is not None for n, p in trainable.items() if "lora_B" in n)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


@pytest.mark.parametrize("variant", ["cola", "lax", "tt"])
def test_lora_loss_falls_and_round_trips(variant, tmp_path):
    model, losses = trained_adapter(variant)
    assert losses[-1] < losses[0] - 0.1, losses
    model.eval()
    ids = batch()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    config = register_bottleneck_lora(LoraConfig.from_pretrained(tmp_path))
    loaded = PeftModel.from_pretrained(base_model(variant), tmp_path, config=config).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)
        assert not torch.equal(expected, base_model(variant)(ids).logits)  # the adapter changed the function


def test_merge_is_exact_at_full_rank_and_refused_on_bottlenecks():
    model, _ = trained_adapter("full")
    model.eval()
    ids = batch()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        merged = model.merge_and_unload()
        assert isinstance(merged, BoostLlamaForCausalLM)
        torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)
    low_rank, _ = trained_adapter("cola", steps=1)
    with pytest.raises(BottleneckMergeError, match="cannot merge a LoRA adapter into a bottleneck projection"):
        low_rank.merge_and_unload()
    with pytest.raises(BottleneckMergeError, match="tensor train of fixed bond ranks"):
        trained_adapter("tt", steps=1)[0].merge_and_unload()
    unloaded = low_rank.unload()  # dropping the adapters (no merge) is fine
    with torch.no_grad():
        assert torch.equal(unloaded(ids).logits, base_model("cola")(ids).logits)


def adapted(model) -> list[str]:
    return sorted(name for name, module in model.named_modules() if getattr(module, "lora_A", None))


def test_all_linear():
    """peft's ``"all-linear"`` adapts the 7 projections of a full-rank model; ``lora_config("all-linear")`` gives a
    bottleneck model the same; a plain ``LoraConfig("all-linear")`` finds no nn.Linear there and peft refuses it."""
    full = adapted(get_peft_model(base_model("full"), LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")))
    assert len(full) == 14 and {name.rsplit(".", 1)[-1] for name in full} == set(PROJECTIONS)
    assert adapted(get_peft_model(base_model("cola"), lora_config(r=4, target_modules="all-linear"))) == full
    with pytest.raises(ValueError):
        get_peft_model(base_model("cola"), LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"))


def test_transformers_load_with_peft_installed(tmp_path):
    """Having peft installed must not break ``from_pretrained`` (transformers passes ``adapter_kwargs``)."""
    from transformers import AutoModelForCausalLM

    base_model("cola").save_pretrained(tmp_path)
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path), BoostLlamaForCausalLM)


def test_docs_peft_example_runs(tmp_path, monkeypatch):
    from .test_docs import python_blocks

    block = next(b for b in python_blocks() if "lora_config(" in b)
    monkeypatch.chdir(tmp_path)
    namespace = {"model": base_model("lax"), "base_model": base_model("lax")}
    exec(compile(block, "docs/sharing.md", "exec"), namespace)
    assert isinstance(namespace["peft_model"], PeftModel) and (tmp_path / "adapter" / "adapter_config.json").is_file()
