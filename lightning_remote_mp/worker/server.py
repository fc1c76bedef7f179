"""The worker's serving loop: one thread reads, runs and answers requests; the main thread stands in.

The serving thread owns the ROUTER socket: it reads a message, runs it, and sends the reply, with no
hand-off between threads on the way (each hand-off cost a thread wake-up and a fight for the
interpreter lock: a round trip through a worker was 10x a raw pyzmq one). While a request runs
longer than `STAND_IN_AFTER`, the main thread takes the socket over and answers heartbeats at once,
admits or refuses drivers, and queues requests for the serving thread; it hands the socket back as
soon as the request returns. Either thread expires a session whose driver falls silent. The main
thread also handles signals. Nothing a message carries is executed: requests only choose among the
handlers of `lightning_remote_mp.worker.session.WorkerSession`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import queue
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import zmq

from lightning_remote_mp._version import __version__
from lightning_remote_mp.errors import ConfigurationError, PeerUnreachableError, ProtocolError, ProtocolVersionError
from lightning_remote_mp.flow import DRIVER as DRIVER_STAGE
from lightning_remote_mp.wire import protocol, transport
from lightning_remote_mp.wire.keys import KeyPair
from lightning_remote_mp.wire.requests import Hello
from lightning_remote_mp.worker import allocator
from lightning_remote_mp.worker.auth import DRIVER, WorkerAuth
from lightning_remote_mp.worker.session import NO_REPLY, WorkerSession, describe_device
from lightning_remote_mp.worker.throttle import Throttle

log = logging.getLogger(__name__)

DEFAULT_SESSION_TIMEOUT = 20.0
#: How long a stage keeps trying to hand a message to the next stage before it reports that stage
#: unreachable (the driver's heartbeat_timeout, when its HELLO says).
DEFAULT_PEER_TIMEOUT = 10.0
#: Seconds of driver silence, after one of the session's connections closed, before the session is
#: dropped (a killed driver's kernel closes its connections; a live driver pings every second).
DISCONNECT_GRACE = 3.0
#: How long a stopping worker waits for a request that is still running (a layer stuck for good,
#: say) before it leaves without it.
_COMPUTE_GRACE = 0.5
#: Seconds a request runs before the main thread takes the socket over to answer heartbeats (which
#: come every second; a driver gives up on a worker after 9 s of silence).
STAND_IN_AFTER = 0.2
#: A worker that finished a request this recently still counts as computing in its heartbeats: it
#: answers them between the short requests of a pipeline.
_BUSY_WINDOW = 1.0
#: Seconds between attempts to hand a held message to a peer that could not take it yet.
_PEER_RETRY = 0.01
_DROP = "__drop__"
_NEW = "__new__"


@dataclasses.dataclass
class _Task:
    peer: bytes
    msg: protocol.Message


def _device_failed(err: BaseException) -> bool:
    """A CUDA error: after one, the device's context is unusable for every later request too."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(err, accelerator_error):
        return True
    return isinstance(err, RuntimeError) and "CUDA error" in str(err)


def error_body(err: BaseException, session: WorkerSession | None = None, *, trace: bool = True) -> dict[str, Any]:
    """The body of an ERROR reply. ``trace=False`` leaves the traceback out: for malformed input
    from anyone, it is costly to format and tells a stranger about this worker's files."""
    layer = getattr(err, "lrmp_layer", None)
    body: dict[str, Any] = {
        "type": type(err).__name__,
        "message": str(err),
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=8)) if trace else "",
        "layer": layer if isinstance(layer, int) else None,
    }
    if body["layer"] is not None and session is not None:
        for stage in session.stages.values():
            if name := stage.layer_name(body["layer"]):
                body["layer_name"] = name
    return body


_PIPELINE_KINDS = frozenset({protocol.FORWARD, protocol.BACKWARD})


def _from_peer(msg: protocol.Message) -> bool:
    """A pipelined message sent by another stage (not by the driver)."""
    if msg.kind not in _PIPELINE_KINDS or not isinstance(msg.body, dict):
        return False
    sender = msg.body.get("from", DRIVER_STAGE)
    return type(sender) is int and sender != DRIVER_STAGE


