"""The tensor-train bottleneck (``bottleneck="tt"``) against the BOOST release's single-device ``TensorTrainLinear``
(``Arcana-2236/BOOST``, ``examples/tensor/basic_tt_llama.py`` and ``tt_utils.py``).

What the release's layer computes, as read from its code (the reference below is written from this description,
not from their code):

* ``in_features`` is split into ``tt_cores // 2`` *input modes*, ``out_features`` into as many *output modes*: the
  balanced exact factorisation of ``_factorize_dimension`` (input modes sorted descending, output modes ascending);
* the bond ranks are ``validate_tt_rank(modes, rank=tt_rank, constant_rank=True, allow_overparametrization=False,
  per_decomp_rank_ratio_limit=tt_rank_ratio)``; core ``i`` is a ``[rank_i, mode_i, rank_{i+1}]`` parameter;
* the forward contracts the input cores into ``M_1: [in_features, r]`` and the output cores into
  ``M_2: [r, out_features]`` and returns ``(x @ M_1) @ M_2`` (+ a bias, zero at init); nothing between them. The two
  halves together are the tensor train ``W[i_0 .. i_{k-1}, o_0 .. o_{k-1}] = G_0[:, i_0, :] ... G_{2k-1}[:, o_{k-1}, :]``
  with ``x @ W`` its function (rows of ``W`` indexed by the input modes row-major, columns by the output modes);
* each core is drawn ``N(0, s^2)``, ``s = (rank_i rank_{i+1})^(-1/4) initializer_range^(1 / tt_cores)``.

Our independent reference (:func:`tensor_train_weight`) contracts *all* cores of a layer in one ``einsum`` over every
bond index, in float64, into the dense ``W: [in_features, out_features]``; the layer must equal ``x @ W`` in fp32 to
1e-6 (largest difference over the largest output), and so must its gradients. The modes and ranks are compared with
a table of what the release's own ``_factorize_dimension`` and ``validate_tt_rank`` return for the same arguments
(obtained by running those two functions; 68,000 further shapes agreed when this was written).
"""

from __future__ import annotations

import math
import string

import pytest
import torch

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from boost_hf.configuration_boost_llama import tensor_train_shape
from boost_hf.modeling_boost_llama import BoostLlamaTensorTrainLinear
from boost_hf.perf.parameters import parameter_count
from boost_hf.perf.flops import contraction_flops

# (d_in, d_out, tt_rank, tt_cores, tt_rank_ratio) -> (input modes, output modes, ranks), as the release returns them
RELEASE = {
    (64, 96, 16, 4, 1.0): ((8, 8), (8, 12), (1, 8, 16, 12, 1)),
    (96, 64, 16, 4, 1.0): ((12, 8), (8, 8), (1, 12, 16, 8, 1)),
    (512, 1344, 128, 6, 1.0): ((8, 8, 8), (8, 12, 14), (1, 8, 64, 128, 128, 14, 1)),
    (1344, 512, 128, 6, 1.0): ((14, 12, 8), (8, 8, 8), (1, 14, 128, 128, 64, 8, 1)),
    (2048, 5472, 512, 6, 1.0): ((16, 16, 8), (16, 18, 19), (1, 16, 256, 512, 342, 19, 1)),
    (5472, 2048, 512, 6, 1.0): ((19, 18, 16), (8, 16, 16), (1, 19, 342, 512, 256, 16, 1)),
    (48, 40, 1000, 2, 1.0): ((48,), (40,), (1, 40, 1)),
    (100, 36, 50, 4, 0.5): ((10, 10), (6, 6), (1, 5, 18, 3, 1)),
    (4096, 11008, 1024, 6, 1.0): ((16, 16, 16), (16, 16, 43), (1, 16, 256, 1024, 688, 43, 1)),
    (1024, 1024, 256, 8, 1.0): ((8, 8, 4, 4), (4, 4, 8, 8), (1, 8, 64, 256, 256, 256, 64, 8, 1)),
    (210, 330, 64, 6, 0.75): ((7, 6, 5), (5, 6, 11), (1, 5, 22, 64, 64, 8, 1)),
}
FORWARD_CASES = [case for case in RELEASE if case[0] * case[1] <= 1024 * 1024]


