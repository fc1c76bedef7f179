"""HELLO: both sides learn each other's protocol, lrmp and torch versions before anything else.

A different wire protocol is an error naming both versions, raised at connect; a different lrmp or
torch version is a warning on both sides (the protocol is what must match).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import msgpack
import pytest
import torch
import zmq

from lightning_remote_mp import ProtocolVersionError, __version__
from lightning_remote_mp.driver.session import DriverSession
from lightning_remote_mp.wire import protocol

pytestmark = pytest.mark.timeout(120)


class FakeWorker:
    """A ROUTER on 127.0.0.1 that answers every request OK, with ``hello`` as its HELLO reply and
    ``version`` as the protocol version in its headers."""

    def __init__(self, hello: dict[str, Any], version: int = protocol.PROTOCOL_VERSION) -> None:
        self.hello = hello
        self.version = version
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            peer, header, *_ = self.sock.recv_multipart()
            _, kind, req_id, session, _, _ = msgpack.unpackb(header, raw=False)
            body = self.hello if kind == protocol.HELLO else {"session_alive": True}
            packed = msgpack.ExtType(0, msgpack.packb(body))
            reply = msgpack.packb([self.version, protocol.OK, req_id, session, [], packed])
            self.sock.send_multipart([peer, reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close(0)


def _hello_body(**overrides: Any) -> dict[str, Any]:
    body = {
        "protocol": protocol.PROTOCOL_VERSION,
        "lrmp": __version__,
        "torch": torch.__version__,
        "pid": 1,
        "device": "cpu",
        "device_name": "cpu",
        "free_memory": 2**30,
    }
    body.update(overrides)
    return body


def test_a_worker_of_another_protocol_version_is_named_at_connect():
    other = protocol.PROTOCOL_VERSION + 1
    fake = FakeWorker(_hello_body(protocol=other, lrmp="9.0.0"), version=other)
    try:
        start = time.monotonic()
        with pytest.raises(ProtocolVersionError) as info:
            DriverSession([fake.address], connect_timeout=30)
        assert time.monotonic() - start < 5
        text = str(info.value)
        assert fake.address in text and f"version {other} (lrmp 9.0.0" in text
        assert f"speaks version {protocol.PROTOCOL_VERSION} (lrmp {__version__})" in text
        assert info.value.remote_version == other
    finally:
        fake.close()


def test_a_worker_that_admits_another_protocol_in_its_hello_is_refused():
    # Same header version, but the worker says it speaks another protocol: refused as well.
    other = protocol.PROTOCOL_VERSION + 1
    fake = FakeWorker(_hello_body(protocol=other, lrmp=f"{other}.0.0"))
    try:
        with pytest.raises(ProtocolVersionError, match=rf"version {other} \(lrmp {other}.0.0\)"):
            DriverSession([fake.address], connect_timeout=30)
    finally:
        fake.close()


def test_other_lrmp_or_torch_versions_only_warn(caplog):
    fake = FakeWorker(_hello_body(lrmp="0.0.1", torch="1.0.0"))
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_remote_mp"):
            session = DriverSession([fake.address], connect_timeout=30)
            session.close()
        assert any("lrmp 0.0.1 / torch 1.0.0" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        fake.close()


def test_a_real_worker_answers_a_driver_of_another_protocol_version(pool):
    """What an older or newer driver hears from this worker: an error that echoes its request id and
    names both versions, in a header whose first fields every version reads the same way."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(pool[0])
    try:
        session = uuid.uuid4().hex
        future = protocol.PROTOCOL_VERSION + 1
        hello = {"driver": "future", "protocol": future, "lrmp": "2.0.0"}
        for header_version in (future, protocol.PROTOCOL_VERSION):  # the body always says the future one
            frames = protocol.encode(protocol.HELLO, 41, session, hello)
            header = msgpack.unpackb(frames[0], raw=False)
            header[0] = header_version
            sock.send_multipart([msgpack.packb(header)])
            assert sock.poll(5000), "no answer"
            reply = sock.recv_multipart()
            assert protocol.peek_id(reply) == 41
            msg = protocol.decode(reply)
            assert msg.kind == protocol.ERROR and msg.id == 41
            assert msg.body["type"] == "ProtocolVersionError"
            assert msg.body["protocol"] == protocol.PROTOCOL_VERSION and msg.body["lrmp"] == __version__
            assert f"version {protocol.PROTOCOL_VERSION}" in msg.body["message"]
            assert str(future) in msg.body["message"]
        # The worker did not start a session for it: a driver of this version is served.
        session = DriverSession(pool[:1], connect_timeout=30)
        session.close()
    finally:
        sock.close(0)
