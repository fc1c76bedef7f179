"""Layers that speak the residual-variable convention, ready for specs; every worker may build them.

>>> import torch
>>> layer = WrappedLinear(4, 4, out_variables=["skip"])
>>> out, variables = layer(torch.ones(2, 4))
>>> [name for name, _ in variables]
['skip']
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
        out = super().forward(x)
        for r in residuals:
            out = out + r
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