def tensor_train_weight(cores, split: int) -> torch.Tensor:
    """The dense ``W: [d_in, d_out]`` (float64) of a layer's cores ``[r_i, m_i, r_{i+1}]``, the first ``split`` of
    them input cores: every bond index contracted in one einsum, the mode indices kept in order (rows: the input
    modes row-major, columns: the output modes), the two boundary ranks (1) dropped."""
    modes, bonds = string.ascii_lowercase, string.ascii_uppercase
    terms = [f"{bonds[i]}{modes[i]}{bonds[i + 1]}" for i in range(len(cores))]
    out = bonds[0] + modes[: len(cores)] + bonds[len(cores)]
    full = torch.einsum(",".join(terms) + "->" + out, *[core.double() for core in cores])
    return full.reshape(math.prod(core.shape[1] for core in cores[:split]), -1)


def dense_weight(layer: BoostLlamaTensorTrainLinear) -> torch.Tensor:
    return tensor_train_weight(list(layer.cores), layer.tensor_train.split)


def release_std(shape, tt_cores: int, initializer_range: float = 0.02) -> float:
    rank_in, _, rank_out = shape
    return (rank_in * rank_out) ** -0.25 * initializer_range ** (1.0 / tt_cores)


def layer_for(case, bias: bool = False, seed: int = 0) -> BoostLlamaTensorTrainLinear:
    d_in, d_out, tt_rank, tt_cores, ratio = case
    layer = BoostLlamaTensorTrainLinear(d_in, d_out, tensor_train_shape(d_in, d_out, tt_rank, tt_cores, ratio), bias=bias)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for core in layer.cores:
            core.normal_(0.0, release_std(core.shape, tt_cores, 0.5), generator=gen)
        if bias:
            layer.bias.normal_(generator=gen)
    return layer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max())


@pytest.mark.parametrize("case", list(RELEASE), ids=str)
def test_modes_and_ranks_are_the_releases(case):
    d_in, d_out, tt_rank, tt_cores, ratio = case
    inputs, outputs, ranks = RELEASE[case]
    shape = tensor_train_shape(d_in, d_out, tt_rank, tt_cores, ratio)
    assert (shape.input_modes, shape.output_modes, shape.ranks) == (inputs, outputs, ranks)
    assert shape.core_shapes == [(ranks[i], m, ranks[i + 1]) for i, m in enumerate(inputs + outputs)]


def test_the_einsum_reference_is_the_tensor_train_definition():
    """``W[i, o] = G_0[0, i, :] G_1[:, o, 0]`` for two cores; a four-core entry by hand."""
    gen = torch.Generator().manual_seed(0)
    g0, g1 = torch.randn(1, 3, 2, generator=gen), torch.randn(2, 4, 1, generator=gen)
    torch.testing.assert_close(tensor_train_weight([g0, g1], 1), g0[0].double() @ g1[..., 0].double())
    cores = [torch.randn(shape, generator=gen) for shape in [(1, 2, 3), (3, 5, 2), (2, 3, 4), (4, 2, 1)]]
    w = tensor_train_weight(cores, 2)
    assert w.shape == (2 * 5, 3 * 2)
    i0, i1, o0, o1 = 1, 3, 2, 1
    by_hand = cores[0][0, i0].double() @ cores[1][:, i1].double() @ cores[2][:, o0].double() @ cores[3][:, o1, 0].double()
    assert abs(float(w[i0 * 5 + i1, o0 * 2 + o1]) - float(by_hand)) < 1e-12


