"""The tensor-parallel hot path as autograd Functions with hand-written backward: few kernels, no needless copies.

Under BTP a projection group reading a normalised residual runs (BOOST.md section 3, online RMSNorm)::

    x: [..., d/p] (this rank's residual shard)    gamma: [d/p]    A = [A_1; ...; A_k]: [k r, d/p]
    down:    buffer = [ x @ (A * gamma)^T | sum(x^2) | pad ]                              [..., k r + W]
    reduce:  all-reduce(buffer) over the TP group (one collective, in place)             (the layout's)
    scale:   latents = buffer[..., :k r] * rsqrt(S / d + eps),  S = buffer[..., k r]    [..., k r]

which equals ``A_i (gamma * x / rms(x))`` exactly: the per-shard ``1/rms`` factors cancel through the
row-parallel GEMM, so each rank needs only its own sum of squares, which rides in the A all-reduce as one
more column. ``gamma`` is folded into the (weight-sized) GEMM operand, never multiplied into activations.
The statistics take :data:`STATISTICS_WIDTH` columns (one used, the rest keep every row of the GEMM output
16-byte aligned for the GPU's GEMM kernels); the unused columns are never read.

The weights a group reads together are row blocks of one buffer (:mod:`boost_hf.parallel.shared_storage`):
``A = [A_1; ...; A_k]`` is a view, so forming the GEMM operand is one op (the cast to the compute dtype, with
``gamma`` folded in) or none at all (fp32 without ``gamma``), and the weight gradient is one buffer split into
each parameter's gradient. :func:`stacked_weight` is that operand for any grouped GEMM (Megatron's q/k/v,
vanilla's A's); :func:`weight_views` gives the B's of a group one cast together, their gradients written by
:func:`latent_linear` into rows of one buffer and cast back in one op. Where the parameters are not stored
together (see that module) the same functions concatenate instead: same values, one copy more.

:func:`down_projection` and :func:`scale_latents` are the eager kernels (GEMMs written straight into the
communication buffer; ``x``'s statistics, and its cast under autocast, in one pass, and ``gamma``'s gradient in
another, each one kernel (:mod:`boost_hf.parallel.statistics_op`); the latent scale computed in fp32 and stored in
the compute dtype; backward writing each gradient once). A grouped BTP group whose
latent function is SiLU or none runs the scale and the function as one kernel each way instead
(:mod:`boost_hf.parallel.latent_op`); :func:`scale_latents` serves the others (ungrouped, LaX's crossing). Under
``torch.compile`` every function here falls back to the same arithmetic written as plain ops, which inductor
fuses. Arithmetic runs in the autocast dtype when autocast is on (statistics and ``1/rms`` in fp32), else in
the input's dtype. No communication here.
"""

from __future__ import annotations

import torch
from transformers.activations import SiLUActivation

from .modules import compute_dtype, statistics_dtype
from .shared_storage import joined_rows
from .statistics_op import column_dots, squares_into

#: columns holding one row's statistics in the down buffer (1 used; 8 keeps rows 16-byte aligned)
STATISTICS_WIDTH = 8


def _stack(weights, dtype: torch.dtype, gamma: torch.Tensor | None = None) -> torch.Tensor:
    """``[W_1; ...; W_k] * gamma`` (``[sum rows_i, cols]``) in ``dtype``, each element rounded once: a view of
    the parameters' shared storage when nothing is to be computed, else one op (two or more where the weights
    are not stored together). No autograd."""
    joined = joined_rows(weights)
    if joined is not None:
        if gamma is None:
            return joined if joined.dtype == dtype else joined.to(dtype)
        return torch.mul(joined, gamma, out=joined.new_empty(joined.shape, dtype=dtype))
    out = weights[0].new_empty((sum(w.shape[0] for w in weights), *weights[0].shape[1:]), dtype=dtype)
    if gamma is None:
        return torch.cat(weights, out=out)
    for w, rows in zip(weights, out.split([w.shape[0] for w in weights])):
        torch.mul(w, gamma, out=rows)
    return out


def _row_products(grad: torch.Tensor, weights) -> torch.Tensor:
    """``grad * [W_1; ...; W_k]`` (``grad: [sum rows_i, cols]``), one op where the weights are stored together."""
    joined = joined_rows(weights)
    if joined is not None:
        return torch.mul(grad, joined)
    products = torch.empty_like(grad, dtype=torch.promote_types(grad.dtype, weights[0].dtype))
    rows = [w.shape[0] for w in weights]
    for w, grad_rows, out in zip(weights, grad.split(rows), products.split(rows)):
        torch.mul(grad_rows, w, out=out)
    return products


