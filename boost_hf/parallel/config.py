"""``ParallelConfig``: how a model is laid out across the tensor-parallel group.

All fields are validated here, once, with errors that say what to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

TPStyle = Literal["btp", "vanilla", "megatron"]
RMSNormMode = Literal["online", "sync", "local"]
CheckpointingMode = Literal["none", "full", "lowrank"]
SEQUENCE_PARALLEL_STYLES: tuple[str, ...] = ("megatron", "btp")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor-parallel layout of a :class:`~boost_hf.BoostLlamaForCausalLM`.

    Args:
        tp_size: ranks per tensor-parallel group (must divide the world size).
        tp_style: ``"btp"`` bottleneck-aware TP (A row-parallel, B column-parallel, residual stream
            sharded along d, r-dim latents replicated); ``"vanilla"`` the paper's naive low-rank TP (each
            (A, B) pair a Megatron MLP: A column-split along r, B row-split, full-width all-reduce);
            ``"megatron"`` classic TP of a full-rank model. Default: ``"btp"`` for low-rank models.
        rmsnorm: BTP only. ``"online"`` (exact; the norm statistics travel in the same all-reduce as the
            next A's partial output), ``"sync"`` (exact; one extra all-reduce of N scalars per norm) or
            ``"local"`` (APPROXIMATE: normalises each d/p shard by its own statistics, a group norm that
            changes the model with tp_size; never the default).
        group_linears: low-rank layouts run the A's that share an input (A_qkv, A_gate_up) as one GEMM
            with one collective (and, under BTP, copy the latents their B's read in one collective);
            Megatron runs q/k/v and gate/up as one GEMM each (one collective either way). The parameters a
            group reads together are stored as row blocks of one buffer (no copy per step); checkpoint names
            and parameters are unchanged.
        activation_checkpointing: ``"none"``; ``"full"`` (recompute each decoder layer, re-running its
            forward collectives); ``"lowrank"`` (save only r-dim latents and the residual; under BTP the
            recomputation issues no collective).
        sequence_parallel: ``"megatron"``: Megatron-LM's sequence parallelism: the residual stream, its norms
            and residual adds run on this rank's ``N/p`` tokens; each all-reduce of a layer becomes a
            reduce-scatter over tokens (after o and down) plus an all-gather (before q/k/v and gate/up): the
            same bytes, ``1/p`` of the element-wise work and of the residual kept for backward. ``"btp"``:
            latent sequence parallelism: each latent all-reduce becomes a
            reduce-scatter over tokens, the latent element-wise work runs on ``N/p`` tokens, and an all-gather
            feeds the B's (the residual stays sharded along ``d``). The sequence length of each micro-batch
            must be divisible by ``tp_size`` (checked at each forward); for generation (one new token per
            step) turn it off. A no-op at ``tp_size=1``; not supported by ``"vanilla"``.
    """

    tp_size: int = 1
    tp_style: TPStyle = "btp"
    rmsnorm: RMSNormMode = "online"
    group_linears: bool = True
    activation_checkpointing: CheckpointingMode = "none"
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}.")
        for field, kind in (("tp_style", TPStyle), ("rmsnorm", RMSNormMode), ("activation_checkpointing", CheckpointingMode)):
            if getattr(self, field) not in get_args(kind):
                raise ValueError(f"Unknown {field} {getattr(self, field)!r}: use one of {', '.join(get_args(kind))}.")
        if not isinstance(self.group_linears, bool):
            raise ValueError(f"group_linears must be True or False, got {self.group_linears!r}.")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}.")
        if self.sequence_parallel and self.tp_style not in SEQUENCE_PARALLEL_STYLES:
            raise ValueError(
                f"sequence_parallel=True is not supported by tp_style={self.tp_style!r} yet (only by "
                f"{', '.join(map(repr, SEQUENCE_PARALLEL_STYLES))}): set sequence_parallel=False."
            )

    @property
    def shards_tokens(self) -> bool:
        """Sequence parallelism is on and there is more than one rank to shard the tokens over."""
        return self.sequence_parallel and self.tp_size > 1

    def check_model(self, config) -> None:
        """Raise ``ValueError`` naming the field to change if this layout cannot hold ``config``."""
        from .parallelize import layout_for

        layout_for(config, self)

    # The single-device model file calls these three (it never imports boost-hf itself).
    def single_device_skeleton(self):
        """Context in which the single-device modules are built on the meta device, uninitialised."""
        from .parallelize import single_device_skeleton

        return single_device_skeleton()

    def parallelize(self, model):
        """Shard ``model`` in place for this rank (see :func:`boost_hf.parallel.parallelize`)."""
        from .parallelize import parallelize

        return parallelize(model, self)

    def load_pretrained(self, model_class, pretrained_model_name_or_path, *model_args, **kwargs):
        """``model_class.from_pretrained(..., parallel_config=self)``: this rank's shard, reading only this
        rank's slices (see :func:`boost_hf.parallel.weights_io.load_pretrained`)."""
        from .weights_io import load_pretrained

        return load_pretrained(model_class, pretrained_model_name_or_path, self, *model_args, **kwargs)

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = ["ParallelConfig", "TPStyle", "RMSNormMode", "CheckpointingMode"]
