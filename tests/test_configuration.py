"""``BoostLlamaConfig`` (validation, defaults, presets, sizes) and ``ParallelConfig`` validation."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from boost_hf import BoostLlamaConfig, BoostLlamaForCausalLM, ParallelConfig
from boost_hf.configuration_boost_llama import PRESET_ARCHS, PRESET_SIZES, RELEASE_TT_PRESETS

from .conftest import TINY


# ---------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "fields, names",
    [
        (dict(bottleneck="lora"), ["bottleneck", "'lora'"]),
        (dict(bottleneck="cola", rank=0), ["rank (0)"]),
        # smallest projection dim is the kv width 2 * 8 = 16
        (dict(bottleneck="svd", rank=17), ["rank (17)", "16"]),
        (dict(bottleneck="lax", rank=-1), ["rank (-1)"]),
        (dict(hidden_size=40, num_attention_heads=6, num_key_value_heads=6), ["hidden_size (40)", "num_attention_heads (6)"]),
        (dict(num_key_value_heads=3), ["num_key_value_heads (3)", "num_attention_heads (4)"]),
        (dict(num_key_value_heads=0), ["num_key_value_heads must be >= 1, got 0"]),
        (dict(hidden_size=12, num_attention_heads=4, num_key_value_heads=4, intermediate_size=16), ["head_dim (3)"]),
        pytest.param(
            dict(hidden_size=36, num_attention_heads=4, num_key_value_heads=4), ["head_dim (9)"]
        ),
        pytest.param(
            dict(hidden_size=30, num_attention_heads=4, num_key_value_heads=4),
            ["hidden_size (30)", "num_attention_heads (4)"],
        ),
        (dict(bottleneck="lax", lax_gate="full"), ["lax_gate", "'full'"]),
        (dict(bottleneck="lax", lax_base="lora"), ["lax_base", "'lora'"]),
        (dict(bottleneck="lax", lax_gate="kronecker", lax_kronecker_factor=3), ["lax_kronecker_factor (3)", "rank (8)"]),
        (dict(bottleneck="lax", lax_gate="kronecker", lax_kronecker_factor=0), ["lax_kronecker_factor must be >= 1, got 0"]),
        (dict(bottleneck="cola", lr_act="swish2"), ["lr_act", "'swish2'"]),
        (dict(vocab_size=0), ["vocab_size"]),
        (dict(hidden_size=0), ["hidden_size"]),
        (dict(intermediate_size=0), ["intermediate_size"]),
        (dict(num_hidden_layers=0), ["num_hidden_layers"]),
        (dict(num_attention_heads=0), ["num_attention_heads"]),
        (dict(rms_norm_eps=0.0), ["rms_norm_eps"]),
    ],
    ids=lambda v: "-".join(f"{k}={v[k]}" for k in v) if isinstance(v, dict) else None,
)
def test_invalid_config_raises_naming_the_field(fields, names):
    with pytest.raises(ValueError) as error:
        BoostLlamaConfig(**{**TINY, "rank": 8, **fields})
    for name in names:
        assert name in str(error.value)


def test_rank_may_equal_the_smallest_projection_dim():
    config = BoostLlamaConfig(**{**TINY, "bottleneck": "svd", "rank": 16})
    assert config.rank == 16


def test_full_rank_ignores_the_low_rank_fields():
    config = BoostLlamaConfig(**{**TINY, "rank": 10_000, "lax_gate": "nonsense", "lr_act": "nonsense"})
    assert config.bottleneck is None and not config.is_low_rank


@pytest.mark.parametrize("rank, factors", [(8, (2, 4)), (16, (4, 4)), (7, (1, 7)), (12, (3, 4))])
def test_default_kronecker_factors(rank, factors):
    config = BoostLlamaConfig(**{**TINY, "num_key_value_heads": 4, "bottleneck": "lax", "lax_gate": "kronecker", "rank": rank})
    assert config.kronecker_factors == factors


def test_explicit_kronecker_factor():
    config = BoostLlamaConfig(**{**TINY, "bottleneck": "lax", "lax_gate": "kronecker", "lax_kronecker_factor": 4})
    assert config.kronecker_factors == (4, 2)


# ---------------------------------------------------------------------------------- defaults
def test_defaults():
    config = BoostLlamaConfig(hidden_size=256, num_attention_heads=8)
    assert config.bottleneck is None
    assert config.rank == 64
    assert config.num_key_value_heads == 8
    assert config.head_dim == 32
    assert config.only_lr_act is True and config.lr_act == "silu"
    assert (config.lax_gate, config.lax_latent_norm, config.lax_base, config.lax_version) == ("kronecker", True, "cola", 2)
    assert config.model_type == "boost_llama"


def test_defaults_match_llama_config():
    ours, llama = BoostLlamaConfig(), transformers.LlamaConfig()
    for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
        "rms_norm_eps", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
        "attention_bias", "attention_dropout", "mlp_bias", "rope_parameters",
    ):
        assert getattr(ours, name) == getattr(llama, name), name
    assert ours.rope_theta == 10000.0


def test_latent_and_mlp_activations():
    make = lambda **f: BoostLlamaConfig(**{**TINY, "rank": 8, **f})  # noqa: E731
    assert (make().latent_activation, make().mlp_activation) == (None, "silu")
    assert (make(bottleneck="svd").latent_activation, make(bottleneck="svd").mlp_activation) == (None, "silu")
    assert (make(bottleneck="cola").latent_activation, make(bottleneck="cola").mlp_activation) == ("silu", None)
    cola_swiglu = make(bottleneck="cola", only_lr_act=False)
    assert (cola_swiglu.latent_activation, cola_swiglu.mlp_activation) == ("silu", "silu")
    assert make(bottleneck="lax").latent_activation == "silu"
    assert make(bottleneck="lax", lax_base="svd").latent_activation is None
    assert make(bottleneck="lax", lax_base="svd").mlp_activation == "silu"


def test_projection_shapes():
    config = BoostLlamaConfig(**TINY)
    assert config.projection_shapes() == {
        "q_proj": (32, 32), "k_proj": (32, 16), "v_proj": (32, 16), "o_proj": (32, 32),
        "gate_proj": (32, 64), "up_proj": (32, 64), "down_proj": (64, 32),
    }


def test_config_dict_round_trip(make_config):
    config = make_config("lax-kronecker", lax_kronecker_factor=4, only_lr_act=False)
    again = BoostLlamaConfig.from_dict(config.to_dict())
    for name in ("bottleneck", "rank", "lax_gate", "lax_kronecker_factor", "only_lr_act", "num_key_value_heads", "rope_parameters"):
        assert getattr(again, name) == getattr(config, name), name


# ---------------------------------------------------------------------------------- presets
@pytest.mark.parametrize("name", BoostLlamaConfig.preset_names())
def test_every_preset_builds(name):
    arch, size = name.split("-")
    config = BoostLlamaConfig.from_preset(name)
    layers, hidden, heads, intermediate, rank = PRESET_SIZES[size]
    release_tt = RELEASE_TT_PRESETS.get(size, {}) if arch == "tt" else {}  # the BOOST release's tt configs
    assert config.bottleneck == PRESET_ARCHS[arch]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (layers, hidden, heads)
    assert (config.intermediate_size, config.rank, config.vocab_size) == (release_tt.get("intermediate_size", intermediate), rank, 32000)
    assert config.num_key_value_heads == heads and config.tie_word_embeddings is release_tt.get("tie_word_embeddings", False)
    assert config.only_lr_act is (size not in ("60m", "130m"))


def test_preset_names_cover_every_arch_and_size():
    assert len(BoostLlamaConfig.preset_names()) == len(PRESET_ARCHS) * len(PRESET_SIZES) == 40
    assert "cola-60m" in BoostLlamaConfig.preset_names() and "llama-13b" in BoostLlamaConfig.preset_names()


def test_30b_preset_is_the_papers():
    # BOOST's appendix table: 30B has 36 layers, 64 heads, d 8192, d_ff 22016, r 2048 (= d/4)
    config = BoostLlamaConfig.from_preset("cola-30b")
    assert (config.num_hidden_layers, config.num_attention_heads, config.hidden_size) == (36, 64, 8192)
    assert (config.intermediate_size, config.rank, config.max_position_embeddings) == (22016, 2048, 4096)
    assert config.head_dim == 128 and config.rank * 4 == config.hidden_size


def test_preset_overrides_and_case():
    config = BoostLlamaConfig.from_preset("CoLA-60M", rank=64, vocab_size=128)
    assert (config.bottleneck, config.rank, config.vocab_size) == ("cola", 64, 128)


@pytest.mark.parametrize("name", ["cola-2b", "lora-60m", "cola", "60m", ""])
def test_unknown_preset_lists_the_choices(name):
    with pytest.raises(ValueError, match=re.escape(f"Unknown preset {name!r}")) as error:
        BoostLlamaConfig.from_preset(name)
    assert "cola-60m" in str(error.value)


def test_preset_override_is_validated():
    with pytest.raises(ValueError, match="rank"):
        BoostLlamaConfig.from_preset("svd-60m", rank=0)


@pytest.mark.parametrize(
    "name, millions",
    [
        ("cola-60m", 42.8),
        ("cola-130m", 94.0),
        ("cola-350m", 185.2),
        ("cola-1b", 609.3),
        ("svd-1b", 609.3),
        ("llama-60m", 58.1),
        # 36 x (7 low-rank pairs r (d_in + d_out) + 2 norms) + 2 x 32000 d + d; the full-rank model is the "30B"
        ("cola-30b", 12038.3),
        ("llama-30b", 29666.9),
    ],
)
def test_parameter_counts(name, millions):
    with torch.device("meta"):
        model = BoostLlamaForCausalLM(BoostLlamaConfig.from_preset(name))
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == millions


# ---------------------------------------------------------------------------------- ParallelConfig
def test_parallel_config_defaults():
    parallel = ParallelConfig()
    assert parallel.to_dict() == dict(tp_size=1, tp_style="btp", rmsnorm="online", group_linears=True, activation_checkpointing="none",
                                      sequence_parallel=False, pp_size=1, pp_schedule="1f1b", pp_microbatches=None, pp_stages_per_rank=None, pp_layer_split=None)


def test_parallel_config_pipeline_defaults_and_layer_split():
    assert ParallelConfig(pp_size=4).microbatches == 4
    interleaved = ParallelConfig(pp_size=2, pp_schedule="interleaved-1f1b")
    assert (interleaved.stages_per_rank, interleaved.num_stages, interleaved.microbatches) == (2, 4, 4)
    assert ParallelConfig(pp_size=3).stage_layers(8) == [range(0, 3), range(3, 6), range(6, 8)]
    assert ParallelConfig(pp_size=2, pp_layer_split=[1, 3]).stage_layers(4) == [range(0, 1), range(1, 4)]


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(tp_size=0), "tp_size"),
        (dict(tp_size=-2), "tp_size"),
        (dict(tp_size=2.0), "tp_size"),
        (dict(tp_style="sequence"), "tp_style"),
        (dict(rmsnorm="approx"), "rmsnorm"),
        (dict(activation_checkpointing="selective"), "activation_checkpointing"),
        (dict(group_linears="yes"), "group_linears"),
        (dict(pp_size=0), "pp_size"),
        (dict(pp_size=2, pp_schedule="dualpipe"), "pp_schedule"),
        (dict(pp_size=2, pp_microbatches=1), "pp_microbatches"),
        (dict(pp_size=2, pp_stages_per_rank=2), "pp_stages_per_rank"),
        (dict(pp_size=2, pp_schedule="zbv"), "pp_schedule"),
        (dict(pp_size=2, pp_layer_split=(2, 2, 2)), "pp_layer_split"),
        (dict(pp_size=2, pp_layer_split=(0, 4)), "pp_layer_split"),
    ],
)
def test_parallel_config_rejects(fields, name):
    with pytest.raises(ValueError, match=name):
        ParallelConfig(**fields)


def test_the_unknown_schedule_message_lists_only_the_schedules_that_run():
    with pytest.raises(ValueError) as error:
        ParallelConfig(pp_size=2, pp_schedule="dualpipe")
    assert str(error.value) == "Unknown pp_schedule 'dualpipe': use one of 1f1b, gpipe, interleaved-1f1b, looped-bfs."


@pytest.mark.parametrize(
    "parallel, model_fields, names",
    [
        (dict(tp_size=3), dict(bottleneck="cola"), ["num_attention_heads (4)", "tp_size (3)"]),
        (dict(tp_size=4), dict(bottleneck="cola"), ["num_key_value_heads (2)", "tp_size (4)"]),
        (dict(tp_style="megatron"), dict(bottleneck="svd"), ["megatron", "bottleneck='svd'"]),
        (dict(tp_size=2, tp_style="btp"), dict(bottleneck=None), ["tp_style='btp'", "megatron"]),
        (dict(tp_size=2, tp_style="vanilla"), dict(bottleneck=None), ["tp_style='vanilla'", "megatron"]),
        (dict(activation_checkpointing="lowrank"), dict(bottleneck=None), ["activation_checkpointing='lowrank'"]),
        (dict(tp_size=2), dict(bottleneck="cola", vocab_size=97), ["vocab_size (97)", "98"]),
        (dict(tp_size=2), dict(bottleneck="cola", intermediate_size=65), ["intermediate_size (65)"]),
        (dict(tp_size=2, tp_style="vanilla"), dict(bottleneck="cola", rank=7), ["rank (7)"]),
    ],
)
def test_parallel_config_check_model(make_config, parallel, model_fields, names):
    config = make_config(**{"variant": "full", **model_fields})
    with pytest.raises(ValueError) as error:
        ParallelConfig(**parallel).check_model(config)
    for name in names:
        assert name in str(error.value)


@pytest.mark.parametrize(
    "parallel, bottleneck",
    [
        (dict(tp_size=2, tp_style="btp"), "cola"),
        (dict(tp_size=2, tp_style="vanilla"), "lax"),
        (dict(tp_size=2, tp_style="megatron"), None),
        (dict(activation_checkpointing="full"), None),
        (dict(activation_checkpointing="lowrank"), "svd"),
    ],
)
def test_parallel_config_accepts(make_config, parallel, bottleneck):
    ParallelConfig(**parallel).check_model(make_config(bottleneck=bottleneck))


def test_building_at_tp_size_above_one_without_a_process_group_says_how_to_launch(make_config):
    with pytest.raises(ValueError, match="torchrun"):
        BoostLlamaForCausalLM(make_config("cola"), ParallelConfig(tp_size=2))
