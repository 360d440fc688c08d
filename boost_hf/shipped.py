"""What the package ships besides code: the reference recipes and accelerate configurations, found without importing
the trainer (``boost-hf plan`` reads them; :mod:`boost_hf.training.recipe` runs them)."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
RECIPES_DIR = PACKAGE_DIR / "recipes"
"""The reference recipes, shipped as package data (in a source checkout, ``boost_hf/recipes`` links to ``recipes/``)."""
ACCELERATE_CONFIGS_DIR = PACKAGE_DIR / "accelerate_configs"
"""The reference ``accelerate`` configurations, shipped the same way."""


def shipped_recipes() -> list[str]:
    """Names of the recipes shipped with the package (``demo``, ``cola-60m``, ...)."""
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(name_or_path: str) -> str:
    """A YAML recipe's path: ``name_or_path`` itself if it is a file, else the shipped recipe of that name (``demo``,
    ``cola-7b``); ``FileNotFoundError`` listing the shipped ones otherwise."""
    if os.path.isfile(name_or_path):
        return name_or_path
    shipped = RECIPES_DIR / f"{Path(name_or_path).stem}.yaml"
    if not name_or_path.endswith((".yaml", ".yml")) or os.sep not in name_or_path:
        if shipped.is_file():
            return str(shipped)
    raise FileNotFoundError(
        f"recipe: no such file {name_or_path!r}, and no shipped recipe of that name: use a YAML file or one of "
        f"{', '.join(shipped_recipes())}."
    )


VOCAB_MULTIPLE = 64
"""A recipe's vocabulary is its tokenizer's padded to a multiple of this (divisible by any power-of-two tp_size up to 64)."""


def recipe_model_config(preset: str, overrides: dict, **tokens):
    """The configuration a recipe's ``model`` section builds: ``preset`` with ``overrides`` (a head count given
    without ``num_key_value_heads`` keeps the presets' no-GQA) and the tokenizer's special ``tokens``."""
    from .configuration_boost_llama import BoostLlamaConfig

    overrides = dict(overrides)
    if "num_attention_heads" in overrides:  # presets have no GQA: keep it that way unless asked
        overrides.setdefault("num_key_value_heads", overrides["num_attention_heads"])
    return BoostLlamaConfig.from_preset(preset, **tokens, **overrides)

__all__ = ["ACCELERATE_CONFIGS_DIR", "PACKAGE_DIR", "RECIPES_DIR", "VOCAB_MULTIPLE", "recipe_model_config", "resolve_recipe", "shipped_recipes"]
