"""Tensor-train projections of the boost-hf LLaMA (the BOOST release's ``TensorTrainLinear``).

A sibling of ``modeling_boost_llama.py`` that ships with it as remote code: it imports only ``torch`` and the
configuration. The cores are ``[rank_in, mode, rank_out]`` tensors (see
:class:`~.configuration_boost_llama.TensorTrainShape`); the projection contracts them into its two factors at every
call, so the model and the tensor-parallel layouts run it as any bottleneck ``y = B (A x)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_boost_llama import TensorTrainShape


def contract_cores(cores: list[torch.Tensor]) -> torch.Tensor:
    """Consecutive tensor-train cores ``[r_0, m_0, r_1], ..., [r_{k-1}, m_{k-1}, r_k]`` contracted over their shared
    ranks: the matrix ``[r_0 m_0 ... m_{k-1}, r_k]``, rows indexed by ``(r_0, m_0, ..., m_{k-1})`` row-major."""
    matrix = cores[0].reshape(-1, cores[0].shape[-1])
    for core in cores[1:]:
        matrix = (matrix @ core.reshape(core.shape[0], -1)).reshape(-1, core.shape[-1])
    return matrix


class BoostLlamaTensorTrainCores(nn.Module):
    """The cores of one tensor-train projection, ``[rank_in, mode, rank_out]`` each: parameters ``0``, ``1``, ...
    (``<projection>.cores.<i>``, as the release names them).

    Module call ``cores(start, stop)``: cores ``start .. stop - 1`` contracted (:func:`contract_cores`). A module
    call, so that what gathers a module's parameters before its forward (DeepSpeed ZeRO-3) gathers the cores."""

    def __init__(self, shapes: list[tuple[int, int, int]]):
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(str(i), nn.Parameter(torch.empty(shape)))

    def __len__(self) -> int:
        return len(self._parameters)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._parameters[str(i)]

    def __iter__(self):
        return iter(self._parameters.values())

    def forward(self, start: int, stop: int) -> torch.Tensor:
        return contract_cores([self[i] for i in range(start, stop)])

    def extra_repr(self) -> str:
        return ", ".join(f"{name}: {tuple(core.shape)}" for name, core in self._parameters.items())


class BoostLlamaTensorTrainLinear(nn.Module):
    """Tensor-train projection (the BOOST release's ``TensorTrainLinear``): ``y = (x A^T) B^T (+ bias)``.

    ``cores``: the input cores (modes of ``in_features``) then the output cores (modes of ``out_features``), see
    :class:`~.configuration_boost_llama.TensorTrainShape`. The input cores contract into ``A^T: [in_features, r]``,
    the output cores into ``B^T: [r, out_features]`` (``r`` the middle rank), both at every call, and the tokens
    go through two GEMMs, as the release's half reconstruction; nothing between the factors. ``A: [r, in_features]``
    and ``B: [out_features, r]`` are these reconstructions (properties, not parameters), so the tensor-parallel
    layouts run it as any bottleneck. ``bias: [out_features]`` after ``B``.
    """

    def __init__(self, in_features: int, out_features: int, tensor_train: TensorTrainShape, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.tensor_train = in_features, out_features, tensor_train
        self.rank = tensor_train.middle_rank
        self.cores = BoostLlamaTensorTrainCores(tensor_train.core_shapes)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @property
    def A(self) -> torch.Tensor:
        """``[r, in_features]``: the input cores contracted (rows of ``A^T`` indexed by the input modes)."""
        return self.cores(0, self.tensor_train.split).T

    @property
    def B(self) -> torch.Tensor:
        """``[out_features, r]``: the output cores contracted (columns of ``B^T`` indexed by the output modes)."""
        split = self.tensor_train.split
        rank = self.cores[split].shape[0]  # r, or the slice of it that a tensor-parallel rank holds
        return self.cores(split, len(self.cores)).reshape(rank, -1).T

    def latent(self, z: torch.Tensor) -> torch.Tensor:
        """The function between the factors: none."""
        return z

    def up(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.B, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(F.linear(x, self.A))

    def extra_repr(self) -> str:
        tt = self.tensor_train
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"modes={list(tt.input_modes)}x{list(tt.output_modes)}, ranks={list(tt.ranks)}, bias={self.bias is not None}"
        )


__all__ = ["BoostLlamaTensorTrainCores", "BoostLlamaTensorTrainLinear", "contract_cores"]
