"""What a finished training run wrote that the tests read: the trainer's log history (``trainer_state.json``), the
training losses by step, and the relative distance between two saved models' weights."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file


def log_history(run: Path) -> list[dict]:
    """``log_history`` of ``run``'s ``trainer_state.json`` (a run's output folder or one of its checkpoints)."""
    return json.loads((run / "trainer_state.json").read_text())["log_history"]


def losses(run: Path) -> dict[int, float]:
    """The training loss logged at each step of ``run``."""
    return {entry["step"]: entry["loss"] for entry in log_history(run) if "loss" in entry}


def weights_rel(actual: Path, expected: Path) -> dict[str, float]:
    """Per weight of two saved folders' ``model.safetensors`` (the same names): ``|actual - expected| / |expected|``
    (Frobenius norms)."""
    a, b = load_file(actual / "model.safetensors"), load_file(expected / "model.safetensors")
    assert a.keys() == b.keys()
    return {name: float((a[name] - b[name]).norm() / b[name].norm().clamp(min=1e-12)) for name in b}


__all__ = ["log_history", "losses", "weights_rel"]
