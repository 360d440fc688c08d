"""LORO (Mo et al., ICLR 2025, "Parameter and Memory Efficient Pretraining via Low-rank Riemannian Optimization")
for ``bottleneck="svd"`` models, ``W = B A``, at any tensor-parallel size.

* **Lazy step** (most steps): AdamW on every parameter; on the factors ``A`` and ``B`` with the learning rate
  scaled by ``lr_scale`` (the authors' ``r / d``, ``d`` the hidden size): the factor parameter group's ``lr`` *is*
  the scaled rate, so any learning-rate scheduler scales it too.
* **Exact step** every ``exact_every`` optimizer steps: each ``(B, A)`` is replaced by the balanced factors of the
  rank-r truncated SVD of ``W - lr P_T(G)``, ``G`` read from the factors' Adam directions and ``lr`` the unscaled
  rate (:mod:`boost_hf.optim.low_rank_retraction`); under bottleneck-aware TP from ``r x r`` products, one
  all-reduce per bucket of projections, without gathering a factor. Then every Adam moment is reset, and
  :func:`restart_schedule_at_exact_steps` warms the learning rate up again over a few steps.
* Embeddings, norms and the LM head are plain AdamW throughout.
* Adam's ``eps`` sits where ``epsilon_placement`` says (:data:`EPSILON_PLACEMENTS`): ``"torch"`` (default,
  ``torch.optim.AdamW``: ``lr m_hat / (sqrt(v_hat) + eps)``, ``m_hat = m / bc1``, ``v_hat = v / bc2``) or
  ``"transformers"`` (transformers' former ``AdamW``, which the LORO authors' ``LOROAdamW`` copies:
  ``lr sqrt(bc2) / bc1 m / (sqrt(v) + eps)``, i.e. torch's with ``eps / sqrt(bc2)``: after each moment reset
  ``bc2 = 1 - beta2^k`` restarts from ``1 - beta2``, so their ``eps`` 1e-6 acts as 3.2e-5 on the first step, 1.6e-6
  after 500). Both on every parameter, lazy steps and the exact step's directions alike.

Only valid where nothing sits between the factors (:func:`check_loro_model`). The optimizer's state has AdamW's
keys (``step``, ``exp_avg``, ``exp_avg_sq`` per parameter) and its place in the period is the factor group's
``loro_step``, so checkpoints reshard across TP sizes as AdamW's do. Every DP replica runs the same exact step
on the same (already averaged) gradients. DeepSpeed ZeRO is refused: its partitions cut through factor rows.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..parallel.sharding import shard_spec_of
from .low_rank_retraction import PRODUCTS, FactorPair, retract

LOWRANK_OPTIMIZERS = ("adamw", "loro")
EPSILON_PLACEMENTS = ("torch", "transformers")
BUCKET_ELEMENTS = 1 << 22
"""Float64 values of ``r x r`` products all-reduced together at an exact step (32 MiB): one collective per bucket."""
RESTART_FLOOR = 1e-6
"""The learning-rate multiplier of the first step after an exact step (the authors' ``eps``)."""


def check_loro_model(config) -> None:
    """Raise ``ValueError`` saying why unless ``config`` is a ``bottleneck="svd"`` model (``W = B A``)."""
    fix = "use --bottleneck svd, or --lowrank_optimizer adamw"
    if config.bottleneck == "svd":
        return
    if config.bottleneck is None:
        raise ValueError(f"--lowrank_optimizer loro trains the factors of low-rank weights W = B A, and this model is full rank: {fix}.")
    if config.bottleneck == "tt":
        raise ValueError(
            "--lowrank_optimizer loro trains factors B and A held as parameters; a tensor train (bottleneck='tt') holds "
            "cores, from which A and B are contracted at every call, and LORO's steps on B and A cannot be written back "
            f"into cores of the same ranks: {fix}."
        )
    between = {
        "cola": "an activation on the r-dim latent (y = B act(A x))",
        "lax": "a latent LayerNorm, activation and crossing from the previous block (y = B act(LN(A x + G c)))",
    }.get(config.bottleneck, f"the {config.bottleneck!r} latent function")
    raise ValueError(
        f"--lowrank_optimizer loro is only valid for bottleneck='svd' (y = B A x): bottleneck={config.bottleneck!r} has "
        f"{between} between the factors, and LORO's exact step replaces B and A by new balanced factors of B A, a "
        f"change of basis of the latent that changes this function: {fix}."
    )


LORO_WITHOUT_DEEPSPEED = (
    "--lowrank_optimizer loro does not run under DeepSpeed: ZeRO keeps flat partitions of the parameters that cut "
    "through the rows of B and columns of A that LORO's exact step rebuilds. Train without DeepSpeed (no --deepspeed, an "
    "accelerate config without deepspeed: DDP over the data-parallel group), or with --lowrank_optimizer adamw."
)


def check_loro_training(model: nn.Module, *, deepspeed: bool) -> None:
    """Raise ``ValueError`` saying why LORO cannot train ``model`` (before any collective: the same answer on every
    rank): under DeepSpeed, a model with something between its factors (:func:`check_loro_model`), a layout that
    splits the rank (:func:`factor_pairs`)."""
    if deepspeed:
        raise ValueError(LORO_WITHOUT_DEEPSPEED)
    check_loro_model(model.config)
    factor_pairs(model)


def factor_pairs(model: nn.Module) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """``(B, A)`` of every low-rank projection of ``model`` in module order (parameters ``*.B``, ``*.A``). Raises
    ``ValueError`` for a layout whose shards cannot be retracted locally (the rank dimension split, vanilla TP)."""
    pairs = []
    for name, module in model.named_modules():
        A, B = getattr(module, "A", None), getattr(module, "B", None)
        if not (isinstance(A, nn.Parameter) and isinstance(B, nn.Parameter)):
            continue
        a_dim, b_dim = (shard_spec_of(p).partition_dim if shard_spec_of(p).is_sharded else None for p in (A, B))
        if (a_dim, b_dim) not in ((None, None), (1, 0)):
            raise ValueError(
                f"--lowrank_optimizer loro needs each rank to hold rows of B and columns of A (tp_style='btp') or whole "
                f"factors; {name} has A split along dim {a_dim} and B along dim {b_dim} (tp_style='vanilla' splits the "
                "rank r, so B^T B would need every rank's columns of B): use --tp_style btp."
            )
        pairs.append((B, A))
    return pairs


class LoroAdamW(torch.optim.Optimizer):
    """AdamW with LORO's lazy and exact steps on ``pairs`` (``(B, A)`` parameters, all in the param groups that
    carry ``lr_scale``; see the module docstring). ``tp_group``: the tensor-parallel group whose ranks hold the
    other rows of each ``B`` and columns of each ``A`` (``None`` at tp_size 1).

    Param groups take AdamW's ``lr``, ``betas``, ``eps``, ``weight_decay`` and ``lr_scale`` (1 for non-factor
    groups). A factor group's ``lr`` defaults to ``lr x lr_scale``; the exact step moves ``W`` with
    ``lr / lr_scale``. With ``epsilon_placement="torch"`` updates are ``torch.optim.AdamW``'s (single-tensor)
    arithmetic, operation for operation; ``"transformers"`` puts ``eps`` where the LORO authors' optimizer does (module
    docstring). Weight decay is torch's (``p (1 - lr wd)`` before the update, and ``(1 - lr wd) W`` in the exact step)
    with either placement; the authors' optimizer decays after the update, factors with the bias-corrected step
    size, and not in the exact step: the same only at their ``weight_decay`` 0.
    """

    def __init__(self, params, pairs, *, exact_every: int, tp_group=None, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, bucket_elements: int = BUCKET_ELEMENTS,
                 epsilon_placement: str = "torch"):
        if exact_every < 1:
            raise ValueError(f"exact_every must be >= 1 (optimizer steps between exact steps), got {exact_every}.")
        if epsilon_placement not in EPSILON_PLACEMENTS:
            raise ValueError(f"adam_epsilon_placement must be one of {', '.join(EPSILON_PLACEMENTS)}, got {epsilon_placement!r}.")
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "lr_scale": 1.0, "loro_step": 0}
        groups = [dict(g) for g in params]
        for group in groups:
            if "lr_scale" in group and "lr" not in group:
                group["lr"] = lr * group["lr_scale"]
        super().__init__(groups, defaults)
        self.pairs = list(pairs)
        self.exact_every, self.tp_group, self.bucket_elements = exact_every, tp_group, bucket_elements
        self.epsilon_placement = epsilon_placement
        groups = self._group_of()
        for B, A in self.pairs:
            for factor in (B, A):
                if factor not in groups or groups[factor]["lr_scale"] <= 0:
                    raise ValueError("every factor of pairs must be in a param group with lr_scale > 0.")

    def _group_of(self) -> dict:
        """Each parameter's group (looked up each time: ``load_state_dict`` replaces the group dicts)."""
        return {p: g for g in self.param_groups for p in g["params"]}

    def _moments(self, param: torch.Tensor, group: dict) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Advance ``param``'s Adam moments with its gradient; ``(exp_avg, denom, bias_correction1)``: the Adam
        direction is ``exp_avg / denom / bias_correction1``."""
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        grad, exp_avg, exp_avg_sq = param.grad, state["exp_avg"], state["exp_avg_sq"]
        state["step"] += 1
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"].item()
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        if self.epsilon_placement == "transformers":  # sqrt(bc2) / bc1 m / (sqrt(v) + eps)
            denom = exp_avg_sq.sqrt().add_(group["eps"]).div_(bias_correction2_sqrt)
        else:  # m / bc1 / (sqrt(v) / sqrt(bc2) + eps), torch's AdamW
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(group["eps"])
        return exp_avg, denom, 1 - beta1**step

    def _adamw_(self, param: torch.Tensor, group: dict) -> None:
        if group["weight_decay"] != 0:
            param.mul_(1 - group["lr"] * group["weight_decay"])
        exp_avg, denom, bias_correction1 = self._moments(param, group)
        param.addcdiv_(exp_avg, denom, value=-group["lr"] / bias_correction1)

    @property
    def steps_in_period(self) -> int:
        """Optimizer steps since the last exact step."""
        return self._group_of()[self.pairs[0][0]]["loro_step"] if self.pairs else 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        exact = self.steps_in_period + 1 == self.exact_every
        factors = {p for pair in self.pairs for p in pair}
        directions = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if exact and param in factors:
                    exp_avg, denom, bias_correction1 = self._moments(param, group)
                    directions[param] = exp_avg / denom / bias_correction1
                else:
                    self._adamw_(param, group)
        groups = self._group_of()
        for group in {id(groups[p]): groups[p] for p in factors}.values():
            group["loro_step"] = 0 if exact else group["loro_step"] + 1
        if exact:
            self._exact_step(directions)
            self.reset_moments()
        return loss

    def _exact_step(self, directions: dict) -> None:
        """Retract every pair (a pair without gradients this step moves along a zero direction: it is only
        re-balanced), in buckets of at most ``bucket_elements`` products: one all-reduce per bucket."""
        bucket, size, groups = [], 0, self._group_of()
        for B, A in self.pairs:
            group = groups[B]
            lr = group["lr"] / group["lr_scale"]
            direction_B = directions[B] if B in directions else torch.zeros_like(B)
            direction_A = directions[A] if A in directions else torch.zeros_like(A)
            pair = FactorPair(B.data, A.data, direction_B, direction_A, lr, group["weight_decay"])
            elements = PRODUCTS * B.shape[1] ** 2
            if bucket and size + elements > self.bucket_elements:
                retract(bucket, self.tp_group)
                bucket, size = [], 0
            bucket.append(pair)
            size += elements
        retract(bucket, self.tp_group)

    def reset_moments(self) -> None:
        """Zero every parameter's Adam moments and step count (the authors refresh all of them after an exact step)."""
        for state in self.state.values():
            for value in state.values():
                value.zero_()


