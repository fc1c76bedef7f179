"""The worker's serving loop: one thread reads, runs and answers requests; the main thread stands in.

The serving thread owns the ROUTER socket: it reads a message, runs it, and sends the reply, with no
hand-off between threads on the way (each hand-off cost a thread wake-up and a fight for the
interpreter lock: a round trip through a worker was 10x a raw pyzmq one). While a request runs
longer than `STAND_IN_AFTER`, the main thread takes the socket over and answers heartbeats at once,
admits or refuses drivers, and queues requests for the serving thread; it hands the socket back as
soon as the request returns. Either thread expires a session whose driver falls silent (which
driver is served, and until when: `lightning_remote_mp.worker.admission`). The main thread also
handles signals.

Each message is read once, as it arrives, into a typed request (`lightning_remote_mp.worker.request`);
the serving thread runs it in its turn (`worker.order.Order.run`: a micro-batch through its
stage's runtime, another request through the session's handler for its type) and answers through
the socket, or, for pipelined work, through the `worker.outbox`. Nothing a message carries is
executed: its type only chooses what runs it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import zmq

from lightning_remote_mp.errors import ConfigurationError, ProtocolError, ProtocolVersionError
from lightning_remote_mp.wire import protocol, sockets
from lightning_remote_mp.wire.keys import KeyPair
from lightning_remote_mp.wire.requests import Hello
from lightning_remote_mp.wire.traffic import MIN_PROGRESS, Sampler
from lightning_remote_mp.worker import allocator
from lightning_remote_mp.worker.admission import DEFAULT_SESSION_TIMEOUT, Admission, describe_duration, versions
from lightning_remote_mp.worker.auth import WorkerAuth
from lightning_remote_mp.worker.order import NO_REPLY
from lightning_remote_mp.worker.outbox import DEFAULT_PEER_TIMEOUT, Outbox
from lightning_remote_mp.worker.request import DROP, NEW, Request, device_failed, error_body, failure_reply, parse
from lightning_remote_mp.worker.session import WorkerSession, describe_device
from lightning_remote_mp.worker.signals import SignalWakeup
from lightning_remote_mp.worker.throttle import Throttle
from lightning_remote_mp.worker.uplink import Uplink

log = logging.getLogger(__name__)

#: How long a stopping worker waits for a request that is still running (a layer stuck for good,
#: say) before it leaves without it.
_COMPUTE_GRACE = 0.5
#: Seconds a request runs before the main thread takes the socket over to answer heartbeats (which
#: come every second; a driver gives up on a worker after 9 s of silence).
STAND_IN_AFTER = 0.2
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
#: A worker that finished a request this recently still counts as computing (between a pipeline's short requests).
_BUSY_WINDOW = 1.0


def _warm_up() -> None:
    """Pay, before the first session needs them, the imports torch does on first use (seconds
    each on a small machine, which a driver's ``call_timeout`` would count): the first
    ``torch.autograd.backward`` with explicit gradients imports sympy, the first optimizer
    ``torch._dynamo``."""
    x = torch.ones(2, 2, requires_grad=True)
    y = x * x
    torch.autograd.backward([y], [torch.ones_like(y)])
    torch.optim.SGD([x], lr=0.0).step()


class WorkerServer:
    """Serves sessions on ``bind`` until `stop` is called.

    Args:
        bind: ZeroMQ endpoint, e.g. ``"tcp://0.0.0.0:5555"`` (port ``*`` picks a free one).
        device: where stages live, e.g. ``"cpu"`` or ``"cuda:0"``.
        allowed_prefixes: module prefixes (beyond ``torch.nn``) whose classes may be built.
        session_timeout: seconds of driver silence after which a session is dropped.
        limits: bounds on what this worker accepts (message size, tensors, dims, layers per stage).
        keys: this worker's CURVE key pair; with ``authorized_keys`` the worker only talks CURVE.
        authorized_keys: directory of the public keys allowed to drive this worker.
        parent: stop once this process is no longer the worker's parent (the driver that started
            it ended, even without stopping it: killed, out of memory).
        connect: dial the driver's switchboard at this ``tcp://host:port`` instead of listening
            (`lightning_remote_mp.worker.uplink`); ``bind`` is then ignored.
        name: with ``connect``, the name the driver knows this worker by.
        driver_key: with ``connect`` and ``keys``, the public key the driver must prove.
    """

    def __init__(
        self,
        bind: str,
        device: str = "cpu",
        allowed_prefixes: Sequence[str] = (),
        session_timeout: float = DEFAULT_SESSION_TIMEOUT,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        keys: KeyPair | None = None,
        authorized_keys: str | os.PathLike[str] | None = None,
        parent: int | None = None,
        connect: str | None = None,
        name: str = "",
        driver_key: bytes | None = None,
    ) -> None:
        from lightning_remote_mp.model.build import DEFAULT_ALLOWED_PREFIXES

        self.uplink: Uplink | None = None
        if connect is not None:
            if keys is not None and driver_key is None:
                raise ConfigurationError("a worker that dials in with CURVE needs the driver's public key to check")
            bind = f"inproc://lrmp-worker-{uuid.uuid4().hex}"  # listening on nothing: all comes up the uplink
            self.uplink = Uplink(connect, name, bind, keys=keys, driver_key=driver_key, limits=limits)
            authorized_keys = None
        elif (keys is None) != (authorized_keys is None):
            raise ConfigurationError(
                "CURVE needs both this worker's key pair (--secret-key) and the directory of the drivers' "
                "public keys (--authorized-keys)"
            )
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ConfigurationError(f"--device {device}: this machine has no CUDA device visible to torch")
            torch.cuda.set_device(self.device)
        self.allowed_prefixes = list(dict.fromkeys([*DEFAULT_ALLOWED_PREFIXES, *allowed_prefixes]))
        self.parent = parent
        self.limits = limits
        self.keys = keys
        # I/O-thread state: the session served (which driver, until when), and whether a request runs.
        self.admission = Admission(session_timeout)
        self._busy_since: float | None = None
        # The authenticator must answer before the first client can complete a handshake.
        self.auth = (
            WorkerAuth(sockets.context(), authorized_keys, self.admission.peer_keys)
            if keys is not None and authorized_keys is not None and connect is None
            else None
        )
        try:
            self.sock, self.endpoint = sockets.bind_router(bind, keys=keys, limits=limits)
        except BaseException:
            if self.auth is not None:
                self.auth.stop()
            raise
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED
        )
        self._throttle = Throttle(log)
        self._device_failure: Exception | None = None  # a CUDA error a request raised (`_answer`)
        self._traffic = Sampler()  # for heartbeats: taken on a thread of its own, asked by the one holding the socket
        self._moved: int | None = None  # its last sample
        self._stop = threading.Event()
        # Who uses the ROUTER socket, the monitor and the session's I/O state (the fields above): the
        # serving thread, or the main thread while a request runs (see `socket`).
        self._io = threading.Lock()
        self._want_io = False  # the serving thread waits for the socket
        self._standing_in = False  # the main thread holds it
        self._pending: collections.deque[Request] = collections.deque()  # read, not yet run
        self._wake_serving = f"inproc://lrmp-serving-{uuid.uuid4().hex}"
        self._serving_rx = sockets.inproc_pull(self._wake_serving)
        self._wake_main = f"inproc://lrmp-main-{uuid.uuid4().hex}"
        self._main_rx = sockets.inproc_pull(self._wake_main)
        self._last_busy = 0.0
        self._session: WorkerSession | None = None  # owned by the serving thread
        # The serving thread runs with this thread's torch thread count (the worker's --threads).
        self._threads = torch.get_num_threads()

    @property
    def secure(self) -> bool:
        return self.auth is not None or (self.uplink is not None and self.uplink.curve is not None)

    def serve_forever(self) -> None:
        """Serve until `stop`: requests on a thread of their own, signals and stand-in on this one."""
        serving = threading.Thread(target=self._serve, name="lrmp-serve", daemon=True)
        serving.start()
        if self.uplink is not None:
            self.uplink.start()
        signals = SignalWakeup.install()
        try:
            self._watch(signals, serving)
        finally:
            if signals is not None:
                signals.close()
            if self.uplink is not None:
                self.uplink.stop()
            self._stop_serving(serving)
            if self.auth is not None:
                self.auth.stop()

    def _stop_serving(self, serving: threading.Thread) -> None:
        """Let the serving thread end, but do not wait long for a request that is still running: a
        stopped worker must be gone at once, and the process exits without that thread anyway."""
        self._stop.set()  # also when the watch ended by an exception (Ctrl-C)
        sockets.wake(self._wake_serving)
        serving.join(timeout=_COMPUTE_GRACE)
        busy_since = self._busy_since
        if serving.is_alive() and busy_since is not None:
            log.warning(
                "stopping while a request still runs (for %s): not waiting for it",
                describe_duration(time.monotonic() - busy_since),
            )
        # A request still running does not hold the socket, and never gets it back (its thread
        # then waits for it for good: this process is about to end).
        if self._io.acquire(timeout=_COMPUTE_GRACE):
            self.sock.disable_monitor()
            self._monitor.close(0)
            self.sock.close(0)
        else:
            log.warning("the serving thread kept the socket; leaving it open")
        self._main_rx.close(0)
        self._traffic.close()

    def stop(self) -> None:
        """Stop serving (from any thread, or a signal handler)."""
        self._stop.set()
        sockets.wake(self._wake_serving)
        sockets.wake(self._wake_main)

    # --- the socket: the serving thread's, lent to the main thread during long requests -------------
    @contextlib.contextmanager
    def socket(self) -> Iterator[None]:
        """Hold the socket (and the I/O state) for the serving thread, taking it back from the main
        thread if that stands in."""
        self._take_socket()
        try:
            yield
        finally:
            self._io.release()

    def _watch(self, signals: SignalWakeup | None, serving: threading.Thread) -> None:
        """The main thread: wake for signals, and stand in for the serving thread while a request
        runs longer than `STAND_IN_AFTER`."""
        poller = zmq.Poller()
        poller.register(self._main_rx, zmq.POLLIN)
        if signals is not None:
            poller.register(signals.fileno(), zmq.POLLIN)  # the poll reports it by that number
        # The same, and the socket with its monitor: polled only while this thread holds them.
        standing_in = zmq.Poller()
        for sock in (*(sock for sock, _ in poller.sockets), self.sock, self._monitor):
            standing_in.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not serving.is_alive():
                log.critical("the serving thread ended; stopping this worker")
                self.stop()
                break
            if self.parent is not None and os.getppid() != self.parent:
                log.warning("the process that started this worker (pid %d) ended; stopping", self.parent)
                self.stop()
                break
            busy_since = self._busy_since
            if busy_since is not None and time.monotonic() - busy_since > STAND_IN_AFTER:
                self._stand_in(standing_in)
                busy_since = self._busy_since
            # Wake when a running request reaches the stand-in time; otherwise check five times a
            # second whether one started (the serving thread does not signal each request).
            wait = STAND_IN_AFTER
            if busy_since is not None:
                wait = min(wait, max(0.01, busy_since + STAND_IN_AFTER - time.monotonic()))
            for sock, _ in poller.poll(wait * 1000):
                if signals is not None and sock == signals.fileno():
                    signals.drain()  # the handler itself runs once this thread is back in Python
                elif sock is self._main_rx:
                    self._main_rx.recv()

    def _stand_in(self, poller: zmq.Poller) -> None:
        """Serve the socket until the running request returns: answer heartbeats and drivers, queue
        everything else for the serving thread. ``poller`` watches the socket, its monitor and this
        thread's wake-ups."""
        if not self._io.acquire(blocking=False):
            return  # the serving thread is sending (a pipelined result): try again soon
        try:
            self._standing_in = True
            while not self._stop.is_set() and not self._want_io and self._busy_since is not None:
                ready = dict(poller.poll(self._poll_timeout(STAND_IN_AFTER)))
                self._on_ready(ready, self._main_rx)
                if ready.keys() - {self.sock, self._monitor, self._main_rx}:
                    return  # a signal: its handler runs in the caller's loop
                self._expire_session()
        finally:
            self._standing_in = False
            self._io.release()

    def _poll_timeout(self, cap: float | None = None) -> float | None:
        """Milliseconds to sleep: until the session would expire, or ``cap`` seconds."""
        timeout = cap
        if self.admission.session is not None:
            left = max(0.0, self.admission.expires_in()) + 0.01
            timeout = left if timeout is None else min(timeout, left)
        return None if timeout is None else timeout * 1000

    def _on_ready(self, ready: dict[Any, int], wake_rx: zmq.Socket) -> None:
        """Handle what a poll found ready: messages, socket events, a wake-up (by the thread holding the socket)."""
        if self.sock in ready:
            self._read_all()
        if self._monitor in ready:
            self._on_monitor_event(self._monitor.recv_multipart())
        if wake_rx in ready:
            wake_rx.recv()

    def _read_all(self, limit: int = 64) -> None:
        """Read what the socket holds (at most ``limit`` messages): answer what the I/O side answers,
        queue the rest."""
        for _ in range(limit):
            if not self.sock.get(_EVENTS) & _POLLIN:  # asked first: a failed read raises, which costs 3x more
                return
            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)  # one waits: ZMQ_EVENTS says so
            try:
                self._on_frames(frames)
            except Exception:  # insurance: nothing a peer sends may stop the worker
                log.exception("dropped a message that could not be handled")

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            self.admission.disconnected()
            return
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and (
            event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        ):
            theirs, this = ("without", "only talks CURVE") if self.secure else ("with", "runs without --secret-key")
            self._throttle.warning("handshake", f"a client {theirs} CURVE keys tried to connect; this worker {this}")
        else:
            self._throttle.warning(
                "handshake", "a client failed the connection handshake (ZeroMQ event %s)", event["event"]
            )

    def _reply(self, peer: bytes, kind: str, req_id: int, body: Any) -> None:
        try:
            frames = protocol.encode(kind, req_id, self.admission.session or "", body)
        except ProtocolError as err:
            frames = protocol.encode(protocol.ERROR, req_id, "", error_body(err))
        sockets.send_frames(self.sock, [peer, *frames])

    def _refuse(self, peer: bytes, req_id: int, error: str | BaseException, message: str = "", **extra: Any) -> None:
        """Answer a request this worker will not run with an ERROR naming why: an exception (its
        class and message, no traceback: the sender may be anyone), or an error type and message."""
        if isinstance(error, BaseException):
            body = error_body(error, trace=False)
        else:
            body = {"type": error, "message": message}
        self._reply(peer, protocol.ERROR, req_id, {**extra, **body})

    def _on_frames(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            return  # not even an identity and a header: nothing to answer
        peer, payload = frames[0].bytes, frames[1:]
        try:
            messages = protocol.decode_all(payload, self.limits)  # one, or a bundle of a call's micro-batches
        except ProtocolVersionError as err:
            theirs = err.info.get("lrmp", "?")
            mismatch = protocol.version_mismatch("the message", err.remote_version, theirs, "this worker")
            self._refuse(peer, protocol.peek_id(payload), "ProtocolVersionError", mismatch, **versions())
            return
        except ProtocolError as err:
            self._throttle.warning("malformed", "dropped a malformed message from peer %s: %s", peer.hex()[:16], err)
            self._refuse(peer, protocol.peek_id(payload), err)
            return
        for msg in messages:
            if msg.kind not in protocol.REQUEST_KINDS:
                self._refuse(peer, msg.id, ProtocolError(f"unexpected message kind {msg.kind!r:.40}"))
                continue
            self._on_message(payload[0], parse(peer, msg))

    def _on_message(self, header: Any, request: Request) -> None:
        """Answer what the I/O side answers (heartbeats, drivers' greetings, refusals); queue the rest."""
        peer, from_peer, admission = request.peer, request.from_peer, self.admission
        if (self.auth is not None and not self._authorized(header, request)) or (
            self.uplink is not None and not admission.relay_authorized(request)
        ):
            self._refuse(
                peer,
                request.id,
                "PermissionError",
                "this connection's key belongs to a peer worker: it may only send pipelined forward/backward "
                "messages of its session",
            )
            return
        if request.kind == protocol.PING:
            alive = admission.heard(request.session)
            # The bytes this worker's connections moved: a large message on a slow link is progress.
            self._moved = self._traffic.latest()
            answer = {"session_alive": alive, "busy": self._computing(), "moved": self._moved}
            session = self._session
            if alive and session is not None and session.id == request.session:
                answer.update(session.beat())
            self._reply(peer, protocol.OK, request.id, answer)
            return
        if isinstance(request.message, Hello):
            self._on_hello(request, request.message)
            return
        if from_peer and request.session != admission.session:
            log.debug("dropped a peer message for session %s, which this worker does not serve", request.session[:8])
            return
        if admission.session is None or request.session != admission.session:
            self._refuse(
                peer,
                request.id,
                "SessionError",
                f"this worker has no session {request.session!r:.40} (it may have restarted or expired it); "
                "start a new one",
            )
            return
        if not from_peer:
            admission.heard(request.session)
        if request.kind == protocol.BYE:
            self._end_session("driver said bye")
            self._reply(peer, protocol.OK, request.id, None)
            return
        self._pending.append(request)

    def _authorized(self, header: Any, request: Request) -> bool:
        """With CURVE, by the key the message came with (`Admission.authorized`)."""
        try:
            user_id = header.get("User-Id")
        except (zmq.ZMQError, AttributeError):
            user_id = None
        role = self.auth.role(user_id) if self.auth is not None else None
        return self.admission.authorized(request, role, user_id)

    def _on_hello(self, request: Request, hello: Hello) -> None:
        """Answered by the thread that holds the socket, at once, so a driver hears back even while
        a request runs (the main thread stands in then)."""
        peer = request.peer
        refusal = self.admission.refusal(request.session, hello, computing=self._busy_since is not None)
        if refusal is not None:
            self._refuse(peer, request.id, refusal.error, refusal.message, **refusal.extra)
            return
        if self.admission.admit(request.session, hello):
            self._pending.append(Request(peer, NEW, 0, request.session, hello))
        self._reply(
            peer,
            protocol.OK,
            request.id,
            {
                **versions(),
                "pid": os.getpid(),
                "allowed_prefixes": self.allowed_prefixes,
                "limits": self.limits.as_dict(),
                "curve": self.secure,
                **describe_device(self.device),
            },
        )

    def _computing(self) -> bool:
        """Whether this worker computes: a request runs, or one ended within `_BUSY_WINDOW`."""
        return self._busy_since is not None or time.monotonic() - self._last_busy < _BUSY_WINDOW

    def _end_session(self, why: str) -> None:
        ended = self.admission.end(why)
        if ended is not None:
            self._pending.append(Request(b"", DROP, 0, ended, None))

    def _expire_session(self) -> None:
        why = self.admission.overdue()
        if why is None:
            return
        if self.uplink is not None and self._still_moving():
            self.admission.last_seen = time.monotonic()  # the driver's pings queue behind a large message
            return
        self._end_session(why)

    def _still_moving(self) -> bool:
        """Whether bytes moved since the last heartbeat (which waits behind a large message on an uplink)."""
        before, self._moved = self._moved, self._traffic.latest()
        return before is not None and self._moved is not None and self._moved - before >= MIN_PROGRESS

    # --- serving thread ------------------------------------------------------------------
    def _serve(self) -> None:
        # OpenMP's and MKL's thread counts are per thread: without this the serving thread gets one
        # OpenMP thread per core, which spin-wait between the small operations of a step (measured:
        # a 1-thread CPU worker burned 5x its compute, and starved the other workers on the machine).
        torch.set_num_threads(self._threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread too
        self._outbox = Outbox(self, self._wake_serving, self.keys, self.uplink.via if self.uplink else "")
        self._busy_since = time.monotonic()  # the main thread answers drivers meanwhile
        try:
            _warm_up()
        finally:
            self._take_socket()
            self._busy_since = None
        poller = zmq.Poller()
        for sock in (self.sock, self._monitor, self._serving_rx):
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # Read before each queued request too (heartbeats are answered between them). None queued:
                # sleep until a message, the session's expiry or a held message's retry. Idle uses no CPU.
                retry = self._outbox.flush() if self._outbox.held else None
                ready = dict(poller.poll(0 if self._pending else self._poll_timeout(retry)))
                self._on_ready(ready, self._serving_rx)
                self._expire_session()
                if self._pending and not self._stop.is_set():
                    self._run(self._pending.popleft())
        except BaseException:
            # A layer that raised SystemExit, say: a worker that stops answering would hang its driver.
            log.critical("the serving thread failed; stopping this worker", exc_info=True)
            self.stop()
        finally:
            self._outbox.close()
            self._serving_rx.close(0)
            self._io.release()

    def _take_socket(self) -> None:
        """Block until this (the serving) thread holds the socket, taking it from a standing-in main thread."""
        self._want_io = True
        if self._standing_in:
            sockets.wake(self._wake_main)
        self._io.acquire()
        self._want_io = False

    def _run(self, request: Request) -> None:
        """Run one request without holding the socket (the main thread may stand in), then reply. What
        waited for it runs next: a carried request of the driver's, peers' micro-batches (`Order.next`)."""
        session = self._session if self._session is not None and self._session.id == request.session else None
        own = request.kind in (DROP, NEW)
        if not own:
            if not request.from_peer:
                self._outbox.driver_peer = request.peer
            self._outbox.session = request.session
        self._busy_since = time.monotonic()
        self._io.release()
        try:
            frames = self._answer(request, session)
        finally:
            self._take_socket()
            self._busy_since = None
            if not own:
                self._last_busy = time.monotonic()
        if session is not None and not own:
            (carried, ready), session.order.next = session.order.next, ([], [])
            driver = self._outbox.driver_peer or request.peer
            carried_requests = [Request(driver, c.request.KIND, c.id, session.id, c.request) for c in carried]
            self._pending.extendleft(reversed([*carried_requests, *ready]))
        if frames is not None:
            if self._outbox.held:
                self._outbox.hold_reply(request.peer, frames)  # after the pipelined messages before it
            else:
                sockets.send_frames(self.sock, [request.peer, *frames])
        if self._device_failure is not None:
            raise self._device_failure  # reported first; the device is unusable: the worker stops

    def _answer(self, request: Request, session: WorkerSession | None) -> list[Any] | None:
        """Run ``request`` in its turn (`Order.run`), or start or drop a session; its reply's frames, or
        ``None`` where the reply travels otherwise or the request waits. Every failure is answered."""
        if request.kind == DROP:
            self._drop_session(request.session)
            return None
        if isinstance(request.message, Hello):  # NEW
            self._new_session(request.session, request.message)
            return None
        try:
            if session is None:
                raise request.refused or ProtocolError("session expired")
            body = session.order.run(request)
            if body is NO_REPLY or request.kind in protocol.QUIET_KINDS:
                return None
            return protocol.encode(protocol.OK, request.id, request.session, body)
        except Exception as err:  # the worker stays up, unless its GPU failed
            if device_failed(err):
                self._device_failure = err
            layer_name = session.layer_name if session is not None else None
            return failure_reply(request, err, self._throttle, self._outbox.to_driver, layer_name)

    def _new_session(self, session_id: str, hello: Hello) -> None:
        self._drop_session(None)
        self._session = WorkerSession(
            session_id,
            self.device,
            self.allowed_prefixes,
            self._outbox,
            limits=self.limits,
            announce_peer_keys=lambda keys: self.admission.announce_peer_keys(session_id, keys),
            seal_key=hello.seal_key,
        )
        self._outbox.peer_timeout = hello.heartbeat_timeout or DEFAULT_PEER_TIMEOUT
        self._outbox.driver_limits = hello.limits

    def _drop_session(self, session_id: str | None) -> None:
        if self._session is not None and (session_id is None or self._session.id == session_id):
            self._session.close()
            self._session = None
            self._outbox.close_peers()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
                if empty_host_cache is not None:  # the pinned buffers of `device_io` (where torch has it)
                    empty_host_cache()
            allocator.release()