@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
def test_projection_equals_the_full_contraction(case):
    layer = layer_for(case, bias=True)
    x = torch.randn(3, 5, case[0], generator=torch.Generator().manual_seed(1))
    weight = dense_weight(layer)
    expected = x.double() @ weight + layer.bias.double()
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (3, 5, case[1])
    assert rel(y, expected) <= 1e-6
    assert layer.A.shape == (layer.rank, case[0]) and layer.B.shape == (case[1], layer.rank)
    assert rel(layer.A.T @ layer.B.T, weight) <= 1e-6


@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
def test_gradients_equal_the_full_contractions(case):
    layer = layer_for(case, bias=True)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, case[0], generator=gen, requires_grad=True)
    upstream = torch.randn(6, case[1], generator=gen)
    (layer(x) * upstream).sum().backward()
    cores = [core.detach().double().requires_grad_() for core in layer.cores]
    x64 = x.detach().double().requires_grad_()
    weight = tensor_train_weight(cores, layer.tensor_train.split)
    ((x64 @ weight) * upstream.double()).sum().backward()
    assert rel(x.grad, x64.grad) <= 1e-6
    for core, reference in zip(layer.cores, cores):
        assert rel(core.grad, reference.grad) <= 1e-5, core.shape
    torch.testing.assert_close(layer.bias.grad, upstream.sum(0))


def tt_config(**overrides) -> BoostLlamaConfig:
    fields = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                  bottleneck="tt", tt_rank=64, tt_cores=6)
    return BoostLlamaConfig(**{**fields, **overrides})


def test_init_is_the_releases():
    """Each core ``N(0, s^2)``, ``s = (r_in r_out)^(-1/4) initializer_range^(1/tt_cores)``; the product has about
    ``initializer_range``'s std; a bias after ``B`` starts at zero."""
    config = tt_config(initializer_range=0.03, attention_bias=True)
    torch.manual_seed(0)
    model = BoostLlamaForCausalLM(config)
    standardised = torch.cat([
        (core / release_std(core.shape, 6, 0.03)).flatten() for name, core in model.named_parameters() if ".cores." in name
    ])
    assert abs(standardised.std().item() - 1) < 0.01 and abs(standardised.mean().item()) < 0.01
    q = model.model.layers[0].self_attn.q_proj
    assert 0.5 * 0.03 < dense_weight(q).std().item() < 1.5 * 0.03
    assert torch.equal(q.bias, torch.zeros_like(q.bias))


def test_parameter_names_shapes_and_counts():
    config = tt_config()
    model = BoostLlamaForCausalLM(config)
    params = dict(model.named_parameters())
    shape = config.tensor_train_shape("down_proj")
    for i, core in enumerate(shape.core_shapes):
        assert tuple(params[f"model.layers.1.mlp.down_proj.cores.{i}"].shape) == core
    assert not any(name.endswith((".A", ".B")) for name in params)
    assert parameter_count(config) == sum(p.numel() for p in model.parameters())
    assert config.rank == shape.middle_rank == 64