def loro_optimizer(model: nn.Module, *, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                   exact_every: int, lr_scale: float | None = None, decay_parameter_names=None,
                   epsilon_placement: str = "torch") -> LoroAdamW:
    """A :class:`LoroAdamW` over ``model``'s trainable parameters: the factors in one group (``lr_scale``, default
    ``r / hidden_size``; ``weight_decay``), the others in AdamW's two groups (``weight_decay`` on
    ``decay_parameter_names``, default every parameter, and 0 on the rest); ``eps`` where ``epsilon_placement`` says.
    Checks the model first."""
    config = model.config
    check_loro_model(config)
    pairs = factor_pairs(model)
    factors = {p for pair in pairs for p in pair}
    decay = set(decay_parameter_names) if decay_parameter_names is not None else None
    others = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p not in factors]
    scale = lr_scale if lr_scale is not None else config.rank / config.hidden_size
    if not scale > 0 or not math.isfinite(scale):
        raise ValueError(f"loro_lr_scale must be a positive number, got {lr_scale}.")
    groups = [
        {"params": [p for n, p in others if decay is None or n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in others if decay is not None and n not in decay], "weight_decay": 0.0},
        {"params": [p for pair in pairs for p in pair if p.requires_grad], "weight_decay": weight_decay, "lr_scale": scale},
    ]
    plan = getattr(model, "plan", None)
    return LoroAdamW(
        [g for g in groups if g["params"]], [pair for pair in pairs if all(p.requires_grad for p in pair)],
        exact_every=exact_every, tp_group=plan.group if plan is not None else None,
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, epsilon_placement=epsilon_placement,
    )


