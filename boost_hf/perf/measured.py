"""Measured per-layer times of one tensor-parallel rank, as the compute term of ``boost-hf estimate``.

``benchmarks/rank_cost.py --json PATH`` times one rank's decoder layer (forward + backward + AdamW, under
a fake process group, so without communication) on the local device and writes::

    {"device": "NVIDIA H100 80GB HBM3", "tp": 4, "micro_batch": 2, "seq": 4096,
     "activation_checkpointing": "none",
     "layers": [{"preset": "cola-7b", "tp_style": "btp", "rmsnorm": "online", "group_linears": true,
                 "sequence_parallel": false, "eager_ms": 4.1, "compiled_ms": 3.2}, ...]}

:func:`measured_layer_seconds` finds the entry that ran exactly the estimated workload (same preset,
layout and layout options (sequence parallelism included), TP size, micro-batch, sequence and checkpointing) and refuses anything else,
naming the field that differs: a time measured on another shape predicts nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODES = ("eager", "compiled")


@dataclass(frozen=True)
class MeasuredLayer:
    """One layout's measured layer time (milliseconds per layer per training step; ``None``: not measured).
    ``sequence_parallel`` defaults to ``False``, as in files written before it was recorded."""

    preset: str
    tp_style: str
    rmsnorm: str
    group_linears: bool
    sequence_parallel: bool = False
    eager_ms: float | None = None
    compiled_ms: float | None = None


@dataclass(frozen=True)
class MeasuredRun:
    """What one ``benchmarks/rank_cost.py`` run measured, and on what."""

    device: str
    tp: int
    micro_batch: int
    seq: int
    activation_checkpointing: str
    layers: tuple[MeasuredLayer, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return {**asdict(self), "layers": [asdict(layer) for layer in self.layers]}

    def save(self, path: str | Path) -> None:
        """Write the run as JSON to ``path``, creating its folder if needed."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> MeasuredRun:
        try:
            data = json.loads(Path(path).read_text())
            return cls(**{**data, "layers": tuple(MeasuredLayer(**layer) for layer in data["layers"])})
        except FileNotFoundError:
            raise FileNotFoundError(
                f"No measured layer times at {path}: write them with `python benchmarks/rank_cost.py --json {path}`."
            ) from None
        except (KeyError, TypeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path} is not a measured-times file of benchmarks/rank_cost.py --json ({error}).") from None


def measured_layer_seconds(run: MeasuredRun, preset: str, parallel, micro_batch: int, seq: int, mode: str = "eager") -> float:
    """Seconds per decoder layer (forward + backward + its AdamW step) that ``run`` measured for ``preset``
    under ``parallel`` at ``micro_batch`` x ``seq``. Raises ``ValueError`` naming what does not match."""
    if mode not in MODES:
        raise ValueError(f"measured mode must be one of {MODES}, got {mode!r}.")
    expected = {
        "tp": parallel.tp_size, "micro_batch": micro_batch, "seq": seq,
        "activation_checkpointing": parallel.activation_checkpointing,
    }
    for name, value in expected.items():
        if getattr(run, name) != value:
            raise ValueError(
                f"The measured run has {name}={getattr(run, name)!r} but the estimate asks for {value!r}: measure "
                f"that workload (benchmarks/rank_cost.py --json) or estimate the measured one."
            )
    options = {"rmsnorm": parallel.rmsnorm, "group_linears": parallel.group_linears} if parallel.tp_style == "btp" else {}
    options["sequence_parallel"] = parallel.sequence_parallel
    for layer in run.layers:
        if layer.preset == preset and layer.tp_style == parallel.tp_style and all(getattr(layer, k) == v for k, v in options.items()):
            ms = getattr(layer, f"{mode}_ms")
            if ms is None:
                raise ValueError(f"{preset} {parallel.tp_style} has no {mode} time in the measured run: measure it "
                                 f"({'--compile' if mode == 'compiled' else 'eager'}) or choose the other mode.")
            return ms / 1e3
    have = ", ".join(f"{layer.preset} {layer.tp_style}{' (sequence parallel)' if layer.sequence_parallel else ''}"
                     for layer in run.layers) or "nothing"
    raise ValueError(
        f"The measured run has no {preset} {parallel.tp_style} layer with {options or 'its options'} (it has: {have}): "
        "measure it with benchmarks/rank_cost.py --json, or estimate only the measured layouts (--layouts)."
    )


__all__ = ["MODES", "MeasuredLayer", "MeasuredRun", "measured_layer_seconds"]
