"""The driver's end of workers that dial in (``lrmp-worker --connect``): one listening socket that
every such worker's single connection reaches, and that carries all of its traffic.

A worker behind NAT or an inbound firewall cannot be dialled, so it dials the driver instead and
keeps one connection open: its *uplink* (`lightning_remote_mp.worker.uplink`). The switchboard
is a thread of the driver process that owns two ROUTER sockets:

- ``listen`` (TCP, CURVE server with keys): uplinks connect here, announcing the worker's name
  (routing id ``w:NAME``); so do the sockets through which other workers send to a dial-in worker
  (``r:NAME/...``: a relay, see `lightning_remote_mp.wire.addresses.relay_address`);
- an inproc endpoint, where this process's own sockets for ``dial://NAME`` connect (``d:NAME/...``:
  the driver's `~lightning_remote_mp.wire.transport.Connection` and heartbeat).

Every message towards a worker goes down its uplink with one extra frame, the *origin* (the routing
id of the socket that sent it); every message up an uplink names the origin it answers. The
worker's uplink gives each origin a socket of its own on the worker's server, so the server sees
the driver and each relaying peer as it would over direct connections, and tells their roles by the
origin's prefix: only this thread writes it (``d:`` for what came from this process, ``r:`` for what
came from another worker), so a worker cannot pass for the driver. With CURVE, the listening socket
admits only the workers' public keys, and an uplink's name must be its own key's.

Nothing here decodes what it forwards (ZeroMQ frames pass by reference); only an uplink's
announcement is read. A message for a worker whose link is down is dropped, as a network drops
it: the driver's heartbeat names that worker.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from lightning_remote_mp.errors import ConfigurationError, WorkerLostError
from lightning_remote_mp.wire import protocol, sockets
from lightning_remote_mp.wire.addresses import DIAL, address_towards
from lightning_remote_mp.wire.keys import KeyPair

log = logging.getLogger(__name__)

#: The first frame after the routing id of an uplink's announcement (a message has a header there).
ANNOUNCE = b""
#: What an uplink says every `ANNOUNCE_INTERVAL` seconds: ``[ANNOUNCE, HELLO, protocol, lrmp]``.
HELLO = b"lrmp-uplink"
WELCOME = b"welcome"
ANNOUNCE_INTERVAL = 1.0
#: Seconds setup still waits for the missing workers after one was refused (a wrong key, a name not
#: in hosts): the refused one is most likely a missing worker, whose setup cannot succeed.
REFUSAL_GRACE = 2.0
_ZAP_DOMAIN = "lrmp-driver"


@dataclasses.dataclass
class Link:
    """A worker's uplink, as the switchboard knows it."""

    routing_id: bytes
    peer_address: str  # where its connection comes from (as this machine sees it: after NAT)
    protocol_version: int | None
    lrmp: str