def restart_schedule_at_exact_steps(scheduler, every: int, warmup_steps: int):
    """Make a ``LambdaLR`` (every ``transformers`` schedule but plateau) restart after each exact step, as the
    authors' ``cosine_restart``: the ``q``-th step after the exact step ending period ``n`` (``q < warmup_steps``)
    runs at ``floor + q / warmup_steps x (m(n every) - floor)`` of the peak rate, ``m`` the original schedule, and
    then on ``m`` again. In place; returns ``scheduler``. The wrapped functions are not saved in its state dict (the
    step count is): build the same wrapper before loading it."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        raise ValueError(
            f"--lowrank_optimizer loro restarts the learning-rate schedule after each exact step and needs a LambdaLR "
            f"schedule (every lr_scheduler_type but reduce_lr_on_plateau); got {type(scheduler).__name__}."
        )

    def restarted(schedule):
        def multiplier(step: int) -> float:
            period, position = divmod(step, every)
            if period == 0 or position >= warmup_steps:
                return schedule(step)
            return RESTART_FLOOR + position / warmup_steps * (schedule(period * every) - RESTART_FLOOR)

        return multiplier

    scheduler.lr_lambdas = [restarted(schedule) for schedule in scheduler.lr_lambdas]
    return scheduler


def optimizer_of_arguments(model: nn.Module, args, decay_parameter_names) -> LoroAdamW:
    """:func:`loro_optimizer` as training arguments ``args`` set it (``--lowrank_optimizer loro``)."""
    return loro_optimizer(model, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                          weight_decay=args.weight_decay, exact_every=args.loro_exact_every, lr_scale=args.loro_lr_scale,
                          decay_parameter_names=decay_parameter_names, epsilon_placement=args.adam_epsilon_placement)


__all__ = ["EPSILON_PLACEMENTS", "LOWRANK_OPTIMIZERS", "LORO_WITHOUT_DEEPSPEED", "LoroAdamW", "check_loro_model", "check_loro_training",
           "factor_pairs", "loro_optimizer", "optimizer_of_arguments", "restart_schedule_at_exact_steps"]