def test_contraction_flops_are_the_forwards_chain_of_gemms():
    """The estimator's contraction FLOPs equal torch's count of the GEMMs that contract one layer's factors."""
    from torch.utils.flop_counter import FlopCounterMode

    config = tt_config()
    layer = BoostLlamaForCausalLM(config).model.layers[0]
    projections = [getattr(layer.self_attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    projections += [getattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")]
    with FlopCounterMode(display=False) as counter:
        for projection in projections:
            projection.A, projection.B
    assert counter.get_total_flops() == contraction_flops(config) > 0


def test_config_validation_names_the_field():
    for fields, message in (
        (dict(tt_cores=3), "tt_cores must be even"),
        (dict(tt_cores=1), "tt_cores must be >= 2"),
        (dict(tt_rank=0), "tt_rank must be >= 1"),
        (dict(tt_rank=2.5), "tt_rank must be an int"),
        (dict(tt_rank_ratio=0), "tt_rank_ratio must be > 0"),
        (dict(tt_rank_ratio=0.001, tt_rank=1000), "tt_rank_ratio"),
        (dict(rank=32), "rank \\(32\\) is derived"),
        (dict(tt_rank=512, num_key_value_heads=2), "different middle ranks"),
        (dict(tt_leading_mode_multiple=7), "tt_leading_mode_multiple=7"),
    ):
        with pytest.raises((ValueError, TypeError), match=message):
            tt_config(**fields)
    assert tt_config(rank=64).rank == 64  # the derived value may be given


def test_leading_mode_multiple_reorders_the_same_modes():
    release = tensor_train_shape(768, 256, 64, 6)
    ours = tensor_train_shape(768, 256, 64, 6, leading_mode_multiple=8)
    assert (release.input_modes, release.output_modes) == ((12, 8, 8), (4, 8, 8))
    assert (ours.input_modes, ours.output_modes) == ((8, 12, 8), (8, 4, 8))
    assert tensor_train_shape(768, 256, 64, 6, leading_mode_multiple=4).input_modes == (12, 8, 8)  # already a multiple
    assert tensor_train_shape(5472, 2048, 512, 6, leading_mode_multiple=2).input_modes == (18, 19, 16)


def test_presets():
    """tt-60m and tt-1b are the release's configs (config_tt_llama_60m.yaml, config_tt_llama_1b.yaml); the other
    sizes are boost-hf's (the table's shapes, 6 cores, leading modes multiples of 4)."""
    small = BoostLlamaConfig.from_preset("tt-60m")
    assert (small.hidden_size, small.intermediate_size, small.num_hidden_layers, small.num_attention_heads) == (512, 1344, 8, 8)
    assert (small.tt_rank, small.tt_cores, small.tt_rank_ratio, small.tie_word_embeddings) == (128, 6, 1.0, False)
    assert (small.max_position_embeddings, small.rms_norm_eps, small.vocab_size, small.tt_leading_mode_multiple) == (4096, 1e-6, 32000, 1)
    large = BoostLlamaConfig.from_preset("tt-1b")
    assert (large.hidden_size, large.intermediate_size, large.num_hidden_layers, large.num_attention_heads) == (2048, 5472, 24, 32)
    assert (large.tt_rank, large.tt_cores, large.tie_word_embeddings, large.tt_leading_mode_multiple) == (512, 6, True, 1)
    ours = BoostLlamaConfig.from_preset("tt-7b")
    assert (ours.intermediate_size, ours.tt_rank, ours.tt_cores, ours.tt_leading_mode_multiple, ours.rank) == (11008, 1024, 6, 4, 1024)
    for name in BoostLlamaConfig.preset_names():
        if name.startswith("tt-"):
            config = BoostLlamaConfig.from_preset(name)
            assert config.latent_activation is None and config.mlp_activation == "silu", name  # the release keeps SwiGLU


def test_tensor_parallel_refusals_name_the_reason():
    """Checked before any process group exists (the layout's check runs first on every rank): BTP at tp_size 4
    cannot split the release's first input mode of down_proj for the release's 60m intermediate size."""
    config = tt_config(intermediate_size=1344)  # down_proj's input modes (14, 12, 8)
    with pytest.raises(ValueError, match="down_proj's input modes are \\[14, 12, 8\\].*tt_leading_mode_multiple=4"):
        ParallelConfig(tp_size=4).check_model(config)
    with pytest.raises(ValueError, match="tp_style='megatron' is the full-rank layout"):
        ParallelConfig(tp_size=2, tp_style="megatron").check_model(config)
    ParallelConfig(tp_size=2).check_model(config)
    ParallelConfig(tp_size=4, tp_style="vanilla").check_model(config)  # splits the middle rank instead
    reordered = tt_config(intermediate_size=1344, tt_leading_mode_multiple=4)
    assert reordered.tensor_train_shape("down_proj").input_modes == (12, 14, 8)
    ParallelConfig(tp_size=4).check_model(reordered)
