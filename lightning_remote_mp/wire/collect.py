"""Collecting a pipeline's answers, which the workers send unasked, from several workers at once,
and telling a pipeline that moves from one that is stuck.

`gather` waits for a call's results (or its backward's completions) from the stages that answer the
driver. It fails a lost worker like `lightning_remote_mp.wire.transport.Connection.recv` does, a
pipeline in which nothing moves anywhere (every worker idle, messages missing: `_check_stall`), and
one that made no progress for ``call_timeout`` while its workers still answer (`_check_overdue`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence

import zmq

from lightning_remote_mp.errors import WorkerLostError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.transport import OVERDUE_CAUSES, POLL_SLICE_MS, Connection

log = logging.getLogger(__name__)


def gather(
    conns: Sequence[Connection],
    count: int,
    *,
    call: int,
    what: str,
    kind: str = "",
    sources: Collection[Connection] = (),
    replies: Mapping[Connection, int] | None = None,
    patience: int = 1,
    late: Mapping[int, str] | None = None,
) -> list[tuple[Connection, protocol.Message]]:
    """Collect ``count`` messages from any of ``conns``: the unsolicited ones of ``kind`` about
    ``call`` from ``sources`` (a pipeline's results or completions), or with ``replies`` (``{a
    connection: the id of a request sent on it}``) the replies to those requests.

    An error a worker reports for this ``call`` is raised at once; leftovers of earlier calls are
    dropped; a lost worker fails the wait like `Connection.recv` does. ``call_timeout`` bounds the
    time between two accepted messages, not the whole wait: a long pipeline that moves is fine.
    ``patience`` multiplies it where one message answers for several micro-batches (a stage
    sends a call's answers together, once it has them all). ``late``: earlier calls whose errors
    are raised too, each as what it names (their workers finish them without the driver waiting).
    """
    poller = zmq.Poller()
    by_sock = {}
    for c in conns:
        if id(c._sock) not in by_sock:
            poller.register(c._sock, zmq.POLLIN)
            by_sock[id(c._sock)] = c
    got: list[tuple[Connection, protocol.Message]] = []
    start = progress = time.monotonic()
    while len(got) < count:
        # The rest of a bundle first: the socket it came on may have nothing more to read.
        ready = [c for c in by_sock.values() if c._inbox] or [by_sock[id(s)] for s, _ in poller.poll(POLL_SLICE_MS)]
        for conn in ready:
            msg = conn.read()
            if msg is None:
                continue
            body = msg.body if isinstance(msg.body, dict) else {}
            if msg.kind == protocol.ERROR and msg.id == 0:  # a pipeline's failure, which nobody asked for
                failed = body.get("call")
                if failed in (call, None):
                    raise conn.remote_failure(body, what)
                if late and failed in late:
                    raise conn.remote_failure(body, late[failed])
                log.warning("%s: late error of an earlier call, dropped: %.300s", conn.where(), body.get("message"))
            elif (
                replies.get(conn) == msg.id
                if replies is not None
                else msg.kind == kind and conn in sources and body.get("call") == call
            ):
                got.append((conn, msg))
                progress = time.monotonic()
            else:
                log.debug("%s: dropping stale %s message", conn.where(), msg.kind)
        if len(got) == count:
            break  # all came: no worker needs checking
        for c in by_sock.values():
            c._check_reachable(start, None, what)
        _check_stall(list(by_sock.values()), progress, what, count - len(got))
        _check_overdue(list(by_sock.values()), progress, what, count - len(got), patience)
    return got


def _check_stall(conns: Sequence[Connection], progress: float, what: str, missing: int) -> None:
    """Every worker answers its heartbeat, none is computing, nothing arrived, and no connection of
    any worker or of this process moved bytes, for a whole heartbeat timeout: a message between two
    workers is not getting through. A large message on a slow link moves bytes all along: it is no
    stall. Where a side cannot tell what its connections move (`lightning_remote_mp.wire.traffic`),
    only ``call_timeout`` judges (`_check_overdue`)."""
    hb = conns[0].heartbeat if conns else None
    limit = min(c.heartbeat_timeout for c in conns) if conns else 0.0
    if hb is None or time.monotonic() - progress < limit:
        return
    moved = hb.moved_for()
    if moved is None or moved < limit:
        return  # bytes are moving: a transfer in progress, however slow (or some side cannot tell)
    if all(hb.idle_for(c.address) > limit for c in conns):
        waiting = [(c, hb.held_back[c.address]) for c in conns if c.address in hb.held_back]
        if waiting:
            c, (held, request) = waiting[0]
            message = (
                f"the pipeline stalled during {what}: {c.where()} holds back {held} micro-batch(es) until it has "
                f"run the driver's request {request}{c.order.note()}, which has not reached it (posted "
                "without waiting for the reply, and lost on the way?); every worker has been idle for over "
                f"{limit:.0f} s with {missing} micro-batch result(s) missing."
            )
            raise WorkerLostError(message, **c.located())
        message = (
            f"the pipeline stalled during {what}: every worker has been idle, and no connection has moved "
            f"bytes, for over {limit:.0f} s with {missing} micro-batch result(s) missing. Can the workers "
            "reach each other at the addresses "
            f"the driver uses ({', '.join(c.address for c in conns)})? Activations travel worker to worker."
        )
        raise WorkerLostError(message, **conns[0].located())


def _check_overdue(conns: Sequence[Connection], progress: float, what: str, missing: int, patience: int = 1) -> None:
    """Nothing arrived for longer than ``call_timeout`` (times ``patience``) although every worker
    answers its heartbeat: blame the ones still computing (all, if none is), and let no later call
    wait for them."""
    limits = [c.call_timeout for c in conns if c.call_timeout is not None]
    hb = conns[0].heartbeat if conns else None
    moved = hb.moved_for() if hb is not None else None
    # Bytes moving count as progress: a large message on a slow link is no call that hangs.
    waited = min(time.monotonic() - progress, moved if moved is not None else float("inf"))
    if not limits or waited <= min(limits) * patience:
        return
    busy = [c for c in conns if hb is not None and hb.busy(c.address)]
    blamed = busy or list(conns)
    if busy:
        state = f"still computing (by {'its heartbeat' if len(busy) == 1 else 'their heartbeats'})"
    else:
        state = "answering heartbeats but computing nothing" if hb is not None else "not answering this call"
    message = (
        f"the pipeline made no progress during {what} for {waited:.0f} s (call_timeout={min(limits):g} s"
        f"{f' per micro-batch, {patience} of them' if patience > 1 else ''}), with "
        f"{missing} micro-batch result(s) missing: {', '.join(c.where() + c.order.note() for c in blamed)} "
        f"{'is' if len(blamed) == 1 else 'are'} {state}. {OVERDUE_CAUSES}"
    )
    for c in busy:
        c.lost_reason = message
    raise WorkerLostError(message, **blamed[0].located())
