"""Which driver a worker serves: a session admitted at its driver's HELLO, other drivers refused
while it lasts, and the session expired once its driver falls silent.

A worker serves one session at a time. `Admission` holds that session's identity and clock: who
started it and when, when its driver was last heard from, whether one of its connections closed,
and the keys of the peer workers its stages may hear from. Whichever thread holds the server's
socket (`lightning_remote_mp.worker.server`) asks it; it sends nothing and queues nothing itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from lightning_remote_mp._version import __version__
from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.requests import Hello
from lightning_remote_mp.worker.auth import DRIVER
from lightning_remote_mp.worker.request import Request

log = logging.getLogger(__name__)

DEFAULT_SESSION_TIMEOUT = 20.0
#: Seconds of driver silence, after one of the session's connections closed, before the session is
#: dropped (a killed driver's kernel closes its connections; a live driver pings every second).
DISCONNECT_GRACE = 3.0


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


def versions() -> dict[str, Any]:
    """What this worker speaks and runs, as its HELLO answer and a version refusal say it."""
    return {"protocol": protocol.PROTOCOL_VERSION, "lrmp": __version__, "torch": torch.__version__}


class Refusal:
    """Why a request is not admitted: an exception (its class and message are sent, no traceback),
    or an error type and message, with details for the driver (``extra``)."""

    def __init__(self, error: str | BaseException, message: str = "", **extra: Any) -> None:
        self.error, self.message, self.extra = error, message, extra


class Admission:
    """The session a worker serves, if any (see the module docstring).

    Args:
        session_timeout: seconds of driver silence after which the session is dropped.
    """

    def __init__(self, session_timeout: float = DEFAULT_SESSION_TIMEOUT) -> None:
        self.session_timeout = session_timeout
        self.session: str | None = None  # the session served now
        self.driver = ""  # who started it, as its HELLO says
        self.started = 0.0
        self.last_seen = 0.0
        self.disconnected_at: float | None = None  # a connection closed during the session: its driver's?
        self._peer_keys: dict[str, frozenset[bytes]] = {}  # session -> announced peer keys

    # --- who may send what ---------------------------------------------------------------
    def peer_keys(self) -> frozenset[bytes]:
        """The keys of the current session's other workers (the authenticator lets them connect)."""
        return self._peer_keys.get(self.session or "", frozenset())

    def announce_peer_keys(self, session: str, keys: Sequence[bytes]) -> None:
        """Called by the serving thread at SETUP: the keys of this session's other workers."""
        self._peer_keys = {session: self._peer_keys.get(session, frozenset()) | frozenset(keys)}

    def authorized(self, request: Request, role: str | None, user_id: str | None) -> bool:
        """With CURVE: drivers may send anything; a peer worker's key only its session's pipeline."""
        if role == DRIVER:
            return True
        if request.from_peer and user_id and request.session == self.session:
            return user_id.encode() in self.peer_keys()
        return False

    def relay_authorized(self, request: Request) -> bool:
        """Dialed in: a peer's message relayed by the driver (origin ``r:``) may only be its session's pipeline."""
        if not request.peer.startswith(b"r:"):
            return True
        return request.from_peer and request.session == self.session

    # --- admitting a driver ----------------------------------------------------------------
    def refusal(self, session: str, hello: Hello, computing: bool) -> Refusal | None:
        """Why the driver of ``session`` is not admitted (``computing``: a request runs now), or ``None``."""
        if not session:
            return Refusal(ProtocolError("hello without a session id"))
        if hello.protocol_version != protocol.PROTOCOL_VERSION:
            mismatch = protocol.version_mismatch("the driver", hello.protocol_version, hello.lrmp, "this worker")
            return Refusal("ProtocolVersionError", mismatch, **versions())
        if self.session is not None and self.session != session:
            return Refusal(
                "WorkerBusy",
                self._busy_message(computing),
                silent_for=time.monotonic() - self.last_seen,
                expires_in=max(0.0, self.expires_in()),
            )
        return None

    def admit(self, session: str, hello: Hello) -> bool:
        """Serve ``session`` (not refused: see `refusal`), its driver heard from now. Whether it is a
        new session (then a new `WorkerSession` is to be started)."""
        new = self.session is None
        if new:
            self.session = session
            self.driver = hello.driver
            self.started = time.monotonic()
            log.info("session %s started by %s", session[:8], hello.driver)
            if (hello.lrmp, hello.torch) != (__version__, torch.__version__):
                log.warning(
                    "driver %s runs lrmp %s / torch %s; this worker runs lrmp %s / torch %s",
                    hello.driver,
                    hello.lrmp,
                    hello.torch,
                    __version__,
                    torch.__version__,
                )
        self.last_seen = time.monotonic()
        return new

    def heard(self, session: str) -> bool:
        """Whether ``session`` is the one served; if so, its driver counts as heard from now."""
        if session != self.session:
            return False
        self.last_seen = time.monotonic()
        return True

    def _busy_message(self, computing: bool) -> str:
        """Why another driver is refused, with what it needs to decide whether to wait: how long the
        running session has lasted, and when it would expire if its driver were gone."""
        now = time.monotonic()
        silent = now - self.last_seen
        computing_now = ", computing now" if computing else ""
        return (
            f"busy, serving {self.driver} (session {(self.session or '')[:8]}) for "
            f"{describe_duration(now - self.started)}{computing_now}; its driver was last heard from "
            f"{describe_duration(silent)} ago. A session is dropped after {describe_duration(self.session_timeout)} "
            f"of driver silence (--session-timeout; {describe_duration(DISCONNECT_GRACE)} once its connection "
            f"closed), so if that driver is gone this one ends within {describe_duration(self.expires_in())}; "
            "otherwise try again when its run ends, or start another worker"
        )

    # --- ending ------------------------------------------------------------------------------
    def disconnected(self) -> None:
        """A connection closed: its driver's, if the driver stays silent (`expires_in`)."""
        if self.session is not None and self.disconnected_at is None:
            self.disconnected_at = time.monotonic()

    def expires_in(self) -> float:
        """Seconds until the current session is dropped unless its driver is heard from.

        A killed driver's connections are closed by its kernel: once a connection closes, a session
        whose driver stays silent for `DISCONNECT_GRACE` (three of its heartbeats) is dropped then,
        not after the whole --session-timeout. A live driver pings every second, so a connection of
        somebody else closing (a refused driver, a scanner) cannot end its session.
        """
        now = time.monotonic()
        left = self.session_timeout - (now - self.last_seen)
        if self.disconnected_at is not None:
            if self.last_seen > self.disconnected_at:
                self.disconnected_at = None  # the driver spoke since: not its connection
            else:
                left = min(left, DISCONNECT_GRACE - (now - self.disconnected_at))
        return left

    def overdue(self) -> str | None:
        """Why the current session is to be dropped now (its driver silent too long), or ``None``."""
        if self.session is None or self.expires_in() > 0:
            return None
        if time.monotonic() - self.last_seen > self.session_timeout:
            return f"driver silent for more than {self.session_timeout:.0f} s"
        return f"a connection closed and the driver has been silent for {DISCONNECT_GRACE:.0f} s since"

    def end(self, why: str) -> str | None:
        """End the current session (logged with ``why``); the session that ended, if there was one."""
        self.disconnected_at = None
        ended = self.session
        if ended is not None:
            log.info("session %s ended: %s", ended[:8], why)
            self._peer_keys.pop(ended, None)
            self.session = None
            self.driver = ""
        return ended