class _DownProjection(torch.autograd.Function):
    """``(x, gamma | None, statistics, grouped, *factors) -> buffers``; see :func:`down_projection`."""

    @staticmethod
    def forward(ctx, x, gamma, statistics, grouped, *factors):
        dtype, lead, d_in = compute_dtype(x), x.shape[:-1], x.shape[-1]
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.reshape(-1, d_in)
            widths = [sum(a.shape[0] for a in factors)] if grouped else [a.shape[0] for a in factors]
            buffers = [x2.new_empty((*lead, width + (STATISTICS_WIDTH if statistics and i == 0 else 0)), dtype=dtype)
                       for i, width in enumerate(widths)]  # returned as they are: no view of a local
            if statistics:
                # the sums of squares of the GEMM's input as it is read (cast to the compute dtype), summed in fp32, into
                # the first buffer's statistics column; the cast (under autocast) in the same kernel
                column = buffers[0].view(-1, buffers[0].shape[-1])[:, widths[0]:widths[0] + 1]
                xc = squares_into(x2, column, dtype)
            else:
                xc = x2 if x2.dtype == dtype else x2.to(dtype)
            weight = _stack(factors, dtype, gamma)
            row = 0
            for width, buffer in zip(widths, buffers):
                rows = buffer.view(-1, buffer.shape[-1])
                torch.mm(xc, weight[row:row + width].t(), out=rows[:, :width] if rows.shape[-1] > width else rows)
                row += width
        ctx.save_for_backward(xc, weight, gamma, *factors)
        ctx.widths, ctx.statistics, ctx.input_shape = widths, statistics, x.shape
        # x's gradient in x's dtype: the wider of the two (torch.promote_types for these float dtypes, without its op)
        ctx.statistics_grad_dtype = x.dtype if x.dtype.itemsize >= dtype.itemsize else dtype
        return tuple(buffers)

    @staticmethod
    def backward(ctx, *grads):
        xc, weight, gamma, *factors = ctx.saved_tensors
        widths = ctx.widths
        with torch.autocast(xc.device.type, enabled=False):
            grad_x = grad_weight = None
            if ctx.needs_input_grad[0] or gamma is not None or any(ctx.needs_input_grad[4:]):
                grad_weight = weight.new_empty(weight.shape)
            row = 0
            for width, grad in zip(widths, grads):
                grad_h = grad.reshape(-1, grad.shape[-1])[:, :width]
                w = weight[row:row + width]
                if ctx.needs_input_grad[0]:
                    grad_x = torch.mm(grad_h, w) if grad_x is None else torch.addmm(grad_x, grad_h, w, out=grad_x)
                if grad_weight is not None:
                    torch.mm(grad_h.t(), xc, out=grad_weight[row:row + width])
                row += width
            if ctx.needs_input_grad[0] and ctx.statistics:
                # d S / d x = 2 x, with dL/dS in the statistics column
                grad_s = grads[0].reshape(-1, grads[0].shape[-1])[:, widths[0]:widths[0] + 1]
                grad_x = torch.addcmul(grad_x, xc, grad_s.to(ctx.statistics_grad_dtype), value=2.0)  # [N, 1] cast: x's dtype
            if grad_x is not None:
                grad_x = grad_x.view(ctx.input_shape)
            grad_gamma = grad_factors = None
            if grad_weight is not None:
                if gamma is None:
                    grad_factors = grad_weight.to(factors[0].dtype)
                else:
                    grad_factors = torch.mul(grad_weight, gamma)
                    if ctx.needs_input_grad[1]:
                        grad_gamma = _gamma_gradient(grad_weight, factors, gamma.dtype)
                grad_factors = grad_factors.split([a.shape[0] for a in factors])
        return (grad_x, grad_gamma, None, None, *(grad_factors or [None] * len(factors)))


def _gamma_gradient(grad_weight: torch.Tensor, factors, dtype: torch.dtype) -> torch.Tensor:
    """``dL/dgamma_c = sum_j dL/dW_jc A_jc`` over every factor's rows (``grad_weight``: the gradient of
    ``[A_1; ...; A_k] * gamma``): one op where the factors are stored together, else their products and a sum."""
    joined = joined_rows(factors)
    if joined is not None:
        return column_dots(grad_weight, joined, dtype)
    return _row_products(grad_weight, factors).sum(0).to(dtype)


