"""A request that arrived on a worker: read as the typed message its kind names, and the reply when
it fails.

`parse` is the one place a received body is read (through `REQUESTS`, one class per kind):
everything after it handles typed messages. A body that cannot be read becomes
a `Request` that carries the refusal, answered in its turn like any request's failure. The server
runs a request in its turn (`lightning_remote_mp.worker.order.Order.run`: a micro-batch goes to
its stage's runtime, another request to the session's handler for its type); `failure_reply` makes
the ERROR that names what failed where. Nothing a message carries is executed: its type only
chooses what runs it.
"""

from __future__ import annotations

import dataclasses
import traceback
from collections.abc import Callable
from typing import Any

import torch

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.flow import DRIVER
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.body import Body
from lightning_remote_mp.wire.carry import Carry
from lightning_remote_mp.wire.grads import Grads
from lightning_remote_mp.wire.messages import Backward, Forward, salvage
from lightning_remote_mp.wire.requests import (
    Bye,
    Fetch,
    GroupInit,
    Hello,
    Loss,
    LossGrad,
    OptimCreate,
    OptimStep,
    Ping,
    Profile,
    Release,
    Setup,
    Sync,
    Timeline,
    ZeroGrad,
)
from lightning_remote_mp.wire.state import GetOptimState, GetState, LoadOptimState, LoadState, ReadOptim, Save, Saved
from lightning_remote_mp.worker.throttle import Throttle

#: The kinds of the worker's own tasks, queued beside requests: drop a session, start one.
DROP, NEW = "__drop__", "__new__"

#: Every kind a worker accepts, and the type its body is read as: the one table a received message
#: is parsed through (`parse`).
REQUESTS: dict[str, type[Body]] = {
    c.KIND: c
    for c in (
        Hello,
        Ping,
        Bye,
        Setup,
        Forward,
        Backward,
        Release,
        GetState,
        LoadState,
        Profile,
        OptimCreate,
        OptimStep,
        ZeroGrad,
        GetOptimState,
        LoadOptimState,
        Grads,
        Timeline,
        GroupInit,
        Sync,
        Fetch,
        Loss,
        Carry,
        LossGrad,
        Save,
        Saved,
        ReadOptim,
    )
}

#: Kinds that stages send each other too; a failure of one is reported to the driver, whoever sent it.
_PIPELINE_KINDS = frozenset({protocol.FORWARD, protocol.BACKWARD, protocol.CARRY})


@dataclasses.dataclass
class Request:
    """A message that arrived, read: who sent it, its header, and its typed body.

    Attributes:
        peer: the sender's identity on the server socket (where a reply goes).
        kind, id, session: the message's header.
        message: the typed body; ``None`` for a body that could not be read (``refused``).
        refused: why the body could not be read; the request is answered with it in its turn.
        from_peer: a pipelined message from another stage, not from the driver.
        salvaged: for a pipelined body that could not be read, the key, call and micro-batch it
            names, so that its failure reaches the driver as that micro-batch's.
    """

    peer: bytes
    kind: str
    id: int
    session: str
    message: Body | None
    refused: ProtocolError | None = None
    from_peer: bool = False
    salvaged: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def about(self) -> dict[str, Any]:
        """The micro-batch a pipelined request's failure is reported for (key, call, mb)."""
        if isinstance(self.message, (Forward, Backward)):
            return {"key": self.message.key, "call": self.message.call, "mb": self.message.mb}
        if isinstance(self.message, Carry):
            return {"key": self.message.key, "call": self.message.call}
        return self.salvaged


def parse(peer: bytes, msg: protocol.Message) -> Request:
    """``msg`` (a kind of `protocol.REQUEST_KINDS`) read as its kind's typed message."""
    try:
        message = REQUESTS[msg.kind].from_body(msg.body)
    except Exception as err:  # whatever a check raised, the request is refused and answered in its turn
        if not isinstance(err, ProtocolError):  # a check's own failure: its traceback goes with the ERROR
            cause = err
            err = ProtocolError(f"{msg.kind} message: unreadable body ({type(err).__name__}: {err})"[:400])
            err.__cause__ = cause
        sender, about = salvage(msg.body) if msg.kind in _PIPELINE_KINDS else (None, {})
        return Request(peer, msg.kind, msg.id, msg.session, None, err, sender not in (None, DRIVER), about)
    from_peer = isinstance(message, (Forward, Backward, Carry)) and message.sender != DRIVER
    return Request(peer, msg.kind, msg.id, msg.session, message, from_peer=from_peer)


def device_failed(err: BaseException) -> bool:
    """A CUDA error: after one, the device's context is unusable for every later request too."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(err, accelerator_error):
        return True
    return isinstance(err, RuntimeError) and "CUDA error" in str(err)


def error_body(
    err: BaseException, layer_name: Callable[[int], str | None] | None = None, *, trace: bool = True
) -> dict[str, Any]:
    """The body of an ERROR reply; ``layer_name`` names the failing layer by its index (the session's
    `~lightning_remote_mp.worker.session.WorkerSession.layer_name`). ``trace=False`` leaves the
    traceback out: for malformed input from anyone, it is costly to format and tells a stranger
    about this worker's files."""
    layer = getattr(err, "lrmp_layer", None)
    body: dict[str, Any] = {
        "type": type(err).__name__,
        "message": str(err),
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=8)) if trace else "",
        "layer": layer if isinstance(layer, int) else None,
    }
    actions = getattr(err, "lrmp_actions", None)
    if isinstance(actions, str):
        body["actions"] = actions  # the stage's action list, the failing action marked (`runtime.StageRuntime`)
    if body["layer"] is not None and layer_name is not None and (name := layer_name(body["layer"])):
        body["layer_name"] = name
    return body


def failure_reply(
    request: Request,
    err: Exception,
    throttle: Throttle,
    to_driver: Callable[[str, dict[str, Any]], None],
    layer_name: Callable[[int], str | None] | None = None,
) -> list[Any] | None:
    """The reply to ``request`` for ``err``, the failure it raised (logged, without flooding the log):
    an ERROR to its sender, or ``None`` for pipelined work, whose failure goes ``to_driver`` (the
    `~lightning_remote_mp.worker.outbox.Outbox`'s) whoever sent the micro-batch. ``layer_name``: as
    for `error_body`."""
    if not isinstance(err, ProtocolError):
        throttle.warning("failed:" + request.kind, "request %s failed: %s: %s", request.kind, type(err).__name__, err)
    error = error_body(err, layer_name)
    if request.kind in _PIPELINE_KINDS:
        error.update(request.about)  # pipelined work answers to the driver, whoever sent the message
        to_driver(protocol.ERROR, error)
        return None
    if request.kind in protocol.QUIET_KINDS:
        error["posted"] = request.kind  # the driver did not wait for it: its next read raises this
    return protocol.encode(protocol.ERROR, request.id, request.session, error)
