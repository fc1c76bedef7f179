"""Layers for specs that torch.nn lacks: residual joins, causal masks, learned positions. Every
worker may build them.

>>> import torch
>>> layer = WrappedLinear(4, 4, out_variables=["skip"])
>>> out, variables = layer(torch.ones(2, 4))
>>> [name for name, _ in variables]
['skip']
>>> _, [(name, mask)] = CausalMask()(torch.zeros(2, 3, 8))  # (batch, sequence, features)
>>> name, mask.shape
('mask', torch.Size([3, 3]))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class WrappedLinear(nn.Linear):
    """A ``Linear`` whose output adds its dependency tensors and can be published as variables.

    With ``dependencies``, ``forward(x, *residuals)`` returns ``linear(x) + sum(residuals)``.
    With ``out_variables``, it returns ``(out, [(name, out) for name in out_variables])``: this is
    the residual layer of the original DistributedTraining design.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        out_variables: Sequence[str] = (),
        dependencies: Sequence[str] = (),
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.out_variables = list(out_variables)
        self.dependencies = list(dependencies)

    def forward(self, x: torch.Tensor, *residuals: torch.Tensor):  # type: ignore[override]
        out = sum(residuals, super().forward(x))
        if self.out_variables:
            return out, [(name, out) for name in self.out_variables]
        return out

    def extra_repr(self) -> str:
        extra = super().extra_repr()
        if self.out_variables:
            extra += f", out_variables={self.out_variables}"
        if self.dependencies:
            extra += f", dependencies={self.dependencies}"
        return extra


class CausalMask(nn.Module):
    """Passes its input on and publishes the causal attention mask of its sequence length (dimension 1
    of a batch-first input) under ``out_variables``: a ``(T, T)`` float mask, ``-inf`` above the
    diagonal, that ``nn.TransformerEncoderLayer`` takes as its second positional argument (``src_mask``)
    and HuggingFace blocks as ``attention_mask``. Later layers receive it with ``"dependencies"``.
    """

    def __init__(self, out_variables: Sequence[str] = ("mask",)) -> None:
        super().__init__()
        self.out_variables = list(out_variables)

    def forward(self, x: torch.Tensor):
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        return x, [(name, mask) for name in self.out_variables]


class PositionalEmbedding(nn.Module):
    """Adds a learned position embedding to a batch-first ``(batch, sequence, dim)`` input."""

    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(max_len, dim) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight[: x.shape[1]]


class Add(nn.Module):
    """The join of a residual block: ``x + projection(sum(residuals))``.

    The residuals come from ``"dependencies"`` in the spec entry. ``projection`` (e.g. a strided
    1x1 ``Conv2d`` for a downsampling block, spelled ``{"object": "torch.nn.Conv2d", "kwargs": {...}}``
    in a spec) maps the skip path to the block's output shape; by default it is the identity.
    """

    def __init__(self, projection: nn.Module | None = None) -> None:
        super().__init__()
        self.projection = projection

    def forward(self, x: torch.Tensor, *residuals: torch.Tensor) -> torch.Tensor:
        if not residuals:
            return x
        skip = sum(residuals[1:], residuals[0])
        return x + (self.projection(skip) if self.projection is not None else skip)
