"""The pipeline's messages, typed: what a micro-batch's forward and backward carry between the
driver and the stages, built on one side and checked once on the other.

`protocol` frames and encodes message bodies; this module says what the pipelined bodies hold. A
`Forward` travels from the driver to stage 0, from stage to stage (the main value to the next
stage, residual variables to the stages that import them) and, as a RESULT, from the last stage
back to the driver. A `Backward` travels the other way, and stage 0's reaches the driver as DONE.
`from_body` is the only place a received body is checked: a malformed one raises
`lightning_remote_mp.errors.ProtocolError` whoever sent it, and nothing in it is executed.

>>> from lightning_remote_mp.flow import DRIVER
>>> m = Forward(key="net", call=3, mb=0, sender=DRIVER, x=torch.ones(2, 4), requires_grad={"x": True})
>>> Forward.from_body(m.body()).requires_grad
{'x': True}
>>> Forward.from_body({"key": "net", "call": "3"})
Traceback (most recent call last):
...
lightning_remote_mp.errors.ProtocolError: forward message: field 'call' must be an int, got str
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.flow import is_main


def _field(what: str, body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in body or body[name] is None:
        if default is ...:
            raise ProtocolError(f"{what} message: field {name!r} is missing")
        return default
    value = body[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ProtocolError(f"{what} message: field {name!r} must be {_a(expected)}, got {type(value).__name__}")
    return value


def _dict_body(what: str, body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProtocolError(f"{what} message: the body must be a dict")
    return body


def _a(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _tensors(what: str, body: dict[str, Any], name: str) -> dict[str, torch.Tensor | None]:
    """A ``{name: tensor}`` field (values may be ``None`` where no gradient exists)."""
    value = _field(what, body, name, dict, {})
    for k, v in value.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, torch.Tensor)):
            raise ProtocolError(f"{what} message: {name!r} must map names to tensors")
    return value


def _flags(what: str, body: dict[str, Any]) -> dict[str, Any]:
    """``requires_grad``: a bool per variable, and for the main value a bool or one per element."""
    value = _field(what, body, "requires_grad", dict, {})
    for k, v in value.items():
        per_element = isinstance(v, list) and all(type(f) is bool for f in v)
        if not isinstance(k, str) or not (isinstance(v, bool) or per_element):
            raise ProtocolError(f"{what} message: 'requires_grad' must map names to bools")
    return value


def _autocast(what: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """``{"enabled": bool, "dtype": a torch dtype or None}``, or ``None``."""
    value = _field(what, body, "autocast", dict, None)
    if value is not None and not (
        type(value.get("enabled")) is bool and (value.get("dtype") is None or isinstance(value["dtype"], torch.dtype))
    ):
        raise ProtocolError(f"{what} message: 'autocast' must be {{'enabled': bool, 'dtype': a torch dtype}}")
    return value


def _fence(what: str, body: dict[str, Any]) -> dict[int, int]:
    """``fence``: stage number -> the id of a driver request to that stage's worker."""
    value = _field(what, body, "fence", dict, {})
    for k, v in value.items():
        if type(k) is not int or type(v) is not int or v < 0:
            raise ProtocolError(f"{what} message: 'fence' must map stage numbers to request ids")
    return value


