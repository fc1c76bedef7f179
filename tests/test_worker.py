"""A real ``lrmp-worker`` process on 127.0.0.1, driven over real ZeroMQ sockets.

Two workers serve the whole module (starting one costs seconds): ``worker`` with the default
session timeout, ``short_worker`` with a 2 s one. Each test ends the sessions it opened, and
the tests that attack a worker check that it is still alive and still serves afterwards.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import random
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
from test_strategy import assert_same_forward_and_backward

from lightning_remote_mp import __version__
from lightning_remote_mp.driver.launch import WorkerOutput
from lightning_remote_mp.driver.session import DriverSession
from lightning_remote_mp.errors import WorkerError
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.wire import protocol

pytestmark = pytest.mark.timeout(120)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SHORT_TIMEOUT = 2.0
REPLY_TIMEOUT = 10.0
PROTOCOL_ERRORS = {"ProtocolError", "LimitExceeded", "ProtocolVersionError"}


class Worker:
    def __init__(self, proc: subprocess.Popen, address: str, log: Path) -> None:
        self.proc = proc
        self.address = address
        self.log = log

    def assert_alive(self) -> None:
        code = self.proc.poll()
        assert code is None, f"the worker exited with code {code}; its log:\n{self.log.read_text()[-3000:]}"


def _start(args: list[str], modules_dir: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, str(modules_dir), *sys.path])
    cmd = [
        sys.executable,
        "-m",
        "lightning_remote_mp.worker",
        "--bind",
        "tcp://127.0.0.1:*",
        "--threads",
        "1",
        "--log-level",
        "INFO",
        "--allow-module",
        "lrmp_testlayers",
        *args,
    ]
    with open(log, "w") as err:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env, text=True)


@pytest.fixture(scope="module")
def modules_dir(tmp_path_factory) -> Path:
    """Importable by the workers; ``lrmp_marker_mod`` leaves a file behind if it is ever imported."""
    d = tmp_path_factory.mktemp("worker_modules")
    (d / "lrmp_marker_mod.py").write_text(
        "import os, torch\n"
        "open(os.path.join(os.path.dirname(__file__), 'IMPORTED'), 'w').close()\n"
        "class Layer(torch.nn.Module):\n"
        "    pass\n"
    )
    return d


@pytest.fixture(scope="module")
def _workers(modules_dir, tmp_path_factory) -> Iterator[tuple[Worker, Worker]]:
    logs = tmp_path_factory.mktemp("worker_logs")
    procs = [
        _start([], modules_dir, logs / "worker.log"),
        _start(["--session-timeout", str(SHORT_TIMEOUT)], modules_dir, logs / "short_worker.log"),
    ]
    try:
        deadline = time.monotonic() + 120
        addresses = [WorkerOutput(p, i).wait_ready(deadline) for i, p in enumerate(procs)]
        yield tuple(Worker(p, a, logs / n) for p, a, n in zip(procs, addresses, ["worker.log", "short_worker.log"]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()


@pytest.fixture
def worker(_workers) -> Worker:
    _workers[0].assert_alive()
    return _workers[0]


@pytest.fixture
def short_worker(_workers) -> Worker:
    _workers[1].assert_alive()
    return _workers[1]


class Client:
    """A raw DEALER socket speaking the protocol as one driver session."""

    def __init__(self, address: str, session: str | None = None) -> None:
        self.address = address
        self.session = uuid.uuid4().hex if session is None else session
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.next_id = 0
        self.admitted = False

    def send(self, kind: str, body: Any = None, *, session: str | None = None) -> int:
        self.next_id += 1
        self.sock.send_multipart(
            protocol.encode(kind, self.next_id, self.session if session is None else session, body)
        )
        return self.next_id

    def send_raw(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float = REPLY_TIMEOUT) -> protocol.Message | None:
        if not self.sock.poll(timeout * 1000, zmq.POLLIN):
            return None
        return protocol.decode(self.sock.recv_multipart())

    def request(self, kind: str, body: Any = None, *, session: str | None = None) -> protocol.Message:
        req_id = self.send(kind, body, session=session)
        msg = self.recv()
        assert msg is not None, f"no reply to {kind} within {REPLY_TIMEOUT} s"
        assert msg.id == req_id
        if kind == protocol.HELLO and msg.kind == protocol.OK:
            self.admitted = True
        if kind == protocol.BYE and msg.kind == protocol.OK:
            self.admitted = False
        return msg

    def ok(self, kind: str, body: Any = None) -> Any:
        msg = self.request(kind, body)
        assert msg.kind == protocol.OK, f"{kind} failed: {msg.body}"
        return msg.body

    def error(self, kind: str, body: Any = None, *, session: str | None = None) -> dict:
        msg = self.request(kind, body, session=session)
        assert msg.kind == protocol.ERROR, f"{kind} should have failed, got {msg.kind}: {msg.body}"
        assert isinstance(msg.body, dict)
        return msg.body

    def close(self) -> None:
        if self.admitted:
            try:
                self.request(protocol.BYE)
            except AssertionError:
                pass
        self.sock.close(0)


@pytest.fixture
def connect() -> Iterator:
    """``connect(address, session=None)``: a Client whose session says bye when the test ends."""
    clients: list[Client] = []

    def make(address: str, session: str | None = None) -> Client:
        c = Client(address, session)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


# --- a stage to serve -----------------------------------------------------------------------


def _stage_body(key: str = "net", paths: tuple[str, str] = ("torch.nn.Linear", "lrmp_testlayers.ScaleBy")) -> dict:
    """A SETUP request as an attacker (or a broken driver) would write it by hand."""
    torch.manual_seed(1)
    lin = torch.nn.Linear(3, 2)
    return {
        "key": key,
        "stage": 0,
        "stages": 1,
        "start": 0,
        "entries": [
            [paths[0], {"in_features": 3, "out_features": 2}, [4, 3]],
            [paths[1], {"init": 2.0}, [4, 2]],
        ],
        "exports": [],
        "sources": [[-1, []]],
        "targets": [[-1, []]],
        "peers": {},
        "state": {"0.weight": lin.weight.detach(), "0.bias": lin.bias.detach(), "1.scale": torch.tensor(2.0)},
    }


def _spec() -> SpecSequential:
    torch.manual_seed(2)
    return SpecSequential(
        [
            ("torch.nn.Linear", {"in_features": 3, "out_features": 2}, (4, 3)),
            ("lrmp_testlayers.ScaleBy", {"init": 2.0}, (4, 2)),
        ]
    )


def _check_serves(worker: Worker) -> None:
    """A real driver session on the worker: place a model there, run forward and backward through
    it, and compare with the same model run locally."""
    worker.assert_alive()
    net = _spec()
    local = copy.deepcopy(net)
    session = DriverSession([worker.address], connect_timeout=REPLY_TIMEOUT)
    try:
        assert session.workers[0]["pid"] == worker.proc.pid
        session.place("net", net)
        assert net.is_remote
        assert_same_forward_and_backward(net, local, torch.randn(4, 3), torch.randn(4, 2))
    finally:
        session.close()
    worker.assert_alive()


# --- hello ----------------------------------------------------------------------------------


def test_hello_reports_the_worker(worker, connect):
    client = connect(worker.address)
    req_id = client.send(protocol.HELLO, {"driver": "pytest", "lrmp": __version__})
    reply = client.recv()
    assert reply is not None
    assert (reply.kind, reply.id, reply.session) == (protocol.OK, req_id, client.session)
    client.admitted = True
    info = reply.body
    assert info["lrmp"] == __version__
    assert info["torch"] == torch.__version__
    assert info["protocol"] == protocol.PROTOCOL_VERSION
    assert info["pid"] == worker.proc.pid
    assert info["device"] == "cpu" and info["device_name"] == "cpu"
    assert isinstance(info["free_memory"], int) and 0 < info["free_memory"] <= info["total_memory"]
    assert {"torch.nn", "lightning_remote_mp.layers", "lrmp_testlayers"} <= set(info["allowed_prefixes"])
    assert "lrmp_marker_mod" not in info["allowed_prefixes"]
    # A repeated hello in the same session is answered the same way.
    assert client.ok(protocol.HELLO, {"driver": "pytest"})["pid"] == worker.proc.pid
    assert client.ok(protocol.BYE) is None


def test_a_driver_session_runs_a_stage_there(worker):
    _check_serves(worker)


# --- the class allowlist --------------------------------------------------------------------


REFUSED = [
    ("os.system", "os"),
    ("subprocess.Popen", "subprocess"),
    ("builtins.eval", "builtins"),
    ("collections.OrderedDict", "collections"),
    ("lightning_remote_mp.model.spec.SpecSequential", "lightning_remote_mp.model.spec"),
    ("lrmp_marker_mod.Layer", "lrmp_marker_mod"),
    ("torch.nnx.Linear", "torch.nnx"),
    ("lrmp_testlayers_x.ScaleBy", "lrmp_testlayers_x"),
]


@pytest.mark.parametrize(
    "nested",
    [
        # itertools.repeat, imported into torch.nn.modules.utils: endless, it hung the worker's setup.
        {"object": "torch.nn.modules.utils.repeat", "kwargs": {"object": 1}},
        # torch.library.Library, imported into an allowed module: it registers operators.
        {"class": "torch.nn.attention._fa3.Library"},
    ],
    ids=["repeat", "Library"],
)
def test_nested_objects_come_only_from_classes_defined_under_the_allowlist(worker, connect, nested):
    """A kwarg value {"object": ...} / {"class": ...} names a class by a path under an allowed prefix,
    but what counts is where the class is defined."""
    client = connect(worker.address)
    client.ok(protocol.HELLO, {"driver": "pytest"})
    body = {
        **_stage_body(),
        "entries": [{"layer": "torch.nn.Identity", "kwargs": {"x": nested}, "input_shape": [4, 3]}],
    }
    body["state"] = {}
    err = client.error(protocol.SETUP, body)
    assert err["type"] == "RefusedClassError" and "defined outside this worker's allowlist" in err["message"], err
    assert client.ok(protocol.GET_STATE) == {}  # the worker answers: not stuck, nothing kept
    client.ok(protocol.BYE)


def test_refused_classes_get_an_error_and_the_worker_keeps_serving(worker, connect, modules_dir):
    client = connect(worker.address)
    client.ok(protocol.HELLO, {"driver": "pytest"})
    for path, module in REFUSED:
        err = client.error(protocol.SETUP, _stage_body(paths=("torch.nn.Linear", path)))
        assert err["type"] == "RefusedClassError", err
        assert repr(path) in err["message"]
        assert f"--allow-module {module} " in err["message"]
    # Reaching a class through a module that an allowed module imports is refused as well.
    escape = "torch.nn.modules.module.torch.ao.nn.quantized.Linear"
    err = client.error(protocol.SETUP, _stage_body(paths=(escape, "lrmp_testlayers.ScaleBy")))
    assert err["type"] == "RefusedClassError" and "--allow-module" in err["message"], err
    # Optimizer classes go through the same allowlist.
    err = client.error(protocol.OPTIM_CREATE, {"index": 0, "cls": "os.system", "defaults": {}, "groups": []})
    assert err["type"] == "RefusedClassError" and "'os.system'" in err["message"], err
    # Refused means never imported.
    assert not (modules_dir / "IMPORTED").exists()
    # The session is intact, and no refused stage was kept.
    assert client.ok(protocol.GET_STATE) == {}
    client.ok(protocol.BYE)
    _check_serves(worker)


def test_a_setup_whose_program_table_does_not_add_up_is_refused_and_the_worker_serves_on(worker, connect):
    """A SETUP's table of programs (issue #60, `lightning_remote_mp.model.program_table`) is checked
    against its digests: one filed under another digest is refused, naming it."""
    from lightning_remote_mp.model.program_table import tabled
    from lightning_remote_mp.model.trace import trace_module

    torch.manual_seed(0)
    traced = trace_module(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()), (torch.ones(4, 3),), {}, "net")
    entries, table = tabled([e.to_wire() for e in traced.entries])
    body = {**_stage_body(), "entries": entries, "state": None, "init_seed": 0}
    client = connect(worker.address)
    client.ok(protocol.HELLO, {"driver": "pytest"})
    key, program = next(iter(table.items()))
    err = client.error(protocol.SETUP, {**body, "programs": {**table, key: {**program, "outputs": []}}})
    assert f"program {key!r} of the table" in err["message"], err
    assert client.ok(protocol.GET_STATE) == {}
    client.ok(protocol.SETUP, {**body, "programs": table})  # as sent, it builds
    assert set(client.ok(protocol.GET_STATE)) == {"net"}
    client.ok(protocol.BYE)
    _check_serves(worker)


def test_a_driver_hears_which_class_was_refused(worker):
    # A real layer class, from a module this worker does not allow.
    net = SpecSequential(
        [
            ("torch.nn.Linear", {"in_features": 3, "out_features": 2}, (4, 3)),
            ("torch.ao.nn.quantized.DeQuantize", {}, (4, 2)),
        ]
    )
    session = DriverSession([worker.address], connect_timeout=REPLY_TIMEOUT)
    try:
        with pytest.raises(WorkerError) as info:
            session.place("net", net)
        err = info.value
        assert err.remote_type == "RefusedClassError"
        assert "'torch.ao.nn.quantized.DeQuantize'" in str(err) and "--allow-module torch.ao.nn.quantized" in str(err)
        assert err.address == worker.address and err.stage == 0
        assert not net.is_remote
        # The same session goes on: a model the worker may build is placed and runs.
        ok = _spec()
        session.place("ok", ok)
        assert torch.allclose(ok(torch.ones(2, 3)), _spec()(torch.ones(2, 3)), atol=1e-6)
    finally:
        session.close()
    worker.assert_alive()


def test_request_errors_keep_the_session(worker, connect):
    client = connect(worker.address)
    client.ok(protocol.HELLO, {"driver": "pytest"})
    err = client.error(protocol.SETUP, {"key": "net"})
    assert err["type"] == "ProtocolError" and "setup message: field 'stage' is missing" in err["message"]
    err = client.error(protocol.SETUP, {**_stage_body(), "stage": "0"})
    assert err["type"] == "ProtocolError" and "field 'stage': expected an int, got a str" in err["message"]
    err = client.error(protocol.SETUP, [1, 2, 3])
    assert err["type"] == "ProtocolError"
    bad_state = _stage_body()
    del bad_state["state"]["1.scale"]
    err = client.error(protocol.SETUP, bad_state)
    assert err["type"] == "SpecError" and "1.scale" in err["message"]
    err = client.error(protocol.SETUP, {**_stage_body(), "entries": [["torch.nn.Linear", {"in_features": "x"}, [1]]]})
    assert err["type"] == "SpecError" and "layer 0 (Linear)" in err["message"]
    err = client.error(protocol.SETUP, {**_stage_body(), "entries": [["not a path", {}, [1]]]})
    assert err["type"] == "SpecError" and "not a dotted import path" in err["message"]
    err = client.error(protocol.LOAD_STATE, {"state": {"nope": {}}})
    assert err["type"] == "SpecError" and "no stage 'nope'" in err["message"]
    # Every request kind is checked whole before it is acted on, even one with nothing to act on.
    err = client.error(protocol.ZERO_GRAD, {"index": 0, "set_to_none": "yes"})
    assert err["type"] == "ProtocolError"
    assert "zero_grad message: field 'set_to_none': expected a bool" in err["message"]
    err = client.error(protocol.GRADS, {"index": 0, "op": "explode"})
    assert err["type"] == "ProtocolError" and "grads message: field 'op' must be one of" in err["message"]
    assert client.ok(protocol.GET_STATE) == {}
    client.ok(protocol.BYE)
    _check_serves(worker)


# --- malformed and hostile input ------------------------------------------------------------


class _ShellBomb:
    """Unpickling this runs a shell command that creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


