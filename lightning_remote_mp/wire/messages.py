"""The pipeline's messages, typed: what a micro-batch's forward and backward carry between the
driver and the stages, built on one side and checked once on the other.

`protocol` frames and encodes message bodies; this module says what the pipelined bodies hold. A
`Forward` travels from the driver to stage 0, from stage to stage (the main value to the next
stage, residual variables to the stages that import them) and, as a RESULT, from the last stage
back to the driver. A `Backward` travels the other way, and stage 0's reaches the driver as DONE.
Their fields are declared once, as types (`lightning_remote_mp.wire.body`): `from_body` is the only place a
received body is checked, and a malformed one raises `lightning_remote_mp.errors.ProtocolError`
whoever sent it; nothing in it is executed.

>>> from lightning_remote_mp.flow import DRIVER
>>> m = Forward(key="net", call=3, mb=0, sender=DRIVER, x=torch.ones(2, 4), requires_grad={"x": True})
>>> Forward.from_body(m.body()).requires_grad
{'x': True}
>>> Forward.from_body({"key": "net", "call": "3"})
Traceback (most recent call last):
...
lightning_remote_mp.errors.ProtocolError: forward message: field 'call': expected an int, got a str
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import torch

from lightning_remote_mp.flow import is_main
from lightning_remote_mp.schedule import SCHEDULES
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.body import Body, Count, Index, plain

#: A flag of ``requires_grad``: a bool per variable, and for the main value a bool or one per element.
Flag = bool | list[bool]


class Generation(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A step of a generation (`Forward.generation`), ``[id, capacity, rows]`` on the wire: its id,
    how many tokens its cache holds, and before this step, beam search's new order of the
    micro-batch's rows (or ``None``)."""

    id: Index
    capacity: int
    rows: list[Index] | None


