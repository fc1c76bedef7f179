"""The shared vocabulary of what flows between the driver and the stages, named once for every layer.

- `Main`: what travels from stage to stage, a tensor or, for a traced model, a tuple of tensors;
- `DRIVER`: the stage number that stands for the driver in a pipelined message and in a stage's routes;
- `Routes`: a stage's forward routes, ``(stage, variable names)`` pairs;
- `SplitBackward`: whether stages defer linear layers' weight gradients;
- `Word`: the base of the Enums whose members are words of the wire (message and action kinds).

The wire, the model, the driver and the worker all speak these words; none of them owns them, so
they live here, below every layer.

>>> is_main((torch.ones(2), torch.zeros(2))), is_main([torch.ones(2)])
(True, False)
>>> is_split_backward("auto"), is_split_backward("yes")
(True, False)
"""

from __future__ import annotations

import enum
from typing import Any, Literal, TypeGuard

import torch

#: What flows from stage to stage: a tensor, or for a traced model a tuple of tensors (its live values).
Main = torch.Tensor | tuple[torch.Tensor, ...]

#: The stage number of the driver in a pipelined message's ``from`` (and in a stage's routes).
DRIVER = -1

#: A stage's forward routes: ``(stage, variable names)`` pairs (`lightning_remote_mp.model.partition.Stage`).
Routes = tuple[tuple[int, tuple[str, ...]], ...]

#: ``split_backward``: defer every eligible linear layer's weight gradient (``True``), none
#: (``False``), or only those large enough to repay it (``"auto"``; `worker.deferred_grads`).
SplitBackward = bool | Literal["auto"]


def is_main(value: Any) -> bool:
    """Whether ``value`` is a `Main`: a tensor or a non-empty tuple of tensors."""
    if isinstance(value, tuple):
        return bool(value) and all(isinstance(t, torch.Tensor) for t in value)
    return isinstance(value, torch.Tensor)


def is_floating(t: torch.Tensor) -> bool:
    """Whether ``t`` can carry a gradient (floating point or complex)."""
    return t.is_floating_point() or t.is_complex()


def is_split_backward(value: Any) -> TypeGuard[SplitBackward]:
    """Whether ``value`` is ``True``, ``False`` or ``"auto"``."""
    return isinstance(value, bool) or (isinstance(value, str) and value == "auto")


class Word(str, enum.Enum):
    """An Enum of strings: a member compares, hashes and prints as its value, and travels as it
    (`lightning_remote_mp.wire.protocol.Kind`, `lightning_remote_mp.schedule.Kind`), so a received
    plain string meets it as an equal."""

    __str__ = str.__str__
    __repr__ = str.__repr__
    __format__ = str.__format__
    __hash__ = str.__hash__
