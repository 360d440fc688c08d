"""GPU presets for the performance estimator: peak compute, memory and interconnect.

Every number is per GPU and can be overridden (``get_hardware("a100", link_gbps=150)``).

=============  ==========  ======  =========  =======  ==============  =======  ===========  ===========
preset         bf16 dense  HBM     collective  latency  node            NVSwitch inter-node   memory
               (TFLOP/s)   (GB/s)  bus (GB/s)  (us)                               (GB/s/GPU)   (GiB)
=============  ==========  ======  =========  =======  ==============  =======  ===========  ===========
a100           312         2039    230        15       4 GPUs (HGX 4)  no       25 (HDR)     80
a100-nvswitch  312         2039    230        15       8 GPUs (DGX)    yes      25 (HDR)     80
h100           989         3350    360        12       8 GPUs (HGX)    yes      50 (NDR)     80
h200           989         4800    360        12       8 GPUs (HGX)    yes      50 (NDR)     141
cpu            0.1         20      1          100      4 processes     yes      1            4
=============  ==========  ======  =========  =======  ==============  =======  ===========  ===========

``link_gbps`` is the *bus bandwidth* NCCL reaches for large collectives over a whole node (the
``busbw`` of nccl-tests, about 75-80 % of the per-direction NVLink bandwidth: 300 GB/s on A100,
450 GB/s on H100/H200), so a ring all-reduce of ``S`` bytes over ``p`` ranks takes
``2 (p-1)/p * S / bandwidth`` plus ``latency_us``; see :meth:`Hardware.collective_gbps` for groups
smaller than a node.

``a100`` is the machine the estimator is calibrated on (BOOST.md section 6; the paper does not describe
its machine): A100 SXM4 80 GB on 4-GPU HGX boards, whose GPUs are fully connected by NVLink without a
switch (4 links, 100 GB/s per direction, to each of the 3 peers). A 2-GPU collective then reaches a
third of a 4-GPU one, which is what the paper's TP2 times show (3B TP2 vanilla is 1.41 s, not the
~1.0 s a switched node predicts). 8 GPUs (13B TP4 x PP2) are two such nodes. ``a100-nvswitch`` is the
8-GPU DGX A100.

``cpu`` is not a GPU: CPU processes talking through gloo (``accelerate launch`` with ``use_cpu``), the rough dense
fp32 peak of one process (:data:`~boost_hf.training.arguments.CPU_PEAK_TFLOPS`), a few GB/s of memory and loopback
bandwidth, and 4 GiB per process; for planning the demo and tests on a laptop, not calibrated.
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
        link_gbps: bus bandwidth of a collective over the GPUs of one node, GB/s.
        latency_us: fixed cost of one collective (or point-to-point send), microseconds.
        inter_node_gbps: network bandwidth per GPU between nodes, GB/s.
        gpus_per_node: GPUs sharing one NVLink domain.
        nvswitch: whether the node's GPUs talk through an NVSwitch (any group gets ``link_gbps``) or a
            fully connected point-to-point NVLink mesh (see :meth:`collective_gbps`).
        memory_gb: memory per GPU, GiB (``boost-hf plan``'s fit).
    """

    name: str
    peak_tflops: float
    hbm_gbps: float
    link_gbps: float
    latency_us: float
    inter_node_gbps: float
    gpus_per_node: int = 8
    nvswitch: bool = True
    memory_gb: float = 80.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("name", "nvswitch") and not value > 0:
                raise ValueError(f"Hardware {f.name} must be > 0, got {value!r}.")

    @property
    def peak_flops(self) -> float:
        """Peak in FLOP/s."""
        return self.peak_tflops * 1e12

    def collective_gbps(self, group_size: int) -> float:
        """Bus bandwidth of a collective over ``group_size`` GPUs, GB/s.

        Within one node behind an NVSwitch every group gets ``link_gbps``. In a fully connected mesh
        each GPU's NVLinks are split evenly over its ``gpus_per_node - 1`` peers, and a collective can
        use only the links to the ``group_size - 1`` peers in its group:
        ``link_gbps * (group_size - 1) / (gpus_per_node - 1)``. A group larger than a node is limited
        by the network, ``inter_node_gbps``.
        """
        if group_size > self.gpus_per_node:
            return self.inter_node_gbps
        if self.nvswitch or self.gpus_per_node == 1:
            return self.link_gbps
        return self.link_gbps * (group_size - 1) / (self.gpus_per_node - 1)

    def point_to_point_gbps(self, same_node: bool) -> float:
        """Bandwidth of one GPU sending to another (pipeline stages), GB/s: one peer's NVLinks within a
        node (all of them behind an NVSwitch), the network across nodes."""
        if not same_node:
            return self.inter_node_gbps
        return self.collective_gbps(2)


HARDWARE_PRESETS: dict[str, Hardware] = {
    "a100": Hardware(
        "a100", peak_tflops=312.0, hbm_gbps=2039.0, link_gbps=230.0, latency_us=15.0, inter_node_gbps=25.0,
        gpus_per_node=4, nvswitch=False,
    ),
    "a100-nvswitch": Hardware(
        "a100-nvswitch", peak_tflops=312.0, hbm_gbps=2039.0, link_gbps=230.0, latency_us=15.0, inter_node_gbps=25.0,
    ),
    "h100": Hardware("h100", peak_tflops=989.0, hbm_gbps=3350.0, link_gbps=360.0, latency_us=12.0, inter_node_gbps=50.0),
    "h200": Hardware("h200", peak_tflops=989.0, hbm_gbps=4800.0, link_gbps=360.0, latency_us=12.0, inter_node_gbps=50.0,
                     memory_gb=141.0),
    "cpu": Hardware("cpu", peak_tflops=0.1, hbm_gbps=20.0, link_gbps=1.0, latency_us=100.0, inter_node_gbps=1.0,
                    gpus_per_node=4, memory_gb=4.0),
}


def get_hardware(name: str, **overrides) -> Hardware:
    """The preset ``name`` with any field replaced by a non-``None`` override."""
    key = name.lower()
    if key not in HARDWARE_PRESETS:
        raise ValueError(f"Unknown GPU {name!r}: use one of {', '.join(HARDWARE_PRESETS)}.")
    return replace(HARDWARE_PRESETS[key], **{k: v for k, v in overrides.items() if v is not None})


__all__ = ["Hardware", "HARDWARE_PRESETS", "get_hardware"]