def _down_reference(x, gamma, statistics, grouped, factors):
    """:func:`down_projection` as plain differentiable ops (for ``torch.compile``)."""
    weights = [a if gamma is None else a * gamma for a in factors]
    parts = [torch.nn.functional.linear(x, torch.cat(weights))] if grouped else [torch.nn.functional.linear(x, w) for w in weights]
    if statistics:
        s = x.to(statistics_dtype(x)).pow(2).sum(-1, keepdim=True).to(parts[0].dtype)
        parts[0] = torch.cat([parts[0], s, s.new_zeros((*s.shape[:-1], STATISTICS_WIDTH - 1))], dim=-1)
    return tuple(parts)


def down_projection(x: torch.Tensor, factors, *, gamma: torch.Tensor | None = None, statistics: bool = False,
                    grouped: bool = True) -> tuple[torch.Tensor, ...]:
    """This rank's partial A outputs, ready to be all-reduced.

    ``x: [..., d_in]``; ``factors``: ``A_i: [r_i, d_in]``; ``gamma: [d_in]`` folded into the weights
    (``A_i * gamma``). ``grouped``: one buffer ``[..., sum r_i]`` from one GEMM, else one ``[..., r_i]`` per
    factor. ``statistics``: the first buffer gains :data:`STATISTICS_WIDTH` columns, column ``sum r_i`` (or
    ``r_1``) holding ``sum(x^2)`` of each row. Buffers are in the compute dtype; no communication."""
    factors = tuple(factors)
    if torch.compiler.is_compiling():
        return _down_reference(x, gamma, statistics, grouped, factors)
    return _DownProjection.apply(x, gamma, statistics, grouped, *factors)


class _ScaleLatents(torch.autograd.Function):
    """``(hidden_size, eps, *reduced buffers) -> latents``; see :func:`scale_latents`."""

    @staticmethod
    def forward(ctx, hidden_size, eps, *buffers):
        width0 = buffers[0].shape[-1] - STATISTICS_WIDTH
        with torch.autocast(buffers[0].device.type, enabled=False):
            inverse_rms = torch.rsqrt(buffers[0][..., width0:width0 + 1].to(statistics_dtype(buffers[0])) / hidden_size + eps)
            latents = []
            for i, buffer in enumerate(buffers):
                z = buffer[..., :width0] if i == 0 else buffer
                latents.append(torch.mul(z, inverse_rms, out=torch.empty_like(z, memory_format=torch.contiguous_format)))
        # the latents, not the buffers: whatever reads a latent next (the latent function, a B GEMM) saves it
        # anyway, so backward keeps no second [N, k r] tensor per group
        ctx.save_for_backward(inverse_rms, *latents)
        ctx.hidden_size = hidden_size
        return tuple(latents)

    @staticmethod
    def backward(ctx, *grads):
        inverse_rms, *latents = ctx.saved_tensors
        width0 = latents[0].shape[-1]
        with torch.autocast(inverse_rms.device.type, enabled=False):
            grad_buffers, dot = [], None
            for i, (latent, grad) in enumerate(zip(latents, grads)):
                extra = STATISTICS_WIDTH if i == 0 else 0
                grad_buffer = latent.new_empty((*latent.shape[:-1], latent.shape[-1] + extra))
                torch.mul(grad, inverse_rms, out=grad_buffer[..., :width0] if i == 0 else grad_buffer)
                part = torch.sum(grad * latent, dim=-1, keepdim=True, dtype=inverse_rms.dtype)
                dot = part if dot is None else dot.add_(part)
                grad_buffers.append(grad_buffer)
            # latent = z s with s = (S/d + eps)^(-1/2):  dL/dS = sum_j dL/dlatent_j z_j (-1/(2d)) s^3
            #                                                  = sum_j dL/dlatent_j latent_j (-1/(2d)) s^2
            torch.mul(dot, inverse_rms.pow(2).mul_(-0.5 / ctx.hidden_size), out=grad_buffers[0][..., width0:width0 + 1])
        return (None, None, *grad_buffers)


def _scale_reference(hidden_size, eps, buffers):
    width0 = buffers[0].shape[-1] - STATISTICS_WIDTH
    inverse_rms = torch.rsqrt(buffers[0][..., width0:width0 + 1].to(statistics_dtype(buffers[0])) / hidden_size + eps)
    zs = [buffers[0][..., :width0], *buffers[1:]]
    return tuple((z.to(inverse_rms.dtype) * inverse_rms).to(z.dtype) for z in zs)


