"""The compute side of one rank's decoder layer: the kernels' efficiency, the GEMMs with their local shapes, and the
element-wise traffic (the time model of :mod:`boost_hf.perf.estimator`, whose docstring states the formulas and the
calibration of :data:`CALIBRATED_EFFICIENCY`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.config import ParallelConfig
from ..parallel.layouts import Gemm, layout_for


@dataclass(frozen=True)
class KernelEfficiency:
    """Fractions of the hardware peaks that kernels reach (see the module docstring).

    Args:
        gemm_max: fraction of peak FLOP/s of a large bf16 GEMM.
        gemm_half_dim: GEMM dimension at which efficiency halves (the others large).
        attention: fraction of peak FLOP/s of (flash) attention, forward and backward.
        memory: fraction of HBM bandwidth reached by memory-bound kernels (elementwise, optimizer).
    """

    gemm_max: float
    gemm_half_dim: float
    attention: float
    memory: float

    def __post_init__(self) -> None:
        for name in ("gemm_max", "attention", "memory"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"KernelEfficiency.{name} must be in (0, 1], got {getattr(self, name)!r}.")
        if self.gemm_half_dim < 0:
            raise ValueError(f"KernelEfficiency.gemm_half_dim must be >= 0, got {self.gemm_half_dim!r}.")

    def gemm(self, m: int, k: int, n: int) -> float:
        """Fraction of peak reached by an ``(m, k) x (k, n)`` GEMM."""
        return self.gemm_max / (1.0 + self.gemm_half_dim * (1.0 / m + 1.0 / k + 1.0 / n))


# Fitted once to the paper's A100 ratios (module docstring); used for every model, layout and GPU.
CALIBRATED_EFFICIENCY = KernelEfficiency(gemm_max=0.75, gemm_half_dim=320.0, attention=0.60, memory=0.70)


def layer_gemms(config, parallel: ParallelConfig, tokens: int, *, crossing: bool = True) -> list[Gemm]:
    """The GEMMs of one decoder layer's forward on one rank, with their local shapes (the layout's,
    :meth:`~boost_hf.parallel.layouts.Layout.local_gemms`), plus LaX's crossings (``crossing`` and
    ``bottleneck == "lax"``), which act on the full, replicated ``r`` (on this rank's ``N/p`` tokens under
    BTP's latent sequence parallelism)."""
    crossing_tokens = tokens // parallel.tp_size if parallel.sequence_parallel else tokens  # (at tp_size 1: all of them)
    return layout_for(config, parallel).local_gemms(config, tokens) + _crossing_gemms(config, crossing_tokens, crossing)


def _crossing_gemms(config, tokens: int, crossing: bool) -> list[Gemm]:
    if not crossing or config.bottleneck != "lax" or config.lax_gate == "identity":
        return []
    r = config.rank
    if config.lax_gate == "dense":
        return [Gemm(f"{name}.G", tokens, r, r, "crossing") for name in config.projection_shapes()]
    # (L kron R) h with L: a x a, R: b x b is two small GEMMs over the latent viewed as (a, b) matrices.
    a, b = config.kronecker_factors
    gemms = []
    for name in config.projection_shapes():
        gemms += [Gemm(f"{name}.G_left", tokens * b, a, a, "crossing"), Gemm(f"{name}.G_right", tokens * a, b, b, "crossing")]
    return gemms


def elementwise_elements_per_token(config, parallel: ParallelConfig) -> float:
    """Elements read + written per token of the micro-batch by one layer's elementwise forward ops on one
    rank.

    2 RMSNorms (read, write) and 2 residual adds (2 reads, 1 write) on the residual width the layout
    holds; RoPE on the local q and k; the latent activation of each of the 7 latents; LaX crossing add
    (3) and latent LayerNorm (2) on the full ``r``; the SwiGLU product (3) and gate activation (2, when
    kept) on the local ``f``; with the online norm of a sharded residual, the scaling of the reduced
    A_qkv and A_gate_up latents by ``1/rms`` (read, write).

    Sequence parallelism runs the work the layout otherwise repeats on every rank on ``N/p`` tokens: the
    norms and residual adds of megatron's replicated residual, and BTP's latent work (activation, LaX
    crossing and LayerNorm, ``1/rms`` scale); per token of the micro-batch that is ``1/p`` of it.
    """
    layout = layout_for(config, parallel)
    widths, r = layout.widths(config), config.rank
    residual = 2 * 2 * widths.residual + 2 * 3 * widths.residual
    rest = 2 * (widths.q + widths.k) + 3 * widths.mlp
    if config.mlp_activation is not None:
        rest += 2 * widths.mlp
    latent_width, latent = widths.latent, 0
    if config.bottleneck == "lax":
        # the crossing and LayerNorm act on the full r (vanilla gathers it)
        latent += 7 * (3 + (2 if config.lax_latent_norm else 0)) * r
        latent_width = r
    if config.latent_activation is not None:
        latent += 7 * 2 * latent_width
    if layout.residual_sharded and parallel.rmsnorm == "online" and parallel.tp_size > 1:
        latent += 2 * (3 * r + 2 * r)
    if layout.sequence_parallel:
        if layout.residual_sharded:
            latent /= parallel.tp_size
        else:
            residual /= parallel.tp_size
    return residual + rest + latent



__all__ = ["CALIBRATED_EFFICIENCY", "KernelEfficiency", "elementwise_elements_per_token", "layer_gemms"]