class _Pipelined(Body, frozen=True):
    """What every pipelined message carries: whose micro-batch it is and who sent it.

    Attributes:
        key: the SpecSequential's name (which stage of this worker).
        call: the driver's forward call; ``mb``: the micro-batch within it.
        sender: the sending stage's number, or `lightning_remote_mp.flow.DRIVER` (``from`` on the wire).
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
    sender: int = msgspec.field(name="from")
    sent_at: float | None = None
    fence: dict[int, Index] = {}
    microbatches: Count = 1


class Forward(_Pipelined, frozen=True):
    """One micro-batch's forward input to a stage (or a stage's output, to the next or the driver).

    Attributes:
        key, call, mb, sender, sent_at, fence, microbatches: see `_Pipelined`.
        x: the main value (a tensor, or a tuple of tensors for a traced model), for the next stage
            only; ``None`` in a message that carries only residual variables.
        vars: the residual variables this receiver imports from the sender.
        requires_grad: which of ``x`` (key ``"x"``) and ``vars`` need a gradient back.
        grad: whether the forward runs under grad (the stages keep what backward needs).
        autocast: the driver's autocast state (``{"enabled": bool, "dtype": a torch dtype or None}``), or ``None``.
        modes: the driver-side layers' train/eval flags (`lightning_remote_mp.model.spec.Modes`).
        checkpoint: recompute this micro-batch's forward at backward.
        keep: for the model's output (the last stage's), which elements the last stage keeps
            instead of sending: the driver fetches them when they are read (`requests.Fetch`).
            Stages pass it on.
        shapes: in a RESULT, the shape of each element kept (by position); its place in ``x``
            holds an empty tensor of its dtype.
        schedule: for a call whose backward starts on the last stage (``loss_output``), the schedule
            (`lightning_remote_mp.schedule`) whose list of actions each stage runs; ``None``: GPipe's
            (the backward starts at the driver). Stages pass it on.
        loss_output: the position of the model's output that is the loss (a sum over the micro-batch):
            the last stage runs each micro-batch's backward as soon as its forward is done, with
            the loss's gradient taken as 1 (an "early" call); the driver's backward then brings the
            real gradient, the input of the call's S action (`requests.LossGrad`). Stages pass it on.
        generation: a step of ``generate()`` (`Generation`): the forward writes its keys and values
            to the stage's cache of that generation and micro-batch. Stages pass it on.
    """

    KIND: ClassVar[str] = protocol.FORWARD
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"keep", "shapes", "schedule", "loss_output", "generation"})
    WRITE: ClassVar[dict[str, Any]] = {
        "vars": plain,
        "requires_grad": plain,
        "fence": plain,
        "generation": lambda g: [g.id, g.capacity, g.rows],
    }

    x: Any = None
    vars: dict[str, torch.Tensor | None] = {}
    requires_grad: dict[str, Flag] = {}
    grad: bool = False
    autocast: dict[str, Any] | None = None
    modes: bool | list[Any] | None = None
    checkpoint: bool = False
    keep: list[bool] | None = None
    shapes: dict[int, list[Index]] | None = None
    schedule: str | None = None
    loss_output: Index | None = None
    generation: Generation | None = None

    def __post_init__(self) -> None:
        if self.x is not None and not is_main(self.x):
            raise ValueError("field 'x' must be a tensor or a tuple of tensors")
        if self.autocast is not None and not _is_autocast(self.autocast):
            raise ValueError("field 'autocast' must be {'enabled': bool, 'dtype': a torch dtype or None}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"field 'schedule' must name a schedule, one of {', '.join(SCHEDULES)}")
        # ``schedule`` alone says how the stage runs the call (`lightning_remote_mp.worker.runtime`):
        # a schedule's list from the loss on the last stage; without it, GPipe's, or forwards alone.
        if (self.schedule is None) != (self.loss_output is None):
            raise ValueError("'schedule' and 'loss_output' come together: where the schedule's backward starts")
        if self.schedule is not None and (not self.grad or self.generation is not None):
            raise ValueError("a 'schedule' is for a forward under grad, not one without or a generation step")


def _is_autocast(value: dict[str, Any]) -> bool:
    dtype = value.get("dtype")
    return (
        value.keys() <= {"enabled", "dtype"}
        and type(value.get("enabled")) is bool
        and (dtype is None or isinstance(dtype, torch.dtype))
    )


def _is_grad_out(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, tuple) and all(g is None or isinstance(g, torch.Tensor) for g in value)
    )


class Backward(_Pipelined, frozen=True):
    """One micro-batch's gradients, from a stage's consumers back to it (and from stage 0 to the driver).

    Attributes:
        key, call, mb, sender, sent_at, fence, microbatches: see `_Pipelined`.
        grad_out: the gradient of the main value the sender received from this stage (``None``
            when it needs none; a tuple for a traced model's tuple).
        grads: the gradients of the residual variables the sender imported from this stage.
        loss_grads: from the driver to the last stage: for each loss the stage computed over this
            micro-batch's kept outputs (`requests.Loss`, in their order), the gradient of its
            value, or ``None`` for a loss the step does not differentiate.
    """

    KIND: ClassVar[str] = protocol.BACKWARD
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"loss_grads"})
    WRITE: ClassVar[dict[str, Any]] = {"grads": plain, "loss_grads": plain, "fence": plain}

    grad_out: Any = None
    grads: dict[str, torch.Tensor | None] = {}
    loss_grads: list[torch.Tensor | None] | None = None

    def __post_init__(self) -> None:
        if self.grad_out is not None and not _is_grad_out(self.grad_out):
            raise ValueError("field 'grad_out' must be a tensor, a tuple of tensors or None")


def salvage(body: Any) -> tuple[int | None, dict[str, Any]]:
    """What a pipelined body that could not be read still says, so that its failure reaches the
    driver as its micro-batch's: its sender, where that is a stage number, and the key, call and
    micro-batch it names, where they are plain values."""
    if not isinstance(body, dict):
        return None, {}
    sender = body.get("from")
    about = {k: body[k] for k in ("key", "call", "mb") if isinstance(body.get(k), (int, str))}
    return (sender if type(sender) is int else None), about