def scale_latents(buffers, hidden_size: int, eps: float) -> tuple[torch.Tensor, ...]:
    """The reduced latents of :func:`down_projection` (``statistics=True``) times ``rsqrt(S/d + eps)``:
    ``buffers[0]: [..., w_1 + STATISTICS_WIDTH]`` (``S`` in column ``w_1``), the others ``[..., w_i]`` ->
    latents ``[..., w_i]`` (contiguous, the buffers' dtype; the scale in fp32)."""
    buffers = tuple(buffers)
    if torch.compiler.is_compiling():
        return _scale_reference(hidden_size, eps, buffers)
    return _ScaleLatents.apply(hidden_size, eps, *buffers)


class _GradientSlots:
    """One gradient buffer, allocated in backward, into whose blocks along ``dim`` the GEMMs reading the
    blocks of one tensor write their gradients, so that no ``cat`` gathers them: the column ranges of a
    grouped latent ``[..., sum w_i]`` (the B GEMMs' input gradients) or the row blocks of a group's stacked
    weights ``[sum rows_i, r]`` (the B GEMMs' weight gradients)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, sizes: list[int], dim: int):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.sizes, self.dim, self.buffer = sizes, dim % len(shape), None

    def slot(self, i: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.buffer.narrow(self.dim, sum(self.sizes[:i]), self.sizes[i])

    def holds(self, grads) -> bool:
        """Whether ``grads`` are exactly this buffer's slots (nothing replaced or added them on the way)."""
        return self.buffer is not None and all(
            g is not None and g._base is self.buffer and g.storage_offset() == s.storage_offset()
            and g.stride() == s.stride() and g.shape == s.shape
            for g, s in ((g, self.slot(i)) for i, g in enumerate(grads))
        )

    def gathered(self, grads) -> torch.Tensor:
        """The whole gradient: the buffer the consumers filled, or the ``cat`` of whatever reached here
        (zeros for a block that got no gradient)."""
        if self.holds(grads):
            return self.buffer
        parts = [g if g is not None else torch.zeros(
            (*self.shape[:self.dim], size, *self.shape[self.dim + 1:]), dtype=self.dtype, device=self.device
        ) for g, size in zip(grads, self.sizes)]
        return torch.cat(parts, dim=self.dim)


def _tag_slots(parts, slots: _GradientSlots):
    for i, part in enumerate(parts):
        part._gradient_slot = (slots, i)
    return parts


class _SplitLatent(torch.autograd.Function):
    """``latent [..., sum w_i] -> views [..., w_i]``; backward returns the slot buffer the consumers filled,
    or concatenates the gradients when they are anything else."""

    @staticmethod
    def forward(ctx, latent, widths, slots):
        ctx.slots = slots
        return tuple(latent.split(widths, dim=-1))

    @staticmethod
    def backward(ctx, *grads):
        return ctx.slots.gathered(grads), None, None


