"""A worker that dials in (``lrmp-worker --connect``): its one connection, out to the driver.

A machine behind NAT or an inbound firewall (a rented cloud container, an office desktop) cannot
be dialled, but it can dial. Such a worker listens on nothing: its server's socket is bound
in-process only, and an `Uplink` thread holds a single outgoing connection to the driver's
switchboard (`lightning_remote_mp.wire.switchboard`). Everything the worker receives comes down
that connection with its *origin* (the driver's connection, its heartbeat, a peer relaying
through the driver); the uplink gives each origin an in-process socket of its own on the server,
named after it, so the server serves it exactly as it serves a direct connection, and sends each
answer back up with its origin. The server tells the driver's origins (``d:``) from peers' (``r:``),
which the switchboard writes and a worker cannot forge, as it tells CURVE keys apart.

The uplink announces the worker's name every second: the driver learns of it, and after a
reconnect (a cable plugged back in) it learns again. ZeroMQ reconnects by itself.

>>> Uplink.routing_id("gpu-a")
b'w:gpu-a'
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from lightning_remote_mp._version import __version__
from lightning_remote_mp.wire import protocol, sockets
from lightning_remote_mp.wire.keys import KeyPair
from lightning_remote_mp.wire.switchboard import ANNOUNCE, ANNOUNCE_INTERVAL, HELLO, WELCOME
from lightning_remote_mp.worker.throttle import Throttle

log = logging.getLogger(__name__)

#: Origins (a driver's or a peer's connections) whose socket has been idle this long are closed
#: once there are more than `_KEEP_ORIGINS`: each session of a driver brings new ones.
_IDLE_ORIGIN = 120.0
_KEEP_ORIGINS = 16
_MECHANISM_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH


class Uplink:
    """Carries a dial-in worker's traffic between the driver at ``connect`` and the server's
    in-process ``endpoint``.

    Args:
        connect: the driver's switchboard, ``tcp://host:port``.
        name: the name the driver knows this worker by (``hosts=["gpu-a", ...]``).
        endpoint: the server's in-process endpoint.
        keys: this worker's CURVE key pair; with ``driver_key`` the connection is encrypted, and
            the driver must prove that key.
        limits: the largest frame accepted from the driver.
    """

    def __init__(
        self,
        connect: str,
        name: str,
        endpoint: str,
        *,
        keys: KeyPair | None = None,
        driver_key: bytes | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
    ) -> None:
        self.connect = connect
        self.name = name
        self.endpoint = endpoint
        self.curve = sockets.Curve(keys, driver_key) if keys is not None and driver_key is not None else None
        self.limits = limits
        self._throttle = Throttle(log)
        self._stop = threading.Event()
        self._wake = f"inproc://lrmp-uplink-wake-{uuid.uuid4().hex}"
        self._wake_rx = sockets.inproc_pull(self._wake)
        self._thread = threading.Thread(target=self._run, name="lrmp-uplink", daemon=True)

    @staticmethod
    def routing_id(name: str) -> bytes:
        return b"w:" + name.encode("ascii")

    @property
    def via(self) -> str:
        """``host:port`` of the driver this worker dialed: where its relays to peers go."""
        return self.connect[len("tcp://") :]

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        sockets.wake(self._wake)
        self._thread.join(timeout=2)

    def _run(self) -> None:
        up = sockets.dealer(self.connect, curve=self.curve, limits=self.limits, connect=False)
        up.setsockopt(zmq.ROUTING_ID, self.routing_id(self.name))
        up.setsockopt(zmq.IMMEDIATE, 1)  # nothing queues for a driver that is not connected: it is lost, as on TCP
        up.setsockopt(zmq.SNDHWM, 0)
        up.setsockopt(zmq.RCVHWM, 0)
        monitor = up.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        up.connect(self.connect)
        origins: dict[bytes, zmq.Socket] = {}
        by_socket: dict[zmq.Socket, bytes] = {}
        used: dict[bytes, float] = {}
        poller = zmq.Poller()
        for sock in (up, monitor, self._wake_rx):
            poller.register(sock, zmq.POLLIN)
        next_announce = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_announce:
                    next_announce = now + ANNOUNCE_INTERVAL
                    hello = [ANNOUNCE, HELLO, str(protocol.PROTOCOL_VERSION).encode(), __version__.encode()]
                    with contextlib.suppress(zmq.Again):  # not connected (yet, or any more): the next one goes
                        sockets.send_frames(up, hello, zmq.NOBLOCK)
                for sock, _ in poller.poll(int(max(0.0, next_announce - time.monotonic()) * 1000)):
                    if sock is self._wake_rx:
                        sock.recv()
                    elif sock is monitor:
                        self._on_event(parse_monitor_message(monitor.recv_multipart()))
                    elif sock is up:
                        self._down(up, origins, by_socket, used, poller)
                    else:
                        self._up(up, sock, by_socket[sock], used)
                self._forget_idle(origins, by_socket, used, poller)
        finally:
            for sock in origins.values():
                sock.close(0)
            up.disable_monitor()
            monitor.close(0)
            up.close(0)
            self._wake_rx.close(0)

    def _down(
        self,
        up: zmq.Socket,
        origins: dict[bytes, zmq.Socket],
        by_socket: dict[zmq.Socket, bytes],
        used: dict[bytes, float],
        poller: zmq.Poller,
    ) -> None:
        """What the driver sent: ``[origin, payload...]`` to the server, from that origin's socket."""
        for _ in range(256):
            try:
                frames = up.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            origin = frames[0].bytes
            if origin == ANNOUNCE:
                if len(frames) > 1 and frames[1].bytes == WELCOME:
                    log.info("connected to the driver at %s as %r", self.connect, self.name)
                continue
            if len(frames) < 2 or not origin.startswith((b"d:", b"r:")):
                continue
            sock = origins.get(origin)
            if sock is None:
                sock = sockets.context().socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.ROUTING_ID, origin)  # the server answers this origin by its name
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                sock.connect(self.endpoint)
                origins[origin] = sock
                by_socket[sock] = origin
                poller.register(sock, zmq.POLLIN)
            used[origin] = time.monotonic()
            sockets.send_frames(sock, frames[1:])

    def _up(self, up: zmq.Socket, sock: zmq.Socket, origin: bytes, used: dict[bytes, float]) -> None:
        """What the server answered an origin: up to the driver, naming the origin."""
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            used[origin] = time.monotonic()
            try:
                sockets.send_frames(up, [origin, *frames], zmq.NOBLOCK)
            except zmq.Again:
                self._throttle.warning("lost", "the driver at %s is not connected: an answer was lost", self.connect)

    def _forget_idle(
        self,
        origins: dict[bytes, zmq.Socket],
        by_socket: dict[zmq.Socket, bytes],
        used: dict[bytes, float],
        poller: zmq.Poller,
    ) -> None:
        if len(origins) <= _KEEP_ORIGINS:
            return
        now = time.monotonic()
        for origin in [o for o, t in used.items() if now - t > _IDLE_ORIGIN]:
            sock = origins.pop(origin)
            poller.unregister(sock)
            del by_socket[sock], used[origin]
            sock.close(0)

    def _on_event(self, event: Mapping[str, Any]) -> None:
        kind = event["event"]
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            log.debug("link to %s up", self.connect)
        elif kind == zmq.EVENT_DISCONNECTED:
            log.debug("link to the driver at %s dropped; reconnecting", self.connect)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            self._throttle.warning(
                "refused",
                "the driver at %s refused this worker's key: give the driver this worker's public key (NAME.key) "
                "in curve.worker_public_keys",
                self.connect,
            )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and event["value"] == _MECHANISM_MISMATCH:
            self._throttle.warning(
                "refused",
                "the driver at %s and this worker disagree on CURVE: both need keys (curve=CurveOptions(...) there, "
                "--secret-key and --authorized-keys here), or neither",
                self.connect,
            )
        else:
            self._throttle.warning(
                "refused",
                "the handshake with the driver at %s failed (ZeroMQ event %s): is the driver's public key the one in "
                "--authorized-keys, and is that address a driver's listen= port?",
                self.connect,
                kind,
            )
