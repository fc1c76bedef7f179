"""Layers the tests ship to workers (allowed there with --allow-module lrmp_testlayers)."""

from __future__ import annotations

import os

import torch
from torch import nn


class PidProbe(nn.Module):
    """Identity that records, in a buffer, the id of the process that last ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pid", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pid.fill_(os.getpid())
        return x


class ScaleBy(nn.Module):
    """Multiplies by a learnable scalar; with ``dependencies`` adds them, with ``out_variables`` publishes."""

    def __init__(self, init: float = 1.0, out_variables=(), dependencies=()) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(init)))
        self.out_variables = list(out_variables)
        self.dependencies = list(dependencies)

    def forward(self, x, *residuals):
        out = x * self.scale
        for r in residuals:
            out = out + r
        if self.out_variables:
            return out, [(n, out) for n in self.out_variables]
        return out
