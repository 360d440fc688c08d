"""GPU presets for the performance estimator: peak compute, memory and interconnect.

Every number is per GPU and can be overridden (``get_hardware("a100", link_gbps=150)``).

========  ============  ======  ===========================  ==========  ==========================
preset    bf16 dense    HBM     intra-node collective         latency     inter-node (per GPU)
          (TFLOP/s)     (GB/s)  bus bandwidth (GB/s)          (us)        (GB/s)
========  ============  ======  ===========================  ==========  ==========================
a100      312           2039    230 (NVLink 3: 300 raw)       15          25 (HDR 200 Gb/s)
h100      989           3350    360 (NVLink 4: 450 raw)       12          50 (NDR 400 Gb/s)
h200      989           4800    360 (NVLink 4: 450 raw)       12          50 (NDR 400 Gb/s)
========  ============  ======  ===========================  ==========  ==========================

``link_gbps`` is the *bus bandwidth* NCCL reaches for large collectives inside an NVSwitch node (the
``busbw`` of nccl-tests, about 75-80 % of the per-direction NVLink bandwidth), so a ring all-reduce of
``S`` bytes over ``p`` ranks takes ``2 (p-1)/p * S / link_gbps`` plus ``latency_us``. A100 is the SXM4
80 GB part (the paper's machine), H100 the SXM5 part.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Hardware:
    """One GPU model and its interconnect.

    Args:
        name: preset name.
        peak_tflops: dense bf16 tensor-core peak, TFLOP/s.
        hbm_gbps: HBM bandwidth, GB/s (10^9 bytes/s); memory-bound kernels and the optimizer step.
        link_gbps: bus bandwidth of intra-node collectives, GB/s (see the module docstring).
        latency_us: fixed cost of one collective (or point-to-point send), microseconds.
        inter_node_gbps: network bandwidth per GPU between nodes, GB/s; pipeline sends that cross nodes.
        gpus_per_node: GPUs sharing one NVLink/NVSwitch domain.
    """

    name: str
    peak_tflops: float
    hbm_gbps: float
    link_gbps: float
    latency_us: float
    inter_node_gbps: float
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not value > 0:
                raise ValueError(f"Hardware {f.name} must be > 0, got {value!r}.")

    @property
    def peak_flops(self) -> float:
        """Peak in FLOP/s."""
        return self.peak_tflops * 1e12


HARDWARE_PRESETS: dict[str, Hardware] = {
    "a100": Hardware("a100", peak_tflops=312.0, hbm_gbps=2039.0, link_gbps=230.0, latency_us=15.0, inter_node_gbps=25.0),
    "h100": Hardware("h100", peak_tflops=989.0, hbm_gbps=3350.0, link_gbps=360.0, latency_us=12.0, inter_node_gbps=50.0),
    "h200": Hardware("h200", peak_tflops=989.0, hbm_gbps=4800.0, link_gbps=360.0, latency_us=12.0, inter_node_gbps=50.0),
}


def get_hardware(name: str, **overrides) -> Hardware:
    """The preset ``name`` (a100, h100, h200) with any field replaced by a non-``None`` override."""
    key = name.lower()
    if key not in HARDWARE_PRESETS:
        raise ValueError(f"Unknown GPU {name!r}: use one of {', '.join(HARDWARE_PRESETS)}.")
    return replace(HARDWARE_PRESETS[key], **{k: v for k, v in overrides.items() if v is not None})


__all__ = ["Hardware", "HARDWARE_PRESETS", "get_hardware"]
