"""GRADS: the operations the driver asks of the workers on an optimizer's gradients across stages
and replicas: their norms and scaling (``clip_grad_norm_``), clamping (``clip_grad_value_``), and
the sum over replicas. One request kind, whose ``op`` names the operation; `Grads.from_body` reads a
body as the operation it names.

>>> Grads.from_body(GradClamp(0, 0.5).body())
GradClamp(index=0, value=0.5)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.body import Body, refuse


class Grads(Body, frozen=True, tag_field="op"):
    """GRADS: one operation on the gradients of optimizer ``index``'s parameters, for clipping and
    replicas across workers. The operations are its subclasses (`GradNorms`, `GradScale`,
    `GradClamp`, `GradAllreduce`), each named by its ``op`` (its tag); `from_body` returns the one a
    body's ``op`` names."""

    KIND: ClassVar[str] = protocol.GRADS

    index: int

    def body(self) -> dict[str, Any] | None:
        written = super().body() or {}
        return {"index": written.pop("index"), "op": self.__struct_config__.tag, **written}

    @classmethod
    def from_body(cls, body: Any) -> Grads:  # type: ignore[override]
        """A received body, checked, as the operation it names; raises `ProtocolError` if it is malformed."""
        if cls is not Grads:
            return super().from_body(body)
        if not isinstance(body, dict):
            raise refuse(cls.KIND, "the body must be a dict")
        op = body.get("op")
        if op is None:
            raise refuse(cls.KIND, "field 'op' is missing")
        if not isinstance(op, str) or op not in _GRAD_OPS:
            raise refuse(cls.KIND, f"field 'op' must be one of {', '.join(map(repr, _GRAD_OPS))}, got {op!r:.40}")
        return _GRAD_OPS[op].from_body(body)


class GradNorms(Grads, frozen=True, tag="norms"):
    """``op="norms"``: each gradient's ``norm_type`` norm (for ``clip_grad_norm_`` across stages)."""

    norm_type: float


class GradScale(Grads, frozen=True, tag="scale"):
    """``op="scale"``: multiply every gradient by ``coef``, a scalar tensor (the clipping coefficient)."""

    coef: torch.Tensor

    def __post_init__(self) -> None:
        if self.coef.dim() != 0 or not self.coef.is_floating_point():
            raise ValueError("field 'coef' must be a floating-point scalar tensor")


class GradClamp(Grads, frozen=True, tag="clamp"):
    """``op="clamp"``: clamp every gradient to ``[-value, value]`` (``clip_grad_value_``)."""

    value: float


class GradAllreduce(Grads, frozen=True, tag="allreduce"):
    """``op="allreduce"``: sum the gradients over the stage's replicas (`GroupInit` joined them)."""


#: The operations, by their ``op`` (each's tag).
_GRAD_OPS: dict[str, type[Grads]] = {
    str(c.__struct_config__.tag): c for c in (GradNorms, GradScale, GradClamp, GradAllreduce)
}
