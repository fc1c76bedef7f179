"""A TCP relay on 127.0.0.1 for tests: a wiretap that records every byte it forwards, and a
switch that silently drops traffic (a network partition) while keeping the connections open."""

from __future__ import annotations

import selectors
import socket
import threading
import time


class Relay:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (``"tcp://127.0.0.1:N"``) in a background thread.

        ``captured()`` returns the byte stream of each direction of each connection (up to ``max_capture``
        in all);
        ``partition()`` starts dropping everything; ``heal()`` ends the partition (the connections it cut
    are reset, as TCP's are after a long outage, and new ones pass); ``close()`` stops the thread and
    closes every socket.
        ``delay`` holds back what the *first* client to connect sends by that many seconds (a slow link
        for that client only; later clients' bytes pass at once).
    """

    def __init__(self, target: str, max_capture: int = 64 * 1024 * 1024, delay: float = 0.0) -> None:
        host, _, port = target.removeprefix("tcp://").rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.max_capture = max_capture
        self._capture: dict[tuple[int, int], bytearray] = {}
        self._captured = 0
        self._lock = threading.Lock()
        self._dropping = threading.Event()
        self._healing = threading.Event()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self.delay = delay
        self._slow: socket.socket | None = None  # the first client, whose bytes are held back
        self._held: list[tuple[float, socket.socket, bytes]] = []  # (due, destination, bytes), in order
        self._thread = threading.Thread(target=self._run, name="test-relay", daemon=True)
        self._thread.start()

    def captured(self) -> list[bytes]:
        with self._lock:
            return [bytes(b) for b in self._capture.values()]

    def partition(self) -> None:
        self._dropping.set()

    def heal(self) -> None:
        self._healing.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ, None)
        try:
            while not self._stop.is_set():
                if self._healing.is_set():
                    for s in self._socks:
                        try:
                            sel.unregister(s)
                        except (KeyError, ValueError):
                            pass
                        s.close()
                    self._socks.clear()
                    self._dropping.clear()
                    self._healing.clear()
                for key, _ in sel.select(0.005 if self._held else 0.05):
                    if key.data is None:
                        self._accept(sel)
                    else:
                        self._forward(sel, key.fileobj, key.data)
                while self._held and self._held[0][0] <= time.monotonic():
                    _, dst, data = self._held.pop(0)
                    self._send(dst, data)
        finally:
            sel.close()
            for s in [self.listener, *self._socks]:
                s.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            client, _ = self.listener.accept()
        except BlockingIOError:
            return
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        for s in (client, upstream):
            s.setblocking(True)
            s.settimeout(5)
        self._socks += [client, upstream]
        if self.delay and self._slow is None:
            self._slow = client
        sel.register(client, selectors.EVENT_READ, upstream)
        sel.register(upstream, selectors.EVENT_READ, client)

    def _forward(self, sel: selectors.BaseSelector, src: socket.socket, dst: socket.socket) -> None:
        try:
            data = src.recv(65536)
        except OSError:
            data = b""
        if not data:
            for s in (src, dst):
                try:
                    sel.unregister(s)
                except (KeyError, ValueError):
                    pass
                s.close()
            return
        if self._dropping.is_set():
            return
        with self._lock:
            room = self.max_capture - self._captured
            if room > 0:
                self._capture.setdefault((src.fileno(), dst.fileno()), bytearray()).extend(data[:room])
                self._captured += min(room, len(data))
        if src is self._slow:
            self._held.append((time.monotonic() + self.delay, dst, data))
        else:
            self._send(dst, data)

    @staticmethod
    def _send(dst: socket.socket, data: bytes) -> None:
        try:
            dst.sendall(data)
        except OSError:
            pass


def wait_for(predicate, timeout: float, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
