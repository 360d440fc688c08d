"""Grouped projections' parameters stored as row blocks of one buffer (:mod:`boost_hf.parallel.shared_storage`).

The layouts are applied at tp_size=1 with full checkpointing (the layers run as the parallel modules, in one
process); the gloo suites check the same layouts at TP 2 and 4 against the single-device model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from boost_hf import BoostLlamaForCausalLM, ParallelConfig
from boost_hf.parallel.shared_storage import joined_rows, share_storage

# name -> (model variant, tp_style, parameters stored together in the qkv and gate_up groups)
LAYOUTS = {
    "btp": ("cola", "btp", ("A", "B")),
    "btp-lax": ("lax-dense", "btp", ("A", "B")),
    "vanilla": ("cola", "vanilla", ("A", "B")),
    "megatron": ("full", "megatron", ("weight",)),
}
GROUPED = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def _build(make_config, name: str, **parallel) -> BoostLlamaForCausalLM:
    variant, style, _ = LAYOUTS[name]
    torch.manual_seed(0)
    config = ParallelConfig(tp_style=style, activation_checkpointing="full", **parallel)
    return BoostLlamaForCausalLM(make_config(variant), parallel_config=config).train()


def _groups(model, name: str):
    """``[(owner name, parameter name, [parameters])]`` of every grouped projection group of every layer."""
    stored = LAYOUTS[name][2]
    for layer in model.model.layers:
        for owner_name, projections in GROUPED.items():
            owner = getattr(layer, owner_name)
            for param in stored:
                yield owner_name, param, [getattr(getattr(owner, p), param) for p in projections]


def _loss_and_grads(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", LAYOUTS)
def test_grouped_parameters_share_one_storage_under_their_own_names(make_config, name):
    model = _build(make_config, name)
    torch.manual_seed(0)
    single = BoostLlamaForCausalLM(make_config(LAYOUTS[name][0]))  # the same seed: the single-device model
    for _, _, params in _groups(model, name):
        assert joined_rows(params) is not None
    assert list(model.state_dict()) == list(single.state_dict())
    for key, value in single.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    # groups of one projection (o, down) and ungrouped layouts keep their own storage
    ungrouped = _build(make_config, name, group_linears=False)
    assert all(joined_rows(params) is None for _, _, params in _groups(ungrouped, name))


@pytest.mark.parametrize("name", LAYOUTS)
def test_gradients_are_row_blocks_of_one_buffer(make_config, name):
    model = _build(make_config, name)
    _loss_and_grads(model)
    for owner, param, params in _groups(model, name):
        assert joined_rows([p.grad for p in params]) is not None, (owner, param)


@pytest.mark.parametrize("name", LAYOUTS)
def test_parameters_in_separate_storage_compute_the_same(make_config, name):
    """Where a framework re-homes the parameters (DeepSpeed ZeRO, ``load_state_dict(assign=True)``), the
    groups concatenate instead: the same loss and gradients, bit for bit."""
    shared, separate = _build(make_config, name), _build(make_config, name)
    for _, _, params in _groups(separate, name):
        for p in params:
            p.data = p.data.clone()
        assert joined_rows(params) is None
    loss, grads = _loss_and_grads(shared)
    other_loss, other_grads = _loss_and_grads(separate)
    assert torch.equal(loss, other_loss)
    for key, grad in grads.items():
        assert torch.equal(grad, other_grads[key]), key


def test_storage_shared_again_after_to_and_to_empty(make_config):
    model = _build(make_config, "btp")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.to(torch.float64)
    assert all(joined_rows(params) is not None and params[0].dtype == torch.float64 for _, _, params in _groups(model, "btp"))
    model.float()
    assert all(joined_rows(params) is not None for _, _, params in _groups(model, "btp"))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    with torch.device("meta"):
        skeleton = _build(make_config, "btp")
    skeleton.to_empty(device="cpu")
    assert all(joined_rows(params) is not None and not params[0].is_meta for _, _, params in _groups(skeleton, "btp"))


def test_storage_left_where_a_framework_put_it(make_config):
    """``module.to(...)`` gathers only what was stored together before: parameters that something else
    re-homed (DeepSpeed's flat buffers) stay theirs."""
    model = _build(make_config, "btp")
    owner, _, params = next(_groups(model, "btp"))
    for p in params:
        p.data = p.data.clone()
    model.to(torch.float64)
    assert joined_rows(params) is None
    assert all(joined_rows(others) is not None for _, _, others in list(_groups(model, "btp"))[1:])


def test_optimizer_steps_update_each_block(make_config):
    shared, separate = _build(make_config, "vanilla"), _build(make_config, "vanilla")
    for _, _, params in _groups(separate, "vanilla"):
        for p in params:
            p.data = p.data.clone()
    for model in (shared, separate):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            _loss_and_grads(model)
            optimizer.step()
            optimizer.zero_grad()
    for (key, value), other in zip(shared.state_dict().items(), separate.state_dict().values()):
        assert torch.equal(value, other), key


def test_save_and_load_keep_canonical_tensors(make_config, tmp_path):
    model = _build(make_config, "btp")
    model.save_pretrained(tmp_path)
    loaded = BoostLlamaForCausalLM.from_pretrained(tmp_path)
    assert list(loaded.state_dict()) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    reloaded = BoostLlamaForCausalLM.from_pretrained(tmp_path, parallel_config=model.parallel_config)
    assert all(joined_rows(params) is not None for _, _, params in _groups(reloaded, "btp"))


def test_share_storage_refuses_mismatched_parameters():
    with pytest.raises(ValueError, match="trailing shape"):
        share_storage([nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(2, 4))])