def _count(what: str, body: dict[str, Any]) -> int:
    """``microbatches``: a positive count (1 where a sender leaves it out)."""
    value = _field(what, body, "microbatches", int, 1)
    if value < 1:
        raise ProtocolError(f"{what} message: 'microbatches' must be at least 1, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class _Pipelined:
    """What every pipelined message carries: whose micro-batch it is and who sent it.

    Attributes:
        key: the SpecSequential's name (which stage of this worker).
        call: the driver's forward call; ``mb``: the micro-batch within it.
        sender: the sending stage's number, or `DRIVER`.
        sent_at: when it was sent (wall clock), while a timeline records.
        fence: for each stage, the id of the last request the driver sent its worker without
            waiting for the reply (the optimizer's step, zero_grad) before this micro-batch; the
            stage runs the micro-batch only once it has run that request (it could arrive later
            than the micro-batch, which comes from another worker). Stages pass it on unchanged.
        microbatches: how many micro-batches the call has (on this replica). The stage that
            answers the driver (the last one's RESULTs, stage 0's DONEs) sends its answers for a
            call together, in one message, once it has them all: the driver needs them all before
            it goes on, and each message costs both sides a send and a wake-up. Stages pass it on.
    """

    key: str
    call: int
    mb: int
    sender: int
    sent_at: float | None = None
    fence: dict[int, int] = dataclasses.field(default_factory=dict)
    microbatches: int = 1

    def _header(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "call": self.call,
            "mb": self.mb,
            "from": self.sender,
            "sent_at": self.sent_at,
            "fence": self.fence,
            "microbatches": self.microbatches,
        }

    @staticmethod
    def _checked_header(what: str, body: Any) -> dict[str, Any]:
        """The header fields of a received ``body``, as constructor arguments; raises `ProtocolError`."""
        body = _dict_body(what, body)
        return {
            "key": _field(what, body, "key", str),
            "call": _field(what, body, "call", int),
            "mb": _field(what, body, "mb", int),
            "sender": _field(what, body, "from", int),
            "sent_at": body["sent_at"] if isinstance(body.get("sent_at"), float) else None,
            "fence": _fence(what, body),
            "microbatches": _count(what, body),
        }


@dataclasses.dataclass(frozen=True)
class Forward(_Pipelined):
    """One micro-batch's forward input to a stage (or a stage's output, to the next or the driver).

    Attributes:
        key, call, mb, sender, sent_at: see `_Pipelined`.
        x: the main value (a tensor, or a tuple of tensors for a traced model), for the next stage
            only; ``None`` in a message that carries only residual variables.
        vars: the residual variables this receiver imports from the sender.
        requires_grad: which of ``x`` (key ``"x"``) and ``vars`` need a gradient back.
        grad: whether the forward runs under grad (the stages keep what backward needs).
        autocast: the driver's autocast state (``{"enabled", "dtype"}``), or ``None``.
        modes: the driver-side layers' train/eval flags (`lightning_remote_mp.model.spec.Modes`).
        checkpoint: recompute this micro-batch's forward at backward.
    """

    x: Any = None
    vars: dict[str, Any] = dataclasses.field(default_factory=dict)
    requires_grad: dict[str, Any] = dataclasses.field(default_factory=dict)
    grad: bool = False
    autocast: dict[str, Any] | None = None
    modes: bool | list[Any] | None = None
    checkpoint: bool = False

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {
            **self._header(),
            "x": self.x,
            "vars": self.vars,
            "requires_grad": self.requires_grad,
            "grad": self.grad,
            "autocast": self.autocast,
            "modes": self.modes,
            "checkpoint": self.checkpoint,
        }

    @classmethod
    def from_body(cls, body: Any) -> Forward:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = "forward"
        header = cls._checked_header(what, body)
        x = body.get("x")
        if x is not None and not is_main(x):
            raise ProtocolError(f"{what} message: 'x' must be a tensor or a tuple of tensors")
        modes = body.get("modes")
        return cls(
            **header,
            x=x,
            vars=_tensors(what, body, "vars"),
            requires_grad=_flags(what, body),
            grad=body.get("grad") is True,
            autocast=_autocast(what, body),
            modes=modes if isinstance(modes, (bool, list)) else None,
            checkpoint=body.get("checkpoint") is True,
        )


@dataclasses.dataclass(frozen=True)
class Backward(_Pipelined):
    """One micro-batch's gradients, from a stage's consumers back to it (and from stage 0 to the driver).

    Attributes:
        key, call, mb, sender, sent_at: see `_Pipelined`.
        grad_out: the gradient of the main value the sender received from this stage (``None``
            when it needs none; a tuple for a traced model's tuple).
        grads: the gradients of the residual variables the sender imported from this stage.
    """

    grad_out: Any = None
    grads: dict[str, Any] = dataclasses.field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {**self._header(), "grad_out": self.grad_out, "grads": self.grads}

    @classmethod
    def from_body(cls, body: Any) -> Backward:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = "backward"
        header = cls._checked_header(what, body)
        grad_out = body.get("grad_out")
        if grad_out is not None and not (
            isinstance(grad_out, torch.Tensor)
            or (isinstance(grad_out, tuple) and all(g is None or isinstance(g, torch.Tensor) for g in grad_out))
        ):
            raise ProtocolError(f"{what} message: 'grad_out' must be a tensor, a tuple of tensors or None")
        return cls(**header, grad_out=grad_out, grads=_tensors(what, body, "grads"))