@dataclasses.dataclass
class _Held:
    """A message the outbox sends later: once its tensors' copies off the GPU are done (``ready``),
    or, with ``ready=None``, once the messages before it have gone (sends keep their order)."""

    frames: list[Any]
    ready: Any  # a torch.cuda.Event, or None
    about: dict[str, Any]  # the micro-batch a failure is reported for (key, call, mb)
    driver: bytes | None = None  # for the driver (or a requester): its identity on the server socket
    peer: str = ""  # else for the peer worker at this address
    kind: str = ""
    give_up_at: float | None = None  # once a peer could not take it: when it is reported unreachable


class _CopyWaiter:
    """A thread that sleeps on each held message's copy (a blocking-sync CUDA event) and wakes the
    serving loop when it is done, so that the loop sleeps in its poll meanwhile, not checking
    events in a spin. A failed copy (a CUDA error) wakes it too: the loop's ``query`` raises it."""

    def __init__(self, wake_endpoint: str) -> None:
        self._endpoint = wake_endpoint
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lrmp-copies", daemon=True)
        self._thread.start()

    def watch(self, event: Any) -> None:
        self._events.put(event)

    def stop(self) -> None:
        self._events.put(None)
        self._thread.join(timeout=_COMPUTE_GRACE)

    def _run(self) -> None:
        wake = transport.inproc_push(self._endpoint)
        try:
            while (event := self._events.get()) is not None:
                with contextlib.suppress(Exception):
                    event.synchronize()
                with contextlib.suppress(zmq.Again):
                    wake.send(b"", zmq.NOBLOCK)
        finally:
            wake.close(0)


