"""Signals wake the worker's main thread, whichever thread the OS delivers them to, and the signal
that stopped the worker is remembered so that it can say so."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable


class SignalWakeup:
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
    def install(cls) -> SignalWakeup | None:
        """A wake-up on the main thread (the only one that may install it), else ``None``."""
        return cls() if threading.current_thread() is threading.main_thread() else None

    def fileno(self) -> int:
        return self._rx.fileno()

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._rx.recv(4096):
                pass

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous)
        self._rx.close()
        self._tx.close()


class StopSignal:
    """The handler of ``signum`` (SIGTERM): calls ``stop`` and remembers the signal, so that the worker
    logs why it stopped once it has. The handler itself does not log: it runs between any two
    bytecodes of the main thread, which may hold the logging module's lock at that moment."""

    def __init__(self, stop: Callable[[], None], signum: int = signal.SIGTERM) -> None:
        self.received: str | None = None  # the signal's name, once it came
        self._stop = stop
        signal.signal(signum, self)

    def __call__(self, signum: int, frame: object) -> None:
        self.received = signal.Signals(signum).name
        self._stop()
