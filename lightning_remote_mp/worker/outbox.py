"""The serving thread's way out: to the driver through the server's socket, to peer workers directly.

Answers to the driver leave through the worker's one ROUTER socket, which the serving thread
borrows for each send (`WorkerServer.socket`: the main thread may be standing in with it). Messages
to peers leave through a DEALER socket per peer. On a GPU, a message whose tensors are still being
copied off the device is *held*, with every message after it, and sent in order once its copy is
done: the worker reads and starts the next micro-batch meanwhile. On CPU nothing is ever held.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from lightning_remote_mp.errors import PeerUnreachableError
from lightning_remote_mp.wire import protocol, sockets
from lightning_remote_mp.wire.addresses import RELAY
from lightning_remote_mp.wire.keys import KeyPair
from lightning_remote_mp.worker.request import error_body

#: How long a stage keeps trying to hand a message to the next stage before it reports that stage
#: unreachable (the driver's heartbeat_timeout, when its HELLO says).
DEFAULT_PEER_TIMEOUT = 10.0
#: Seconds between attempts to hand a held message to a peer that could not take it yet.
PEER_RETRY = 0.01
#: How long a peer whose connection closed may take to accept this worker's again before a message
#: to it fails: a worker that stopped (killed, out of memory) closes its connections, and the next
#: stage would otherwise wait its whole peer timeout for it (30 s per message with a driver's
#: heartbeat_timeout of 30 s; the driver, bringing the weights back, waited for those). A network
#: that only drops packets closes no connection: that waits the peer timeout as before.
PEER_GONE_GRACE = 3.0
#: How long a stopping outbox waits for its copy waiter.
_STOP_GRACE = 0.5


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
        self._thread.join(timeout=_STOP_GRACE)

    def _run(self) -> None:
        wake = sockets.inproc_push(self._endpoint)
        try:
            while (event := self._events.get()) is not None:
                with contextlib.suppress(Exception):
                    event.synchronize()
                with contextlib.suppress(zmq.Again):
                    wake.send(b"", zmq.NOBLOCK)
        finally:
            wake.close(0)


class SocketHolder(Protocol):
    """Who holds the socket to the driver and lends it for each send (the `WorkerServer`)."""

    sock: zmq.Socket

    def socket(self) -> contextlib.AbstractContextManager[None]:
        """Hold the socket for the duration of a send."""
        ...


class Outbox:
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

    def __init__(
        self, holder: SocketHolder, wake_endpoint: str, keys: KeyPair | None = None, relay_via: str = ""
    ) -> None:
        self.holder = holder  # the server: its socket to the driver, lent to this thread for each send
        self.wake_endpoint = wake_endpoint  # wakes the serving loop when a held copy is done
        self.keys = keys
        self.relay_via = relay_via  # a dial-in worker's driver (host:port): where relays without a host go
        self.driver_peer = b""
        self.session = ""
        self.peer_timeout = DEFAULT_PEER_TIMEOUT
        self.driver_limits = protocol.DEFAULT_LIMITS  # what the session's driver accepts (its HELLO)
        self.peer_keys: dict[str, bytes] = {}  # address -> public key, announced by the driver
        self._peers: dict[str, zmq.Socket] = {}
        # Each peer socket's connection events, and since when its connection is closed.
        self._monitors: dict[str, zmq.Socket] = {}
        self._closed_since: dict[str, float] = {}
        #: Messages waiting for their tensors' copies off the GPU, in order (a plain attribute: the
        #: serving loop reads it after every request). Never any on CPU.
        self.held: collections.deque[_Held] = collections.deque()
        self._copies: _CopyWaiter | None = None  # started by the first held copy: never on CPU

    def to_driver(
        self,
        kind: str,
        body: Any,
        ready: Any = None,
        about: dict[str, Any] | None = None,
        compression: str | None = None,
    ) -> None:
        """Send to the driver (from a request's handler: the socket is taken for the send), floating
        tensors compressed as ``compression`` says (`wire.compression.COMPRESSIONS`)."""
        frames = protocol.encode(kind, 0, self.session, body, compression=compression)
        if ready is not None or self.held:
            self._hold(_Held(frames, ready, about or {}, driver=self.driver_peer))
            return
        with self.holder.socket():
            self._send_driver(self.driver_peer, frames)

    def to_driver_all(
        self, kind: str, answers: Sequence[tuple[Any, Any, dict[str, Any] | None]], compression: str | None = None
    ) -> None:
        """Send several messages to the driver as bundles (`protocol.encode_all`): one send, one
        wake-up of the driver, for a call's answers. Each bundle stays within the driver's limits
        (its HELLO says them); messages whose tensors are still being copied off a GPU go one by
        one, in order."""
        if self.held or any(ready is not None for _, ready, _ in answers):
            for body, ready, about in answers:
                self.to_driver(kind, body, ready, about, compression)
            return
        encoded = [protocol.encode(kind, 0, self.session, body, compression=compression) for body, _, _ in answers]
        with self.holder.socket():
            for bundle in protocol.encode_all(encoded, self.driver_limits):
                self._send_driver(self.driver_peer, bundle)

    def to_peer(
        self,
        address: str,
        kind: str,
        body: Any,
        ready: Any = None,
        about: dict[str, Any] | None = None,
        compression: str | None = None,
    ) -> None:
        frames = protocol.encode(kind, 0, self.session, body, compression=compression)
        held = _Held(frames, ready, about or {}, peer=address, kind=kind)
        if ready is not None or self.held:
            self._hold(held)
            return
        while not self._offer(held):  # raises once the peer has refused it for peer_timeout
            self._socket(address).poll(100, zmq.POLLOUT)

    def hold_reply(self, peer: bytes, frames: list[Any]) -> None:
        """Send a reply behind the held messages (the socket's holder calls this)."""
        self._hold(_Held(frames, None, {}, driver=peer))

    def _hold(self, held: _Held) -> None:
        self.held.append(held)
        if held.ready is not None:
            if self._copies is None:
                self._copies = _CopyWaiter(self.wake_endpoint)
            self._copies.watch(held.ready)

    def _send_driver(self, peer: bytes, frames: list[Any]) -> None:
        sockets.send_frames(self.holder.sock, [peer, *frames])

    def flush(self) -> float | None:
        """Send the held messages that can go, in order (by the thread that holds the socket).

        Returns ``None`` when the rest wait for their copies (the copy waiter wakes the loop), or
        the seconds after which to try again, when a peer could not take its message yet. A send
        that fails is reported to the driver as its micro-batch's ERROR; so is a failed copy, which
        is then raised: after a CUDA error the device is unusable, and the worker stops.
        """
        while self.held:
            held = self.held[0]
            try:
                if held.ready is not None and not held.ready.query():
                    return None
            except Exception as err:
                self.held.popleft()
                self._report(err, held.about)
                raise
            try:
                if held.driver is not None:
                    self._send_driver(held.driver, held.frames)
                elif not self._offer(held):
                    return PEER_RETRY
            except Exception as err:
                self._report(err, held.about)
            self.held.popleft()
        return None

    def _offer(self, held: _Held) -> bool:
        """Try once to hand a message to its peer; raise once it has been refused for ``peer_timeout``."""
        try:
            sockets.send_frames(self._socket(held.peer), held.frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            now = time.monotonic()
            if held.give_up_at is None:
                held.give_up_at = now + self.peer_timeout
            if now > held.give_up_at:
                raise self._unreachable(held.peer, held.kind) from None
            closed = self._closed_for(held.peer, now)
            if closed is not None and closed > PEER_GONE_GRACE:
                raise PeerUnreachableError(
                    f"could not hand a {held.kind} message to the worker at {held.peer}: its connection to this "
                    f"worker closed at least {closed:.0f} s ago and it has not accepted a new one (has it stopped?)"
                ) from None
            return False

    def _closed_for(self, address: str, now: float) -> float | None:
        """Seconds since this outbox saw the connection to the peer at ``address`` closed (its events
        are read here, when a message waits for the peer), ``None`` while it is open (or was never made)."""
        monitor = self._monitors.get(address)
        while monitor is not None and monitor.poll(0):
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._closed_since.setdefault(address, now)
            elif event == zmq.EVENT_CONNECTED:
                self._closed_since.pop(address, None)
        since = self._closed_since.get(address)
        return None if since is None else now - since

    def _report(self, err: Exception, about: dict[str, Any]) -> None:
        error = {**error_body(err), **about}
        self._send_driver(self.driver_peer, protocol.encode(protocol.ERROR, 0, self.session, error))

    def _unreachable(self, address: str, kind: str) -> PeerUnreachableError:
        return PeerUnreachableError(
            f"could not hand a {kind} message to the worker at {address} within {self.peer_timeout:.0f} s: no "
            "connection to it from this worker (is it reachable from here, not only from the driver, and does "
            "it accept this worker's key?)"
        )

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
                curve = sockets.Curve(self.keys, server_key)
            route = address
            if address.startswith(RELAY + "/"):  # through the driver this worker dialed
                route = RELAY + self.relay_via + address[len(RELAY) :]
            sock = self._peers[address] = sockets.dealer(route, curve=curve, immediate=True)
            self._monitors[address] = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        return sock

    def close_peers(self) -> None:
        self.held.clear()  # the session's messages: its driver is gone
        for address, sock in self._peers.items():
            sock.disable_monitor()
            self._monitors.pop(address).close(0)
            sock.close(0)
        self._peers.clear()
        self._closed_since.clear()
        self.peer_keys.clear()

    def close(self) -> None:
        self.close_peers()
        if self._copies is not None:
            self._copies.stop()
