"""The driver's connection to a worker: requests, replies and deadlines.

The driver talks to each worker through a `Connection` (a DEALER socket), whose waits the
`lightning_remote_mp.wire.heartbeat` bounds: a worker that dies or hangs is noticed while the driver
waits for a reply. A worker serves on one ROUTER socket. A pipeline's answers are collected from
several connections at once by `lightning_remote_mp.wire.collect`. The sockets themselves are made
by `lightning_remote_mp.wire.sockets`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from lightning_remote_mp.errors import (
    AuthenticationError,
    ConfigurationError,
    LrmpError,
    ProtocolError,
    ProtocolVersionError,
    WorkerError,
    WorkerLostError,
    worker_location,
)
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.addresses import dial_name, endpoint_of, why_unreachable
from lightning_remote_mp.wire.carry import Carried
from lightning_remote_mp.wire.request_order import RequestOrder
from lightning_remote_mp.wire.sockets import HANDSHAKE_EVENTS, Curve, dealer, handshake_failure, send_frames

if TYPE_CHECKING:
    from lightning_remote_mp.wire.heartbeat import Heartbeat  # which makes its sockets here

log = logging.getLogger(__name__)

#: How long the driver waits for a worker to answer its first message.
DEFAULT_CONNECT_TIMEOUT = 30.0
#: How long a worker may stay silent (no reply, no heartbeat) before it is declared lost.
DEFAULT_HEARTBEAT_TIMEOUT = 9.0  # a lost worker is named within 10 s: the timeout plus one heartbeat poll
#: How long one call (a request, or a pipeline's wait for its next result) may go on while the worker
#: answers heartbeats but makes no progress (a layer that never returns, a deadlock).
DEFAULT_CALL_TIMEOUT = 300.0
POLL_SLICE_MS = 50
_VAGUE_FAILURE_WAIT = 1.0  # seconds a handshake failure without detail waits for a more telling one (a reconnect)


class Connection:
    """Request/reply with one worker, bounded in time by the heartbeat and by ``call_timeout``.

    The heartbeat catches a worker that died or hangs as a whole; ``call_timeout`` (seconds, ``None``
    for no bound) one that answers heartbeats but never answers the call (a layer that never
    returns, a deadlock). Replies echo the request id; a stale reply (to a request that was
    abandoned) is dropped. A monitor on the socket turns a failed handshake (a refused key, keys on
    one side only) into an `lightning_remote_mp.errors.AuthenticationError` at once, instead of a
    silent timeout.
    """

    def __init__(
        self,
        address: str,
        *,
        stage: int | None = None,
        replica: int | None = None,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        process: Process | None = None,
        curve: Curve | None = None,
        call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        if call_timeout is not None and not call_timeout > 0:  # also for a DriverSession built directly
            raise ConfigurationError(f"call_timeout must be a positive number of seconds or None, got {call_timeout!r}")
        self.address = address
        self.stage = stage
        self.replica = replica  # set when stages are replicated (data parallel)
        self.session = ""
        self.heartbeat: Heartbeat | None = None
        self.heartbeat_timeout = heartbeat_timeout
        self.call_timeout = call_timeout
        self.limits = limits
        #: The worker's limits (from its HELLO reply): what this side may send it.
        self.remote_limits: protocol.Limits | None = None
        self.process = process  # a worker this process started: lost as soon as its process ends
        self.curve = curve
        self._sock = dealer(address, curve=curve, limits=limits, connect=False)
        # Attached before connecting: a refused handshake is not retried, so its event must not be missed.
        self._monitor: zmq.Socket | None = self._sock.get_monitor_socket(HANDSHAKE_EVENTS)
        self._sock.connect(endpoint_of(address))
        self._tcp_connected_at: float | None = None
        self._vague_failure: tuple[float, dict[str, Any]] | None = None
        self._heard = False
        self._unreachable: str | None = None  # why connecting failed ("": not known), until the worker is heard
        #: The driver's requests to this worker in their order: ids, what is held, what is not known run.
        self.order = RequestOrder(address)
        self._inbox: collections.deque[protocol.Message] = collections.deque()  # the rest of a bundle read
        self.closed = False
        self.lost_reason: str | None = None
        #: ZeroMQ messages sent to the worker and received from it on this connection (a bundle of
        #: micro-batches is one): what a step costs in hand-offs (heartbeats have their own sockets).
        self.sent_messages = 0
        self.received_messages = 0
        #: The driver's requests sent straight to the worker (each message of a bundle, but a `Carry`):
        #: a request that travelled along the pipeline and is known to have run is not among them again.
        self.sent_requests = 0
        #: The connections of this one's session (`DriverSession` sets it): where to look for a lost
        #: worker when a failure here may be its doing (`blame_the_lost`).
        self.session_conns: Sequence[Connection] = [self]

    def where(self) -> str:
        return worker_location(self.address, self.stage, self.replica)

    def located(self) -> dict[str, Any]:
        """Where this worker is (address, stage, replica): the keyword arguments of the errors about it."""
        return {"address": self.address, "stage": self.stage, "replica": self.replica}

    def send(self, kind: str, body: Any = None) -> int:
        return self.send_all(kind, [body])[0]

    def send_all(
        self,
        kind: str,
        bodies: Sequence[Any],
        compression: str | None = None,
        lead: Sequence[tuple[str, Any]] = (),
        link: bool = True,
    ) -> list[int]:
        """Send one message of ``kind`` per body, bundled (`protocol.encode_all`) into as few ZeroMQ
        messages as the worker's limits allow: each costs a send and a wake-up on either side.
        ``compression``: how floating tensors travel (`wire.compression.COMPRESSIONS`). Returns the ids of
        ``bodies``.

        What `order` holds goes before ``bodies`` (`RequestOrder.take_ahead`), so nothing sent straight
        to the worker overtakes it. ``lead``: messages ``(kind, body)`` that go before everything
        but the worker's loss gradients, in the same bundle, with no place in the order of requests
        (id 0): a `lightning_remote_mp.wire.carry.Carry`, which the worker passes on before it runs
        its other quiet requests. ``link=False`` leaves the workers linked to the held requests
        (`carry`) to the caller, which sends them theirs another way first (`flush_linked`).
        If a message cannot be encoded, nothing is sent, and nothing held is lost."""
        first_id = self.order.last_id
        before, after = self.order.take_ahead()
        ids = []
        try:
            if self.lost_reason is not None:
                raise WorkerLostError(self.lost_reason, **self.located())
            if self.closed:
                raise WorkerLostError(f"{self.where()}: connection already closed", **self.located())
            encoded = [list(c.frames) for c in before]  # encoded for this worker when posted (`carry`)
            encoded += [self._encode(k, body, req_id=0) for k, body in lead]
            encoded += [list(c.frames) for c in after]
            for body in bodies:
                encoded.append(self._encode(kind, body, compression))
                ids.append(self.order.last_id)
        except BaseException:
            self.order.put_back(first_id)  # nothing was sent: no id is used up, and what was held still is
            raise
        self.sent_requests += len(encoded) - len(lead)
        for bundle in protocol.encode_all(encoded, self.remote_limits or protocol.DEFAULT_LIMITS):
            self._send_frames(kind, bundle)
        if link:
            self.flush_linked()
        return ids

    def carry(self, request: Any, linked: Sequence[Connection] = ()) -> None:
        """Post ``request`` (of `protocol.CARRIED_KINDS`) to travel with the next call's micro-batches
        along the pipeline (`RequestOrder.take_carried`, `lightning_remote_mp.wire.carry.Carry`) instead of in a
        message of its own; whatever is sent straight to the worker first sends it (`send_all`).
        Like `post`, a failure is raised by whichever later call reads the reply.

        ``linked``: the workers that run ``request`` together with this one (a step that sums
        gradients over them): once it leaves, straight or along the pipeline, theirs must leave too
        (`flush_linked`), so that none waits for the rest.

        What it buys, with the unwaited backward (`lightning_remote_mp.driver.pipeline.RemoteSpec.confirm`),
        measured (`benchmarks/README.md`, section 1h): without both, the small model trains 10-15%
        slower (the driver then sends 6 messages per step where it sends 2). Alone (section 1j):
        7% at m=4 (4 messages per step without it), nothing at m=1; and a stage passes the
        stages beyond their step only once it applied its own loss gradient."""
        req_id = self.order.last_id + 1
        with self._naming_errors():
            sealed = Carried.sealed(request, req_id, req_id - 1, self.session, self.order.seal_key, self.remote_limits)
        self.order.hold(sealed, linked)  # an id is used up only once encoded: no gap

    def flush_linked(self) -> None:
        """Send straight what the workers linked to this one's requests (`carry`) still hold: a
        replica whose pipeline got no message this call, say."""
        for other in self.order.take_linked() if self.order.linked else ():
            if other.order.holds:  # sent straight now: its pipeline got no message to carry them
                other.send_all(protocol.SYNC, [])

    def _encode(self, kind: str, body: Any, compression: str | None = None, *, req_id: int | None = None) -> list[Any]:
        """``body`` encoded as the next request (or as request ``req_id``, one already counted):
        a request id is used up only by a message that encodes, so the worker sees no gap."""
        next_id = self.order.last_id + 1 if req_id is None else req_id
        with self._naming_errors():
            frames = protocol.encode(kind, next_id, self.session, body, self.remote_limits, compression)
        if req_id is None:
            self.order.last_id = next_id
        return frames

    @contextlib.contextmanager
    def _naming_errors(self) -> Iterator[None]:
        """An encoding failure, as an error that names this worker (and a limit's flag)."""
        try:
            yield
        except protocol.LimitExceeded as err:
            flag = protocol.LIMIT_FLAGS.get(err.limit, err.limit)
            raise protocol.LimitExceeded(
                f"{self.where()}: {err} (its {flag}); start the worker with a larger {flag}, or send less at once "
                "(e.g. smaller batches or more micro-batches)",
                err.limit,
            ) from None
        except ProtocolError as err:
            raise ProtocolError(f"{self.where()}: {err}") from None

    def _send_frames(self, kind: str, frames: list[Any]) -> None:
        start = time.monotonic()
        while True:  # bounded: a full queue to a worker that stopped reading ends with the heartbeat
            try:
                send_frames(self._sock, frames, zmq.NOBLOCK)
                self.sent_messages += 1
                return
            except zmq.Again:
                self._sock.poll(POLL_SLICE_MS, zmq.POLLOUT)
                self._check_alive(start, None if self.heartbeat else self.heartbeat_timeout, f"sending {kind}")

    def post(self, kind: str, body: Any = None) -> None:
        """Send a request without waiting for its reply. The worker runs requests in order, so what
        is sent next sees its effect; a failure is raised by whichever later call reads the reply
        (or by `settle`). Requests of `protocol.QUIET_KINDS` are answered only when they fail: one
        counts as run once a later request's reply arrives, or the heartbeat says so."""
        self.order.awaits(self.send(kind, body), kind)

    def settle(self, timeout: float | None = None, what: str = "") -> None:
        """Wait until every posted request has been answered (before ``what``); raise the first failure."""
        self.order.confirm_first()
        start = time.monotonic()
        if self.order.needs_sync:
            self.post(protocol.SYNC)  # answered after the quiet requests before it have run (or failed)
        while self.order.unanswered:
            if self.readable(POLL_SLICE_MS):
                self.read()
            else:
                self._check_alive(start, timeout, what)

    def readable(self, timeout_ms: int = 0) -> bool:
        """Whether a message waits to be `read` (the rest of a bundle, or one on the socket)."""
        return bool(self._inbox) or bool(self._sock.poll(timeout_ms, zmq.POLLIN))

    def read(self) -> protocol.Message | None:
        """Read one waiting message (`readable` must be true). The reply to a posted request is
        consumed here (``None``), or raised if it reports a failure."""
        if not self._inbox:
            self._inbox.extend(self._receive())
        msg = self._inbox.popleft()
        self._heard = True
        if self.heartbeat is not None:
            self.heartbeat.touch(self.address)
        posted = self.order.answered(msg)
        if posted is None:
            return msg
        if msg.kind == protocol.ERROR:
            raise self.remote_failure(msg.body, f"{posted} (reported late: the driver does not wait for it)")
        return None

    def _receive(self) -> list[protocol.Message]:
        try:
            frames = self._sock.recv_multipart(copy=False)
            self.received_messages += 1
            return protocol.decode_all(frames, self.limits)
        except ProtocolVersionError as err:
            info = err.info
            raise ProtocolVersionError(
                protocol.version_mismatch(self.where(), err.remote_version, info.get("lrmp", "?"), "this driver"),
                remote_version=err.remote_version,
                info=info,
            ) from None
        except ProtocolError as err:
            raise ProtocolError(f"{self.where()} sent an undecodable message: {err}") from None

    def recv(self, req_id: int, *, timeout: float | None = None, what: str = "", bounded: bool = True) -> Any:
        """Wait for the reply to ``req_id``; return its body or raise WorkerError / WorkerLostError.
        ``bounded=False`` exempts the call from ``call_timeout``: moving a stage's weights (setup,
        checkpoints) or profiling it takes as long as the stage is large and the network slow, and
        the heartbeat still catches a worker that dies or hangs meanwhile."""
        unasked: list[protocol.Message] = []  # a pipeline's failures: the next gather raises them (`collect`)
        start = time.monotonic()
        try:
            while True:
                if self.readable(POLL_SLICE_MS):
                    msg = self.read()
                    if msg is None:
                        continue
                    if msg.id != req_id:
                        if msg.id == 0 and msg.kind == protocol.ERROR:
                            unasked.append(msg)
                        else:
                            log.debug("%s: dropping stale reply %s (waiting for %s)", self.where(), msg.id, req_id)
                        continue
                    if msg.kind == protocol.ERROR:
                        raise self.remote_failure(msg.body, what)
                    return msg.body
                if bounded:
                    self._check_alive(start, timeout, what)
                else:
                    self._check_reachable(start, timeout, what)
        finally:
            self._inbox.extendleft(reversed(unasked))

    def request(self, kind: str, body: Any = None, *, timeout: float | None = None) -> Any:
        return self.recv(self.send(kind, body), timeout=timeout, what=kind)

    def _check_handshake(self) -> None:
        while self._monitor is not None and self._monitor.poll(0, zmq.POLLIN):
            event = parse_monitor_message(self._monitor.recv_multipart())
            log.debug("%s: socket event %s (value %s)", self.where(), event["event"], event["value"])
            if event["event"] == zmq.EVENT_CONNECTED:
                if self._tcp_connected_at is None:
                    self._tcp_connected_at = time.monotonic()
            elif event["event"] == zmq.EVENT_CONNECT_RETRIED:
                self._connect_failed()
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # Also seen just before the telling event of a mechanism mismatch: wait briefly for that.
                if self._vague_failure is None:
                    self._vague_failure = (time.monotonic(), event)
            elif why := handshake_failure(event, self.curve):
                self._refused(why)
        if self._vague_failure is not None and time.monotonic() - self._vague_failure[0] > _VAGUE_FAILURE_WAIT:
            self._refused(handshake_failure(self._vague_failure[1], self.curve) or "the handshake failed")

    def _connect_failed(self) -> None:
        """A TCP connection attempt failed before the worker was ever heard: say why at once (the
        worker may yet start, within ``connect_timeout``), and keep the reason for the final error."""
        if self._heard or self._unreachable is not None:
            return
        self._unreachable = why_unreachable(self.address) or ""
        if self._unreachable:
            log.warning("%s: %s. Waiting for it to start (connect_timeout)", self.where(), self._unreachable)

    def _refused(self, why: str) -> None:
        self.lost_reason = f"{self.where()}: {why}"
        raise AuthenticationError(self.lost_reason, **self.located())

    def _doing(self, what: str) -> str:
        return (f" during {what}" if what else "") + self.order.note()

    def _check_alive(self, start: float, timeout: float | None, what: str) -> None:
        """Raise `WorkerLostError` if the worker is gone, or the call begun at ``start`` went on too long."""
        self._check_reachable(start, timeout, what)
        if self.call_timeout is not None and time.monotonic() - start > self.call_timeout:
            self._lost(self._overdue(time.monotonic() - start, what))

    def _overdue(self, elapsed: float, what: str) -> str:
        hb = self.heartbeat
        if hb is not None and hb.busy(self.address):
            state = "its heartbeat says it is still computing"
        elif hb is not None:
            state = f"its heartbeat says it has not been computing for {hb.idle_for(self.address):.0f} s"
        else:
            state = "it answers, but not to this call"
        return (
            f"{self.where()} has not answered{self._doing(what)} for {elapsed:.0f} s "
            f"(call_timeout={self.call_timeout:g} s), and {state}. {OVERDUE_CAUSES}"
        )

    def _check_reachable(self, start: float, timeout: float | None, what: str) -> None:
        """Raise `WorkerLostError` if the worker died, went silent, or never answered within ``timeout``."""
        self._check_handshake()
        if self.process is not None and (ended := why_ended(self.process)):
            self._lost(f"{self.where()} died{self._doing(what)}: {ended}")
        hb = self.heartbeat
        if hb is not None:
            if self.address in hb.lost:
                self._lost(f"{self.where()} lost{self._doing(what)}: {hb.lost[self.address]}")
            silent = hb.silent_for(self.address)
            if silent > self.heartbeat_timeout and dial_name(self.address) and (moved := hb.moved_for()) is not None:
                # A worker that dialed in answers heartbeats on its one connection, behind whatever
                # large message that connection carries: while bytes move, it is no silence.
                silent = min(silent, moved)
            if silent > self.heartbeat_timeout:
                self._lost(
                    f"{self.where()} stopped answering{self._doing(what)}: no reply or heartbeat for {silent:.1f} s "
                    f"(heartbeat_timeout={self.heartbeat_timeout} s). "
                    "Is the worker process still running and reachable?"
                )
        elif not self._heard and self._tcp_connected_at is not None:
            # A worker answers HELLO at once, even while it computes: a TCP connection that stays silent
            # is a hung (stopped) process, or something else listening on that port.
            silent = time.monotonic() - self._tcp_connected_at
            if silent > self.heartbeat_timeout:
                self._lost(
                    f"{self.where()} accepted the TCP connection {silent:.1f} s ago but has not answered"
                    f"{self._doing(what)} (heartbeat_timeout={self.heartbeat_timeout} s): is the worker hung "
                    "(stopped), or is something other than lrmp-worker listening on that port?"
                )
        if timeout is not None and time.monotonic() - start > timeout:
            if not self._heard and self._unreachable is not None:
                self._unreachable = why_unreachable(self.address) or self._unreachable  # it may have changed
            cause = (
                self._unreachable
                or "Is lrmp-worker running at that address, and is the port reachable from this machine?"
            )
            self._lost(f"{self.where()} did not answer{self._doing(what)} within {timeout:.0f} s. {cause}")

    def _lost(self, message: str) -> None:
        self.lost_reason = message
        raise WorkerLostError(message, **self.located())

    def remote_failure(self, body: Any, what: str) -> LrmpError:
        """The error to raise for the worker's failure ``body``: `_remote_error`, or the loss of another
        worker of the session that caused it (`blame_the_lost`), with the report as its cause."""
        err = self._remote_error(body, what)
        blamed = blame_the_lost(err, self.session_conns)
        if blamed is not err:
            blamed.__cause__ = err
        return blamed

    def _remote_error(self, body: Any, what: str) -> WorkerError:
        body = body if isinstance(body, dict) else {}
        rtype = str(body.get("type", "Error"))
        rmsg = str(body.get("message", ""))
        layer = body.get("layer")
        layer = layer if isinstance(layer, int) else None
        where = self.where()
        if layer is not None:
            where += f", layer {layer}" + (f" ({body['layer_name']})" if body.get("layer_name") else "")
        doing = f" during {what}" if what else ""
        actions = f"\n{body['actions']}" if isinstance(body.get("actions"), str) else ""
        return WorkerError(
            f"{where} raised {rtype}{doing}: {rmsg}{actions}",
            **self.located(),
            layer=layer,
            remote_type=rtype,
            remote_message=rmsg,
            remote_traceback=str(body.get("traceback", "")),
            details={
                k: v for k, v in body.items() if k not in _ERROR_FIELDS and isinstance(v, (int, float, str, bool))
            },
        )

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(0)
                self._monitor = None
            self._sock.close(0)


_ERROR_FIELDS = frozenset({"type", "message", "traceback", "layer", "layer_name", "actions"})

OVERDUE_CAUSES = (
    "A layer that never returns, a deadlock, or a step slower than call_timeout: raise call_timeout=... "
    "if it is legitimately slow (None waits forever); `kill -USR1 <worker pid>` prints where the worker's "
    "threads are."
)


class Process(Protocol):
    """A worker process this one started: a `subprocess.Popen`, or one the local workers' fork
    server forked (`lightning_remote_mp.driver.launch.ForkedWorker`)."""

    @property
    def pid(self) -> int | None: ...

    def poll(self) -> int | None: ...


def why_ended(process: Process) -> str | None:
    """``None`` while a worker process this one started runs, else how it ended."""
    code = process.poll()
    return None if code is None else f"its process (pid {process.pid}) exited with code {code}"


def blame_the_lost(err: WorkerError, conns: Iterable[Connection]) -> LrmpError:
    """The error to raise for ``err``: when it is a failed sum of gradients over a process group
    (`lightning_remote_mp.errors.GroupError`), or a message another worker could not take
    (``PeerUnreachableError``), most likely because another worker stopped, the loss of one of
    ``conns``, if one is found lost within its heartbeat timeout; else ``err``. A step that sums
    gradients fails on every member that is left, a backward on the stage after the lost one,
    and blaming the first to report would name a worker that is fine."""
    if err.remote_type not in ("GroupError", "PeerUnreachableError"):
        return err
    others = [c for c in conns if c.address != err.address]
    wait = max((c.heartbeat_timeout for c in others), default=0.0)
    if err.remote_type == "PeerUnreachableError":
        wait /= 2  # the reporting worker waited its peer timeout (the heartbeat's) already
    deadline = time.monotonic() + wait + 2.0
    while others and time.monotonic() < deadline:
        for c in others:
            try:
                c._check_reachable(time.monotonic(), None, "")
            except WorkerLostError as lost:
                return lost
        time.sleep(POLL_SLICE_MS / 1000)
    return err


def post_all(
    requests: Iterable[tuple[Connection, str, Any]], *, what: str | None = None, bounded: bool = True
) -> Callable[[], list[Any]]:
    """Send ``(connection, kind, body)`` requests at once; calling what it returns collects every
    reply's body, in order (``bounded``: see `Connection.recv`), so the driver can work meanwhile."""
    sent = [(conn, kind, conn.send(kind, body)) for conn, kind, body in requests]
    return lambda: [conn.recv(i, what=what or kind, bounded=bounded) for conn, kind, i in sent]


def request_all(
    requests: Iterable[tuple[Connection, str, Any]], *, what: str | None = None, bounded: bool = True
) -> list[Any]:
    """Send ``(connection, kind, body)`` requests at once, then collect every reply, in order."""
    return post_all(requests, what=what, bounded=bounded)()


def broadcast(conns: Iterable[Connection], kind: str, body: Any = None, *, bounded: bool = True) -> list[Any]:
    """Send one request to several workers at once, then collect every reply (``bounded``: see
    `Connection.recv`)."""
    return request_all(((c, kind, body) for c in conns), bounded=bounded)
