"""The worker's serving loop: one I/O thread on the ROUTER socket, one compute thread.

The I/O thread decodes every message, answers heartbeats at once (even while a layer runs),
admits one session at a time and expires it when its driver falls silent. The compute thread
runs requests in arrival order and hands replies back over an inproc socket. Nothing a message
carries is executed: requests only choose among the handlers of
`lightning_remote_mp.worker.session.WorkerSession`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Sequence
from typing import Any

import torch
import zmq

from lightning_remote_mp import __version__, protocol, transport
from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.worker.session import NO_REPLY, WorkerSession, describe_device

log = logging.getLogger(__name__)

DEFAULT_SESSION_TIMEOUT = 20.0
_DROP = "__drop__"


@dataclasses.dataclass
class _Task:
    peer: bytes
    msg: protocol.Message


def error_body(err: BaseException, session: WorkerSession | None = None) -> dict[str, Any]:
    layer = getattr(err, "lrmp_layer", None)
    body: dict[str, Any] = {
        "type": type(err).__name__,
        "message": str(err),
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__, limit=8)),
        "layer": layer if isinstance(layer, int) else None,
    }
    if body["layer"] is not None and session is not None:
        for stage in session.stages.values():
            if name := stage.layer_name(body["layer"]):
                body["layer_name"] = name
    return body


_PIPELINE_KINDS = frozenset({protocol.FORWARD, protocol.BACKWARD})


class _Outbox:
    """The compute thread's way out: to the driver through the I/O thread, to peers directly."""

    def __init__(self, to_io: zmq.Socket) -> None:
        self.to_io = to_io
        self.driver_peer = b""
        self.session = ""
        self._peers: dict[str, zmq.Socket] = {}

    def to_driver(self, kind: str, body: Any) -> None:
        frames = protocol.encode(kind, 0, self.session, body)
        self.to_io.send_multipart([self.driver_peer, *frames], copy=False)

    def to_peer(self, address: str, kind: str, body: Any) -> None:
        sock = self._peers.get(address)
        if sock is None:
            sock = self._peers[address] = transport.dealer(address)
        sock.send_multipart(protocol.encode(kind, 0, self.session, body), copy=False)

    def close_peers(self) -> None:
        for sock in self._peers.values():
            sock.close(0)
        self._peers.clear()

    def close(self) -> None:
        self.close_peers()


def _warm_up() -> None:
    """The first ``torch.autograd.backward`` with explicit gradients in a process imports sympy
    (seconds on a small machine); pay that before the first session needs it."""
    x = torch.ones(2, 2, requires_grad=True)
    y = x * x
    torch.autograd.backward([y], [torch.ones_like(y)])


