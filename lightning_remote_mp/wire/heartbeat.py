"""The driver's heartbeat: a background thread that pings every worker on sockets of its own, so
that a worker that dies or hangs is noticed while the driver waits for a reply, and a worker
notices a driver that vanished. Its answers also say whether a worker is computing, which driver
requests it has run, and what it holds back: what the stall checks of `lightning_remote_mp.wire.collect`
read.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping

import zmq

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.sockets import Curve, dealer, inproc_pull, send_frames, wake
from lightning_remote_mp.wire.traffic import MIN_PROGRESS, Traffic


class Heartbeat:
    """Pings every worker each ``interval`` seconds from a background thread.

    ``silent_for(address)`` says how long a worker has not answered; a worker that reports it
    no longer knows the session (it restarted) is marked ``lost``. It starts before the workers are
    greeted, so that a worker that answered keeps its session while setup waits for a late one: a
    worker that has not yet said it knows the session is not lost. ``moved_for()`` says how long
    since any worker's connections, or this process's, last moved a transfer's worth of bytes
    (`lightning_remote_mp.wire.traffic`).
    """

    def __init__(
        self,
        addresses: Iterable[str],
        session: str,
        interval: float,
        curve: Mapping[str, Curve] | None = None,
    ) -> None:
        self.addresses = list(addresses)
        self.session = session
        self.interval = interval
        self.curve = dict(curve or {})
        now = time.monotonic()
        self._last_seen = {a: now for a in self.addresses}
        self._last_busy = {a: now for a in self.addresses}  # last heartbeat that found the worker computing
        # From the last heartbeat: micro-batches a worker holds back for a driver request (count, request id).
        self.held_back: dict[str, tuple[int, int]] = {}
        # From the last heartbeat: the id of the last driver request each worker has run.
        self.ran: dict[str, int] = {}
        #: From the last heartbeat: a worker's long work, ``(what, bytes done, bytes in all)``.
        self.progress: dict[str, tuple[str, int, int]] = {}
        self.lost: dict[str, str] = {}
        self._knew: set[str] = set()  # workers that have answered that they serve this session
        self._moved: dict[str, int] = {}  # by worker address, and "" for this process: bytes at the last progress
        self._last_moved = now  # when bytes last moved anywhere
        self.blind = False  # a side whose kernel does not tell what its connections move
        self._traffic = Traffic()
        self._stop = threading.Event()
        self._wake = f"inproc://lrmp-heartbeat-{id(self)}-{time.monotonic_ns()}"
        self._wake_rx = inproc_pull(self._wake)  # used by the thread only; created here so close() can't race
        self._thread = threading.Thread(target=self._run, name="lrmp-heartbeat", daemon=True)
        self._thread.start()

    def silent_for(self, address: str) -> float:
        return time.monotonic() - self._last_seen.get(address, time.monotonic())

    def touch(self, address: str) -> None:
        self._last_seen[address] = time.monotonic()

    def idle_for(self, address: str) -> float:
        """How long the worker's heartbeats have found it not computing."""
        return time.monotonic() - self._last_busy.get(address, time.monotonic())

    def moved_for(self) -> float | None:
        """Seconds since bytes last moved on the connections of any worker or of this process (a
        transfer in progress, however slow), or ``None`` when some side cannot tell."""
        return None if self.blind else time.monotonic() - self._last_moved

    def _count_traffic(self, who: str, moved: object) -> None:
        if moved is None:
            self.blind = True
        elif type(moved) is int and moved - self._moved.setdefault(who, moved) >= MIN_PROGRESS:
            self._moved[who] = moved
            self._last_moved = time.monotonic()

    def busy(self, address: str) -> bool:
        """Whether the worker's latest heartbeats found it computing (one may be in flight, hence two intervals)."""
        return self.idle_for(address) <= 2 * self.interval

    def close(self) -> None:
        self._stop.set()
        wake(self._wake)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        socks = {a: dealer(a, curve=self.curve.get(a)) for a in self.addresses}
        by_sock = {s: a for a, s in socks.items()}
        poller = zmq.Poller()
        poller.register(self._wake_rx, zmq.POLLIN)
        for s in socks.values():
            poller.register(s, zmq.POLLIN)
        seq = 0
        try:
            while not self._stop.is_set():
                seq += 1
                for sock in socks.values():
                    try:
                        send_frames(sock, protocol.encode(protocol.PING, seq, self.session), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                self._count_traffic("", self._traffic.sample())  # what this process receives and sends
                deadline = time.monotonic() + self.interval
                while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
                    for sock, _ in poller.poll(left * 1000):
                        if sock is self._wake_rx:
                            sock.recv()
                            continue
                        address = by_sock[sock]
                        try:
                            msg = protocol.decode(sock.recv_multipart())
                        except ProtocolError:
                            continue
                        self.touch(address)
                        body = msg.body if isinstance(msg.body, dict) else {}
                        if msg.kind == protocol.OK and body.get("busy"):
                            self._last_busy[address] = time.monotonic()
                        if msg.kind == protocol.OK and "moved" in body:
                            self._count_traffic(address, body["moved"])
                        progress = body.get("progress")
                        if isinstance(progress, list) and [type(v) for v in progress] == [str, int, int]:
                            self.progress[address] = (progress[0][:80], progress[1], progress[2])
                        else:
                            self.progress.pop(address, None)
                        if type(body.get("ran")) is int:
                            self.ran[address] = body["ran"]
                        held, waits_for = body.get("held_back"), body.get("waits_for")
                        if type(held) is int and type(waits_for) is int and held > 0:
                            self.held_back[address] = (held, waits_for)
                        else:
                            self.held_back.pop(address, None)
                        if msg.kind == protocol.OK and body.get("session_alive", True):
                            self._knew.add(address)
                        elif msg.kind == protocol.OK and address in self._knew:
                            self.lost.setdefault(address, "the worker no longer knows this session (it restarted?)")
        finally:
            for s in socks.values():
                s.close(0)
            self._wake_rx.close(0)
