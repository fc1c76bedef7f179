"""The driver's quiet requests carried along the pipeline (`Carry`), each sealed for its worker (`Carried`).

The optimizer's step, ``zero_grad``, a release and a loss's gradient (`protocol.CARRIED_KINDS`)
need no answer the driver waits for. Instead of one message per worker, the driver bundles the
requests for a pipeline's stages with a call's micro-batches, and each stage passes on what is not
its own (`lightning_remote_mp.worker.order.Order`). A stage on the way can neither forge nor
alter what it passes on: every request is sealed, under a key only the driver and its worker know.
What carrying buys, measured (`benchmarks/README.md`, issue 37): 5-7% on the small model where a GPipe
step has several micro-batches, nothing elsewhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import msgspec

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.body import Body, refuse
from lightning_remote_mp.wire.requests import LossGrad, OptimStep, Release, ZeroGrad

#: The requests a `Carry` may bring, by kind (`protocol.CARRIED_KINDS`).
_CARRIED: dict[str, type[Body]] = {c.KIND: c for c in (OptimStep, ZeroGrad, Release, LossGrad)}
assert set(_CARRIED) == protocol.CARRIED_KINDS

#: The most requests one `Carry` brings for one stage: a few per optimizer and step.
MAX_CARRIED = 1024


def _seal(key: bytes, after: int, frames: Sequence[bytes]) -> bytes:
    """HMAC-SHA256, under ``key``, of ``after`` and the request's frames (each with its length)."""
    mac = hmac.new(key, after.to_bytes(8, "little"), hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))
        mac.update(frame)
    return mac.digest()


@dataclasses.dataclass(frozen=True)
class Carried:
    """One request that travels along the pipeline to its worker (`Carry`), sealed for it.

    The request travels as the frames the driver would send that worker straight (`protocol.encode`:
    its kind, id, session and body), with a seal: an HMAC under a key only the driver and that
    worker know (each worker's own, from the driver's HELLO). The stages it crosses on the way pass
    it on as it came; they can neither forge nor alter it for another worker.

    Attributes:
        id: its id among the driver's requests to that worker, as if it had been sent straight there.
        after: the id of the driver's request to that worker just before it: the worker runs it
            only once that one has run, so a request that came the short way is never overtaken.
        request: the request (`protocol.CARRIED_KINDS`).
        frames: the request as encoded for its worker; ``seal``: their HMAC (`sealed`, `sealed_by`).
        session: the session its frames name.

    >>> from lightning_remote_mp.wire.requests import SEAL_KEY_BYTES
    >>> key = bytes(SEAL_KEY_BYTES)
    >>> c = Carried.sealed(ZeroGrad(0), 7, 6, "s", key)
    >>> c.sealed_by(key, "s"), c.sealed_by(bytes(range(SEAL_KEY_BYTES)), "s"), c.sealed_by(key, "other")
    (True, False, False)
    """

    id: int
    after: int
    request: Body
    frames: tuple[bytes, ...] = ()
    seal: bytes = b""
    session: str = ""

    @classmethod
    def sealed(
        cls,
        request: Body,
        req_id: int,
        after: int,
        session: str,
        key: bytes,
        limits: protocol.Limits | None = None,
    ) -> Carried:
        """``request``, the driver's ``req_id``-th to a worker, sealed with that worker's ``key``;
        encoded within that worker's ``limits``, so that its frames may also go to it straight."""
        frames = tuple(bytes(f) for f in protocol.encode(request.KIND, req_id, session, request.body(), limits))
        return cls(req_id, after, request, frames, _seal(key, after, frames), session)

    def sealed_by(self, key: bytes | None, session: str) -> bool:
        """Whether the driver of ``session`` sealed this request with ``key`` (its worker's)."""
        if not key or self.session != session:
            return False
        return hmac.compare_digest(self.seal, _seal(key, self.after, self.frames))

    def wire(self) -> list[Any]:
        return [self.after, list(self.frames), self.seal]


