"""``check_config_fields``: every wrong type or range of a model field fails with the field's name."""

from __future__ import annotations

import pytest

from boost_hf import BoostLlamaConfig
from boost_hf.configuration_boost_llama import check_config_fields


def small_config(**fields) -> BoostLlamaConfig:
    return BoostLlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        bottleneck="cola", rank=16, **fields,
    )


def test_a_valid_config_passes():
    check_config_fields(small_config())
    check_config_fields(small_config(pad_token_id=3))


@pytest.mark.parametrize(
    "field, value, error, message",
    [
        ("hidden_size", "64", TypeError, "hidden_size must be an int, got str '64'"),
        ("num_hidden_layers", 2.0, TypeError, "num_hidden_layers must be an int, got float"),
        ("vocab_size", True, TypeError, "vocab_size must be an int, got bool"),
        ("max_position_embeddings", 0, ValueError, "max_position_embeddings must be >= 1"),
        ("rank", "16", TypeError, "rank must be an int"),
        ("lax_kronecker_factor", 0, ValueError, "lax_kronecker_factor must be >= 1"),
        ("only_lr_act", "false", TypeError, "only_lr_act must be true or false"),
        ("hidden_act", "swish2", ValueError, "unknown hidden_act 'swish2'"),
        ("lr_act", None, ValueError, "unknown lr_act None"),
        ("initializer_range", -0.02, ValueError, "initializer_range must be > 0"),
        ("initializer_range", "0.02", TypeError, "initializer_range must be a number"),
        ("rms_norm_eps", 0.0, ValueError, "rms_norm_eps must be > 0"),
        ("attention_dropout", 1.0, ValueError, r"attention_dropout must be in \[0.0, 1.0\)"),
        ("rope_parameters", {"rope_theta": -1.0}, ValueError, "rope_theta must be > 0"),
        ("rope_parameters", {"rope_theta": float("nan")}, ValueError, "rope_theta must be finite"),
        ("rope_parameters", {"rope_type": "default"}, ValueError, "rope_parameters must be a dict with a 'rope_theta'"),
        ("pad_token_id", 128, ValueError, r"pad_token_id \(128\) must be < vocab_size \(128\)"),
        ("eos_token_id", -1, ValueError, "eos_token_id must be >= 0"),
    ],
)
def test_each_bad_field_is_named(field, value, error, message):
    config = small_config()
    setattr(config, field, value)
    with pytest.raises(error, match=message):
        check_config_fields(config)
