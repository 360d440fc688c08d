"""Performance model: FLOPs (:mod:`.flops`), GPU presets (:mod:`.hardware`) and the iteration-time
estimator of the three tensor-parallel layouts (:mod:`.estimator`). Communication volumes come from
:mod:`boost_hf.perf.comm_formula`."""

from .estimator import CALIBRATED_EFFICIENCY, LAYOUTS, Estimate, KernelEfficiency, LayoutEstimate, Workload, estimate
from .flops import forward_flops_per_token, training_flops_per_token
from .hardware import HARDWARE_PRESETS, Hardware, get_hardware

__all__ = [
    "CALIBRATED_EFFICIENCY",
    "Estimate",
    "HARDWARE_PRESETS",
    "Hardware",
    "KernelEfficiency",
    "LAYOUTS",
    "LayoutEstimate",
    "Workload",
    "estimate",
    "forward_flops_per_token",
    "get_hardware",
    "training_flops_per_token",
]
