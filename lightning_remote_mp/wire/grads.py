"""GRADS: the operations the driver asks of the workers on an optimizer's gradients across stages
and replicas: their norms and scaling (``clip_grad_norm_``), clamping (``clip_grad_value_``), and
the sum over replicas. One request kind, whose ``op`` names the operation; `Grads.from_body` reads a
body as the operation it names.

>>> Grads.from_body(GradClamp(0, 0.5).body())
GradClamp(index=0, value=0.5)
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.fields import INT, TENSOR, Body, choice, field, number, refuse

_INDEX = field(INT)  # the optimizer's position among the driver's optimizers


def _grad_op(kind: str, name: str, value: Any) -> str:
    return choice(list(_GRAD_OPS))(kind, name, value)


@dataclasses.dataclass(frozen=True)
class Grads(Body):
    """GRADS: one operation on the gradients of optimizer ``index``'s parameters, for clipping and
    replicas across workers. The operations are its subclasses (`GradNorms`, `GradScale`,
    `GradClamp`, `GradAllreduce`), each named by its ``op``; `from_body` returns the one a body's
    ``op`` names."""

    KIND: ClassVar[str] = protocol.GRADS

    index: int = _INDEX
    op: str = field(_grad_op, init=False, repr=False)

    @classmethod
    def from_body(cls, body: Any) -> Grads:  # type: ignore[override]
        """A received body, checked, as the operation it names; raises `ProtocolError` if it is malformed."""
        if cls is not Grads:
            return super().from_body(body)
        return _GRAD_OPS[cls._read(body)["op"]].from_body(body)


@dataclasses.dataclass(frozen=True)
class GradNorms(Grads):
    """``op="norms"``: each gradient's ``norm_type`` norm (for ``clip_grad_norm_`` across stages)."""

    op: str = field(_grad_op, default="norms", init=False, repr=False)
    norm_type: float = field(number)


def _coef(kind: str, name: str, value: Any) -> torch.Tensor:
    if TENSOR(kind, name, value).dim() != 0 or not value.is_floating_point():
        raise refuse(kind, f"field {name!r} must be a floating-point scalar tensor")
    return value


@dataclasses.dataclass(frozen=True)
class GradScale(Grads):
    """``op="scale"``: multiply every gradient by ``coef``, a scalar tensor (the clipping coefficient)."""

    op: str = field(_grad_op, default="scale", init=False, repr=False)
    coef: torch.Tensor = field(_coef)


@dataclasses.dataclass(frozen=True)
class GradClamp(Grads):
    """``op="clamp"``: clamp every gradient to ``[-value, value]`` (``clip_grad_value_``)."""

    op: str = field(_grad_op, default="clamp", init=False, repr=False)
    value: float = field(number)


@dataclasses.dataclass(frozen=True)
class GradAllreduce(Grads):
    """``op="allreduce"``: sum the gradients over the stage's replicas (`GroupInit` joined them)."""

    op: str = field(_grad_op, default="allreduce", init=False, repr=False)


_GRAD_OPS: dict[str, type[Grads]] = {c.op: c for c in (GradNorms, GradScale, GradClamp, GradAllreduce)}  # type: ignore[misc]
