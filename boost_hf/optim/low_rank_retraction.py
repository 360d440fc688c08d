"""LORO's exact step: the rank-r truncated SVD of ``W - lr P_T(G)`` for ``W = B A``, from the factors alone.

For one projection with ``B: [m, r]``, ``A: [r, n]`` and Adam directions ``D_B`` (like ``B``) and ``D_A`` (like
``A``), with ``U``, ``V`` orthonormal bases of the column space of ``B`` and of the row space of ``A``:

* the directions read as the two sides of a gradient ``G`` of ``W``: ``U^T G`` from ``D_A`` (``D_A = B^T G``) and
  ``G V`` from ``D_B`` (``D_B = G A^T``); the tangent vector at ``W`` is ``T = U (U^T G) + (I - U U^T)(G V) V^T``
  (for a true gradient, ``T = P_U G + G P_V - P_U G P_V``, the projection onto the tangent space of rank-r
  matrices; Mo et al., ICLR 2025);
* ``W - lr T = [U Q2] C [V Q1]^T`` with ``Q1``, ``Q2`` orthonormal bases of the parts of ``T`` outside ``V`` and
  ``U`` and a ``(2r x 2r)`` core ``C``; the SVD of ``C`` gives the truncated SVD of ``W - lr T`` and the new
  *balanced* factors ``B' = [U Q2] U_C S^1/2``, ``A' = S^1/2 V_C^T [V Q1]^T`` (``B'^T B' = A' A'^T = S``).

Every basis is implicit: everything follows from six ``r x r`` products per projection,
``B^T B``, ``D_B^T D_B``, ``B^T D_B``, ``A A^T``, ``D_A D_A^T``, ``D_A A^T``, which are sums over the rows of ``B``
and the columns of ``A``. Under bottleneck-aware TP each rank holds rows of ``B`` and columns of ``A``: it sums
its own rows and columns, **one all-reduce over the TP group** adds them (all the projections of a bucket in one
buffer, ``6 r^2`` float64 values each), every rank does the same ``r x r`` algebra in float64, and rebuilds its own
rows ``B'_i = B_i C_B + D_B,i C_DB`` and columns ``A'_j = C_A A_j + C_DA D_A,j``. No factor is gathered.

The ``r x r`` algebra is in float64 (a Gram matrix squares the condition number). Orthonormal bases come from the
eigendecomposition of the Gram matrices (the symmetric square root), which also covers rank-deficient factors
or directions (a zero gradient, a factor with zero columns): directions below float64 round-off are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel.primitives import reduce_from_tp

PRODUCTS = 6
"""r x r products per projection: ``B^T B``, ``D_B^T D_B``, ``B^T D_B``, ``A A^T``, ``D_A D_A^T``, ``D_A A^T``."""


@dataclass
class FactorPair:
    """One projection ``W = B A`` as this rank holds it: ``B`` its rows ``[m_i, r]``, ``A`` its columns ``[r, n_j]``,
    with their Adam directions ``direction_B`` / ``direction_A`` (same shapes), the step ``lr`` and the decoupled
    ``weight_decay`` applied to ``W``."""

    B: torch.Tensor
    A: torch.Tensor
    direction_B: torch.Tensor
    direction_A: torch.Tensor
    lr: float
    weight_decay: float = 0.0


def local_products(pair: FactorPair) -> torch.Tensor:
    """This rank's partial sums of the six ``r x r`` products, float64 ``[6, r, r]``."""
    B, dB = pair.B.double(), pair.direction_B.double()
    A, dA = pair.A.double(), pair.direction_A.double()
    return torch.stack([B.T @ B, dB.T @ dB, B.T @ dB, A @ A.T, dA @ dA.T, dA @ A.T])


