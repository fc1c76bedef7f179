"""Limits on what a worker accepts, set by its --max-* flags: refused with errors that name the flag.

A legitimate driver learns the limits at HELLO and refuses to send what would be refused, before it
sends it; anything else that breaks a limit gets an error reply (or, for a frame over
--max-message-bytes, a dropped connection while it arrives), and the worker keeps serving.
"""

from __future__ import annotations

import time
import uuid

import pytest
import torch
import zmq

from lightning_remote_mp import ProtocolError, SpecError
from lightning_remote_mp.driver.launch import LocalWorkers
from lightning_remote_mp.driver.session import DriverSession
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.protocol import LimitExceeded
from lightning_remote_mp.worker.cli import parse_size

pytestmark = pytest.mark.timeout(120)

MIB = 1024 * 1024
FLAGS = ["--max-message-bytes", "1MiB", "--max-header-bytes", "256KiB"]
FLAGS += ["--max-tensors", "8", "--max-tensor-dims", "4", "--max-layers", "3"]


@pytest.fixture(scope="module")
def limited():
    """One worker started with small limits, shared by this module's tests (each ends its session)."""
    workers = LocalWorkers(1, devices=["cpu"], threads=1, extra_args=FLAGS)
    workers.start()
    yield workers.addresses[0]
    workers.stop()


def _net(layers: int) -> SpecSequential:
    torch.manual_seed(0)
    return SpecSequential([("torch.nn.Linear", {"in_features": 8, "out_features": 8}, (4, 8))] * layers)


def _raw(address: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def _ask(sock: zmq.Socket, frames: list, timeout: float = 5.0) -> protocol.Message | None:
    sock.send_multipart(frames)
    if not sock.poll(timeout * 1000):
        return None
    return protocol.decode(sock.recv_multipart())


def test_parse_size():
    assert parse_size("1048576") == MIB and parse_size("1MiB") == MIB and parse_size("2GB") == 2 * 10**9
    assert parse_size("64kib") == 64 * 1024
    for bad in ("", "-1", "1.5GB", "0", "1TB"):
        with pytest.raises(Exception, match="is not a size"):
            parse_size(bad)


def test_the_driver_respects_the_limits_a_worker_announces(limited):
    session = DriverSession([limited], connect_timeout=30)
    try:
        limits = session.conns[0].remote_limits
        assert (limits.max_message_bytes, limits.max_frames, limits.max_tensor_dims, limits.max_layers) == (
            MIB,
            8,
            4,
            3,
        )
        # Spec length: four layers for a worker that takes three per stage.
        with pytest.raises(SpecError, match=r"4 layers, but worker .* accepts at most 3 per stage.*--max-layers"):
            session.place("long", _net(4))
        net = _net(3)
        session.place("net", net)
        assert torch.allclose(net(torch.ones(4, 8)), _net(3)(torch.ones(4, 8)), atol=1e-6)
        # Message size: a 2 MiB batch is refused here, before it is sent, naming the flag.
        big = torch.zeros(2 * MIB // 32, 8)
        with pytest.raises(LimitExceeded, match=r"accepts 1048576 \(its --max-message-bytes\)") as info:
            net(big)
        assert info.value.limit == "max_message_bytes" and limited in str(info.value)
        # The session goes on.
        assert net(torch.ones(2, 8)).shape == (2, 8)
    finally:
        session.close()


def test_the_worker_enforces_its_limits_on_raw_messages(limited):
    sock = _raw(limited)
    session = uuid.uuid4().hex
    try:
        assert _ask(sock, protocol.encode(protocol.HELLO, 1, session, {"driver": "raw"})).kind == protocol.OK
        body = {
            "key": "net",
            "stage": 0,
            "stages": 1,
            "start": 0,
            "entries": [["torch.nn.Identity", {}, [1]]] * 4,
            "exports": [],
            "init_seed": 0,
            "sources": [[-1, []]],
            "targets": [[-1, []]],
            "peers": {},
        }
        cases = {
            "--max-layers": (protocol.encode(protocol.SETUP, 2, session, body), "4 layers in one stage"),
            "--max-tensors": (
                protocol.encode(protocol.LOAD_STATE, 3, session, {"t": [torch.zeros(1)] * 9}),
                "9 tensor frames; the limit is 8",
            ),
            "--max-tensor-dims": (
                protocol.encode(protocol.LOAD_STATE, 4, session, {"t": torch.zeros([1] * 5)}),
                "at most 4 sizes",
            ),
            "--max-message-bytes (two frames of 600 KiB)": (
                protocol.encode(protocol.LOAD_STATE, 5, session, {"t": [torch.zeros(150 * 1024)] * 2}),
                "exceeds the limit of 1048576",
            ),
        }
        for case, (frames, expected) in cases.items():
            reply = _ask(sock, frames)
            assert reply is not None, case
            assert reply.kind == protocol.ERROR and reply.id == protocol.peek_id(frames), case
            assert reply.body["type"] == "LimitExceeded" and expected in reply.body["message"], (case, reply.body)
        # One frame over the limit: ZeroMQ drops the connection while it arrives; nothing is answered.
        start = time.monotonic()
        assert _ask(sock, protocol.encode(protocol.LOAD_STATE, 6, session, {"t": torch.zeros(MIB)}), 2.0) is None
        assert time.monotonic() - start < 5
    finally:
        sock.close(0)
    # The worker goes on: a new connection ends the session, and a driver is served.
    sock = _raw(limited)
    try:
        assert _ask(sock, protocol.encode(protocol.BYE, 1, session)).kind == protocol.OK
    finally:
        sock.close(0)
    session = DriverSession([limited], connect_timeout=30)
    try:
        session.place("net", _net(2))
    finally:
        session.close()


def test_the_driver_limits_what_workers_send_it(pool):
    # The driver accepts at most 1 KiB per message: a 4 KiB output is refused as it arrives.
    session = DriverSession(pool[:1], connect_timeout=30, limits=protocol.Limits(max_message_bytes=1024))
    try:
        net = _net(2)
        session.place("net", net)
        assert net(torch.ones(4, 8)).shape == (4, 8)  # 128 bytes: fine
        with pytest.raises(ProtocolError, match="exceeds the limit of 1024"):
            net(torch.ones(128, 8))
        # A stage sends a call's results together, in bundles within the limits the driver's HELLO
        # gave: 4 micro-batches of 768 bytes travel as 4 messages, not one of 3 KiB.
        split, local = _net(2), _net(2)
        session.place("split", split, microbatches=4)
        x = torch.randn(96, 8)
        with torch.no_grad():
            assert torch.allclose(split(x), local(x), atol=1e-6)
    finally:
        session.close()
