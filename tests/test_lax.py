"""LaX as its authors define it (``K1seki221/Latent_Crossing``, ``TensorizedLinear``, 2-core case), block by block.

Written from the published definition, not from our module: block 0 ``h = act(A x)`` (no crossing, no latent
LayerNorm); block ``l > 0`` ``h = act(LayerNorm_r(A x + G h_prev))`` with LayerNorm eps 1e-6; ``y = B h``; the
latent handed to the same projection of the next block is ``h``, the one fed to ``B``. The authors' Kronecker
gate contracts ``h_prev`` viewed as ``[a, b]`` with a decoder ``D: [a, a]`` and an encoder ``E: [b, b]``
(``einsum('cd,de,cf->fe', H, E, D)``): our ``gate_left = D^T``, ``gate_right = E^T``.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM
from .tolerances import ONE_OPERATOR, assert_scaled_close

GATES = ("dense", "kronecker", "identity")
BASES = ("cola", "svd")
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "o_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def lax_model(make_config, gate: str, base: str, layers: int = 3) -> BoostLlamaForCausalLM:
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(make_config("lax-dense", lax_gate=gate, lax_base=base, num_hidden_layers=layers))
    with torch.no_grad():  # LayerNorm affine parameters away from their (1, 0) init, so that they are exercised
        for name, param in model.named_parameters():
            if "latent_norm" in name or name.endswith("gate_bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def authors_gate(projection, gate: str, h_prev: torch.Tensor) -> torch.Tensor:
    """``G h_prev`` written as the authors do."""
    if gate == "identity":
        return h_prev
    if gate == "dense":  # nn.Linear(r, r) with its bias
        return h_prev @ projection.gate.T + projection.gate_bias
    decoder, encoder = projection.gate_left.T, projection.gate_right.T
    a, b = decoder.shape[0], encoder.shape[0]
    return torch.einsum("ncd,de,cf->nfe", h_prev.view(-1, a, b), encoder, decoder).reshape(h_prev.shape)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("gate", GATES)
def test_lax_chain_block_by_block_matches_the_authors_definition(make_config, gate, base):
    model = lax_model(make_config, gate, base)
    act = F.silu if base == "cola" else (lambda t: t)
    for part, name in PROJECTIONS:
        chain = [getattr(getattr(layer, part), name) for layer in model.model.layers]
        h_prev = None
        for block, projection in enumerate(chain):
            x = torch.randn(6, projection.in_features, generator=torch.Generator().manual_seed(block))
            z = x @ projection.A.T
            if block == 0:
                assert projection.latent_norm is None and projection.crossing is None
                h = act(z)
            else:
                norm = projection.latent_norm
                crossed = z + authors_gate(projection, gate, h_prev)
                h = act(F.layer_norm(crossed, (crossed.shape[-1],), norm.weight, norm.bias, eps=1e-6))
            with torch.no_grad():
                y, carried = projection(x, h_prev)
            assert_scaled_close(y, h.detach() @ projection.B.T.detach(), ONE_OPERATOR, f"{name} block {block}")
            assert_scaled_close(carried, h.detach(), ONE_OPERATOR, f"{name} block {block}: handed-on latent")
            h_prev = carried


def test_latent_norm_eps_and_block_zero_parameters(make_config):
    model = lax_model(make_config, "dense", "cola")
    first, second = model.model.layers[0].mlp.down_proj, model.model.layers[1].mlp.down_proj
    assert second.latent_norm.eps == 1e-6
    assert {name for name, _ in first.named_parameters()} == {"A", "B"}
    assert {name for name, _ in second.named_parameters()} == {"A", "B", "gate", "gate_bias", "latent_norm.weight", "latent_norm.bias"}


def test_default_gate_is_the_authors_kronecker_gate():
    assert BoostLlamaConfig().lax_gate == "kronecker"
    config = BoostLlamaConfig(hidden_size=512, num_attention_heads=8, bottleneck="lax", rank=128)
    assert config.kronecker_factors == (8, 16)  # the authors' most balanced factor pair of 128


def test_crossing_without_the_previous_latent_is_an_error(make_config):
    projection = lax_model(make_config, "kronecker", "cola").model.layers[1].self_attn.q_proj
    with pytest.raises(ValueError, match="previous block's latent"):
        projection(torch.randn(2, projection.in_features))


def test_the_earlier_lax_definition_is_refused(make_config, tmp_path):
    config = make_config("lax-kronecker")
    with pytest.raises(ValueError, match="lax_version 1.*block 0.*pre-norm sum"):
        BoostLlamaConfig(**{**config.to_dict(), "lax_version": 1})
    # a folder written by the earlier code: its config.json has no lax_version
    torch.manual_seed(0)
    BoostLlamaForCausalLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["lax_version"] == 2
    del saved["lax_version"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="earlier LaX.*another function"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path)
    # a non-LaX config needs no lax_version
    cola = make_config("cola").to_dict()
    del cola["lax_version"]
    assert BoostLlamaConfig.from_dict(cola).bottleneck == "cola"


def test_earlier_lax_weights_under_a_current_config_are_refused_naming_the_difference(make_config, tmp_path):
    from safetensors.torch import load_file, save_file

    model = lax_model(make_config, "dense", "cola", layers=2)
    model.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    r = model.config.rank
    for name in [n for n in weights if n.endswith(".gate_bias")]:
        del weights[name]  # the earlier dense gate had no bias, and block 0 had a latent LayerNorm
        block0 = name.replace("layers.1.", "layers.0.").replace(".gate_bias", ".latent_norm")
        weights[f"{block0}.weight"], weights[f"{block0}.bias"] = torch.ones(r), torch.zeros(r)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="gate_bias.*earlier LaX.*block 0"):
        BoostLlamaForCausalLM.from_pretrained(tmp_path)