def split_latent(latent: torch.Tensor, count: int, widths: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """``count`` equal slices (views) of ``latent``'s last dim, one per projection of a group (or slices of ``widths``).
    Fed to :func:`latent_linear` or :func:`batched_latent_linear`, their gradients are written into one buffer in place
    (no ``cat`` in backward)."""
    if count == 1:
        return (latent,)
    widths = widths or [latent.shape[-1] // count] * count
    if torch.compiler.is_compiling():
        return latent.split(widths, dim=-1)
    slots = _GradientSlots(latent.shape, latent.dtype, latent.device, widths, -1)
    return _tag_slots(_SplitLatent.apply(latent, widths, slots), slots)


def _unchanged(ctx) -> None:
    """Unpack the weights saved in forward: autograd raises if any was modified in place since. Where the
    stacked weight is the parameters' own storage (no cast), the GEMM that saved it tracks only the first
    parameter's version; this checks every one of them, as a per-weight GEMM would."""
    ctx.saved_tensors


class _StackedWeight(torch.autograd.Function):
    """``(dtype, *weights) -> [W_1; ...; W_k]`` in ``dtype``; see :func:`stacked_weight`."""

    @staticmethod
    def forward(ctx, dtype, *weights):
        ctx.rows, ctx.dtype = [w.shape[0] for w in weights], weights[0].dtype
        ctx.save_for_backward(*weights)  # only to check their versions: see _unchanged
        return _stack(weights, dtype)

    @staticmethod
    def backward(ctx, grad):
        _unchanged(ctx)
        return None, *grad.to(ctx.dtype).split(ctx.rows)


def stacked_weight(weights, dtype: torch.dtype) -> torch.Tensor:
    """The weights of a grouped GEMM, ``[rows_i, cols]`` each, as one ``[sum rows_i, cols]`` tensor in ``dtype``
    (the compute dtype): the parameters' shared storage itself, or its cast in one op (the cast autocast would
    make of each weight). Backward: one cast of the gradient, split into views, one per weight."""
    if torch.compiler.is_compiling():
        return torch.cat(list(weights)).to(dtype)
    return _StackedWeight.apply(dtype, *weights)


class _WeightViews(torch.autograd.Function):
    """``(dtype, slots, *weights) -> views [rows_i, cols]`` of ``[W_1; ...; W_k]`` in ``dtype``; backward casts
    the slot buffer the GEMMs filled (or the ``cat`` of the gradients) back once and splits it."""

    @staticmethod
    def forward(ctx, dtype, slots, *weights):
        ctx.rows, ctx.dtype, ctx.slots = [w.shape[0] for w in weights], weights[0].dtype, slots
        ctx.save_for_backward(*weights)  # only to check their versions: see _unchanged
        return tuple(_stack(weights, dtype).split(ctx.rows))

    @staticmethod
    def backward(ctx, *grads):
        _unchanged(ctx)
        return None, None, *ctx.slots.gathered(grads).to(ctx.dtype).split(ctx.rows)


def weight_views(weights, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The weights of a group's separate GEMMs (the B's, ``[rows_i, r]`` each) in ``dtype``, cast together in
    one op (none in fp32 when they are stored together). Fed to :func:`latent_linear`, their gradients are
    written into the rows of one buffer and cast back in one op."""
    weights = tuple(weights)
    if torch.compiler.is_compiling():
        return tuple(w.to(dtype) for w in weights)
    rows = [w.shape[0] for w in weights]
    slots = _GradientSlots((sum(rows), *weights[0].shape[1:]), dtype, weights[0].device, rows, 0)
    return _tag_slots(_WeightViews.apply(dtype, slots, *weights), slots)


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor, slot, dtype: torch.dtype) -> torch.Tensor:
    """``grad^T x`` (``grad: [N, rows]``, ``x: [N, cols]``) written into ``slot`` (``(slots, i)``: the weight's
    rows of :func:`weight_views`' gradient buffer) when there is one, else a fresh tensor cast to ``dtype``."""
    if slot is not None:
        slots, i = slot
        return torch.mm(grad.t(), x, out=slots.slot(i))
    grad_weight = torch.mm(grad.t(), x)
    return grad_weight if grad_weight.dtype == dtype else grad_weight.to(dtype)


class _LatentLinear(torch.autograd.Function):
    """``latent [..., r] @ weight.T`` in the compute dtype; backward writes the latent's and the weight's
    gradients into their gradient slots (see :func:`split_latent`, :func:`weight_views`) when they have them."""

    @staticmethod
    def forward(ctx, latent, weight, latent_slot, weight_slot):
        dtype = compute_dtype(latent)
        with torch.autocast(latent.device.type, enabled=False):
            w = weight if weight.dtype == dtype else weight.to(dtype)
            x = latent if latent.dtype == dtype else latent.to(dtype)
            out = torch.nn.functional.linear(x, w)
        ctx.save_for_backward(x, w)
        ctx.slots, ctx.weight_dtype, ctx.latent_dtype = (latent_slot, weight_slot), weight.dtype, latent.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        latent_slot, weight_slot = ctx.slots
        with torch.autocast(x.device.type, enabled=False):
            grad = grad if grad.dtype == w.dtype else grad.to(w.dtype)
            g2 = grad.reshape(-1, grad.shape[-1])
            grad_latent = grad_weight = None
            if ctx.needs_input_grad[0]:
                if latent_slot is not None and ctx.latent_dtype == w.dtype:
                    slots, i = latent_slot
                    grad_latent = slots.slot(i)
                    torch.mm(g2, w, out=grad_latent.view(-1, w.shape[1]))
                else:
                    grad_latent = torch.mm(g2, w).view(*grad.shape[:-1], w.shape[1])
            if ctx.needs_input_grad[1]:
                slot = weight_slot if ctx.weight_dtype == w.dtype else None
                grad_weight = _weight_gradient(g2, x.reshape(-1, x.shape[-1]), slot, ctx.weight_dtype)
        return grad_latent, grad_weight, None, None


def latent_linear(latent: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(latent, weight)`` (a B GEMM) under autocast; see :func:`split_latent` and :func:`weight_views`."""
    if torch.compiler.is_compiling():
        return torch.nn.functional.linear(latent, weight)
    return _LatentLinear.apply(latent, weight, getattr(latent, "_gradient_slot", None), getattr(weight, "_gradient_slot", None))


class StackedGradients:
    """The gradients of a batched GEMM's ``count`` outputs as one ``[count, *shape]`` buffer, allocated in backward, whose
    blocks the outputs' consumers write their gradients into (RoPE's backward, the gated product's:
    :meth:`slot`); the batched GEMM's backward reads it whole (:meth:`gathered`), so no step stacks the gradients."""

    def __init__(self, count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.count, self.shape, self.dtype, self.device = count, tuple(shape), dtype, device
        self.buffer = self.blocks = None

    def slot(self, i: int) -> torch.Tensor:
        """Block ``i``, ``shape``."""
        if self.buffer is None:
            self.buffer = torch.empty((self.count, *self.shape), dtype=self.dtype, device=self.device)
            self.blocks = self.buffer.unbind(0)
        return self.blocks[i]

    def holds(self, i: int, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is block ``i`` (any view of it with its layout)."""
        block = self.slot(i)
        return grad._base is self.buffer and grad.storage_offset() == block.storage_offset() and grad.is_contiguous() \
            and grad.numel() == block.numel()

    def gathered(self, grads) -> torch.Tensor:
        """The ``[count, *shape]`` gradient: the buffer, each gradient not already in its block copied into it (one op
        each: under a hook that replaced one, or a consumer that does not write into its slot), zeros for none."""
        for i, grad in enumerate(grads):
            if grad is None:
                self.slot(i).zero_()
            elif not self.holds(i, grad):
                self.slot(i).copy_(grad.reshape(self.shape))
        return self.buffer


def stacked_slot(tensor: torch.Tensor) -> tuple[StackedGradients, int] | None:
    """``(gradients, i)`` where ``tensor`` is output ``i`` of :func:`batched_latent_linear` (else ``None``): its consumer
    may write its gradient into ``gradients.slot(i)``."""
    return getattr(tensor, "_stacked_slot", None)


class _BatchedLatentLinear(torch.autograd.Function):
    """``(latent [..., k r], gradients, latent_slot, weight_slots, *weights [w, r]) -> k outputs [..., w]``; see
    :func:`batched_latent_linear`."""

    @staticmethod
    def forward(ctx, latent, gradients, latent_slot, weight_slots, *weights):
        count, (width, rank), dtype = len(weights), weights[0].shape, weights[0].dtype
        with torch.autocast(latent.device.type, enabled=False):
            x = latent if latent.dtype == dtype else latent.to(dtype)
            stacked = _stack(weights, dtype).view(count, width, rank)
            out = torch.bmm(x.reshape(-1, count, rank).transpose(0, 1), stacked.transpose(1, 2))  # [k, N, w]
        ctx.save_for_backward(x, *weights)
        ctx.gradients, ctx.slots, ctx.latent_dtype = gradients, (latent_slot, weight_slots), latent.dtype
        return out.view(count, *latent.shape[:-1], width).unbind(0)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        count, (width, rank) = len(weights), weights[0].shape
        with torch.autocast(x.device.type, enabled=False):
            grad_out = ctx.gradients.gathered(grads).view(count, -1, width)
            latents = x.reshape(-1, count, rank).transpose(0, 1)  # [k, N, r]
            latent_slot, slots = ctx.slots
            grad_latent = grad_weights = None
            if ctx.needs_input_grad[0]:
                stacked = _stack(weights, x.dtype).view(count, width, rank)
                if latent_slot is not None and ctx.latent_dtype == x.dtype:  # its columns of split_latent's buffer
                    grad_latent = latent_slot[0].slot(latent_slot[1])
                else:
                    grad_latent = torch.empty_like(x, memory_format=torch.contiguous_format)
                torch.bmm(grad_out, stacked, out=grad_latent.view(-1, count, rank).transpose(0, 1))
                if grad_latent.dtype != ctx.latent_dtype:
                    grad_latent = grad_latent.to(ctx.latent_dtype)
            if any(ctx.needs_input_grad[4:]):
                if slots is not None:  # the first rows of weight_views' gradient buffer, cast back by it in one op
                    slots.slot(0)
                    buffer = slots.buffer.narrow(0, 0, count * width).view(count, width, rank)
                else:
                    buffer = weights[0].new_empty((count, width, rank))
                torch.bmm(grad_out.transpose(1, 2), latents, out=buffer)
                grad_weights = [slots.slot(i) for i in range(count)] if slots is not None else list(buffer.unbind(0))
        return (grad_latent, None, None, None, *(grad_weights or [None] * count))


def _shared_weight_slots(weights) -> _GradientSlots | None:
    """The gradient buffer of :func:`weight_views` that ``weights`` are rows ``0, 1, ...`` of, else ``None``."""
    slots = [getattr(w, "_gradient_slot", None) for w in weights]
    if any(s is None for s in slots) or any(s[0] is not slots[0][0] or s[1] != i for i, s in enumerate(slots)):
        return None
    return slots[0][0]


def batched_latent_linear(latent: torch.Tensor, weights) -> tuple[torch.Tensor, ...]:
    """The B GEMMs of a group whose projections read consecutive ``r``-wide blocks of one latent and have outputs of one
    width: ``latent [..., k r]``, ``weights``: ``k`` tensors ``[w, r]`` in the compute dtype (pass
    :func:`weight_views`) -> ``k`` outputs ``latent_i @ W_i^T: [..., w]``, as **one** batched GEMM (``bmm`` over the
    ``[k, N, r]`` view of the latent and the ``[k, w, r]`` view of the weights: no copy of either). The outputs are the
    blocks of one ``[k, ..., w]`` tensor (whatever keeps one for backward keeps them all: give this GEMM the outputs that
    are consumed, not kept); each is tagged (:func:`stacked_slot`) with the block of one gradient buffer its consumer may
    write its gradient into, so that backward is one batched GEMM for the latent's gradient (into its columns of
    :func:`split_latent`'s buffer when the latent is one of its slices, else a fresh ``[..., k r]`` tensor) and one for
    the weights' (into the first rows of :func:`weight_views`' buffer) with nothing stacked. Under ``torch.compile``:
    ``F.linear`` per block (plain ops; inductor fuses)."""
    weights = tuple(weights)
    count, (width, rank) = len(weights), weights[0].shape
    if torch.compiler.is_compiling():
        return tuple(torch.nn.functional.linear(x, w) for x, w in zip(latent.split(rank, dim=-1), weights))
    gradients = StackedGradients(count, (*latent.shape[:-1], width), weights[0].dtype, latent.device)
    outputs = _BatchedLatentLinear.apply(latent, gradients, getattr(latent, "_gradient_slot", None), _shared_weight_slots(weights),
                                         *weights)
    for i, output in enumerate(outputs):
        output._stacked_slot = (gradients, i)
    return outputs


_SILU_MODULES = (torch.nn.SiLU, SiLUActivation)  # transformers' ACT2FN["silu"] and ["swish"]


class _GatedProduct(torch.autograd.Function):
    """``(gate, up, silu, gradients, i_gate, i_up) -> act(gate) * up``; see :func:`gated_product`."""

    @staticmethod
    def forward(ctx, gate, up, silu, gradients, i_gate, i_up):
        activated = torch.nn.functional.silu(gate) if silu else gate
        ctx.save_for_backward(gate, up, *((activated,) if silu else ()))
        ctx.silu, ctx.slots = silu, (gradients, i_gate, i_up)
        return activated * up

    @staticmethod
    def backward(ctx, grad):
        gate, up, *activated = ctx.saved_tensors
        gradients, i_gate, i_up = ctx.slots
        grad_gate, grad_up = gradients.slot(i_gate).view(gate.shape), gradients.slot(i_up).view(up.shape)
        torch.mul(grad, activated[0] if ctx.silu else gate, out=grad_up)
        if ctx.silu:
            torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        else:
            torch.mul(grad, up, out=grad_gate)
        return grad_gate, grad_up, None, None, None, None


def gated_product(gate: torch.Tensor, up: torch.Tensor, act_fn) -> torch.Tensor:
    """The gated MLP's ``act(gate) * up`` (``act_fn``: a module, or ``None`` for none). When ``gate`` and ``up`` are
    outputs of one :func:`batched_latent_linear` and ``act_fn`` is none or a plain SiLU, one autograd Function whose
    backward writes both gradients into that GEMM's gradient buffer (the same ops and saved tensors as autograd's:
    ``gate``, ``up`` and, with SiLU, ``act(gate)``); else plain ops (under ``torch.compile`` too)."""
    slots = stacked_slot(gate), stacked_slot(up)
    silu = type(act_fn) in _SILU_MODULES and not (act_fn._forward_hooks or act_fn._forward_pre_hooks)
    if (torch.compiler.is_compiling() or None in slots or slots[0][0] is not slots[1][0]
            or (act_fn is not None and not silu)):
        return (gate if act_fn is None else act_fn(gate)) * up
    return _GatedProduct.apply(gate, up, silu, slots[0][0], slots[0][1], slots[1][1])


def column_outputs(x: torch.Tensor, weights, lead, grouped: bool) -> tuple[torch.Tensor, ...]:
    """``x [N, d] @ W_i^T`` as ``[*lead, w_i]`` for each ``W_i: [w_i, d]`` (``x``'s dtype, no autograd).
    ``grouped``: one GEMM on ``[W_1; ...; W_k]`` (a view when the weights are consecutive rows of one tensor, as
    :func:`weight_views` gives them) and its output's column blocks (views); else one GEMM per weight, each
    into a fresh tensor."""
    if grouped:
        stacked = _stack(weights, weights[0].dtype)
        out = x.new_empty((*lead, stacked.shape[0]))
        torch.mm(x, stacked.t(), out=out.view(-1, stacked.shape[0]))
        return tuple(out.split([w.shape[0] for w in weights], dim=-1))
    outputs = tuple(x.new_empty((*lead, w.shape[0])) for w in weights)
    for w, out in zip(weights, outputs):
        torch.mm(x, w.t(), out=out.view(-1, w.shape[0]))
    return outputs


def column_input_gradient(grads, weights) -> torch.Tensor:
    """``sum_i g_i W_i`` (``g_i: [N, w_i]``, ``W_i: [w_i, d]``) -> ``[N, d]``: one GEMM, then each further block
    accumulated into it (no ``[N, sum w_i]`` concatenation of the ``g_i``). Accumulating GEMMs are spelled
    ``addmm(..., out=grad_x)``, the kernel of ``addmm_``, so that op counters keyed on ``addmm`` count them as GEMMs."""
    grad_x = torch.mm(grads[0], weights[0])
    for grad, weight in zip(grads[1:], weights[1:]):
        torch.addmm(grad_x, grad, weight, out=grad_x)
    return grad_x


def column_weight_gradients(grads, x, slots, needed) -> list[torch.Tensor | None]:
    """``g_i^T x`` (``[w_i, d]``) for each needed weight, into its rows of :func:`weight_views`' gradient buffer
    where ``slots[i]`` is its slot, else fresh (``g_i``'s dtype)."""
    return [_weight_gradient(grad, x, slot, grad.dtype) if need else None for grad, slot, need in zip(grads, slots, needed)]


class _ColumnLinear(torch.autograd.Function):
    """``(x, grouped, slots, *weights) -> outputs``; see :func:`column_linear`."""

    @staticmethod
    def forward(ctx, x, grouped, slots, *weights):
        with torch.autocast(x.device.type, enabled=False):
            outputs = column_outputs(x.reshape(-1, x.shape[-1]), weights, x.shape[:-1], grouped)
        ctx.save_for_backward(x, *weights)
        ctx.slots = slots
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        grads = [grad.reshape(-1, grad.shape[-1]) for grad in grads]
        grad_x = None
        with torch.autocast(x.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = column_input_gradient(grads, weights).view(x.shape)
            grad_weights = column_weight_gradients(grads, x.reshape(-1, x.shape[-1]), ctx.slots, ctx.needs_input_grad[3:])
        return grad_x, None, None, *grad_weights


def column_slots(weights) -> list:
    """Each weight's gradient slot (``None`` where it has none; see :func:`weight_views`)."""
    return [getattr(w, "_gradient_slot", None) for w in weights]


def column_linear(x: torch.Tensor, weights, *, grouped: bool = False) -> tuple[torch.Tensor, ...]:
    """Column-parallel GEMMs sharing one input: ``x [..., d] @ W_i^T -> [..., w_i]`` for each ``W_i: [w_i, d]``
    (``x`` and the weights in the compute dtype). ``grouped``: one GEMM on the stacked weights (pass
    :func:`weight_views`), the outputs its column blocks. Backward never concatenates the outputs' gradients:
    the input gradient is ``sum_i g_i W_i`` (:func:`column_input_gradient`), each weight gradient ``g_i^T x``
    is written into its rows of :func:`weight_views`' buffer, which is cast back in one op. Under
    ``torch.compile``: ``F.linear`` on the concatenated weights and ``split`` (plain ops; inductor fuses)."""
    weights = tuple(weights)
    if torch.compiler.is_compiling():
        if grouped:
            return torch.nn.functional.linear(x, torch.cat(weights)).split([w.shape[0] for w in weights], dim=-1)
        return tuple(torch.nn.functional.linear(x, w) for w in weights)
    return _ColumnLinear.apply(x, grouped, column_slots(weights), *weights)


__all__ = [
    "STATISTICS_WIDTH", "down_projection", "scale_latents", "split_latent", "stacked_weight", "weight_views", "latent_linear",
    "StackedGradients", "batched_latent_linear", "stacked_slot", "gated_product",
    "column_linear", "column_outputs", "column_input_gradient", "column_weight_gradients", "column_slots",
]