class _OpenBomb:
    """Unpickling this creates ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def _bad_payloads(tmp_path: Path, session: str) -> list[tuple[str, list[bytes]]]:
    good = protocol.encode(protocol.FORWARD, 1, session, {"x": torch.ones(4, 3), "i": torch.arange(2)})
    header = msgpack.unpackb(good[0], raw=False)
    rng = random.Random(1234)
    payloads: list[tuple[str, list[bytes]]] = [
        ("empty frame", [b""]),
        ("never-used msgpack byte", [b"\xc1"]),
        ("text", [b"GET / HTTP/1.1\r\nHost: worker\r\n\r\n"]),
        ("an array claiming 4 billion items", [b"\xdd\xff\xff\xff\xff"]),
        ("many empty frames", [b""] * 5000),
    ]
    payloads += [(f"random bytes {i}", [rng.randbytes(rng.randint(1, 200))]) for i in range(10)]
    payloads += [
        (f"truncated header at {n}", [good[0][:n], *good[1:]]) for n in (1, 5, len(good[0]) // 2, len(good[0]) - 1)
    ]
    payloads += [
        ("tensor frame one byte short", [good[0], bytes(good[1])[:-1], bytes(good[2])]),
        ("tensor frame one byte long", [good[0], bytes(good[1]) + b"\x00", bytes(good[2])]),
        ("tensor frame empty", [good[0], b"", bytes(good[2])]),
        ("tensor frames swapped", [good[0], bytes(good[2]), bytes(good[1])]),
        ("a tensor frame missing", [good[0], bytes(good[1])]),
        ("an extra tensor frame", [*good, b"\x00" * 8]),
        ("wrong version", [msgpack.packb([protocol.PROTOCOL_VERSION + 1, *header[1:]]), *good[1:]]),
        ("unknown dtype", [msgpack.packb([*header[:4], [["object", [4, 3]], header[4][1]], header[5]]), *good[1:]]),
        ("too many dims", [msgpack.packb([*header[:4], [["uint8", [1] * 40]], header[5]]), b"\x00"]),
        ("negative shape", [msgpack.packb([*header[:4], [["float32", [-4, -3]], header[4][1]], header[5]]), *good[1:]]),
    ]
    # Found by these tests: each used to kill the worker (a segfault; an exception out of the I/O loop).
    inner = msgpack.packb(None)
    for _ in range(1000):
        inner = msgpack.packb(msgpack.ExtType(2, msgpack.packb([msgpack.ExtType(2, inner)])))
    payloads.append(
        (
            "tuples nested 2000 deep",
            [msgpack.packb([protocol.PROTOCOL_VERSION, "forward", 1, session, [], msgpack.ExtType(0, inner)])],
        )
    )
    payloads.append(
        (
            "empty tensor of absurd size",
            [
                msgpack.packb(
                    [protocol.PROTOCOL_VERSION, "forward", 1, session, [["float32", [0, 2**61, 2**61]]], header[5]]
                ),
                b"",
            ],
        )
    )
    # Pickles whose unpickling would create a file: a worker must never unpickle anything.
    for bomb in (_ShellBomb(tmp_path / "pwned_shell"), _OpenBomb(tmp_path / "pwned_open")):
        for proto in (0, 2, pickle.HIGHEST_PROTOCOL):
            payloads.append((f"{type(bomb).__name__} pickle v{proto}", [pickle.dumps(bomb, protocol=proto)]))
    return payloads


def _pickle_bombs(tmp_path: Path) -> list[bytes]:
    return [pickle.dumps(b) for b in (_ShellBomb(tmp_path / "pwned_shell"), _OpenBomb(tmp_path / "pwned_open"))]


def test_the_pickle_bombs_are_live(tmp_path):
    # Control: unpickled here, the payload does create its file (so its absence below means something).
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_OpenBomb(control))).close()
    assert control.exists()


@pytest.mark.parametrize("admitted", [False, True], ids=["no session", "during a session"])
def test_malformed_messages_never_crash_the_worker(worker, connect, tmp_path, admitted):
    attacker = connect(worker.address)
    if admitted:
        attacker.ok(protocol.HELLO, {"driver": "attacker"})
    for what, frames in _bad_payloads(tmp_path, attacker.session):
        attacker.send_raw(frames)
        reply = attacker.recv()
        assert reply is not None, f"{what}: no reply"
        assert reply.kind == protocol.ERROR, f"{what}: {reply}"
        # ProtocolError, or the subclass naming what was wrong (a limit, the protocol version).
        assert reply.body["type"] in PROTOCOL_ERRORS, f"{what}: {reply.body}"
        worker.assert_alive()
    assert not (tmp_path / "pwned_shell").exists()
    assert not (tmp_path / "pwned_open").exists()
    if admitted:
        # A body that decodes but fails its kind's checks (no 'op'): it escaped as a KeyError, unanswered.
        attacker.send_raw(protocol.encode(protocol.GRADS, 7, attacker.session, {"index": 0}))
        reply = attacker.recv()
        assert reply is not None and reply.kind == protocol.ERROR and reply.id == 7
        assert reply.body["type"] == "ProtocolError" and "field 'op' is missing" in reply.body["message"]
        assert attacker.ok(protocol.GET_STATE) == {}  # the session survived the barrage
        attacker.ok(protocol.BYE)
    _check_serves(worker)


def test_pickles_inside_valid_messages_stay_bytes(worker, connect, tmp_path):
    client = connect(worker.address)
    client.ok(protocol.HELLO, {"driver": "pytest"})
    for bomb in _pickle_bombs(tmp_path):
        # As a uint8 tensor in the weights: it arrives as numbers, of the wrong shape.
        body = _stage_body()
        body["state"]["0.weight"] = torch.frombuffer(bytearray(bomb), dtype=torch.uint8)
        client.error(protocol.SETUP, body)
        # As bytes in layer kwargs: they reach a constructor as bytes, which fails.
        err = client.error(
            protocol.SETUP, {**_stage_body(), "entries": [["torch.nn.Linear", {"in_features": bomb}, [1]]]}
        )
        assert err["type"] == "SpecError"
        # As bytes in the state: refused before anything is built, as weights must be tensors.
        err = client.error(protocol.SETUP, {**_stage_body(), "state": {"0.weight": bomb}})
        assert err["type"] == "ProtocolError" and "field 'state[...]': expected a tensor, got bytes" in err["message"]
        body = _stage_body()
        body["state"]["0.weight"] = bomb
        client.error(protocol.SETUP, body)
        # As a message kind and a session id.
        assert client.error(bomb.decode("latin-1"))["type"] == "ProtocolError"
    assert not (tmp_path / "pwned_shell").exists()
    assert not (tmp_path / "pwned_open").exists()
    assert client.ok(protocol.GET_STATE) == {}
    client.ok(protocol.BYE)
    _check_serves(worker)


# --- sessions -------------------------------------------------------------------------------


def test_a_second_driver_is_refused_while_a_session_is_active(worker, connect):
    first, second = connect(worker.address), connect(worker.address)
    first.ok(protocol.HELLO, {"driver": "first"})
    err = second.error(protocol.HELLO, {"driver": "second"})
    assert err["type"] == "WorkerBusy"
    assert "busy" in err["message"] and "first" in err["message"]
    # The refused driver cannot act in the session it did not get, nor end it...
    assert second.error(protocol.SETUP, _stage_body())["type"] == "SessionError"
    assert second.error(protocol.BYE)["type"] == "SessionError"
    # ...and the first session is undisturbed.
    assert first.ok(protocol.GET_STATE) == {}
    assert "busy" in second.error(protocol.HELLO, {"driver": "second"})["message"]
    first.ok(protocol.BYE)
    info = second.ok(protocol.HELLO, {"driver": "second"})
    assert info["pid"] == worker.proc.pid
    assert second.ok(protocol.GET_STATE) == {}
    assert first.error(protocol.GET_STATE)["type"] == "SessionError"
    second.ok(protocol.BYE)


def test_the_busy_reply_says_how_long_the_session_ran_and_when_it_would_expire(short_worker, connect):
    first, second = connect(short_worker.address), connect(short_worker.address)
    first.ok(protocol.HELLO, {"driver": "first"})
    time.sleep(1.2)
    assert first.request(protocol.PING).body["session_alive"]  # heard from: the session lives on
    message = second.error(protocol.HELLO, {"driver": "second"})["message"]
    print(f"\nbusy reply: {message}")
    assert re.search(r"serving first \(session \w{8}\) for (1\.[2-9]|[2-9]\.\d) s", message), message
    assert re.search(r"last heard from \d\.\d s ago", message), message
    assert f"dropped after {SHORT_TIMEOUT:.1f} s of driver silence (--session-timeout;" in message, message
    assert re.search(r"ends within [0-2]\.\d s", message), message
    first.ok(protocol.BYE)


def _cpu_by_thread(pid: int) -> dict[str, int]:
    """Clock ticks of CPU each thread of process ``pid`` has used, by thread id."""
    ticks = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # the thread ended
        ticks[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs /proc, 2 cores")
def test_a_one_thread_worker_computes_on_one_thread(worker):
    """``--threads 1`` holds for the thread that runs the layers, not only the main thread: OpenMP's
    thread count is per thread, and a serving thread left with one OpenMP thread per core had a
    spare one spinning between the small operations of a pipeline, burning more CPU than the
    compute itself (a small model's workers used 5x the CPU they needed)."""
    torch.manual_seed(0)
    net = SpecSequential([("torch.nn.Linear", {"in_features": 128, "out_features": 128}, (64, 128))] * 8)
    session = DriverSession([worker.address], connect_timeout=REPLY_TIMEOUT)
    try:
        session.place("net", net)
        x = torch.randn(64, 128)
        net(x).sum().backward()
        before = _cpu_by_thread(worker.proc.pid)
        for _ in range(150):
            net(x).sum().backward()
        after = _cpu_by_thread(worker.proc.pid)
    finally:
        session.close()
    used = sorted((after[t] - before.get(t, 0) for t in after), reverse=True)
    # The serving thread computes; every other thread (ZeroMQ's I/O) uses a fraction of its CPU.
    assert used[0] > 0 and used[1] < used[0] / 2, f"CPU ticks by thread: {used}"


def test_heartbeats_and_other_drivers_are_answered_while_a_layer_runs(worker, connect):
    """One thread serves requests; while one runs longer than a moment, the main thread takes over
    the socket: a ping is answered at once, as computing, and another driver hears why it waits."""
    net = SpecSequential([("lrmp_testlayers.SlowIdentity", {"seconds": 2.0}, (2, 3))])
    session = DriverSession([worker.address], connect_timeout=REPLY_TIMEOUT)
    outputs: list[torch.Tensor] = []
    try:
        session.place("net", net)
        running = threading.Thread(target=lambda: outputs.append(net(torch.ones(2, 3))))
        running.start()
        time.sleep(0.5)  # the layer sleeps for 2 s from now on
        pinger = Client(worker.address, session=session.id)
        try:
            for _ in range(3):
                start = time.monotonic()
                reply = pinger.request(protocol.PING)
                assert time.monotonic() - start < 0.5, "a ping waited for the running layer"
                moved = reply.body.pop("moved")  # what the worker's connections moved: progress on a slow link
                assert type(moved) is int and moved > 0
                assert reply.body == {"session_alive": True, "busy": True, "ran": 2}  # hello's and setup's ids
        finally:
            pinger.sock.close(0)
        other = connect(worker.address)
        start = time.monotonic()
        assert "computing now" in other.error(protocol.HELLO, {"driver": "other"})["message"]
        assert time.monotonic() - start < 0.5
        running.join(timeout=10)
        assert not running.is_alive() and torch.equal(outputs[0], torch.ones(2, 3))
    finally:
        session.close()


def test_a_new_session_starts_empty(worker, connect):
    net = _spec()
    session = DriverSession([worker.address], connect_timeout=REPLY_TIMEOUT)
    try:
        session.place("net", net)
        holder = Client(worker.address, session=session.id)
        try:
            state = holder.ok(protocol.GET_STATE)  # the driver's session, seen from a raw socket
        finally:
            holder.sock.close(0)
        assert set(state) == {"net"} and set(state["net"]) == {"0.weight", "0.bias", "1.scale"}
        assert torch.equal(state["net"]["0.weight"], net.layers[0].weight.detach())
    finally:
        session.close()
    client = connect(worker.address)
    client.ok(protocol.HELLO, {"driver": "next"})
    assert client.ok(protocol.GET_STATE) == {}
    client.ok(protocol.BYE)


def test_a_silent_session_expires(short_worker, connect):
    first, second = connect(short_worker.address), connect(short_worker.address)
    first.ok(protocol.HELLO, {"driver": "first"})
    # (No local work between requests here: the session only lives 2 s without a word.)
    assert first.ok(protocol.GET_STATE) == {}
    last_heard = time.monotonic()  # a ping refreshes the session: the last sign of life
    assert first.request(protocol.PING).body["session_alive"] is True
    assert "busy" in second.error(protocol.HELLO, {"driver": "second"})["message"]
    admitted_at = None
    while time.monotonic() - last_heard < SHORT_TIMEOUT + 8:
        msg = second.request(protocol.HELLO, {"driver": "second"})
        if msg.kind == protocol.OK:
            admitted_at = time.monotonic()
            second.admitted = True
            break
        assert "busy" in msg.body["message"]
        time.sleep(0.25)
    assert admitted_at is not None, "the silent session never expired"
    assert admitted_at - last_heard >= SHORT_TIMEOUT - 0.05
    # The expired session is gone for good: its driver hears so, on requests and on pings.
    first.admitted = False
    err = first.error(protocol.GET_STATE)
    assert err["type"] == "SessionError" and "no session" in err["message"]
    ping = first.request(protocol.PING)
    assert ping.kind == protocol.OK and ping.body["session_alive"] is False
    assert second.ok(protocol.GET_STATE) == {}
    second.ok(protocol.BYE)


def test_pings_keep_a_session_alive(short_worker, connect):
    first, second = connect(short_worker.address), connect(short_worker.address)
    first.ok(protocol.HELLO, {"driver": "first"})
    start = time.monotonic()
    while time.monotonic() - start < SHORT_TIMEOUT * 1.5:
        ping = first.request(protocol.PING)
        assert ping.kind == protocol.OK and ping.body["session_alive"] is True
        time.sleep(0.3)
    assert "busy" in second.error(protocol.HELLO, {"driver": "second"})["message"]
    assert first.ok(protocol.GET_STATE) == {}
    first.ok(protocol.BYE)
    second.ok(protocol.HELLO, {"driver": "second"})
    second.ok(protocol.BYE)


def test_driver_session_heartbeat_holds_the_worker(short_worker, connect):
    net = _spec()
    session = DriverSession([short_worker.address], heartbeat_timeout=3.0, connect_timeout=REPLY_TIMEOUT)
    try:
        assert session.workers[0]["pid"] == short_worker.proc.pid
        session.place("net", net)
        time.sleep(SHORT_TIMEOUT * 1.5)
        other = connect(short_worker.address)
        assert "busy" in other.error(protocol.HELLO, {"driver": "other"})["message"]
        # The session, and the stage it placed, outlived the session timeout.
        x = torch.randn(2, 3)
        assert torch.allclose(net(x), _spec()(x), atol=1e-6)
    finally:
        session.close()
    other.ok(protocol.HELLO, {"driver": "other"})
    other.ok(protocol.BYE)


def test_unknown_sessions_get_an_error(worker, connect):
    stranger = connect(worker.address)
    for kind in (protocol.SETUP, protocol.FORWARD, protocol.GET_STATE, protocol.BYE, protocol.OPTIM_STEP):
        err = stranger.error(kind, {"key": "net"})
        assert err["type"] == "SessionError", (kind, err)
        assert repr(stranger.session) in err["message"] and "no session" in err["message"]
    ping = stranger.request(protocol.PING)
    assert ping.kind == protocol.OK and ping.body["session_alive"] is False
    err = stranger.error(protocol.HELLO, {"driver": "x"}, session="")
    assert err["type"] == "ProtocolError" and "without a session id" in err["message"]
    err = stranger.error("launch_missiles")
    assert err["type"] == "ProtocolError" and "unexpected message kind 'launch_missiles'" in err["message"]
    err = stranger.error(protocol.OK)
    assert "unexpected message kind" in err["message"]
    # While another session is active, a message naming a different session is refused too.
    owner = connect(worker.address)
    owner.ok(protocol.HELLO, {"driver": "owner"})
    err = stranger.error(protocol.GET_STATE, session=owner.session + "x")
    assert err["type"] == "SessionError"
    err = owner.error(protocol.GET_STATE, session="")
    assert err["type"] == "SessionError"
    owner.ok(protocol.BYE)
    worker.assert_alive()


def test_a_driver_of_other_lrmp_and_torch_versions_is_served_with_a_warning(worker, connect):
    client = connect(worker.address)
    hello = {"driver": "old-driver", "protocol": protocol.PROTOCOL_VERSION, "lrmp": "0.0.1", "torch": "1.0"}
    info = client.ok(protocol.HELLO, hello)  # a warning, not a refusal (only the protocol must match)
    assert (info["lrmp"], info["torch"], info["protocol"]) == (
        __version__,
        torch.__version__,
        protocol.PROTOCOL_VERSION,
    )
    client.ok(protocol.BYE)
    expected = "driver old-driver runs lrmp 0.0.1 / torch 1.0; this worker runs lrmp"
    deadline = time.monotonic() + 5
    while expected not in worker.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert expected in worker.log.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_worker_allocator_reuses_small_blocks_and_maps_large_ones_apart():
    """``keep_freed_memory``: a step's blocks under 1 MiB are served again from the heap (no page
    faults), and a block of 1 MiB or more that the heap cannot serve is mapped apart, its pages given
    back when it is freed, so it leaves no hole in the heap that a stage's peak would carry (issue #59)."""
    from lightning_remote_mp.worker import allocator

    # What a training step does to memory: allocate, touch and free the same buffers again.
    # Left alone, glibc adapts its thresholds to the largest block freed so far, so whether the
    # steps below fault depends on what the process did before; pinned, they show the difference.
    script = f"""
import importlib.util, resource, sys, torch
torch.set_num_threads(1)  # one thread allocates: no per-thread arena's first use inside the timed steps
spec = importlib.util.spec_from_file_location("allocator", {allocator.__file__!r})
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
# glibc's initial settings, pinned (set, they no longer adapt to what was freed before); in "keep"
# mode only keep_freed_memory can lift them (unpinned, glibc's own adaptation would hide its failure).
allocator._glibc().mallopt(allocator._M_MMAP_THRESHOLD, 128 << 10)
allocator._glibc().mallopt(allocator._M_TRIM_THRESHOLD, 128 << 10)
if sys.argv[1] == "keep":
    assert allocator.keep_freed_memory()
def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
large = torch.ones(1 << 20)  # 4 MiB, a long sequence's activation, on a heap with nothing free
held = anon()
del large
given_back = held - anon()
def step():
    ts = [torch.ones(1 << 17) for _ in range(32)]  # 512 KiB buffers: a stage's activations, weights' gradients
    del ts
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults, given_back, flush=True)
import os; os._exit(0)  # skips the interpreter's slow teardown of torch
"""
    # Both at once (each is mostly a fresh interpreter importing torch): faults are counted per process.
    procs = {
        mode: subprocess.Popen([sys.executable, "-c", script, mode], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for mode in ("keep", "default")
    }
    faults, given_back = {}, {}
    try:
        for mode, proc in procs.items():
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err.decode()
            faults[mode], given_back[mode] = map(int, out.split())
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    # With glibc's initial settings every step maps its 16 MiB afresh: ~4,000 faults a step. Kept,
    # none on a quiet machine; a loaded CI machine has shown ~250 a step (a reclaimed page here and
    # there), still a sixteenth of the default: the ratio is what this asserts.
    assert faults["keep"] * 10 < faults["default"] and faults["default"] > 20 * 1000, faults
    # A freed block of 1 MiB and more gives its pages back (KiB; served from the heap, it kept them all).
    assert given_back["keep"] > 3 * 1024, given_back


def test_a_micro_batch_from_a_peer_waits_for_the_driver_request_sent_before_it(pool):
    """The driver posts requests (the optimizer's step, zero_grad) without waiting for their replies
    and sends the next micro-batch to stage 0 at once, so stage 0's output can reach stage 1 before
    the request does. Stage 1 holds such a micro-batch back (its fence) until it has run the request."""
    from lightning_remote_mp.wire import sockets
    from lightning_remote_mp.wire.messages import Forward
    from lightning_remote_mp.wire.state import LoadState

    torch.manual_seed(0)
    net = SpecSequential(
        [
            ("torch.nn.Linear", {"in_features": 4, "out_features": 4}, (2, 4)),
            ("torch.nn.Linear", {"in_features": 4, "out_features": 3}, (2, 4)),
        ]
    )
    session = DriverSession(pool[:2])
    peer = None
    try:
        session.place("net", net, balance=[1, 1])
        stage1 = session.conns[1]
        assert stage1.address == pool[1]
        request_id = stage1.order.last_id + 1  # the id of the driver's next request to stage 1
        x = torch.randn(2, 4)
        peer = sockets.dealer(stage1.address)  # stage 0's link to stage 1, as a worker opens it
        early = Forward(key="net", call=99, mb=0, sender=0, x=x, fence={1: request_id})
        peer.send_multipart(protocol.encode(protocol.FORWARD, 0, stage1.session, early.body()))
        # A second micro-batch behind it on the same link, with nothing to wait for: its result proves
        # that stage 1 has read the first one (a link keeps the order, and so does the worker).
        unfenced = Forward(key="net", call=98, mb=0, sender=0, x=x)
        peer.send_multipart(protocol.encode(protocol.FORWARD, 0, stage1.session, unfenced.body()))

        def next_result(timeout: float = 10.0) -> Any:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if stage1.readable(100):
                    msg = stage1.read()  # the reply to a posted request is consumed here (None)
                    if msg is not None:
                        return msg
            return None

        first = next_result()
        assert first is not None and first.kind == protocol.RESULT and first.body["call"] == 98, first
        assert not stage1.readable(200), "stage 1 ran the micro-batch before the request it must wait for"
        w, b = torch.randn(3, 4), torch.randn(3)
        stage1.post(protocol.LOAD_STATE, LoadState({"net": {"1.weight": w, "1.bias": b}}).body())
        assert stage1.order.unanswered_up_to == request_id
        result = next_result()
        assert result is not None and result.kind == protocol.RESULT, "the held-back micro-batch never ran"
        assert not stage1.order.unanswered_up_to, "the result overtook the reply to the request it waited for"
        out = Forward.from_body(result.body)
        assert out.call == 99 and out.sender == 1 and out.fence == {1: request_id}
        assert torch.allclose(out.x, x @ w.T + b, atol=1e-6), "the micro-batch ran with the old weights"
    finally:
        if peer is not None:
            peer.close(0)
        session.close()


def test_a_calls_micro_batches_travel_as_one_message_each_way(worker):
    """The driver sends a call's micro-batches to a stage in one ZeroMQ message, and the stage that
    answers the driver sends their results back in one, once it has them all (each message costs
    both sides a send and a wake-up). A call that fails midway sends its error, and the results it
    kept are dropped when the driver releases the call."""
    from lightning_remote_mp.flow import DRIVER
    from lightning_remote_mp.wire.messages import Forward
    from lightning_remote_mp.wire.requests import Release

    net = _spec()
    local = copy.deepcopy(net)
    session = DriverSession([worker.address], connect_timeout=REPLY_TIMEOUT)
    try:
        session.place("net", net)
        conn = session.conns[0]

        def bodies(call: int, xs: list[torch.Tensor]) -> list[dict]:
            return [
                Forward(key="net", call=call, mb=i, sender=DRIVER, x=x, microbatches=len(xs)).body()
                for i, x in enumerate(xs)
            ]

        def next_zmq_message(timeout: float = REPLY_TIMEOUT) -> list[protocol.Message] | None:
            if not conn._sock.poll(timeout * 1000):
                return None
            return protocol.decode_all(conn._sock.recv_multipart(copy=False))

        xs = [torch.randn(4, 3) for _ in range(3)]
        with torch.no_grad():
            conn.send_all(protocol.FORWARD, bodies(7, xs))
            results = next_zmq_message()
            assert results is not None, "no results"
            got = [(m.kind, m.body["call"], m.body["mb"]) for m in results]
            assert got == [(protocol.RESULT, 7, i) for i in range(3)]
            for m, x in zip(results, xs):
                assert torch.allclose(Forward.from_body(m.body).x, local(x), atol=1e-6)
            assert next_zmq_message(0.3) is None, "a result came twice"

            # Micro-batch 1 of call 8 fails (a wrong input width); micro-batch 0's result is kept, then dropped.
            conn.send_all(protocol.FORWARD, bodies(8, [xs[0], torch.randn(4, 5)]))
            error = next_zmq_message()
            assert error is not None and [m.kind for m in error] == [protocol.ERROR]
            assert (error[0].body["call"], error[0].body["mb"]) == (8, 1)
            conn.post(protocol.RELEASE, Release({"net": [8]}).body())  # answered only if it fails
            conn.settle(timeout=REPLY_TIMEOUT)
            conn.send_all(protocol.FORWARD, bodies(9, xs[:1]))
            after = next_zmq_message()
            assert after is not None and [(m.kind, m.body["call"]) for m in after] == [(protocol.RESULT, 9)], (
                "the failed call's kept result reached the driver"
            )
    finally:
        session.close()
    worker.assert_alive()


def test_the_optimizers_requests_are_answered_only_when_they_fail(worker, connect):
    """The driver posts zero_grad and the optimizer's step every step without waiting: the worker
    answers them only when they fail (an ERROR that says it answers a posted request), and SYNC
    once everything before it has run."""
    client = connect(worker.address)
    client.ok(protocol.HELLO, {"driver": "pytest"})
    client.ok(protocol.SETUP, _stage_body())
    client.send(protocol.ZERO_GRAD, {"index": 0, "set_to_none": True})
    assert client.recv(timeout=0.5) is None, "a zero_grad that worked was answered"
    bad = client.send(protocol.ZERO_GRAD, {"index": "first"})
    error = client.recv()
    assert error is not None and (error.kind, error.id) == (protocol.ERROR, bad)
    assert error.body["posted"] == protocol.ZERO_GRAD and "index" in error.body["message"]
    assert client.ok(protocol.SYNC) is None
    assert client.recv(timeout=0.3) is None


def test_the_driver_forgets_quiet_requests_once_they_have_run_and_raises_their_failures(worker):
    """Posted zero_grads are answered only if they fail, so the driver counts them run once a later
    request's reply arrives (the worker runs requests in order) or the heartbeat says so; `settle`
    asks with a SYNC. A failed one is raised by whichever read meets its ERROR."""
    from lightning_remote_mp.wire.requests import ZeroGrad
    from lightning_remote_mp.wire.state import GetState

    session = DriverSession([worker.address], connect_timeout=REPLY_TIMEOUT)
    try:
        session.place("net", _spec())
        conn = session.conns[0]
        for _ in range(50):
            conn.post(protocol.ZERO_GRAD, ZeroGrad(0).body())
        assert conn.order.unanswered_up_to == conn.order.last_id
        assert "net" in conn.request(protocol.GET_STATE, GetState().body())
        assert not conn.order.unanswered and not conn.order.unanswered_up_to, (
            "50 zero_grads are still counted as pending"
        )
        conn.post(protocol.ZERO_GRAD, ZeroGrad(0).body())
        deadline = time.monotonic() + 10
        while conn.order.unanswered_up_to and time.monotonic() < deadline:  # the heartbeat says it ran
            time.sleep(0.1)
        assert not conn.order.unanswered_up_to, "the heartbeat never confirmed the posted zero_grad"
        conn.post(protocol.ZERO_GRAD, {"index": "first"})  # fails on the worker
        conn.post(protocol.ZERO_GRAD, ZeroGrad(0).body())
        with pytest.raises(WorkerError, match=r"zero_grad \(reported late"):
            conn.settle()
        conn.settle()  # the SYNC's reply came after the error: nothing is left
        assert not conn.order.unanswered
        # The heartbeat (another socket) may count a failed one as run before its ERROR is read:
        # settle still meets the ERROR, on its way to the SYNC's reply.
        conn.post(protocol.ZERO_GRAD, {"index": "first"})
        deadline = time.monotonic() + 10
        while (conn.order.unanswered_up_to or not conn.readable(0)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not conn.order.unanswered_up_to and conn.readable(0)
        with pytest.raises(WorkerError, match=r"zero_grad \(reported late"):
            conn.settle()
        conn.settle()
    finally:
        session.close()


def _sealing_worker(client: Client) -> tuple[bytes, Any]:
    """A session that gave the worker a seal key (returned), a stage and an SGD optimizer; and a step
    that fails when it runs (two groups' hyperparameters for one), so a test sees whether it ran."""
    from lightning_remote_mp.wire.requests import OptimCreate, OptimStep

    key = os.urandom(32)
    client.ok(protocol.HELLO, {"driver": "pytest", "seal_key": key})
    client.ok(protocol.SETUP, _stage_body())
    create = OptimCreate(0, "torch.optim.SGD", {"lr": 0.1}, [{"params": ["net/0.weight"], "lr": 0.1}])
    client.ok(protocol.OPTIM_CREATE, create.body())
    return key, OptimStep(0, [{"lr": 0.1}, {"lr": 0.2}])


def _carried_step_runs_right_after_the_request_it_follows(client: Client, key: bytes, step: Any, sender: int) -> Any:
    """Carry ``step``, sealed with ``key``, after a SYNC not sent yet: it must not run before that
    SYNC, and must run (and fail) right after it. Returns its error's body."""
    from lightning_remote_mp.wire.carry import Carried, Carry

    before = client.next_id + 2  # the SYNC sent after the CARRY
    carried = Carried.sealed(step, before + 1, before, client.session, key)
    client.send(protocol.CARRY, Carry("net", 1, sender, 1, {0: [carried]}).body())
    assert client.recv(timeout=0.5) is None, "the carried step ran before the request it follows came"
    assert client.send(protocol.SYNC) == before
    first, second = client.recv(), client.recv()
    assert first is not None and (first.kind, first.id) == (protocol.OK, before)
    assert second is not None and (second.kind, second.id) == (protocol.ERROR, before + 1), second
    assert "2 groups" in second.body["message"]
    client.next_id = before + 1
    return second.body


def test_a_carried_request_without_the_drivers_seal_for_this_worker_is_refused_and_runs_nothing(worker, connect):
    """What the driver sends a worker along the pipeline bears its seal for that worker (an HMAC
    under the key its HELLO gave). A stage on the way knows no other worker's key: a request it
    forges or alters, or one sealed for another session, is refused, names where it came from, and
    does not run; the driver's own sealed request does."""
    from lightning_remote_mp.wire.carry import Carried, Carry

    client = connect(worker.address)
    key, bad = _sealing_worker(client)
    ran = client.next_id  # every request so far has run: a carried one after it would run at once
    forged = [
        Carried.sealed(bad, ran + 1, ran, client.session, os.urandom(32)),  # another key
        Carried.sealed(bad, ran + 1, ran, "another session", key),  # another session's
        dataclasses.replace(Carried.sealed(bad, ran + 1, ran, client.session, key), after=ran - 1),  # altered
    ]
    for carried in forged:
        client.send(protocol.CARRY, Carry("net", 1, 1, 1, {0: [carried]}).body())  # as if stage 1 passed it on
        error = client.recv()
        assert error is not None and error.kind == protocol.ERROR, error
        text = error.body["message"]
        assert "does not bear the driver's seal" in text and "from stage 1" in text and "2 groups" not in text, text
    assert client.ok(protocol.SYNC) is None  # none of them ran
    _carried_step_runs_right_after_the_request_it_follows(client, key, bad, sender=1)
    assert client.ok(protocol.SYNC) is None


def test_a_request_carried_along_the_pipeline_waits_for_the_one_before_it_and_runs_once(worker, connect):
    """The driver's quiet requests may travel with the micro-batches (`Carry`): each names the request
    before it, and runs only once that one has run, however it came; a copy sent straight afterwards
    (the driver does not know the first arrived) does not run again."""
    from lightning_remote_mp.flow import DRIVER

    client = connect(worker.address)
    key, bad = _sealing_worker(client)
    error = _carried_step_runs_right_after_the_request_it_follows(client, key, bad, sender=DRIVER)
    before = client.next_id - 1
    assert error["posted"] == protocol.OPTIM_STEP
    client.send_raw(protocol.encode(protocol.OPTIM_STEP, before + 1, client.session, bad.body()))  # the copy
    client.next_id = before + 1
    assert client.recv(timeout=0.5) is None, "the step ran twice"
    assert client.ok(protocol.SYNC) is None


def test_a_message_that_cannot_be_encoded_sends_nothing_and_loses_no_held_request(worker):
    """The driver holds its quiet requests until the next message (`Connection.carry`). One that
    cannot be encoded raises before anything is sent: the held step still goes with the next
    message, and no request id goes missing (the worker would wait for it)."""
    from lightning_remote_mp.errors import ProtocolError
    from lightning_remote_mp.wire.requests import OptimStep

    session = DriverSession([worker.address], connect_timeout=REPLY_TIMEOUT)
    try:
        net = _spec()
        session.place("net", net)
        session.mirror_optimizer(0, torch.optim.SGD(net.parameters(), lr=0.1))
        conn = session.conns[0]
        conn.carry(OptimStep(0, [{"lr": 0.1}, {"lr": 0.2}]))  # two groups' hyperparameters for one: it fails
        with pytest.raises(ProtocolError, match="cannot send a value of type object"):
            conn.send_all(protocol.SYNC, [{"x": object()}])
        with pytest.raises(WorkerError, match=r"optim_step \(reported late"):
            conn.settle(timeout=REPLY_TIMEOUT)
        conn.settle(timeout=REPLY_TIMEOUT)  # answered: the worker saw every id in order
    finally:
        session.close()
