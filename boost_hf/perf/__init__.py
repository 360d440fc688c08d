"""Performance model: FLOPs (:mod:`.flops`), GPU presets (:mod:`.hardware`), the iteration-time
estimator of the three tensor-parallel layouts (:mod:`.estimator`, with the pipeline schedules of
:mod:`.pipeline`) and one rank's counted / measured decoder-layer cost (:mod:`.rank_cost`, counting with
:mod:`.op_counter`). Communication volumes, stage boundaries included, come from :mod:`.comm_formula`."""

from .estimator import CALIBRATED_EFFICIENCY, LAYOUTS, Estimate, KernelEfficiency, LayoutEstimate, Workload, estimate
from .flops import forward_flops_per_token, training_flops_per_token
from .hardware import HARDWARE_PRESETS, Hardware, get_hardware
from .rank_cost import count_rank_layer, measure_rank_layer

__all__ = [
    "CALIBRATED_EFFICIENCY",
    "Estimate",
    "HARDWARE_PRESETS",
    "Hardware",
    "KernelEfficiency",
    "LAYOUTS",
    "LayoutEstimate",
    "Workload",
    "count_rank_layer",
    "estimate",
    "forward_flops_per_token",
    "get_hardware",
    "measure_rank_layer",
    "training_flops_per_token",
]