def _carried(kind: str, name: str, value: Any) -> dict[int, tuple[Carried, ...]]:
    """``{stage: [[after, frames, seal], ...]}``, ids rising, each request's frames decoded and read
    as its kind's request (its seal is checked by the worker it is for: `Carried.sealed_by`). Read
    here alone, as a pipelined message is in `lightning_remote_mp.wire.body`: a stage reads one
    with every call's micro-batches."""
    if not isinstance(value, dict):
        raise refuse(kind, f"field {name!r} must be a dict, got {type(value).__name__}")
    out = {}
    for stage, entries in value.items():
        if not (type(stage) is int and stage >= 0 and isinstance(entries, list) and 0 < len(entries) <= MAX_CARRIED):
            raise refuse(
                kind,
                f"field {name!r} must map stage numbers to lists of at most {MAX_CARRIED} requests; "
                f"entry {stage!r:.40} does not",
            )
        read: list[Carried] = []
        for i, e in enumerate(entries):
            message = None
            if (
                isinstance(e, list)
                and len(e) == 3
                and type(e[0]) is int
                and isinstance(e[1], list)
                and all(isinstance(f, bytes) for f in e[1])
                and isinstance(e[2], bytes)
                and len(e[2]) == hashlib.sha256().digest_size
            ):
                try:
                    message = protocol.decode(e[1])
                except ProtocolError:
                    message = None
            if not (
                message is not None
                and message.kind in _CARRIED
                and 0 <= e[0] < message.id
                and (not read or message.id > read[-1].id)
            ):
                raise refuse(
                    kind,
                    f"field {name!r}: request {i} for stage {stage} must be [after, frames, seal] with frames "
                    f"that decode to a request of kind one of {sorted(_CARRIED)}, after < its id, ids rising",
                )
            request = _CARRIED[message.kind].from_body(message.body)
            read.append(Carried(message.id, e[0], request, tuple(e[1]), e[2], message.session))
        out[stage] = tuple(read)
    return out


class Carry(Body, frozen=True):
    """CARRY: the driver's quiet requests (`protocol.CARRIED_KINDS`: the optimizer's step,
    zero_grad, releases) for the stages of one pipeline, travelling with its micro-batches instead of one
    message per worker: the driver bundles one with a call's forward (to stage 0) or backward (to
    the last stage), and each stage passes on what is not its own to the next stage ``toward``,
    before it runs its own. A step then costs the driver no message of its own.

    Attributes:
        key, call: the SpecSequential and the call whose messages it travels with.
        sender: the stage that passed it on, or `lightning_remote_mp.flow.DRIVER` (``from``).
        toward: ``1``: on down the pipeline (with a forward); ``-1``: up it (with a backward).
        requests: by stage, its requests (`Carried`), in the order the driver made them.

    >>> from lightning_remote_mp.wire.requests import SEAL_KEY_BYTES
    >>> c = Carry("net", 3, -1, 1, {1: (Carried.sealed(ZeroGrad(0), 7, 6, "s", bytes(SEAL_KEY_BYTES)),)})
    >>> Carry.from_body(c.body()).requests[1][0].request
    ZeroGrad(index=0, set_to_none=True)
    """

    KIND: ClassVar[str] = protocol.CARRY
    WRITE: ClassVar[dict[str, Any]] = {
        "requests": lambda m: {stage: [c.wire() for c in entries] for stage, entries in m.items()}
    }

    key: str
    call: int
    sender: int = msgspec.field(name="from")
    toward: Literal[1, -1]
    requests: dict[int, Any]  # by stage, its `Carried` requests (as lists on the wire, read by `_carried`)

    @classmethod
    def from_body(cls, body: Any) -> Carry:  # type: ignore[override]
        """A received body, checked, each request decoded and read as its kind's (`_carried`)."""
        carry = super().from_body(body)
        return carry.replace(requests=_carried(cls.KIND, "requests", carry.requests))
