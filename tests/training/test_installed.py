"""An installed package trains: the wheel ships the reference recipes and accelerate configurations, and, installed
on its own (no source checkout on the path), ``accelerate launch --config_file <installed>/accelerate_configs/cpu-2proc.yaml
-m boost_hf.cli train demo ...`` trains tp 2 from another working directory and writes there. About a minute on 2
cores (a wheel build, then one 2-process launch of the shrunk demo)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .launcher import REPO, TINY


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The package built as a wheel and installed alone into a fresh folder (``pip install --target``)."""
    root = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q", "-w", root / "wheel"],
                   check=True, capture_output=True, timeout=300, cwd=root)
    wheel = next((root / "wheel").glob("boost_hf-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", root / "site", wheel],
                   check=True, capture_output=True, timeout=300)
    return root


def test_the_wheel_ships_every_recipe_and_accelerate_config(installed):
    names = set(zipfile.ZipFile(next((installed / "wheel").glob("*.whl"))).namelist())
    for folder in ("recipes", "accelerate_configs"):
        for path in (REPO / folder).glob("*.yaml"):
            assert f"boost_hf/{folder}/{path.name}" in names, path


def test_installed_package_trains_under_accelerate_from_another_directory(installed, training_env, tmp_path):
    site = installed / "site"
    env = {**training_env, "PYTHONPATH": str(site)}  # the installed copy only, no source checkout
    config = site / "boost_hf" / "accelerate_configs" / "cpu-2proc.yaml"
    args = [*TINY, "--dataset", training_env["CORPUS"], "--tp_size", "2", "--per_device_train_batch_size", "8",
            "--max_steps", "2", "--output_dir", "out"]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "-m", "boost_hf.cli", "train", "demo", *args]
    output = run_commands_in(command, env, tmp_path)
    assert "model and tokenizer saved to out/final" in output
    assert (tmp_path / "out" / "final" / "manifest.json").is_file()
    assert not (site / "boost_hf" / "outputs").exists() and not (REPO / "out").exists()
    # where ``import boost_hf`` resolves there (found as import finds it, without importing torch again)
    resolved = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec('boost_hf').origin)"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120).stdout.strip()
    assert resolved == str(site / "boost_hf" / "__init__.py")  # the installed copy ran, with its own recipes


def run_commands_in(command, env, cwd) -> str:
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return result.stdout + result.stderr


def test_unknown_recipe_names_the_shipped_ones():
    from boost_hf.training.recipe import resolve_recipe

    assert resolve_recipe("demo").endswith("boost_hf/recipes/demo.yaml")
    with pytest.raises(FileNotFoundError, match="no shipped recipe of that name: use a YAML file or one of cola-130m, .*demo"):
        resolve_recipe("nonexistent")
