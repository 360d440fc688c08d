"""The precision a run trains in: one named :class:`PrecisionPolicy`, applied the same way in every mode.

The precision asked for (``--bf16``, accelerate's ``mixed_precision`` from an accelerate config or
``ACCELERATE_MIXED_PRECISION``, DeepSpeed's ``bf16``) and the settings declared once in
:class:`~boost_hf.precision_config.PrecisionConfig` (``--precision_policy``, ``--grad_reduce_dtype``,
``--fp32_residual``; ``boost-hf plan`` and ``estimate`` take the same options) resolve, once, in
:func:`resolve_precision`, into a policy that the trainer, the pipeline and the checkpoints read:

=================  ===============================================================================================
policy             what runs
=================  ===============================================================================================
``fp32``           no half precision asked: fp32 parameters, activations, gradients and reduction.
``autocast``       (default with bf16) fp32 parameters, the forward under ``torch.autocast(bf16)``: each GEMM casts
                   its weight (every forward, every recomputation, every micro-batch) and its input to bf16; the
                   residual stream stays fp32; gradients accumulate and are all-reduced over DP in fp32 (DDP).
``bf16_params``    bf16 parameters with fp32 master weights and fp32 gradient accumulation, as Megatron-core
                   (``Float16OptimizerWithFloat16Params`` with ``--accumulate-allreduce-grads-in-fp32``) and the
                   BOOST release (bf16 weights, ``accumulate_grad_in_fp32``) train: no autocast; the weights are
                   cast to bf16 once per optimizer step (:class:`MasterParameters`); each micro-batch's bf16
                   gradient is added into an fp32 buffer and freed; the buffer is all-reduced over DP in fp32
                   (``--grad_reduce_dtype bf16``: in bf16); clipping and the optimizer step the fp32 masters;
                   checkpoints and ``save_pretrained`` hold the fp32 masters. ``--fp32_residual``: the residual
                   stream in fp32 (Megatron's ``fp32_residual_connection``, off by default as there), the layers
                   under autocast to bf16 over the bf16 weights (autocast does not cast a bf16 weight).
                   With DeepSpeed's bf16 mode DeepSpeed owns the same scheme: the policy says so and records
                   the accumulation and reduction dtypes DeepSpeed's configuration gives. Under FSDP2
                   (``--data_parallel fsdp2``) FSDP2 owns it: the sharded parameters are the fp32 masters,
                   gathered in bf16 for each layer's forward and backward, their gradients reduce-scattered in
                   fp32 (``--grad_reduce_dtype``) and kept in fp32 (``MixedPrecisionPolicy(param_dtype=bf16,
                   reduce_dtype=fp32)``, :mod:`boost_hf.parallel.fully_shard`); no masters of boost-hf's.
=================  ===============================================================================================

Bytes per parameter, AdamW (fp32 moments), without ZeRO: fp32 16 (4 parameter + 4 gradient + 8 moments);
``autocast`` 16, plus a 2-byte bf16 copy of each weight made by every forward and kept for its backward;
``bf16_params`` 18 (2 bf16 parameter + 4 master + 4 fp32 gradient + 8 moments; each micro-batch's 2-byte bf16
gradient lives only until it is added into the fp32 one). With ``--zero1_optimizer`` the moments are sharded:
``8/dp`` instead of 8 (the masters are not: every DP rank keeps all of its stage's, which the save reads).

**Why masters are swapped in, not kept beside the model.** The optimizer, ZeRO-1 (torch's
``ZeroRedundancyOptimizer``), LORO, the gradient clipping, the optimizer-state checkpoints and their resharding all
key on the model's ``nn.Parameter`` objects and read ``p.data`` / ``p.grad``. :class:`MasterParameters` keeps those
objects: between backward and the end of the optimizer step (and around a save or a load) each parameter's ``data``
is its fp32 master and its ``grad`` its fp32 gradient; otherwise ``data`` is the bf16 tensor the forward reads. So
every consumer runs unchanged on fp32 values, the optimizer state is fp32 and keyed by the model's parameters, and
checkpoints hold fp32 under the canonical names. The bf16 tensors are made by the module's own ``_apply`` path
(:func:`cast_parameters`), so parameters that a grouped GEMM reads together stay row blocks of one buffer
(:class:`~boost_hf.parallel.shared_storage.SharedStorageOwner`); the swap restores those very views.

**Why not DDP.** DDP reduces ``p.grad`` in the parameter's dtype and cannot change a parameter's dtype after it is
built, so under ``bf16_params`` it would all-reduce (and, with ``no_sync``, accumulate) in bf16. Instead each
parameter's post-accumulate-grad hook adds its bf16 gradient into the fp32 buffer; the buffer is cut into buckets
(``--ddp_bucket_cap_mb``, 25 MiB by default, in reverse parameter order as backward produces them) and the buckets'
all-reduces over the DP group are started, asynchronously, in bucket order, as DDP's reducer issues them: a bucket
whose parameters all received the last micro-batch's gradient starts once every bucket before it has started (a
bucket that fills early waits for the earlier ones), so every rank issues the same all-reduces in the same order
whatever order its gradients arrive in, and the reduction overlaps the rest of backward; the step waits for them.

**The checkpoint contract.** :func:`full_precision_parameters` is the one context a save or a load enters: inside
it the model's parameters are the fp32 masters under their canonical names (``loading=True``: whatever is written
into them becomes the masters, and the bf16 parameters are cast from them on exit). Loading optimizer state must
run inside it too (``Optimizer.load_state_dict`` casts the state to each parameter's dtype).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback

from ..data_parallel_config import DataParallelConfig
from ..precision_config import PRECISION_POLICIES, PrecisionConfig

GRAD_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # GradReduceDtype's
HALF_PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_BUCKET_MB = 25


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


@dataclass(frozen=True)
class PrecisionPolicy:
    """What a run computes, stores, accumulates and reduces in (see the module docstring for each ``name``).

    ``compute_dtype``: the GEMMs' inputs; ``param_dtype``: the parameters the forward and backward read;
    ``master_dtype``: what the optimizer steps and checkpoints hold; ``grad_accumulation_dtype`` /
    ``grad_reduce_dtype``: the gradients across micro-batches and over DP; ``residual_dtype``: the residual stream
    between decoder layers; ``owner``: who applies it (``"boost-hf"``, ``"deepspeed"`` or ``"fsdp2"``: FSDP2's
    ``MixedPrecisionPolicy`` keeps the masters and casts the parameters, boost-hf the autocast and the residual).
    """

    name: str
    compute_dtype: torch.dtype = torch.float32
    param_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    grad_accumulation_dtype: torch.dtype = torch.float32
    grad_reduce_dtype: torch.dtype = torch.float32
    residual_dtype: torch.dtype = torch.float32
    owner: str = "boost-hf"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The autocast dtype of the forward, ``None`` for none: autocast runs where the residual or the
        parameters are wider than the compute dtype."""
        wider = self.compute_dtype != self.param_dtype or self.compute_dtype != self.residual_dtype
        return self.compute_dtype if wider and self.owner != "deepspeed" else None

    @property
    def boundary_dtype(self) -> torch.dtype:
        """The dtype of the residual (and LaX latents) crossing a pipeline stage boundary: the compute dtype, or
        fp32 when the residual is kept in fp32 under bf16 parameters (Megatron sends fp32 then too)."""
        return self.residual_dtype if self.name == "bf16_params" else self.compute_dtype

    @property
    def has_masters(self) -> bool:
        """Whether boost-hf keeps master weights apart from the parameters (:class:`MasterParameters`)."""
        return self.owner == "boost-hf" and self.name == "bf16_params"

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The context every forward of the run executes in: ``torch.autocast`` to the compute dtype, or nothing."""
        dtype = self.autocast_dtype
        return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    @property
    def keeps_fp32_residual(self) -> bool:
        """Whether the residual stream is kept wider than the parameters (``--fp32_residual``)."""
        return self.residual_dtype != self.param_dtype

    def apply_residual_dtype(self, model: nn.Module) -> None:
        """Set a boost-hf model's residual stream dtype to the policy's (a pipeline stage's input, sent in the boundary
        dtype, is cast back to it; elsewhere the embedding's output is cast only under ``--fp32_residual``). Another
        model is left as it is, unless the policy keeps a wider residual (then it raises: only boost-hf models can)."""
        base = getattr(model, "base_model", model)
        if self.owner != "deepspeed" and hasattr(type(base), "residual_dtype"):
            base.residual_dtype = self.residual_dtype
        elif self.keeps_fp32_residual:
            set_residual_dtype(model, self.residual_dtype)

    def record(self) -> dict:
        """The policy as plain data (``training_layout.json``, the model card, logs)."""
        return {
            "policy": self.name,
            "compute": dtype_name(self.compute_dtype),
            "parameters": dtype_name(self.param_dtype),
            "masters": dtype_name(self.master_dtype),
            "grad_accumulation": dtype_name(self.grad_accumulation_dtype),
            "grad_reduce": dtype_name(self.grad_reduce_dtype),
            "residual": dtype_name(self.residual_dtype),
            "owner": self.owner,
        }

    def describe(self) -> str:
        r = self.record()
        return (f"precision policy {self.name} ({self.owner}): compute {r['compute']}, parameters {r['parameters']}, "
                f"masters {r['masters']}, gradients accumulated in {r['grad_accumulation']} and reduced in "
                f"{r['grad_reduce']}, residual {r['residual']}, pipeline boundaries in {dtype_name(self.boundary_dtype)}")


FP32 = PrecisionPolicy("fp32")


def _deepspeed_dtype(config: dict, key: str, default: torch.dtype) -> torch.dtype:
    value = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    names = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
    return names.get(str(value).lower(), default) if value not in (None, "auto") else default


def resolve_precision(args) -> PrecisionPolicy:
    """The policy of training arguments ``args`` (any ``TrainingArguments``; boost-hf's add the fields of
    :class:`~boost_hf.precision_config.PrecisionConfig`, validated there) with the half precision they ask for. Raises
    ``ValueError`` naming the fix for a contradictory setting; no communication, the same answer on every rank."""
    settings = PrecisionConfig.of(args)
    half = HALF_PRECISIONS.get(getattr(args, "mixed_precision", "no"))
    asked, reduce, fp32_residual = settings.precision_policy, settings.grad_reduce_dtype, settings.fp32_residual
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is not None or getattr(args, "deepspeed", None):
        return _deepspeed_precision(args, plugin, half, asked, reduce, fp32_residual)
    if half is None:
        if asked == "bf16_params" or reduce is not None or fp32_residual:
            given = "precision_policy bf16_params" if asked == "bf16_params" else "grad_reduce_dtype" if reduce else "fp32_residual"
            raise ValueError(
                f"--{given} sets how bf16 training runs, but no half precision was asked for (mixed precision "
                f"{getattr(args, 'mixed_precision', 'no')!r}): add --bf16 true (or mixed_precision: bf16 in the accelerate "
                "config), or drop it for an fp32 run."
            )
        return FP32
    if asked == "fp32":
        raise ValueError(_fp32_with_half(half))
    # the default with bf16 is bf16_params (benchmarks/results/precision_evidence.md: as close to fp32 as autocast over
    # 600 steps, fewer bytes per step); fp16 parameters would need loss scaling, so fp16 runs under autocast
    asked = asked or ("bf16_params" if half == torch.bfloat16 else "autocast")
    if asked != "bf16_params":
        if reduce is not None or fp32_residual:
            raise ValueError(
                "--grad_reduce_dtype and --fp32_residual belong to --precision_policy bf16_params (autocast keeps fp32 "
                "parameters, so its gradients and residual are fp32 already): pass --precision_policy bf16_params, or "
                "drop them."
            )
        if half == torch.float16 and DataParallelConfig.of(args).fully_sharded:
            raise ValueError(
                "fp16 autocast needs a gradient scaler that unscales FSDP2's sharded gradients, which boost-hf does not "
                "run: use --bf16 true (bf16 needs no loss scaling) with --data_parallel fsdp2."
            )
        if half == torch.float16 and getattr(args, "pp_size", 1) > 1:
            raise ValueError(
                "fp16 autocast needs a gradient scaler, which the pipeline schedule does not run: use --bf16 true "
                "(bf16 needs no loss scaling) with pp_size > 1."
            )
        return PrecisionPolicy("autocast", compute_dtype=half)
    if half != torch.bfloat16:
        raise ValueError(
            "--precision_policy bf16_params keeps bf16 parameters, but fp16 was asked for (fp16 parameters would need "
            "loss scaling): use --bf16 true instead of --fp16."
        )
    return PrecisionPolicy(
        "bf16_params", compute_dtype=torch.bfloat16, param_dtype=torch.bfloat16,
        grad_reduce_dtype=GRAD_REDUCE_DTYPES[reduce or "fp32"],
        residual_dtype=torch.float32 if fp32_residual else torch.bfloat16,
        owner="fsdp2" if DataParallelConfig.of(args).fully_sharded else "boost-hf",
    )


def _deepspeed_precision(args, plugin, half, asked, reduce, fp32_residual) -> PrecisionPolicy:
    """DeepSpeed's own precision: its bf16 (fp16) mode keeps half-precision parameters and fp32 masters in its
    optimizer; its configuration says where gradients accumulate (``data_types.grad_accum_dtype``) and in what they
    are reduced (``communication_data_type``), both the parameters' dtype unless set."""
    config = getattr(plugin, "deepspeed_config", None) or {}
    for dtype, key in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        if str(config.get(key, {}).get("enabled", "false")).lower() == "true":
            half = dtype
    if reduce is not None or fp32_residual:
        raise ValueError(
            "--grad_reduce_dtype and --fp32_residual are boost-hf's own bf16_params settings; with DeepSpeed its engine "
            "owns the gradients: set communication_data_type / data_types.grad_accum_dtype in the DeepSpeed config "
            "instead, and drop them."
        )
    if half is None:
        if asked == "bf16_params":
            raise ValueError(
                "--precision_policy bf16_params with DeepSpeed needs DeepSpeed's bf16 mode: add --bf16 true (or "
                "bf16.enabled: true in the DeepSpeed config)."
            )
        return PrecisionPolicy("fp32", owner="deepspeed")
    if asked == "fp32":
        raise ValueError(_fp32_with_half(half))
    if asked == "autocast":
        raise ValueError(
            f"--precision_policy autocast asks for fp32 parameters under autocast, but DeepSpeed's {dtype_name(half)} mode "
            "casts the parameters themselves to half precision (with fp32 masters in its optimizer): that is bf16_params. "
            "Pass --precision_policy bf16_params (or leave it unset) with DeepSpeed, or drop DeepSpeed for autocast."
        )
    name = "bf16_params" if half == torch.bfloat16 else "fp16_params"
    return PrecisionPolicy(
        name, compute_dtype=half, param_dtype=half, residual_dtype=half, owner="deepspeed",
        grad_accumulation_dtype=_deepspeed_dtype(config, "data_types.grad_accum_dtype", half),
        grad_reduce_dtype=_deepspeed_dtype(config, "communication_data_type", half),
    )


def _fp32_with_half(half: torch.dtype) -> str:
    return (f"--precision_policy fp32 trains without half precision, but {dtype_name(half)} was asked for (--bf16 / --fp16, "
            "accelerate's mixed_precision or DeepSpeed's bf16): drop it, or choose --precision_policy autocast or bf16_params.")


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every floating-point parameter of ``model`` new ``dtype`` storage through the modules' own ``_apply``
    (parameters a grouped GEMM reads together become row blocks of one new buffer again); the ``nn.Parameter``
    objects stay. Buffers (the rotary frequencies) keep their dtype."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        is_parameter = isinstance(tensor, nn.Parameter) and tensor.is_floating_point()
        return tensor.to(dtype) if is_parameter and tensor.dtype != dtype else tensor

    model._apply(cast)


def set_residual_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Set the residual dtype of a ``BoostLlamaForCausalLM`` (its base model's ``residual_dtype``; ``None``: the
    embedding's); a model without one raises when a dtype is asked for."""
    base = getattr(model, "base_model", model)
    if not hasattr(type(base), "residual_dtype"):
        if dtype is None:
            return
        raise ValueError(f"{type(model).__name__} has no residual_dtype to keep its residual stream in fp32 (--fp32_residual): "
                         "only boost-hf models do.")
    base.residual_dtype = dtype


class _Bucket:
    """A contiguous range of the flat gradient buffer and the parameters whose gradients it holds."""

    def __init__(self, view: torch.Tensor, members: list[int]):
        self.view, self.members = view, members
        self.pending = len(members)
        self.work = None
        self.reduced: torch.Tensor | None = None  # the tensor all-reduced (the view, or its bf16 copy)


class MasterParameters:
    """``bf16_params`` applied to a model (one pipeline rank's parameters, or the whole model): bf16 parameters,
    fp32 masters, fp32 gradient accumulation and the DP gradient reduction (see the module docstring).

    Cycle of one optimizer step: the trainer sets :attr:`accumulations_per_step` (micro-batches whose backward
    reaches every parameter), backward runs (the hooks accumulate and start bucket all-reduces), then
    :meth:`gradients_ready` (wait for the reduction; ``data`` / ``grad`` become the fp32 master and gradient),
    clipping and ``optimizer.step()``, then :meth:`step_done` (cast the masters into the bf16 parameters: the one
    weight cast of the step; zero the fp32 gradients). ``dp_group=None``: no reduction (one DP rank);
    ``overlap=False``: every bucket's all-reduce starts in :meth:`gradients_ready` (for measurements).
    """

    def __init__(self, model: nn.Module, policy: PrecisionPolicy, dp_group=None, dp_size: int = 1,
                 bucket_bytes: int = DEFAULT_BUCKET_MB << 20, overlap: bool = True):
        self.policy, self.dp_group, self.dp_size, self.overlap = policy, dp_group, dp_size, overlap
        self.params = [p for p in model.parameters() if p.is_floating_point()]
        # the fp32 values as they are (copied only where the parameters keep their dtype and storage)
        self.masters = [p.detach().to(policy.master_dtype, copy=p.dtype == policy.param_dtype) for p in self.params]
        cast_parameters(model, policy.param_dtype)
        self.low_precision = [p.data for p in self.params]  # the views the forward reads (shared storage kept)
        trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        order = trainable[::-1]  # backward produces the gradients roughly in reverse order
        total = sum(self.params[i].numel() for i in order)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.flat_grads = torch.zeros(total, dtype=policy.grad_accumulation_dtype, device=device)
        self.grads: dict[int, torch.Tensor] = {}
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, _Bucket] = {}
        start, members, size = 0, [], 0
        limit = max(1, bucket_bytes // self.flat_grads.element_size())
        for position, i in enumerate(order):
            n = self.params[i].numel()
            self.grads[i] = self.flat_grads[start + size:start + size + n].view_as(self.params[i])
            members.append(i)
            size += n
            if size >= limit or position == len(order) - 1:
                bucket = _Bucket(self.flat_grads[start:start + size], members)
                self.buckets.append(bucket)
                self.bucket_of.update((m, bucket) for m in members)
                start, members, size = start + size, [], 0
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.next_bucket = 0  # the first bucket whose all-reduce has not started (they start in bucket order)
        self.arrivals = [0] * len(self.params)
        self.accumulations_per_step = 1
        self.swapped = False
        self.handles = [self.params[i].register_post_accumulate_grad_hook(self._accumulate) for i in trainable]

    # ------------------------------------------------------------------ backward
    @torch.no_grad()
    def _accumulate(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``grad`` (this micro-batch's, bf16) added into the fp32 buffer and freed; once
        all its bucket's parameters received their last micro-batch's gradient, the ready buckets from the next one
        in bucket order start their all-reduces (:meth:`_launch_ready`)."""
        i = self.index[id(param)]
        self.grads[i].add_(param.grad)
        param.grad = None
        self.arrivals[i] += 1
        if self.dp_group is None or not self.overlap or self.arrivals[i] < self.accumulations_per_step:
            return
        if self.arrivals[i] > self.accumulations_per_step:
            raise RuntimeError(
                f"a parameter received {self.arrivals[i]} gradients in one optimizer step, more than the "
                f"{self.accumulations_per_step} micro-batches announced: its bucket's all-reduce had started already."
            )
        bucket = self.bucket_of[i]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the all-reduces of the consecutive full buckets from :attr:`next_bucket` on (bucket order: the same
        collectives in the same order on every rank)."""
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._launch(self.buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        """Start ``bucket``'s average over DP: divided by ``dp`` first (as DDP), summed in the reduce dtype."""
        bucket.view.div_(self.dp_size)
        reduced = bucket.view if bucket.view.dtype == self.policy.grad_reduce_dtype else bucket.view.to(self.policy.grad_reduce_dtype)
        bucket.reduced = reduced
        bucket.work = dist.all_reduce(reduced, group=self.dp_group, async_op=True)

    # ------------------------------------------------------------------ the optimizer step
    @torch.no_grad()
    def gradients_ready(self) -> None:
        """Finish the DP reduction (buckets not started yet, e.g. of parameters without a gradient, start now, in
        the same order on every rank) and make each parameter's ``data`` its fp32 master and ``grad`` its fp32
        gradient (a parameter without one gets zeros, as under DDP). Idempotent until :meth:`step_done`."""
        if self.swapped:
            return
        if self.dp_group is not None:
            for bucket in self.buckets[self.next_bucket:]:
                self._launch(bucket)
            self.next_bucket = len(self.buckets)
            for bucket in self.buckets:
                bucket.work.wait()
                if bucket.reduced is not bucket.view:
                    bucket.view.copy_(bucket.reduced)
        for i, param in enumerate(self.params):
            param.data = self.masters[i]
            param.grad = self.grads.get(i)
        self.swapped = True

    @torch.no_grad()
    def step_done(self) -> None:
        """After the optimizer step: the masters (whatever the optimizer left in ``data``) cast into the bf16
        parameters, in one ``foreach`` copy; the fp32 gradients zeroed for the next step."""
        if not self.swapped:
            return
        self._restore(write_back=True)
        self.flat_grads.zero_()
        self.arrivals = [0] * len(self.params)
        self.next_bucket = 0
        for bucket in self.buckets:
            bucket.pending, bucket.work, bucket.reduced = len(bucket.members), None, None

    def _restore(self, write_back: bool) -> None:
        for i, param in enumerate(self.params):
            master = self.masters[i]
            if write_back and (param.data_ptr() != master.data_ptr() or param.dtype != master.dtype):
                self.masters[i] = param.detach().to(self.policy.master_dtype)  # re-homed (a load assigning new tensors)
            param.data = self.low_precision[i]
            param.grad = None
        if write_back and self.params:
            torch._foreach_copy_(self.low_precision, self.masters)
        self.swapped = False

    @contextlib.contextmanager
    def full_precision(self, loading: bool = False):
        """Within: every parameter's ``data`` is its fp32 master (``loading``: what is written into the parameters,
        copied or assigned, becomes the masters, and the bf16 parameters are cast from them on exit)."""
        if self.swapped:
            yield
            return
        with torch.no_grad():
            for i, param in enumerate(self.params):
                param.data = self.masters[i]
        self.swapped = True
        try:
            yield
        finally:
            with torch.no_grad():
                self._restore(write_back=loading)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


_MASTERS: "weakref.WeakKeyDictionary[nn.Module, MasterParameters]" = weakref.WeakKeyDictionary()


def keep_master_parameters(model: nn.Module, policy: PrecisionPolicy, dp_group=None, dp_size: int = 1,
                           bucket_bytes: int = DEFAULT_BUCKET_MB << 20) -> MasterParameters:
    """Apply ``bf16_params`` to ``model`` (:class:`MasterParameters`), registered so that
    :func:`full_precision_parameters` finds it from the model."""
    if model in _MASTERS:
        raise ValueError("this model already keeps master parameters (it was given to a trainer under bf16_params before).")
    _MASTERS[model] = masters = MasterParameters(model, policy, dp_group, dp_size, bucket_bytes)
    return masters


def master_parameters_of(model: nn.Module) -> MasterParameters | None:
    return _MASTERS.get(model)


@contextlib.contextmanager
def full_precision_parameters(model: nn.Module, *, loading: bool = False):
    """THE context of every save and load of a model in training: within it the model's parameters are the values
    the optimizer steps (under ``bf16_params``: the fp32 masters, same ``nn.Parameter`` objects, canonical names);
    with ``loading=True`` what is written into them (weights, or optimizer state, which ``load_state_dict`` casts to
    the parameters' dtype) is kept at full precision and the bf16 parameters are cast from it on exit. A no-op for
    every other policy."""
    masters = master_parameters_of(model)
    with masters.full_precision(loading) if masters is not None else contextlib.nullcontext():
        yield


class CastAfterOptimizerStep(TrainerCallback):
    """Ends each optimizer step of :class:`MasterParameters` (:meth:`~MasterParameters.step_done`) right after
    ``optimizer.step()``, before the scheduler, logging, evaluation or a save."""

    def __init__(self, masters: MasterParameters):
        self.masters = masters

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.masters.step_done()


__all__ = [
    "CastAfterOptimizerStep",
    "FP32",
    "GRAD_REDUCE_DTYPES",
    "MasterParameters",
    "PRECISION_POLICIES",
    "PrecisionPolicy",
    "cast_parameters",
    "full_precision_parameters",
    "keep_master_parameters",
    "master_parameters_of",
    "resolve_precision",
    "set_residual_dtype",
]