def _basis(gram: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(R, R_pinv)`` for a Gram matrix ``Z^T Z`` ``[k, k]``: ``R = L^1/2 E^T`` ``[s, k]`` and ``R_pinv = E L^-1/2``
    ``[k, s]`` over the ``s`` eigenvalues above float64 round-off of ``scale``, so that ``Q = Z R_pinv`` is
    orthonormal and ``Z = Q R``."""
    eigenvalues, vectors = torch.linalg.eigh((gram + gram.T) / 2)
    keep = eigenvalues > gram.shape[0] * torch.finfo(torch.float64).eps * scale.clamp_min(torch.finfo(torch.float64).tiny)
    root = eigenvalues[keep].sqrt()
    vectors = vectors[:, keep]
    return (vectors * root).T, vectors / root


def retraction_coefficients(products: torch.Tensor, lr: float, weight_decay: float, rank: int) -> tuple[torch.Tensor, ...]:
    """From the summed products ``[6, r, r]`` (float64): ``(C_B, C_DB, C_A, C_DA)``, each ``[r, r]``, such that the
    new factors are ``B' = B C_B + D_B C_DB`` and ``A' = C_A A + C_DA D_A``. Replicated algebra, no communication."""
    BB, dBdB, BdB, AA, dAdA, dAA = products
    Rm, Rm_pinv = _basis(BB, BB.trace())  # B = U Rm
    Rn, Rn_pinv = _basis(AA, AA.trace())  # A^T = V Rn
    # X = U^T G = Rm_pinv^T D_A, Y = G V = D_B Rn_pinv (implicitly)
    K0 = Rm_pinv.T @ dAA @ Rn_pinv  # X V
    K0_right = Rm_pinv.T @ BdB @ Rn_pinv  # U^T Y
    XX = Rm_pinv.T @ dAdA @ Rm_pinv
    YY = Rn_pinv.T @ dBdB @ Rn_pinv
    # Y1 = X^T - V K0^T (the part of T's rows outside V), Y2 = Y - U K0_right (T's columns outside U)
    K1, K1_pinv = _basis(XX - K0 @ K0.T, XX.trace())  # Y1 = Q1 K1
    K2, K2_pinv = _basis(YY - K0_right.T @ K0_right, YY.trace())  # Y2 = Q2 K2
    s_b, s_a, t1, t2 = Rm.shape[0], Rn.shape[0], K1.shape[0], K2.shape[0]
    core = torch.zeros(s_b + t2, s_a + t1, dtype=torch.float64, device=products.device)
    core[:s_b, :s_a] = (1 - lr * weight_decay) * (Rm @ Rn.T) - lr * K0
    core[:s_b, s_a:] = -lr * K1.T
    core[s_b:, :s_a] = -lr * K2
    left, singular, right_t = torch.linalg.svd(core, full_matrices=False)
    k = min(rank, singular.shape[0])
    root = singular[:k].sqrt()
    left, right = left[:, :k] * root, right_t[:k].T * root  # [s_b + t2, k], [s_a + t1, k]
    top_b, bottom_b, top_a, bottom_a = left[:s_b], left[s_b:], right[:s_a], right[s_a:]
    # B' = U top_b + Q2 bottom_b with U = B Rm_pinv, Q2 = (D_B Rn_pinv - B Rm_pinv K0_right) K2_pinv
    C_B = Rm_pinv @ (top_b - K0_right @ K2_pinv @ bottom_b)
    C_DB = Rn_pinv @ K2_pinv @ bottom_b
    # A'^T = V top_a + Q1 bottom_a with V = A^T Rn_pinv, Q1 = (D_A^T Rm_pinv - A^T Rn_pinv K0^T) K1_pinv
    C_A = (Rn_pinv @ (top_a - K0.T @ K1_pinv @ bottom_a)).T
    C_DA = (Rm_pinv @ K1_pinv @ bottom_a).T
    pad = rank - k  # a retraction of rank < r: the missing singular directions are zero
    if pad:
        C_B, C_DB = (torch.nn.functional.pad(c, (0, pad)) for c in (C_B, C_DB))
        C_A, C_DA = (torch.nn.functional.pad(c, (0, 0, 0, pad)) for c in (C_A, C_DA))
    return C_B, C_DB, C_A, C_DA


@torch.no_grad()
def retract(pairs: list[FactorPair], group=None) -> None:
    """Replace each pair's ``B`` and ``A`` in place by the balanced factors of the rank-r truncated SVD of
    ``(1 - lr wd) B A - lr T`` (see the module docstring). ``group``: the TP group whose ranks hold the other rows
    of every ``B`` and columns of every ``A`` (``None``: this rank holds whole factors). Communication: one
    all-reduce of ``6 r^2 len(pairs)`` float64 values over ``group``."""
    if not pairs:
        return
    products = torch.stack([local_products(pair) for pair in pairs])  # [P, 6, r, r]
    products = reduce_from_tp(products, group)
    for pair, summed in zip(pairs, products):
        rank = pair.B.shape[1]
        C_B, C_DB, C_A, C_DA = retraction_coefficients(summed, pair.lr, pair.weight_decay, rank)
        new_B = pair.B.double() @ C_B + pair.direction_B.double() @ C_DB
        new_A = C_A @ pair.A.double() + C_DA @ pair.direction_A.double()
        pair.B.copy_(new_B)
        pair.A.copy_(new_A)


__all__ = ["FactorPair", "PRODUCTS", "local_products", "retraction_coefficients", "retract"]