class Switchboard:
    """Listens at ``listen`` for workers that dial in, and carries their traffic.

    Args:
        listen: the endpoint to bind, e.g. ``"tcp://0.0.0.0:7000"`` (port ``*``: a free one).
        keys: this driver's CURVE key pair: workers must know its public key.
        worker_keys: with ``keys``, each expected worker's public key by name: only these keys may
            connect, and each only under its name.
        limits: the largest frame accepted (``frame_cap``).
    """

    def __init__(
        self,
        listen: str,
        *,
        keys: KeyPair | None = None,
        worker_keys: Mapping[str, bytes] | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
    ) -> None:
        if (keys is None) != (worker_keys is None):
            raise ConfigurationError("a switchboard with CURVE needs both the driver's key pair and the workers' keys")
        self.keys = keys
        self.worker_keys = dict(worker_keys or {})
        self.links: dict[str, Link] = {}
        self.strangers: dict[str, str] = {}  # names that announced without being expected: name -> why refused
        self.refused_keys: set[bytes] = set()  # keys that are none of the workers', refused at the handshake
        self._refused_at: float | None = None  # when a worker was first refused
        self._changed = threading.Condition()
        self._auth: ThreadAuthenticator | None = None
        # The listening socket has a context of its own, so that its ZAP handler cannot clash with
        # a worker's in this process; the inproc one shares the driver's sockets' context.
        self._ctx = zmq.Context()
        self.local_endpoint = f"inproc://lrmp-switchboard-{uuid.uuid4().hex}"
        try:
            self._tcp = self._listening(listen, limits)
            self.endpoint = bytes(self._tcp.getsockopt(zmq.LAST_ENDPOINT)).decode()
            self._local = sockets.context().socket(zmq.ROUTER)
            _router_options(self._local)
            self._local.bind(self.local_endpoint)
        except zmq.ZMQError as err:
            self._close_sockets()
            raise ConfigurationError(f"listen={listen!r}: cannot listen there for workers to dial in: {err}") from None
        self._stop = threading.Event()
        self._wake = f"inproc://lrmp-switchboard-wake-{uuid.uuid4().hex}"
        self._wake_rx = sockets.inproc_pull(self._wake)
        self._thread = threading.Thread(target=self._run, name="lrmp-switchboard", daemon=True)
        self._thread.start()
        log.info("listening on %s for workers that dial in", self.endpoint)

    def _listening(self, listen: str, limits: protocol.Limits) -> zmq.Socket:
        sock = sockets.keep_alive(self._ctx.socket(zmq.ROUTER))
        _router_options(sock)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a worker that reconnects takes its name back
        sock.setsockopt(zmq.MAXMSGSIZE, limits.frame_cap)
        if self.keys is not None:
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(__name__ + ".zap"))
            self._auth.start()
            self._auth.configure_curve_callback(_ZAP_DOMAIN, credentials_provider=self)
            sock.curve_secretkey = self.keys.secret
            sock.curve_publickey = self.keys.public
            sock.curve_server = True
            sock.zap_domain = _ZAP_DOMAIN.encode()
        sock.bind(listen)
        return sock

    def callback(self, domain: str, key: bytes) -> bool:
        """The ZAP handler's question: may the client with this public key connect?"""
        if key in self.worker_keys.values():
            return True
        self._refused_at = self._refused_at or time.monotonic()
        if key not in self.refused_keys:
            self.refused_keys.add(key)
            log.warning("refused a worker dialling in with public key %s: not among the workers' keys", key.decode())
        return False

    # --- what the driver asks -----------------------------------------------------------------
    def wait_for(self, names: Iterable[str], timeout: float) -> None:
        """Block until every worker in ``names`` has dialed in; after ``timeout`` seconds, or
        `REFUSAL_GRACE` after a worker was refused, raise `WorkerLostError` naming those missing
        (and who dialed in instead)."""
        names = list(names)
        start = time.monotonic()
        deadline = start + timeout
        with self._changed:
            while (missing := [n for n in names if n not in self.links]) and (left := deadline - time.monotonic()) > 0:
                if self._refused_at is not None and time.monotonic() - self._refused_at > REFUSAL_GRACE:
                    break
                self._changed.wait(min(left, 0.5))
        if missing:
            waited = time.monotonic() - start
            raise WorkerLostError(self._missing_message(names, missing, waited), address=DIAL + missing[0])
        for name in names:
            link = self.links[name]
            if link.protocol_version != protocol.PROTOCOL_VERSION:
                raise WorkerLostError(
                    protocol.version_mismatch(
                        f"worker {name!r} (dialed in from {link.peer_address})",
                        link.protocol_version,
                        link.lrmp,
                        "this driver",
                    ),
                    address=DIAL + name,
                )

    def _missing_message(self, names: list[str], missing: list[str], waited: float) -> str:
        arrived = [f"{n} (from {self.links[n].peer_address})" for n in names if n in self.links]
        others = [f"{n} ({why})" for n, why in self.strangers.items()]
        if self.refused_keys:
            count = len(self.refused_keys)
            others.append(f"{count} connection key{'s' if count > 1 else ''} that none of the workers has")
        return (
            f"waited {waited:.0f} s for the workers that dial in to {self.endpoint}"
            + (" (connect_timeout)" if self._refused_at is None else ", until one was refused")
            + ": "
            f"{', '.join(missing)} {'has' if len(missing) == 1 else 'have'} not dialed in"
            + (f"; dialed in: {', '.join(arrived)}" if arrived else "")
            + (f"; refused: {', '.join(others)}" if others else "")
            + f". Start `lrmp-worker --connect tcp://<this machine>:{self.port} --name NAME` on each, and check "
            f"that it reaches this machine's port {self.port}"
            + (" and that its --secret-key pairs with the public key given for it" if self.keys is not None else "")
        )

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])

    def via_toward(self, address: str) -> str:
        """``host:port`` of this switchboard as the worker at ``address`` (``tcp://``) reaches it:
        the listening host, or, when that is a wildcard, this machine's address on the route there."""
        host = self.endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
        if host in ("0.0.0.0", "*", "::", ""):
            host = address_towards(address)
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def close(self) -> None:
        self._stop.set()
        sockets.wake(self._wake)
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for name in ("_tcp", "_local", "_wake_rx"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # --- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in (self._tcp, self._local, self._wake_rx):
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(1000):
                for _ in range(256):  # bounded: the other socket gets its turn
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    try:
                        if sock is self._tcp:
                            self._from_worker(frames)
                        elif sock is self._local:
                            self._from_driver(frames)
                    except Exception:  # insurance: nothing a worker sends may stop the switchboard
                        log.exception("dropped a message the switchboard could not forward")

    def _from_driver(self, frames: list[Any]) -> None:
        """``[d:NAME/..., payload...]`` from this process: down NAME's uplink. Nothing answers for a
        worker that is not connected: the driver's heartbeat names it, as any silent worker."""
        name = frames[0].bytes[2:].partition(b"/")[0].decode("ascii", "replace")
        link = self.links.get(name)
        if link is not None:
            _send(self._tcp, [link.routing_id, frames[0], *frames[1:]])

    def _from_worker(self, frames: list[Any]) -> None:
        sender = frames[0].bytes
        if sender.startswith(b"w:"):
            name = sender[2:].decode("ascii", "replace")
            if not self._is_own_key(name, frames[0]):
                return
            if len(frames) >= 2 and frames[1].bytes == ANNOUNCE:
                self._announced(name, sender, frames)
                return
            if len(frames) < 3:
                return
            origin = frames[1].bytes
            if origin.startswith(b"d:" + name.encode() + b"/"):
                _send(self._local, [frames[1], *frames[2:]])
            elif origin.startswith(b"r:" + name.encode() + b"/"):
                _send(self._tcp, [frames[1], *frames[2:]])
        elif sender.startswith(b"r:"):  # a worker sends to a dial-in peer
            link = self.links.get(sender[2:].partition(b"/")[0].decode("ascii", "replace"))
            if link is not None and len(frames) >= 2:
                _send(self._tcp, [link.routing_id, frames[0], *frames[1:]])

    def _is_own_key(self, name: str, frame: Any) -> bool:
        """With CURVE: whether the connection that sent ``frame`` proved the key given for ``name``."""
        if self.keys is None:
            return True
        try:
            user_id = frame.get("User-Id")
        except (zmq.ZMQError, AttributeError):
            user_id = None
        expected = self.worker_keys.get(name)
        if expected is not None and user_id == expected.decode("ascii"):
            return True
        self._refused_at = self._refused_at or time.monotonic()
        if name not in self.strangers:
            why = "not a worker in hosts" if expected is None else "its key is not the one given for it"
            self.strangers[name] = why
            log.warning("refused a worker that dialed in as %r: %s", name, why)
        return False

    def _announced(self, name: str, routing_id: bytes, frames: list[Any]) -> None:
        parts = [f.bytes for f in frames[2:5]]
        if not parts or parts[0] != HELLO:
            return
        try:
            version: int | None = int(parts[1])
        except (IndexError, ValueError):
            version = None
        lrmp = parts[2].decode("ascii", "replace")[:40] if len(parts) > 2 else "?"
        try:
            peer = frames[0].get("Peer-Address")
        except (zmq.ZMQError, AttributeError):
            peer = "?"
        with self._changed:
            known = self.links.get(name)
            self.links[name] = Link(routing_id, peer, version, lrmp)
            self._changed.notify_all()
        if known is None or known.peer_address != peer:
            log.info("worker %r dialed in from %s", name, peer)
            _send(self._tcp, [routing_id, ANNOUNCE, WELCOME])


def _router_options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a message for a peer that is gone raises instead of vanishing
    sock.setsockopt(zmq.SNDHWM, 0)  # what the pipeline has in flight is bounded already: never drop it
    sock.setsockopt(zmq.RCVHWM, 0)


def _send(sock: zmq.Socket, frames: list[Any]) -> None:
    """Forward ``frames``; dropped when their first names no connected peer."""
    try:
        sockets.send_frames(sock, frames)
    except zmq.ZMQError as err:
        if err.errno != zmq.EHOSTUNREACH:
            raise