class _Outbox:
    """The serving thread's way out: to the driver through the server's socket, to peers directly.

    Peer links are DEALER sockets with ``IMMEDIATE`` set, so a message only goes to a connected
    (and, with CURVE, authenticated) peer; one that cannot be handed over within ``peer_timeout``
    fails the micro-batch with `PeerUnreachableError` instead of waiting forever.

    A message whose tensors are still being copied off a GPU (``ready``, an event: see
    `lightning_remote_mp.worker.device_io`) is *held*, as is every message after it, and sent in
    order by `flush`, which the serving loop calls whenever it wakes: the worker reads and starts
    the next micro-batch while the GPU finishes the last one, and a `_CopyWaiter` wakes the loop
    when a copy is done. On CPU nothing is ever held.
    """

    def __init__(self, server: WorkerServer, keys: KeyPair | None = None) -> None:
        self.server = server
        self.keys = keys
        self.driver_peer = b""
        self.session = ""
        self.peer_timeout = DEFAULT_PEER_TIMEOUT
        self.driver_limits = protocol.DEFAULT_LIMITS  # what the session's driver accepts (its HELLO)
        self.peer_keys: dict[str, bytes] = {}  # address -> public key, announced by the driver
        self._peers: dict[str, zmq.Socket] = {}
        self._held: collections.deque[_Held] = collections.deque()
        self._copies: _CopyWaiter | None = None  # started by the first held copy: never on CPU

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def to_driver(self, kind: str, body: Any, ready: Any = None, about: dict[str, Any] | None = None) -> None:
        """Send to the driver (from a request's handler: the socket is taken for the send)."""
        frames = protocol.encode(kind, 0, self.session, body)
        if ready is not None or self._held:
            self._hold(_Held(frames, ready, about or {}, driver=self.driver_peer))
            return
        with self.server.socket():
            self._send_driver(self.driver_peer, frames)

    def to_driver_all(self, kind: str, answers: Sequence[tuple[Any, Any, dict[str, Any] | None]]) -> None:
        """Send several messages to the driver as bundles (`protocol.encode_all`): one send, one
        wake-up of the driver, for a call's answers. Each bundle stays within the driver's limits
        (its HELLO says them); messages whose tensors are still being copied off a GPU go one by
        one, in order."""
        if self._held or any(ready is not None for _, ready, _ in answers):
            for body, ready, about in answers:
                self.to_driver(kind, body, ready, about)
            return
        encoded = [protocol.encode(kind, 0, self.session, body) for body, _, _ in answers]
        with self.server.socket():
            for bundle in protocol.encode_all(encoded, self.driver_limits):
                self._send_driver(self.driver_peer, bundle)

    def to_peer(
        self, address: str, kind: str, body: Any, ready: Any = None, about: dict[str, Any] | None = None
    ) -> None:
        held = _Held(protocol.encode(kind, 0, self.session, body), ready, about or {}, peer=address, kind=kind)
        if ready is not None or self._held:
            self._hold(held)
            return
        while not self._offer(held):  # raises once the peer has refused it for peer_timeout
            self._socket(address).poll(100, zmq.POLLOUT)

    def hold_reply(self, peer: bytes, frames: list[Any]) -> None:
        """Send a reply behind the held messages (the socket's holder calls this)."""
        self._hold(_Held(frames, None, {}, driver=peer))

    def _hold(self, held: _Held) -> None:
        self._held.append(held)
        if held.ready is not None:
            if self._copies is None:
                self._copies = _CopyWaiter(self.server._wake_serving)
            self._copies.watch(held.ready)

    def _send_driver(self, peer: bytes, frames: list[Any]) -> None:
        self.server.sock.send_multipart([peer, *frames], copy=False)

    def flush(self) -> float | None:
        """Send the held messages that can go, in order (by the thread that holds the socket).

        Returns ``None`` when the rest wait for their copies (the copy waiter wakes the loop), or
        the seconds after which to try again, when a peer could not take its message yet. A send
        that fails is reported to the driver as its micro-batch's ERROR; so is a failed copy, which
        is then raised: after a CUDA error the device is unusable, and the worker stops.
        """
        while self._held:
            held = self._held[0]
            try:
                if held.ready is not None and not held.ready.query():
                    return None
            except Exception as err:
                self._held.popleft()
                self._report(err, held.about)
                raise
            try:
                if held.driver is not None:
                    self._send_driver(held.driver, held.frames)
                elif not self._offer(held):
                    return _PEER_RETRY
            except Exception as err:
                self._report(err, held.about)
            self._held.popleft()
        return None

    def _offer(self, held: _Held) -> bool:
        """Try once to hand a message to its peer; raise once it has been refused for ``peer_timeout``."""
        try:
            self._socket(held.peer).send_multipart(held.frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            now = time.monotonic()
            if held.give_up_at is None:
                held.give_up_at = now + self.peer_timeout
            if now > held.give_up_at:
                raise self._unreachable(held.peer, held.kind) from None
            return False

    def _report(self, err: Exception, about: dict[str, Any]) -> None:
        error = {**error_body(err), **about}
        self._send_driver(self.driver_peer, protocol.encode(protocol.ERROR, 0, self.session, error))

    def _unreachable(self, address: str, kind: str) -> PeerUnreachableError:
        return PeerUnreachableError(
            f"could not hand a {kind} message to the worker at {address} within {self.peer_timeout:.0f} s: no "
            "connection to it from this worker (is it reachable from here, not only from the driver, and does "
            "it accept this worker's key?)"
        )

    def add_peer_keys(self, keys: dict[str, bytes]) -> None:
        self.peer_keys.update(keys)

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._peers.get(address)
        if sock is None:
            curve = None
            if self.keys is not None:
                server_key = self.peer_keys.get(address)
                if server_key is None:
                    raise PeerUnreachableError(
                        f"no public key was announced for the worker at {address}; this worker talks to its "
                        "peers only over CURVE (the driver sends their keys at setup)"
                    )
                curve = transport.Curve(self.keys, server_key)
            sock = self._peers[address] = transport.dealer(address, curve=curve, immediate=True)
        return sock

    def close_peers(self) -> None:
        self._held.clear()  # the session's messages: its driver is gone
        for sock in self._peers.values():
            sock.close(0)
        self._peers.clear()
        self.peer_keys.clear()

    def close(self) -> None:
        self.close_peers()
        if self._copies is not None:
            self._copies.stop()


def describe_duration(seconds: float) -> str:
    """``"0.4 s"``, ``"12 s"``, ``"3 min 12 s"``, ``"2 h 5 min"``: a span of time as people say it."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s"
    return f"{whole // 3600} h {whole % 3600 // 60} min"


class _SignalWakeup:
    """Makes the main thread's poll return when a signal arrives, whichever thread receives it.

    Python runs signal handlers in the main thread only, between bytecodes, but the OS may deliver
    SIGTERM to any thread that does not block it (the serving thread, torch's threads): a main
    thread asleep in ``zmq_poll`` then never runs the handler. Stopping a worker after a session
    took 10 s (and a SIGKILL) that way. `signal.set_wakeup_fd` writes a byte for every signal, from
    any thread, to a socket that this poll watches.
    """

    def __init__(self) -> None:
        self._rx, self._tx = socket.socketpair()
        self._rx.setblocking(False)
        self._tx.setblocking(False)
        self._previous = signal.set_wakeup_fd(self._tx.fileno(), warn_on_full_buffer=False)

    @classmethod
    def install(cls) -> _SignalWakeup | None:
        """A wake-up on the main thread (the only one that may install it), else ``None``."""
        return cls() if threading.current_thread() is threading.main_thread() else None

    def fileno(self) -> int:
        return self._rx.fileno()

    def drain(self) -> None:
        try:
            while self._rx.recv(4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        self._rx.close()
        self._tx.close()


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
    ) -> None:
        from lightning_remote_mp.model.spec import DEFAULT_ALLOWED_PREFIXES

        if (keys is None) != (authorized_keys is None):
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
        self.session_timeout = session_timeout
        self.limits = limits
        self.keys = keys
        # I/O-thread state of the current session.
        self._session_id: str | None = None
        self._session_peer = ""
        self._last_seen = 0.0
        self._session_started = 0.0
        self._busy_since: float | None = None
        self._session_peer_keys: dict[str, frozenset[bytes]] = {}  # session -> announced peer keys
        # The authenticator must answer before the first client can complete a handshake.
        self.auth = (
            WorkerAuth(transport.context(), authorized_keys, self._current_peer_keys)
            if keys is not None and authorized_keys is not None
            else None
        )
        try:
            self.sock, self.endpoint = transport.bind_router(bind, keys=keys, limits=limits)
        except BaseException:
            if self.auth is not None:
                self.auth.stop()
            raise
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED
        )
        self._disconnected_at: float | None = None  # a connection closed during the session: its driver's?
        self._throttle = Throttle(log)
        self._stop = threading.Event()
        # Who uses the ROUTER socket, the monitor and the session's I/O state (the fields above): the
        # serving thread, or the main thread while a request runs (see `socket`).
        self._io = threading.Lock()
        self._want_io = False  # the serving thread waits for the socket
        self._standing_in = False  # the main thread holds it
        self._pending: collections.deque[_Task] = collections.deque()  # read, not yet run
        self._wake_serving = f"inproc://lrmp-serving-{uuid.uuid4().hex}"
        self._serving_rx = transport.inproc_pull(self._wake_serving)
        self._wake_main = f"inproc://lrmp-main-{uuid.uuid4().hex}"
        self._main_rx = transport.inproc_pull(self._wake_main)
        self._last_busy = 0.0
        self._device_failure: Exception | None = None  # a CUDA error, raised once reported: the worker stops
        self._session: WorkerSession | None = None  # owned by the serving thread
        self.served = 0
        # The serving thread runs with this thread's torch thread count (the worker's --threads).
        self._threads = torch.get_num_threads()

    @property
    def secure(self) -> bool:
        return self.auth is not None

    def _current_peer_keys(self) -> frozenset[bytes]:
        return self._session_peer_keys.get(self._session_id or "", frozenset())

    def announce_peer_keys(self, session: str, keys: Sequence[bytes]) -> None:
        """Called by the serving thread at SETUP: the keys of this session's other workers."""
        self._session_peer_keys = {session: self._session_peer_keys.get(session, frozenset()) | frozenset(keys)}

    def serve_forever(self) -> None:
        """Serve until `stop`: requests on a thread of their own, signals and stand-in on this one."""
        serving = threading.Thread(target=self._serve, name="lrmp-serve", daemon=True)
        serving.start()
        signals = _SignalWakeup.install()
        try:
            self._watch(signals, serving)
        finally:
            if signals is not None:
                signals.close()
            self._stop_serving(serving)
            if self.auth is not None:
                self.auth.stop()

    def _stop_serving(self, serving: threading.Thread) -> None:
        """Let the serving thread end, but do not wait long for a request that is still running: a
        stopped worker must be gone at once, and the process exits without that thread anyway."""
        self._stop.set()  # also when the watch ended by an exception (Ctrl-C)
        transport.wake(self._wake_serving)
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

    def stop(self) -> None:
        """Stop serving (from any thread, or a signal handler)."""
        self._stop.set()
        transport.wake(self._wake_serving)
        transport.wake(self._wake_main)

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

    def _watch(self, signals: _SignalWakeup | None, serving: threading.Thread) -> None:
        """The main thread: wake for signals, and stand in for the serving thread while a request
        runs longer than `STAND_IN_AFTER`."""
        poller = zmq.Poller()
        poller.register(self._main_rx, zmq.POLLIN)
        if signals is not None:
            poller.register(signals.fileno(), zmq.POLLIN)  # the poll reports it by that number
        # The same, and the socket with its monitor: polled only while this thread holds them.
        standing_in = zmq.Poller()
        for sock, _ in poller.sockets:
            standing_in.register(sock, zmq.POLLIN)
        standing_in.register(self.sock, zmq.POLLIN)
        standing_in.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            if not serving.is_alive():
                log.critical("the serving thread ended; stopping this worker")
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
        if self._session_id is not None:
            left = max(0.0, self._expires_in()) + 0.01
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
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._on_frames(frames)
            except Exception:  # insurance: nothing a peer sends may stop the worker
                log.exception("dropped a message that could not be handled")

    def _on_monitor_event(self, frames: list[bytes]) -> None:
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_DISCONNECTED:
            if self._session_id is not None and self._disconnected_at is None:
                self._disconnected_at = time.monotonic()
            return
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and (
            event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        ):
            if self.secure:
                self._throttle.warning(
                    "handshake", "a client without CURVE keys tried to connect; this worker only talks CURVE"
                )
            else:
                self._throttle.warning(
                    "handshake", "a client with CURVE keys tried to connect; this worker runs without --secret-key"
                )
        else:
            self._throttle.warning(
                "handshake", "a client failed the connection handshake (ZeroMQ event %s)", event["event"]
            )

    def _reply(self, peer: bytes, kind: str, req_id: int, body: Any) -> None:
        try:
            frames = protocol.encode(kind, req_id, self._session_id or "", body)
        except ProtocolError as err:
            frames = protocol.encode(protocol.ERROR, req_id, "", error_body(err))
        self.sock.send_multipart([peer, *frames], copy=False)

    def _refuse(self, peer: bytes, req_id: int, error: str | BaseException, message: str = "", **extra: Any) -> None:
        """Answer a request this worker will not run with an ERROR naming why: an exception (its
        class and message, no traceback: the sender may be anyone), or an error type and message."""
        if isinstance(error, BaseException):
            body = error_body(error, trace=False)
        else:
            body = {"type": error, "message": message}
        self._reply(peer, protocol.ERROR, req_id, {**extra, **body})

    def _versions(self) -> dict[str, Any]:
        return {"protocol": protocol.PROTOCOL_VERSION, "lrmp": __version__, "torch": torch.__version__}

    def _on_frames(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            return  # not even an identity and a header: nothing to answer
        peer, payload = frames[0].bytes, frames[1:]
        try:
            messages = protocol.decode_all(payload, self.limits)  # one, or a bundle of a call's micro-batches
        except ProtocolVersionError as err:
            theirs = err.info.get("lrmp", "?")
            mismatch = protocol.version_mismatch("the message", err.remote_version, theirs, "this worker")
            self._refuse(peer, protocol.peek_id(payload), "ProtocolVersionError", mismatch, **self._versions())
            return
        except ProtocolError as err:
            self._throttle.warning("malformed", "dropped a malformed message from peer %s: %s", peer.hex()[:16], err)
            self._refuse(peer, protocol.peek_id(payload), err)
            return
        for msg in messages:
            self._on_message(peer, payload[0], msg)

    def _on_message(self, peer: bytes, header: Any, msg: protocol.Message) -> None:
        """Answer what the I/O side answers (heartbeats, drivers' greetings, refusals); queue the rest."""
        if msg.kind not in protocol.REQUEST_KINDS:
            self._refuse(peer, msg.id, ProtocolError(f"unexpected message kind {msg.kind!r:.40}"))
            return
        from_peer = _from_peer(msg)
        if self.auth is not None and not self._authorized(header, msg, from_peer):
            self._refuse(
                peer,
                msg.id,
                "PermissionError",
                "this connection's key belongs to a peer worker: it may only send pipelined forward/backward "
                "messages of its session",
            )
            return
        if msg.kind == protocol.PING:
            alive = msg.session == self._session_id
            if alive:
                self._last_seen = time.monotonic()
            answer = {"session_alive": alive, "busy": self._computing()}
            session = self._session
            if alive and session is not None and session.id == msg.session:
                answer.update(session.held_back())  # what waits for the driver: named when the pipeline stalls
                answer["ran"] = session.driver_ran  # the driver's requests up to this one have run
            self._reply(peer, protocol.OK, msg.id, answer)
            return
        if msg.kind == protocol.HELLO:
            self._on_hello(peer, msg)
            return
        if from_peer and msg.session != self._session_id:
            log.debug("dropped a peer message for session %s, which this worker does not serve", msg.session[:8])
            return
        if self._session_id is None or msg.session != self._session_id:
            self._refuse(
                peer,
                msg.id,
                "SessionError",
                f"this worker has no session {msg.session!r:.40} (it may have restarted or expired it); "
                "start a new one",
            )
            return
        if not from_peer:
            self._last_seen = time.monotonic()
        if msg.kind == protocol.BYE:
            self._end_session("driver said bye")
            self._reply(peer, protocol.OK, msg.id, None)
            return
        self._pending.append(_Task(peer, msg))

    def _authorized(self, header: Any, msg: protocol.Message, from_peer: bool) -> bool:
        """With CURVE: drivers may send anything; a peer worker's key only its session's pipeline."""
        try:
            user_id = header.get("User-Id")
        except (zmq.ZMQError, AttributeError):
            user_id = None
        role = self.auth.role(user_id) if self.auth is not None else None
        if role == DRIVER:
            return True
        if from_peer and user_id and msg.session == self._session_id:
            return user_id.encode() in self._current_peer_keys()
        return False

    def _on_hello(self, peer: bytes, msg: protocol.Message) -> None:
        """Answered by the thread that holds the socket, at once, so a driver hears back even while
        a request runs (the main thread stands in then)."""
        hello = Hello.from_body(msg.body)
        if not msg.session:
            self._refuse(peer, msg.id, ProtocolError("hello without a session id"))
            return
        if hello.protocol_version != protocol.PROTOCOL_VERSION:
            mismatch = protocol.version_mismatch("the driver", hello.protocol_version, hello.lrmp, "this worker")
            self._refuse(peer, msg.id, "ProtocolVersionError", mismatch, **self._versions())
            return
        if self._session_id is not None and self._session_id != msg.session:
            self._refuse(
                peer,
                msg.id,
                "WorkerBusy",
                self._busy_message(),
                silent_for=time.monotonic() - self._last_seen,
                expires_in=max(0.0, self._expires_in()),
            )
            return
        if self._session_id is None:
            self._session_id = msg.session
            self._session_peer = hello.driver
            self._session_started = time.monotonic()
            log.info("session %s started by %s", msg.session[:8], hello.driver)
            if (hello.lrmp, hello.torch) != (__version__, torch.__version__):
                log.warning(
                    "driver %s runs lrmp %s / torch %s; this worker runs lrmp %s / torch %s",
                    hello.driver,
                    hello.lrmp,
                    hello.torch,
                    __version__,
                    torch.__version__,
                )
            self._pending.append(_Task(peer, protocol.Message(_NEW, 0, msg.session, hello)))
        self._last_seen = time.monotonic()
        self._reply(
            peer,
            protocol.OK,
            msg.id,
            {
                **self._versions(),
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

    def _busy_message(self) -> str:
        """Why another driver is refused, with what it needs to decide whether to wait: how long the
        running session has lasted, and when it would expire if its driver were gone."""
        now = time.monotonic()
        silent = now - self._last_seen
        computing = ", computing now" if self._busy_since is not None else ""
        return (
            f"busy, serving {self._session_peer} (session {(self._session_id or '')[:8]}) for "
            f"{describe_duration(now - self._session_started)}{computing}; its driver was last heard from "
            f"{describe_duration(silent)} ago. A session is dropped after {describe_duration(self.session_timeout)} "
            f"of driver silence (--session-timeout; {describe_duration(DISCONNECT_GRACE)} once its connection "
            f"closed), so if that driver is gone this one ends within {describe_duration(self._expires_in())}; "
            "otherwise try again when its run ends, or start another worker"
        )

    def _end_session(self, why: str) -> None:
        self._disconnected_at = None
        if self._session_id is not None:
            log.info("session %s ended: %s", self._session_id[:8], why)
            self._pending.append(_Task(b"", protocol.Message(_DROP, 0, self._session_id, None)))
            self._session_peer_keys.pop(self._session_id, None)
            self._session_id = None
            self._session_peer = ""

    def _expires_in(self) -> float:
        """Seconds until the current session is dropped unless its driver is heard from.

        A killed driver's connections are closed by its kernel: once a connection closes, a session
        whose driver stays silent for `DISCONNECT_GRACE` (three of its heartbeats) is dropped then,
        not after the whole --session-timeout. A live driver pings every second, so a connection of
        somebody else closing (a refused driver, a scanner) cannot end its session.
        """
        now = time.monotonic()
        left = self.session_timeout - (now - self._last_seen)
        if self._disconnected_at is not None:
            if self._last_seen > self._disconnected_at:
                self._disconnected_at = None  # the driver spoke since: not its connection
            else:
                left = min(left, DISCONNECT_GRACE - (now - self._disconnected_at))
        return left

    def _expire_session(self) -> None:
        if self._session_id is None or self._expires_in() > 0:
            return
        if time.monotonic() - self._last_seen > self.session_timeout:
            self._end_session(f"driver silent for more than {self.session_timeout:.0f} s")
        else:
            self._end_session(f"a connection closed and the driver has been silent for {DISCONNECT_GRACE:.0f} s since")

    # --- serving thread ------------------------------------------------------------------
    def _serve(self) -> None:
        # OpenMP's and MKL's thread counts are per thread: without this the serving thread gets one
        # OpenMP thread per core, which spin-wait between the small operations of a step (measured:
        # a 1-thread CPU worker burned 5x its compute, and starved the other workers on the machine).
        torch.set_num_threads(self._threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread too
        self._outbox = _Outbox(self, self.keys)
        self._busy_since = time.monotonic()  # the main thread answers drivers meanwhile
        try:
            _warm_up()
        finally:
            self._take_socket()
            self._busy_since = None
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._serving_rx, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # Read before each queued request too, so heartbeats are answered between them. With
                # nothing queued, sleep until a message or the session's expiry: an idle worker uses no CPU.
                # Messages held for their copies off a GPU go as soon as they can.
                retry = self._outbox.flush() if self._outbox.holding else None
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
            transport.wake(self._wake_main)
        self._io.acquire()
        self._want_io = False

    def _run(self, task: _Task) -> None:
        """Run one request without holding the socket (the main thread may stand in), then reply.
        A peer's micro-batch that the driver sent after a request this worker has not run yet
        waits for it (`WorkerSession.hold_back`); it runs right after that request."""
        msg = task.msg
        session = self._session if self._session is not None and self._session.id == msg.session else None
        from_peer = _from_peer(msg)
        from_driver = msg.kind not in (_DROP, _NEW) and not from_peer
        if msg.kind not in (_DROP, _NEW):
            if from_driver:
                self._outbox.driver_peer = task.peer
            self._outbox.session = msg.session
        self._busy_since = time.monotonic()
        self._io.release()
        try:
            frames = self._answer(task, session if from_peer else None)
        finally:
            self._take_socket()
            self._busy_since = None
            if msg.kind not in (_DROP, _NEW):
                self._last_busy = time.monotonic()
        if session is not None and from_driver:
            self._pending.extendleft(reversed(session.ran(msg.id)))
        if frames is not None:
            if self._outbox.holding:
                self._outbox.hold_reply(task.peer, frames)  # after the pipelined messages before it
            else:
                self.sock.send_multipart([task.peer, *frames], copy=False)
        if self._device_failure is not None:
            raise self._device_failure

    def _answer(self, task: _Task, peer_session: WorkerSession | None) -> list[Any] | None:
        """Run a request; its reply's frames, or ``None`` where the reply travels otherwise (or the
        request waits: a peer's micro-batch that ``peer_session``, the session it belongs to, holds
        back for a driver request, `WorkerSession.hold_back`)."""
        msg = task.msg
        if msg.kind == _DROP:
            self._drop_session(msg.session)
            return None
        if msg.kind == _NEW:
            self._new_session(msg.session, msg.body)
            return None
        try:
            if peer_session is not None and peer_session.hold_back(msg.body, task):
                return None
            body = self._handle(msg)
            if body is NO_REPLY or msg.kind in protocol.QUIET_KINDS:
                return None
            return protocol.encode(protocol.OK, msg.id, msg.session, body)
        except Exception as err:  # every failure becomes an error reply; the worker stays up, unless its GPU failed
            if _device_failed(err):
                self._device_failure = err  # reported first, then raised by `_run`: the worker stops
            if not isinstance(err, ProtocolError):
                self._throttle.warning(
                    "failed:" + msg.kind, "request %s failed: %s: %s", msg.kind, type(err).__name__, err
                )
            error = error_body(err, self._session)
            if msg.kind in _PIPELINE_KINDS:
                # Pipelined work answers to the driver, whoever sent the message.
                if isinstance(msg.body, dict):
                    error.update(
                        {k: msg.body.get(k) for k in ("key", "call", "mb") if isinstance(msg.body.get(k), (int, str))}
                    )
                self._outbox.to_driver(protocol.ERROR, error)
                return None
            if msg.kind in protocol.QUIET_KINDS:
                error["posted"] = msg.kind  # the driver did not wait for it: its next read raises this
            return protocol.encode(protocol.ERROR, msg.id, msg.session, error)

    def _new_session(self, session_id: str, hello: Hello) -> None:
        self._drop_session(None)
        self._session = WorkerSession(
            session_id,
            self.device,
            self.allowed_prefixes,
            self._outbox,
            limits=self.limits,
            announce_peer_keys=lambda keys: self.announce_peer_keys(session_id, keys),
        )
        self._outbox.peer_timeout = hello.heartbeat_timeout or DEFAULT_PEER_TIMEOUT
        self._outbox.driver_limits = hello.limits
        self.served += 1

    def _handle(self, msg: protocol.Message) -> Any:
        if self._session is None or self._session.id != msg.session:
            raise ProtocolError("session expired")
        return self._session.handle(msg.kind, msg.body)

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
