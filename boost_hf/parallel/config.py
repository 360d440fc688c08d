"""``ParallelConfig``: how a model is laid out across the tensor-parallel group.

All fields are validated here, once, with errors that say what to change.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

TPStyle = Literal["btp", "vanilla", "megatron"]
RMSNormMode = Literal["online", "sync", "local"]
CheckpointingMode = Literal["none", "full", "lowrank"]


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
        group_linears: concatenate the A's that share an input (A_qkv, A_gate_up) into one GEMM and one
            collective, and run equally-shaped B's as one batched GEMM. Checkpoint names are unchanged.
        activation_checkpointing: ``"none"``; ``"full"`` (recompute each decoder layer, re-running its
            forward collectives); ``"lowrank"`` (save only r-dim latents and the residual; under BTP the
            recomputation issues no collective).
    """

    tp_size: int = 1
    tp_style: TPStyle = "btp"
    rmsnorm: RMSNormMode = "online"
    group_linears: bool = True
    activation_checkpointing: CheckpointingMode = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}.")
        for field, kind in (("tp_style", TPStyle), ("rmsnorm", RMSNormMode), ("activation_checkpointing", CheckpointingMode)):
            if getattr(self, field) not in get_args(kind):
                raise ValueError(f"Unknown {field} {getattr(self, field)!r}: use one of {', '.join(get_args(kind))}.")
        if not isinstance(self.group_linears, bool):
            raise ValueError(f"group_linears must be True or False, got {self.group_linears!r}.")

    def check_model(self, config) -> None:
        """Raise ``ValueError`` if this layout cannot hold ``config`` (a ``BoostLlamaConfig``)."""
        p = self.tp_size
        if config.bottleneck is None and self.tp_style != "megatron" and p > 1:
            raise ValueError(
                f"tp_style={self.tp_style!r} needs a low-rank model (bottleneck svd/cola/lax); "
                "the full-rank model (bottleneck=None) uses tp_style='megatron'."
            )
        if config.bottleneck is not None and self.tp_style == "megatron":
            raise ValueError(
                f"tp_style='megatron' is the full-rank layout; for bottleneck={config.bottleneck!r} "
                "use tp_style='btp' (or 'vanilla' for the naive baseline)."
            )
        if self.activation_checkpointing == "lowrank" and config.bottleneck is None:
            raise ValueError(
                "activation_checkpointing='lowrank' cuts at r-dim latents and needs a low-rank model; "
                "use 'full' for the full-rank model."
            )
        if p == 1:
            return
        for name, value in (("num_attention_heads", config.num_attention_heads), ("num_key_value_heads", config.num_key_value_heads)):
            if value % p != 0:
                raise ValueError(f"{name} ({value}) is not divisible by tp_size ({p}): choose a tp_size that divides it.")
        if config.vocab_size % p != 0:
            raise ValueError(
                f"vocab_size ({config.vocab_size}) is not divisible by tp_size ({p}): pad the vocabulary "
                f"to a multiple of {p} (e.g. {-(-config.vocab_size // p) * p})."
            )
        if self.tp_style == "btp" and config.tie_word_embeddings:
            raise ValueError(
                "tie_word_embeddings=True cannot be combined with tp_style='btp' at tp_size > 1 (the embedding is "
                "split along d, the LM head along the vocabulary): set tie_word_embeddings=False."
            )
        if self.tp_style in ("btp", "megatron"):
            dims = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size}
        else:
            dims = {"rank": config.rank}
        for name, value in dims.items():
            if value % p != 0:
                raise ValueError(
                    f"{name} ({value}) is not divisible by tp_size ({p}), which tp_style={self.tp_style!r} "
                    "splits: choose a tp_size that divides it."
                )

    def to_dict(self) -> dict:
        return asdict(self)


__all__ = ["ParallelConfig", "TPStyle", "RMSNormMode", "CheckpointingMode"]
