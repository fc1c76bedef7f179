"""The pipeline's messages, typed: what a micro-batch's forward and backward carry between the
driver and the stages, built on one side and checked once on the other.

`protocol` frames and encodes message bodies; this module says what the pipelined bodies hold. A
`Forward` travels from the driver to stage 0, from stage to stage (the main value to the next
stage, residual variables to the stages that import them) and, as a RESULT, from the last stage
back to the driver. A `Backward` travels the other way, and stage 0's reaches the driver as DONE.
Their fields are declared once (`lightning_remote_mp.wire.fields`): `from_body` is the only place a
received body is checked, and a malformed one raises `lightning_remote_mp.errors.ProtocolError`
whoever sent it; nothing in it is executed.

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
from typing import Any, ClassVar

import torch

from lightning_remote_mp.flow import is_main
from lightning_remote_mp.schedule import BACKWARD, SCALE
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.fields import (
    INT,
    STR,
    Body,
    bool_or_list_or_none,
    choice,
    count,
    field,
    float_or_none,
    is_autocast,
    is_bool,
    is_flag,
    is_grad_out,
    is_index,
    is_int,
    is_scalar,
    is_schedule,
    is_shape,
    is_str,
    is_tensor_or_none,
    lenient,
    list_of,
    map_of,
    must,
    refuse,
    true_only,
)


def _tensors() -> Any:
    """A ``{name: tensor}`` field (values may be ``None`` where no gradient exists)."""
    return field(map_of(is_str, is_tensor_or_none, "names to tensors"), default_factory=dict, write=dict)


def is_generation(value: Any) -> bool:
    """A step of a generation: ``[id, capacity, reorder]``, its id, how many tokens its cache holds,
    and before this step, beam search's new order of the micro-batch's rows (or ``None``)."""
    if not (isinstance(value, list) and len(value) == 3 and is_index(value[0]) and type(value[1]) is int):
        return False
    rows = value[2]
    return rows is None or (isinstance(rows, list) and all(type(r) is int and r >= 0 for r in rows))


@dataclasses.dataclass(frozen=True)
class _Pipelined(Body):
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

    key: str = field(STR)
    call: int = field(INT)
    mb: int = field(INT)
    sender: int = field(INT, wire="from")
    sent_at: float | None = field(lenient(float_or_none), default=None)
    fence: dict[int, int] = field(
        map_of(is_int, is_index, "stage numbers to request ids"), default_factory=dict, write=dict
    )
    microbatches: int = field(count, default=1)


@dataclasses.dataclass(frozen=True)
class Forward(_Pipelined):
    """One micro-batch's forward input to a stage (or a stage's output, to the next or the driver).

    Attributes:
        key, call, mb, sender, sent_at, fence, microbatches: see `_Pipelined`.
        x: the main value (a tensor, or a tuple of tensors for a traced model), for the next stage
            only; ``None`` in a message that carries only residual variables.
        vars: the residual variables this receiver imports from the sender.
        requires_grad: which of ``x`` (key ``"x"``) and ``vars`` need a gradient back.
        grad: whether the forward runs under grad (the stages keep what backward needs).
        autocast: the driver's autocast state (``{"enabled", "dtype"}``), or ``None``.
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
            real gradient, the input of the call's S action (`Backward.action`). Stages pass it on.
        generation: a step of ``generate()`` (`Generation`): the forward writes its keys and values
            to the stage's cache of that generation and micro-batch. Stages pass it on.
    """

    KIND: ClassVar[str] = protocol.FORWARD

    x: Any = field(must(is_main, "'x' must be a tensor or a tuple of tensors"), default=None)
    vars: dict[str, Any] = _tensors()
    requires_grad: dict[str, Any] = field(map_of(is_str, is_flag, "names to bools"), default_factory=dict, write=dict)
    grad: bool = field(lenient(true_only), default=False)
    autocast: dict[str, Any] | None = field(
        must(is_autocast, "'autocast' must be {'enabled': bool, 'dtype': a torch dtype}"), default=None
    )
    modes: bool | list[Any] | None = field(lenient(bool_or_list_or_none), default=None)
    checkpoint: bool = field(lenient(true_only), default=False)
    keep: list[bool] | None = field(list_of(is_bool, "bools"), default=None, omit_none=True)
    shapes: dict[int, list[int]] | None = field(
        map_of(is_int, is_shape, "output positions to shapes"), default=None, omit_none=True
    )
    schedule: str | None = field(must(is_schedule, "'schedule' must name a schedule"), default=None, omit_none=True)
    loss_output: int | None = field(
        must(is_index, "'loss_output' must be an output position"), default=None, omit_none=True
    )
    generation: list[Any] | None = field(
        must(is_generation, "'generation' must be [id, capacity, rows or None]"), default=None, omit_none=True
    )

    @classmethod
    def _check(cls, values: dict[str, Any]) -> None:
        # ``schedule`` alone says how the stage runs the call (`lightning_remote_mp.worker.runtime`):
        # a schedule's list from the loss on the last stage; without it, GPipe's, or forwards alone.
        if (values["schedule"] is None) != (values["loss_output"] is None):
            raise refuse(cls.KIND, "'schedule' and 'loss_output' come together: where the schedule's backward starts")
        if values["schedule"] is not None and (not values["grad"] or values["generation"] is not None):
            raise refuse(cls.KIND, "a 'schedule' is for a forward under grad, not one without or a generation step")


@dataclasses.dataclass(frozen=True)
class Backward(_Pipelined):
    """One micro-batch's gradients, from a stage's consumers back to it (and from stage 0 to the driver).

    Attributes:
        key, call, mb, sender, sent_at, fence, microbatches: see `_Pipelined`.
        action: the action whose input this is (`lightning_remote_mp.schedule`): ``"B"``, the
            backward of the micro-batch (the gradients of what the stage sent on); or ``"S"``, an
            early call's loss scale (`Forward.loss_output`): the driver's gradient of the loss, in
            ``grad_out`` (from the driver) or ``scale`` (from the next stage).
        grad_out: the gradient of the main value the sender received from this stage (``None``
            when it needs none; a tuple for a traced model's tuple).
        grads: the gradients of the residual variables the sender imported from this stage.
        loss_grads: from the driver to the last stage: for each loss the stage computed over this
            micro-batch's kept outputs (`requests.Loss`, in their order), the gradient of its
            value, or ``None`` for a loss the step does not differentiate.
        scale: an S input between stages: the gradient the driver's backward brought for the loss;
            each stage adds its weight gradients times ``scale`` to ``.grad``.
    """

    KIND: ClassVar[str] = protocol.BACKWARD

    action: str = field(choice((BACKWARD, SCALE)), default=BACKWARD)
    grad_out: Any = field(must(is_grad_out, "'grad_out' must be a tensor, a tuple of tensors or None"), default=None)
    grads: dict[str, Any] = _tensors()
    loss_grads: list[Any] | None = field(
        list_of(is_tensor_or_none, "tensors or None"), default=None, omit_none=True, write=list
    )
    scale: torch.Tensor | None = field(
        must(is_scalar, "'scale' must be a floating tensor of one value"), default=None, omit_none=True
    )


def salvage(body: Any) -> tuple[int | None, dict[str, Any]]:
    """What a pipelined body that could not be read still says, so that its failure reaches the
    driver as its micro-batch's: its sender, where that is a stage number, and the key, call and
    micro-batch it names, where they are plain values."""
    if not isinstance(body, dict):
        return None, {}
    sender = body.get("from")
    about = {k: body[k] for k in ("key", "call", "mb") if isinstance(body.get(k), (int, str))}
    return (sender if type(sender) is int else None), about
