"""Performance model: FLOPs (:mod:`.flops`), parameter counts (:mod:`.parameters`), GPU presets (:mod:`.hardware`),
the iteration-time estimator of the three tensor-parallel layouts (:mod:`.estimator`, timing the workload of
:mod:`.workload` with the kernels of :mod:`.kernels`, the collectives of :mod:`.traffic` and the pipeline schedules of
:mod:`.pipeline`; the micro-batch split searched by :mod:`.micro_batches`) and one rank's counted / measured
decoder-layer cost (:mod:`.rank_cost`, counting with :mod:`.op_counter`). Communication volumes, stage boundaries
included, come from :mod:`.comm_formula`."""

from .estimator import LAYOUTS, Estimate, LayoutEstimate, estimate
from .flops import forward_flops_per_token, training_flops_per_token
from .hardware import HARDWARE_PRESETS, Hardware, get_hardware
from .kernels import CALIBRATED_EFFICIENCY, KernelEfficiency
from .rank_cost import count_rank_layer, measure_rank_layer
from .workload import Workload

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
