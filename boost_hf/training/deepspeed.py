"""DeepSpeed ZeRO over the data-parallel group only: how boost-hf's process groups reach DeepSpeed.

DeepSpeed learns the layout from a Megatron-style *model-parallel unit* (``mpu``): it shards ZeRO
states and averages gradients over ``get_data_parallel_group()``, and its gradient-norm code sums the
squares of parameters flagged ``tensor_model_parallel`` over ``get_model_parallel_group()`` (every
boost-hf parameter carries that flag, :mod:`boost_hf.parallel.sharding`). :class:`ModelParallelUnit`
answers with our TP group as the model-parallel group and our DP group as the data-parallel group.

``accelerate`` forwards an ``mpu`` to ``deepspeed.initialize`` only for its own sequence parallelism,
but ``Accelerator._prepare_deepspeed`` looks ``deepspeed.initialize`` up when it is called. The one
integration point is :func:`deepspeed_initialize_hooks`, a context manager under which
``deepspeed.initialize`` receives our ``mpu`` and a model whose grouped projections DeepSpeed keeps grouped;
:class:`~boost_hf.training.trainer.BoostTrainer` wraps its ``accelerator.prepare`` call in it.
:func:`configure_deepspeed` fixes the batch size (from the DP size, not the world size) and the clipping
threshold of the DeepSpeed config.

**Grouped storage under DeepSpeed.** The parameters a grouped GEMM reads together (q/k/v's and gate/up's A's and
B's, Megatron's q/k/v and gate/up weights) are row blocks of one buffer (:mod:`boost_hf.parallel.shared_storage`),
so the GEMM reads them as one tensor without a copy. DeepSpeed re-homes parameters twice: its bf16 / fp16 mode
casts each one (``p.data = p.data.to(dtype)``, a storage of its own each), and its optimizers (ZeRO-1/2, the bf16
and fp16 optimizers) copy the trainable ones into flat buffers, in the order of the optimizer's parameter groups,
and point each parameter at its slice. :func:`deepspeed_initialize_hooks` therefore, before DeepSpeed sees them,
casts the parameters itself keeping each group in one buffer
(:func:`~boost_hf.parallel.shared_storage.cast_parameters`; DeepSpeed's cast then has nothing to do) and orders
the optimizer's parameter groups so that the parameters stored together are consecutive, in storage order
(:func:`order_stored_together`): DeepSpeed's flat buffers then hold each group as consecutive rows again, and
the grouped GEMMs keep reading views (in fp32 and in bf16). This changes where each parameter lies in
DeepSpeed's flat buffers, so a checkpoint records the order (``DEEPSPEED_PARAMETER_ORDER``) and one written
in the earlier order is refused on resume instead of loading its ZeRO partitions into the wrong parameters
(:mod:`boost_hf.checkpoint.resume`, which records it: :data:`~boost_hf.checkpoint.resume.DEEPSPEED_PARAMETER_ORDER`).

**The fp32 masters of the bf16 / fp16 mode** are the weights as they were before the cast
(:func:`full_precision_copies`, :func:`set_masters`), as boost-hf's own ``bf16_params`` keeps them: DeepSpeed's
optimizer would copy them from the cast parameters, starting the run from weights rounded to half precision.

On CPU, DeepSpeed compiles a shared-memory collective op on first use (75-95 s on 2 cores, cached in
``~/.cache/torch_extensions``); training does not need it. ``BOOST_HF_DEEPSPEED_SHM_COMM=0`` skips it.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from ..checkpoint.resume import DEEPSPEED_PARAMETER_ORDER
from ..parallel.shared_storage import SharedStorageOwner, cast_parameters
from ..parallel.state import ParallelState
from ..checkpoint.deepspeed_universal import UniversalResume, attach_universal_checkpoint_info

SHM_COMM_ENV = "BOOST_HF_DEEPSPEED_SHM_COMM"


class ModelParallelUnit:
    """The ``mpu`` DeepSpeed reads: model parallel = our TP group, data parallel = our DP group."""

    def __init__(self, state: ParallelState):
        if state.mesh is None:
            raise ValueError("ModelParallelUnit needs a launched process group (torch.distributed initialised).")
        self.state = state
        self._tp_group = state.mesh.get_group("tp")
        self._dp_group = state.mesh.get_group("dp")

    def get_model_parallel_rank(self) -> int:
        return self.state.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.state.tp_size

    def get_model_parallel_group(self):
        return self._tp_group

    def get_data_parallel_rank(self) -> int:
        return self.state.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.state.dp_size

    def get_data_parallel_group(self):
        return self._dp_group

    # the names DeepSpeed's universal-checkpoint loader asks for the TP size by (Megatron's newer API)
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size




def order_stored_together(model, param_groups) -> None:
    """Reorder each parameter group's ``"params"`` (a list, in place) so that the parameters ``model`` stores
    together (:class:`~boost_hf.parallel.shared_storage.SharedStorageOwner`) follow each other in storage order,
    at the place of the first of them; the other parameters keep their order. A set split over two groups (not
    expected: a projection group's parameters share their weight decay) is left as it is."""
    together = {}
    for owner in model.modules():
        if isinstance(owner, SharedStorageOwner):
            for params in owner.parameters_stored_together():
                together.update({id(p): params for p in params})
    for group in param_groups:
        params = group["params"]
        present, ordered, placed = {id(p) for p in params}, [], set()
        for param in params:
            members = together.get(id(param), [param])
            if not all(id(p) in present for p in members):
                members = [param]
            for member in members:
                if id(member) not in placed:
                    ordered.append(member)
                    placed.add(id(member))
        params[:] = ordered


def _parameter_dtype(config) -> torch.dtype | None:
    """The dtype DeepSpeed's config casts the parameters to (bf16 / fp16), or ``None``."""
    if not isinstance(config, dict):
        return None
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp16", torch.float16)):
        if config.get(key, {}).get("enabled") is True:
            return dtype
    return None


def full_precision_copies(model: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Every trainable floating-point parameter of ``model`` with a copy of its value in host memory, taken before
    DeepSpeed's half-precision cast (4 bytes per parameter of this rank, held while ``deepspeed.initialize`` runs)."""
    return [(p, p.detach().to("cpu", torch.float32, copy=True)) for p in model.parameters()
            if p.requires_grad and p.is_floating_point()]


def set_masters(copies: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """DeepSpeed's fp32 masters set from ``copies`` (:func:`full_precision_copies`): its engine casts the module to
    half precision before its optimizer copies the parameters into the masters, which would then start from the
    weights rounded to bf16 (2^-9 of each, where boost-hf's ``bf16_params`` keeps the fp32 initialisation). Each rank
    writes its own partition (``deepspeed.utils.safe_set_full_fp32_param``, ZeRO 1/2/3): no collective. A checkpoint
    resumed later overwrites them."""
    from deepspeed.utils import safe_set_full_fp32_param

    for parameter, value in copies:
        safe_set_full_fp32_param(parameter, value)


@contextlib.contextmanager
def masters_in_parameters(model: nn.Module):
    """Within the block, every parameter of ``model`` that DeepSpeed keeps an fp32 master of holds that master, whole
    (what a save writes under its bf16 / fp16 mode, as under boost-hf's ``bf16_params``); each parameter's own
    storage is back on exit. Collective over DP: each master is assembled from the ranks' partitions
    (``deepspeed.utils.safe_get_full_fp32_param``). Under ZeRO-3, inside ``deepspeed.zero.GatheredParameters``."""
    from deepspeed.utils import safe_get_full_fp32_param

    held = []
    try:
        for parameter in model.parameters():
            master = safe_get_full_fp32_param(parameter)
            if master is not None:
                held.append((parameter, parameter.data))
                parameter.data = master.reshape(parameter.data.shape)
        yield
    finally:
        for parameter, data in held:
            parameter.data = data


@contextlib.contextmanager
def deepspeed_initialize_hooks(mpu: ModelParallelUnit | None, universal: UniversalResume | None = None):
    """Within the block, every ``deepspeed.initialize(...)`` call (accelerate's included) gets ``mpu=mpu`` (when
    given) and keeps the grouped projections' storage: the model's parameters are cast to DeepSpeed's bf16 / fp16
    dtype in groups first and the optimizer's parameter groups (or ``model_parameters``) are ordered with
    :func:`order_stored_together` (see the module docstring); the model carries DeepSpeed's
    ``universal_checkpoint_info`` (:mod:`boost_hf.checkpoint.deepspeed_universal`), and with ``universal`` the engine
    loads that converted checkpoint in place of the ZeRO files it is asked for."""
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        if kwargs.get("mpu") is not None:
            raise ValueError("accelerate passed its own mpu (sequence parallelism), which boost-hf's TP groups cannot share.")
        if mpu is not None:
            kwargs["mpu"] = mpu
        model, config = kwargs.get("model"), kwargs.get("config_params", kwargs.get("config"))
        full_precision = None
        if model is not None:
            dtype = _parameter_dtype(config)
            if dtype is not None:
                full_precision = full_precision_copies(model)
                cast_parameters(model, dtype)
            optimizer = kwargs.get("optimizer")
            if optimizer is not None and hasattr(optimizer, "param_groups"):
                order_stored_together(model, optimizer.param_groups)
            parameters = kwargs.get("model_parameters")
            if isinstance(parameters, list) and parameters and isinstance(parameters[0], dict):
                order_stored_together(model, parameters)
            attach_universal_checkpoint_info(model, loading=universal is not None)
        if universal is not None:
            kwargs["config_params" if "config_params" in kwargs else "config"] = universal.deepspeed_config(config)
        initialized = original(*args, **kwargs)
        if full_precision is not None:
            set_masters(full_precision)
        if universal is not None:
            universal.redirect(initialized[0])
        return initialized

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def configure_deepspeed(hf_ds_config, args, dp_size: int) -> None:
    """Set the batch sizes and clipping of a DeepSpeed config (``HfDeepSpeedConfig``) for ``dp_size`` DP ranks.

    ``train_batch_size = per_device_train_batch_size x gradient_accumulation_steps x dp_size``: the TP
    ranks of a group share their micro-batch, so the world size would over-count. ``gradient_clipping``
    is ``args.max_grad_norm`` (DeepSpeed would default to 1.0). Explicit values that disagree raise.
    """
    config = hf_ds_config.config
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    expected = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * dp_size,
        "gradient_clipping": args.max_grad_norm,
    }
    # transformers already replaced an 'auto' train_batch_size with the world-size product
    accepted = {"train_batch_size": micro * accumulation * args.world_size}
    for key, value in expected.items():
        current = config.get(key, "auto")
        if current not in ("auto", value, accepted.get(key)):
            raise ValueError(
                f"DeepSpeed config {key}={current} but boost-hf needs {value} (per_device_train_batch_size="
                f"{micro}, gradient_accumulation_steps={accumulation}, dp={dp_size}, max_grad_norm={args.max_grad_norm}): "
                "set it to 'auto'."
            )
        config[key] = value
    # transformers checked train_batch_size against the world size; our value above replaces that check
    hf_ds_config.mismatches = [m for m in getattr(hf_ds_config, "mismatches", []) if "train_batch_size" not in m]


def skip_shm_comm_if_requested() -> None:
    """Tell DeepSpeed not to build its CPU shared-memory op when ``BOOST_HF_DEEPSPEED_SHM_COMM=0``."""
    if os.environ.get(SHM_COMM_ENV, "1") == "0":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


__all__ = ["ModelParallelUnit", "DEEPSPEED_PARAMETER_ORDER", "deepspeed_initialize_hooks", "full_precision_copies", "masters_in_parameters",
           "order_stored_together", "configure_deepspeed", "set_masters", "skip_shm_comm_if_requested", "SHM_COMM_ENV"]
