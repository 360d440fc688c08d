"""DeepSpeed ZeRO over the data-parallel group only: how boost-hf's process groups reach DeepSpeed.

DeepSpeed learns the layout from a Megatron-style *model-parallel unit* (``mpu``): it shards ZeRO
states and averages gradients over ``get_data_parallel_group()``, and its gradient-norm code sums the
squares of parameters flagged ``tensor_model_parallel`` over ``get_model_parallel_group()`` (every
boost-hf parameter carries that flag, :mod:`boost_hf.parallel.sharding`). :class:`ModelParallelUnit`
answers with our TP group as the model-parallel group and our DP group as the data-parallel group.

``accelerate`` forwards an ``mpu`` to ``deepspeed.initialize`` only for its own sequence parallelism,
but ``Accelerator._prepare_deepspeed`` looks ``deepspeed.initialize`` up when it is called. The one
integration point is :func:`deepspeed_initialize_with_mpu`, a context manager under which
``deepspeed.initialize`` receives our ``mpu``; :class:`~boost_hf.training.trainer.BoostTrainer` wraps
its ``accelerator.prepare`` call in it. :func:`configure_deepspeed` fixes the batch size (from the DP
size, not the world size) and the clipping threshold of the DeepSpeed config.

On CPU, DeepSpeed compiles a shared-memory collective op on first use (75-95 s on 2 cores, cached in
``~/.cache/torch_extensions``); training does not need it. ``BOOST_HF_DEEPSPEED_SHM_COMM=0`` skips it.
"""

from __future__ import annotations

import contextlib
import os

from ..parallel.state import ParallelState

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


@contextlib.contextmanager
def deepspeed_initialize_with_mpu(mpu: ModelParallelUnit):
    """Within the block, every ``deepspeed.initialize(...)`` call (accelerate's included) gets ``mpu=mpu``."""
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        if kwargs.get("mpu") is not None:
            raise ValueError("accelerate passed its own mpu (sequence parallelism), which boost-hf's TP groups cannot share.")
        kwargs["mpu"] = mpu
        return original(*args, **kwargs)

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


__all__ = ["ModelParallelUnit", "deepspeed_initialize_with_mpu", "configure_deepspeed", "skip_shm_comm_if_requested", "SHM_COMM_ENV"]