class WorkerServer:
    """Serves sessions on ``bind`` until `stop` is called.

    Args:
        bind: ZeroMQ endpoint, e.g. ``"tcp://0.0.0.0:5555"`` (port ``*`` picks a free one).
        device: where stages live, e.g. ``"cpu"`` or ``"cuda:0"``.
        allowed_prefixes: module prefixes (beyond ``torch.nn``) whose classes may be built.
        session_timeout: seconds of driver silence after which a session is dropped.
    """

    def __init__(
        self,
        bind: str,
        device: str = "cpu",
        allowed_prefixes: Sequence[str] = (),
        session_timeout: float = DEFAULT_SESSION_TIMEOUT,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
    ) -> None:
        from lightning_remote_mp.spec import DEFAULT_ALLOWED_PREFIXES

        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"--device {device}: this machine has no CUDA device visible to torch")
            torch.cuda.set_device(self.device)
        self.allowed_prefixes = list(dict.fromkeys([*DEFAULT_ALLOWED_PREFIXES, *allowed_prefixes]))
        self.session_timeout = session_timeout
        self.limits = limits
        self.sock, self.endpoint = transport.bind_router(bind)
        self._stop = threading.Event()
        self._tasks: queue.Queue[_Task | None] = queue.Queue()
        self._inproc = f"inproc://lrmp-replies-{uuid.uuid4().hex}"
        self._replies = transport.context().socket(zmq.PULL)
        self._replies.bind(self._inproc)
        # I/O-thread state of the current session.
        self._session_id: str | None = None
        self._session_peer = ""
        self._last_seen = 0.0
        self._busy_since: float | None = None
        self._session: WorkerSession | None = None  # owned by the compute thread
        self.served = 0

    # --- I/O thread --------------------------------------------------------------------
    def serve_forever(self) -> None:
        compute = threading.Thread(target=self._compute_loop, name="lrmp-compute", daemon=True)
        compute.start()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._replies, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # Sleep until a message or the session's expiry: an idle worker uses no CPU.
                timeout = None
                if self._session_id is not None:
                    timeout = max(0.0, self.session_timeout - (time.monotonic() - self._last_seen)) * 1000 + 10
                for sock, _ in poller.poll(timeout):
                    if sock is self._replies:
                        frames = self._replies.recv_multipart(copy=False)
                        if len(frames) > 1:  # a lone frame only wakes the loop (stop)
                            self.sock.send_multipart(frames, copy=False)
                    else:
                        frames = self.sock.recv_multipart(copy=False)
                        try:
                            self._on_frames(frames)
                        except Exception:  # insurance: nothing a peer sends may stop the worker
                            log.exception("dropped a message that could not be handled")
                self._expire_session()
        finally:
            self._tasks.put(None)
            compute.join(timeout=10)
            self.sock.close(0)
            self._replies.close(0)

    def stop(self) -> None:
        """Stop serving (from any thread, or a signal handler)."""
        self._stop.set()
        wake = transport.context().socket(zmq.PUSH)
        wake.setsockopt(zmq.LINGER, 1000)
        wake.connect(self._inproc)
        wake.send(b"", zmq.NOBLOCK)
        wake.close()

    def _reply(self, peer: bytes, kind: str, req_id: int, body: Any) -> None:
        try:
            frames = protocol.encode(kind, req_id, self._session_id or "", body)
        except ProtocolError as err:
            frames = protocol.encode(protocol.ERROR, req_id, "", error_body(err))
        self.sock.send_multipart([peer, *frames], copy=False)

    def _on_frames(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            return  # not even an identity and a header: nothing to answer
        peer, payload = frames[0].bytes, frames[1:]
        try:
            msg = protocol.decode(payload, self.limits)
        except ProtocolError as err:
            log.warning("dropped a malformed message from peer %s: %s", peer.hex()[:16], err)
            self._reply(peer, protocol.ERROR, 0, error_body(err))
            return
        if msg.kind not in protocol.REQUEST_KINDS:
            self._reply(
                peer, protocol.ERROR, msg.id, error_body(ProtocolError(f"unexpected message kind {msg.kind!r:.40}"))
            )
            return
        if msg.kind == protocol.PING:
            alive = msg.session == self._session_id
            if alive:
                self._last_seen = time.monotonic()
            self._reply(peer, protocol.OK, msg.id, {"session_alive": alive, "busy": self._busy_since is not None})
            return
        if msg.kind == protocol.HELLO:
            self._on_hello(peer, msg)
            return
        from_peer = msg.kind in _PIPELINE_KINDS and isinstance(msg.body, dict) and msg.body.get("from", -1) != -1
        if from_peer and msg.session != self._session_id:
            log.debug("dropped a peer message for session %s, which this worker does not serve", msg.session[:8])
            return
        if self._session_id is None or msg.session != self._session_id:
            self._reply(
                peer,
                protocol.ERROR,
                msg.id,
                {
                    "type": "SessionError",
                    "message": f"this worker has no session {msg.session!r:.40} (it may have restarted or expired it); "
                    "start a new one",
                },
            )
            return
        if not from_peer:
            self._last_seen = time.monotonic()
        if msg.kind == protocol.BYE:
            self._end_session("driver said bye")
            self._reply(peer, protocol.OK, msg.id, None)
            return
        self._tasks.put(_Task(peer, msg))

    def _on_hello(self, peer: bytes, msg: protocol.Message) -> None:
        body = msg.body if isinstance(msg.body, dict) else {}
        driver = str(body.get("driver", "?"))[:200]
        if not msg.session:
            self._reply(peer, protocol.ERROR, msg.id, error_body(ProtocolError("hello without a session id")))
            return
        if self._session_id is not None and self._session_id != msg.session:
            self._reply(
                peer,
                protocol.ERROR,
                msg.id,
                {
                    "type": "WorkerBusy",
                    "message": f"busy, serving {self._session_peer} (session {self._session_id[:8]}); "
                    "try again when that run ends, or start another worker",
                },
            )
            return
        if self._session_id is None:
            self._session_id = msg.session
            self._session_peer = driver
            log.info("session %s started by %s", msg.session[:8], driver)
        self._last_seen = time.monotonic()
        self._tasks.put(_Task(peer, msg))

    def _end_session(self, why: str) -> None:
        if self._session_id is not None:
            log.info("session %s ended: %s", self._session_id[:8], why)
            self._tasks.put(_Task(b"", protocol.Message(_DROP, 0, self._session_id, None)))
            self._session_id = None
            self._session_peer = ""

    def _expire_session(self) -> None:
        if self._session_id is not None and time.monotonic() - self._last_seen > self.session_timeout:
            self._end_session(f"driver silent for more than {self.session_timeout:.0f} s")

    # --- compute thread ------------------------------------------------------------------
    def _compute_loop(self) -> None:
        out = transport.context().socket(zmq.PUSH)
        out.connect(self._inproc)
        self._outbox = _Outbox(out)
        _warm_up()
        try:
            while (task := self._tasks.get()) is not None:
                msg = task.msg
                if msg.kind == _DROP:
                    self._drop_session(msg.session)
                    continue
                from_peer = (
                    msg.kind in _PIPELINE_KINDS and isinstance(msg.body, dict) and msg.body.get("from", -1) != -1
                )
                if not from_peer:
                    self._outbox.driver_peer = task.peer
                self._outbox.session = msg.session
                self._busy_since = time.monotonic()
                try:
                    body = self._handle(msg)
                    if body is NO_REPLY:
                        continue
                    frames = protocol.encode(protocol.OK, msg.id, msg.session, body)
                except Exception as err:  # every failure becomes an error reply; the worker stays up
                    if not isinstance(err, ProtocolError):
                        log.warning("request %s failed: %s: %s", msg.kind, type(err).__name__, err)
                    error = error_body(err, self._session)
                    if msg.kind in _PIPELINE_KINDS:
                        # Pipelined work answers to the driver, whoever sent the message.
                        if isinstance(msg.body, dict):
                            error.update(
                                {
                                    k: msg.body.get(k)
                                    for k in ("key", "call", "mb")
                                    if isinstance(msg.body.get(k), (int, str))
                                }
                            )
                        self._outbox.to_driver(protocol.ERROR, error)
                        continue
                    frames = protocol.encode(protocol.ERROR, msg.id, msg.session, error)
                finally:
                    self._busy_since = None
                out.send_multipart([task.peer, *frames], copy=False)
        finally:
            self._outbox.close()
            out.close(0)

    def _handle(self, msg: protocol.Message) -> Any:
        if msg.kind == protocol.HELLO:
            if self._session is None or self._session.id != msg.session:
                self._drop_session(None)
                self._session = WorkerSession(msg.session, self.device, self.allowed_prefixes, self._outbox)
                self.served += 1
            return {
                "lrmp": __version__,
                "torch": torch.__version__,
                "protocol": protocol.PROTOCOL_VERSION,
                "pid": os.getpid(),
                "allowed_prefixes": self.allowed_prefixes,
                **describe_device(self.device),
            }
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
