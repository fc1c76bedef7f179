"""CURVE encryption and authentication between the driver and the workers, and between workers.

Real workers on 127.0.0.1 run with key pairs from ``lrmp-worker keygen``; drivers with the right
key, a wrong key, no key, or a wrong idea of the worker's key try to use them; a wiretap relay
checks that what crosses the network is ciphertext.
"""

from __future__ import annotations

import copy
import json
import os
import stat
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import zmq
from lrmp_relay import Relay
from test_strategy import (
    Net,
    assert_same_forward_and_backward,
    assert_same_losses,
    assert_same_weights,
    data,
    residual_spec,
    trainer,
)
from zmq.utils.monitor import recv_monitor_message

from lightning_remote_mp import (
    AuthenticationError,
    ConfigurationError,
    CurveOptions,
    LocalWorkerOptions,
    LrmpError,
    RemoteModelParallelStrategy,
)
from lightning_remote_mp.driver.launch import LocalWorkers
from lightning_remote_mp.driver.session import DriverSession
from lightning_remote_mp.driver.workers import load_keys
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.keys import KeyPair, load_keypair, load_public_key
from lightning_remote_mp.worker import cli
from lightning_remote_mp.worker.cli import insecure_bind_warning

pytestmark = pytest.mark.timeout(120)

REFUSAL_BOUND = 5.0  # seconds within which a refused driver must hear why


def keygen(directory: Path, name: str, *args: str) -> int:
    """``lrmp-worker keygen DIR --name NAME`` (its ``main``, in this process: starting one costs seconds)."""
    return cli.main(["keygen", str(directory), "--name", name, *args])


class Keyring:
    def __init__(self, root: Path) -> None:
        self.root = root
        for name in ("driver", "stranger", "w0", "w1", "w2"):
            assert keygen(root, name) == 0
        self.authorized = root / "authorized"
        self.authorized.mkdir()
        (self.authorized / "driver.key").write_bytes((root / "driver.key").read_bytes())

    def secret(self, name: str) -> str:
        return str(self.root / f"{name}.key_secret")

    def public(self, name: str) -> str:
        return str(self.root / f"{name}.key")

    def pair(self, name: str) -> KeyPair:
        return load_keypair(self.secret(name))

    def public_key(self, name: str) -> bytes:
        return load_public_key(self.public(name))


@pytest.fixture(scope="module")
def keyring(tmp_path_factory) -> Keyring:
    return Keyring(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def curve_workers(keyring) -> Any:
    """Two workers that only talk CURVE and only to the key in ``keyring.authorized``."""
    workers = LocalWorkers(
        2,
        devices=["cpu"] * 2,
        threads=1,
        allow_modules=["lrmp_testlayers"],
        secret_keys=[keyring.secret("w0"), keyring.secret("w1")],
        authorized_keys=str(keyring.authorized),
    )
    workers.start()
    yield workers
    workers.stop()


def _spec() -> SpecSequential:
    torch.manual_seed(2)
    return SpecSequential(
        [
            ("torch.nn.Linear", {"in_features": 3, "out_features": 4}, (4, 3)),
            ("torch.nn.Linear", {"in_features": 4, "out_features": 2}, (4, 4)),
        ]
    )


def _check_serves(addresses: list[str], keyring: Keyring) -> None:
    """An authorized driver places a two-stage model and gets the local result, forward and backward."""
    net, local = _spec(), _spec()
    session = DriverSession(
        addresses,
        keys=keyring.pair("driver"),
        worker_keys=dict(zip(addresses, [keyring.public_key("w0"), keyring.public_key("w1")])),
        connect_timeout=20,
    )
    try:
        session.place("net", net)
        assert_same_forward_and_backward(net, local, torch.randn(4, 3), torch.ones(4, 2))  # as .sum().backward()
    finally:
        session.close()


def _dealer(address: str, curve: tuple[KeyPair, bytes] | None = None) -> zmq.Socket:
    sock = _unconnected_dealer(curve)
    sock.connect(address)
    return sock


def _unconnected_dealer(curve: tuple[KeyPair, bytes] | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A refused handshake can drop the pipe: a send with nowhere to queue fails (zmq.Again) instead of
    # blocking the test forever.
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    if curve is not None:
        sock.curve_secretkey = curve[0].secret
        sock.curve_publickey = curve[0].public
        sock.curve_serverkey = curve[1]
    return sock


def _request(sock: zmq.Socket, kind: str, session: str, body: Any = None, timeout: float = 5.0):
    try:
        sock.send_multipart(protocol.encode(kind, 1, session, body))
    except zmq.Again:  # not even queued (see _unconnected_dealer): no answer either
        return None
    if not sock.poll(timeout * 1000, zmq.POLLIN):
        return None
    return protocol.decode(sock.recv_multipart())


# --- keys -------------------------------------------------------------------------------------


def test_keygen_writes_a_private_key_pair_and_never_overwrites(keyring, capsys):
    secret, public = Path(keyring.secret("w0")), Path(keyring.public("w0"))
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pair = keyring.pair("w0")
    assert pair.public == keyring.public_key("w0") and len(pair.secret) == 40
    assert pair.secret.decode() not in public.read_text()
    assert pair.secret.decode() not in repr(pair)
    # Running keygen again for the same name refuses, and leaves the keys as they were.
    capsys.readouterr()
    assert keygen(keyring.root, "w0") == 2
    err = capsys.readouterr().err
    assert "already exist" in err and "--force" in err
    assert keyring.pair("w0") == pair
    # A public key file where a secret one is expected is a clear error.
    with pytest.raises(ValueError, match="holds only a public key"):
        load_keypair(keyring.public("w0"))


def test_keygen_without_a_directory_writes_into_a_private_lrmp_in_home(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli.main(["keygen", "--name", "gpu1"]) == 0
    home = tmp_path / ".lrmp"
    assert stat.S_IMODE(home.stat().st_mode) == 0o700  # as ssh-keygen's ~/.ssh: it holds secret keys
    assert stat.S_IMODE((home / "gpu1.key_secret").stat().st_mode) == 0o600
    assert load_keypair(home / "gpu1.key_secret").public == load_public_key(home / "gpu1.key")
    out = capsys.readouterr().out
    assert f"wrote a key pair into {home}" in out and str(home / "gpu1.key_secret") in out
    # An explicit directory still works, and the default directory keeps what it holds.
    assert keygen(tmp_path / "elsewhere", "gpu2") == 0
    assert (tmp_path / "elsewhere" / "gpu2.key").is_file() and not (home / "gpu2.key").exists()
    assert cli.main(["keygen"]) == 0 and (home / "worker.key").is_file() and (home / "gpu1.key").is_file()


def test_the_strategy_checks_its_key_arguments(keyring):
    hosts = ["127.0.0.1:5555", "127.0.0.1:5556"]
    with pytest.raises(ConfigurationError, match="curve.worker_public_keys is empty"):
        RemoteModelParallelStrategy(hosts=hosts, curve=CurveOptions(keyring.secret("driver")))
    with pytest.raises(ConfigurationError, match="curve.worker_public_keys names 3 files for 2 hosts"):
        RemoteModelParallelStrategy(
            hosts=hosts, curve=CurveOptions(keyring.secret("driver"), [keyring.public("w0")] * 3)
        )
    with pytest.raises(ConfigurationError, match="curve.worker_public_keys is for workers given in hosts"):
        RemoteModelParallelStrategy(curve=CurveOptions(keyring.secret("driver"), [keyring.public("w0")]))
    # The key files are read at setup: a missing one is named then, not at construction.
    missing = RemoteModelParallelStrategy(
        hosts=hosts, curve=CurveOptions(str(keyring.root / "nope"), [keyring.public("w0")])
    )
    with pytest.raises(LrmpError, match="does not exist"):
        load_keys(missing.curve, missing.topology)
    shared = RemoteModelParallelStrategy(
        hosts=hosts, curve=CurveOptions(keyring.secret("driver"), keyring.public("w0"))
    )
    assert load_keys(shared.curve, shared.topology)[1] == {f"tcp://{h}": keyring.public_key("w0") for h in hosts}


def test_binding_beyond_loopback_without_keys_warns():
    assert insecure_bind_warning("tcp://127.0.0.1:5555", secure=False) is None
    assert insecure_bind_warning("tcp://0.0.0.0:5555", secure=True) is None
    warning = insecure_bind_warning("tcp://0.0.0.0:5555", secure=False)
    assert warning is not None and "WITHOUT encryption" in warning and "--secret-key" in warning


# --- who may connect ----------------------------------------------------------------------------


def test_refused_drivers_hear_why_at_once(curve_workers, keyring, pool):
    addresses = curve_workers.addresses
    worker_keys = [keyring.public_key("w0"), keyring.public_key("w1")]
    cases = {  # case: the session's arguments, what the error says, the workers that refuse
        "a key the workers do not list": (
            dict(keys=keyring.pair("stranger"), worker_keys=dict(zip(addresses, worker_keys))),
            "refused this driver's public key " + keyring.public_key("stranger").decode(),
            addresses,
        ),
        "no key at all": (dict(), "requires CURVE encryption", addresses),
        "a wrong idea of the worker's key": (
            dict(
                keys=keyring.pair("driver"),
                worker_keys=dict(zip(addresses, [keyring.public_key("w2"), worker_keys[1]])),
            ),
            "is probably not the public key",
            addresses[:1],
        ),
    }
    for case, (kwargs, expected, refusing) in cases.items():
        start = time.monotonic()
        with pytest.raises(AuthenticationError) as info:
            DriverSession(addresses, connect_timeout=30, **kwargs)
        elapsed = time.monotonic() - start
        assert elapsed < REFUSAL_BOUND, (case, elapsed)
        assert expected in str(info.value), (case, str(info.value))
        # Where both refuse, the error names the one whose refusal came first.
        assert info.value.address in refusing and info.value.address in str(info.value), case
    # A driver with keys meets a worker without: said so too.
    with pytest.raises(AuthenticationError, match="does not use CURVE"):
        DriverSession(pool[:1], keys=keyring.pair("driver"), worker_keys={pool[0]: worker_keys[0]}, connect_timeout=30)
    # Through the strategy, a refused key fails fit with the same error.
    strategy = RemoteModelParallelStrategy(
        hosts=addresses, curve=CurveOptions(keyring.secret("stranger"), [keyring.public("w0")])
    )
    start = time.monotonic()
    with pytest.raises(AuthenticationError, match="--authorized-keys"):
        trainer(strategy, epochs=1).fit(Net(residual_spec(probe=False)), data())
    assert time.monotonic() - start < REFUSAL_BOUND + 5
    # None of this disturbed the workers: the authorized driver is served.
    _check_serves(addresses, keyring)


def test_plaintext_and_unknown_keys_get_no_answer_at_all(curve_workers, keyring):
    address = curve_workers.addresses[0]
    server_key = keyring.public_key("w0")
    plaintext = _unconnected_dealer()
    monitor = plaintext.get_monitor_socket()  # before connecting: the handshake fails at once
    plaintext.connect(address)
    socks = {
        "plaintext": plaintext,
        "stranger": _dealer(address, (keyring.pair("stranger"), server_key)),
        "authorized": _dealer(address, (keyring.pair("driver"), server_key)),
    }
    try:
        session = uuid.uuid4().hex
        for name in ("plaintext", "stranger"):  # both asked at once, both waited for 2 s
            try:  # a refused handshake may have dropped the pipe already: then nothing can even be queued
                socks[name].send_multipart(protocol.encode(protocol.HELLO, 1, session, {"driver": name}))
            except zmq.Again:
                pass
        time.sleep(2.0)
        assert not socks["plaintext"].poll(0) and not socks["stranger"].poll(0)
        events = []
        while monitor.poll(0):
            events.append(recv_monitor_message(monitor)["event"])
        # libzmq names the mechanism mismatch, or (when the connection drops first) gives no detail.
        failures = {zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
        assert failures & set(events), events
        # Control: the same request with the authorized key is answered.
        reply = _request(socks["authorized"], protocol.HELLO, session, {"driver": "authorized"})
        assert reply is not None and reply.kind == protocol.OK and reply.body["curve"] is True
        assert _request(socks["authorized"], protocol.BYE, session).kind == protocol.OK
        socks["plaintext"].disable_monitor()
        monitor.close(0)
    finally:
        for s in socks.values():
            s.close(0)


def test_a_peer_key_may_only_send_its_sessions_pipeline(curve_workers, keyring):
    """The driver announces a peer's key at SETUP; that key may send forward/backward messages of
    the session, but never drive the worker, and may not connect once the session is over."""
    address = curve_workers.addresses[1]
    server_key = keyring.public_key("w1")
    peer_pair = keyring.pair("w2")
    session = uuid.uuid4().hex
    driver = _dealer(address, (keyring.pair("driver"), server_key))
    sink = zmq.Context.instance().socket(zmq.ROUTER)  # stands in for stage 0, where gradients go
    sink.setsockopt(zmq.LINGER, 0)
    sink_address = f"tcp://127.0.0.1:{sink.bind_to_random_port('tcp://127.0.0.1')}"
    peer = None
    try:
        assert _request(driver, protocol.HELLO, session, {"driver": "test"}).kind == protocol.OK
        setup = {
            "key": "net",
            "stage": 1,
            "stages": 2,
            "start": 1,
            "entries": [["torch.nn.Linear", {"in_features": 4, "out_features": 2}, [4, 4]]],
            "exports": [],
            "state": None,
            "init_seed": 0,
            "sources": [[0, []]],
            "targets": [[-1, []]],
            "peers": {0: sink_address},
            "peer_keys": {0: peer_pair.public.decode()},
        }
        reply = _request(driver, protocol.SETUP, session, setup)
        assert reply.kind == protocol.OK, reply.body
        peer = _dealer(address, (peer_pair, server_key))
        # As a peer: a forward of stage 0's output is accepted, and its result goes to the driver.
        forward = {"key": "net", "call": 1, "mb": 0, "from": 0, "x": torch.ones(4, 4), "vars": {}, "grad": False}
        peer.send_multipart(protocol.encode(protocol.FORWARD, 0, session, forward))
        assert driver.poll(5000), "the peer's forward was not run"
        result = protocol.decode(driver.recv_multipart())
        assert result.kind == protocol.RESULT and result.body["x"].shape == (4, 2)
        # As a driver: refused, whatever it asks.
        for kind in (protocol.GET_STATE, protocol.HELLO, protocol.BYE, protocol.SETUP):
            reply = _request(peer, kind, session, {"driver": "peer"})
            assert reply is not None and reply.kind == protocol.ERROR, kind
            assert reply.body["type"] == "PermissionError" and "peer worker" in reply.body["message"], kind
        assert _request(driver, protocol.GET_STATE, session).kind == protocol.OK  # the session is intact
        assert _request(driver, protocol.BYE, session).kind == protocol.OK
        # The session is over: the peer's key is no longer accepted on a new connection.
        peer.close(0)
        peer = _dealer(address, (peer_pair, server_key))
        assert _request(peer, protocol.PING, session, timeout=2.0) is None
    finally:
        for s in (driver, sink, peer):
            if s is not None:
                s.close(0)
    _check_serves(curve_workers.addresses, keyring)


# --- training over CURVE ------------------------------------------------------------------------


class _SessionId(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.id = trainer.strategy.session.id


@pytest.fixture(scope="module")
def local_run() -> tuple[Net, Net]:
    """A model trained one epoch locally, and an untrained twin of it."""
    torch.manual_seed(11)
    local = Net(residual_spec(probe=False))
    untrained = copy.deepcopy(local)
    trainer(epochs=1).fit(local, data())
    return local, untrained


@pytest.mark.parametrize("secure", [True, False], ids=["curve", "plaintext-control"])
def test_training_through_a_wiretap_equals_local_and_shows_no_plaintext(
    secure, keyring, curve_workers, pool, local_run
):
    """Every connection (driver to workers, heartbeats, worker to worker) goes through a relay that
    records the bytes. With keys, nothing recognisable crosses it; the plaintext run shows the same
    check would see the data."""
    addresses = curve_workers.addresses if secure else pool[:2]
    relays = [Relay(a) for a in addresses]
    try:
        local, untrained = local_run
        remote = copy.deepcopy(untrained)
        keys = {}
        if secure:
            keys = dict(curve=CurveOptions(keyring.secret("driver"), [keyring.public("w0"), keyring.public("w1")]))
        # res_1 crosses from stage 0 to stage 1: activations and gradients flow worker to worker.
        strategy = RemoteModelParallelStrategy(hosts=[r.address for r in relays], balance=[4, 6], **keys)
        session = _SessionId()
        trainer(strategy, epochs=1, callbacks=[session]).fit(remote, data())
        assert_same_losses(local.losses, remote.losses)
        assert_same_weights(local, remote)
        streams = [s for r in relays for s in r.captured()]
    finally:
        for r in relays:
            r.close()
    assert sum(len(s) for s in streams) > 20_000  # the whole run crossed the relays
    first_batch = next(iter(data()))[0].numpy().tobytes()
    markers = {
        "the first batch": first_batch,
        "the session id": session.id.encode(),
        "a message kind": b"optim_step",
        "a layer path": b"torch.nn.Linear",
        "a residual name": b"res_1",
    }
    seen = {name for name, m in markers.items() if any(m in s for s in streams)}
    if secure:
        assert not seen, f"readable on the wire despite CURVE: {sorted(seen)}"
    else:
        assert seen == set(markers), f"the wiretap missed {sorted(set(markers) - seen)}"


def test_replicas_with_keys_are_refused_unless_the_plaintext_allreduce_is_allowed():
    # Refused before any file is read: the key file named here does not exist.
    missing = "/nonexistent/driver.key_secret"
    rows = [["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3", "127.0.0.1:4"]]
    with pytest.raises(ConfigurationError, match="curve.allow_plaintext_allreduce=True") as info:
        RemoteModelParallelStrategy(hosts=rows, curve=CurveOptions(missing, ["w.key"]))
    assert isinstance(info.value, ValueError)
    assert "curve is set and hosts has 2 rows" in str(info.value) and "gradients" in str(info.value)
    with pytest.raises(ConfigurationError, match=r"curve is set and replicas=2, .*allow_plaintext"):
        RemoteModelParallelStrategy(curve=CurveOptions(missing), local_workers=LocalWorkerOptions(count=2), replicas=2)
    # One pipeline, or no keys, needs no opt-in; with the opt-in, the key file is first read at setup.
    RemoteModelParallelStrategy(hosts=rows[0], curve=CurveOptions(missing, ["w.key"]))
    RemoteModelParallelStrategy(hosts=rows)
    allowed = RemoteModelParallelStrategy(
        hosts=rows, curve=CurveOptions(missing, ["w.key"], allow_plaintext_allreduce=True)
    )
    with pytest.raises(LrmpError, match="does not exist"):
        load_keys(allowed.curve, allowed.topology)


def test_local_workers_get_fresh_keys_with_a_curve_secret_key(keyring, caplog):
    torch.manual_seed(12)
    remote = Net(residual_spec(probe=False))
    local = copy.deepcopy(remote)
    before = {k: v.clone() for k, v in remote.state_dict().items()}
    # Two one-stage replicas: their all-reduce is the one link CURVE does not cover, allowed here.
    strategy = RemoteModelParallelStrategy(
        curve=CurveOptions(keyring.secret("driver"), allow_plaintext_allreduce=True),
        local_workers=LocalWorkerOptions(count=2),
        replicas=2,
    )
    seen = {}

    class Check(L.Callback):
        def on_train_start(self, trainer, pl_module):
            s = trainer.strategy
            seen["curve"] = [w["curve"] for w in s.session.workers]
            seen["dir"] = s._workers.keys_dir

    trainer(strategy, epochs=1, callbacks=[Check()]).fit(remote, data())
    assert seen["curve"] == [True, True]
    assert seen["dir"] and not os.path.exists(seen["dir"])  # the generated keys are gone with the workers
    # It trained there: four steps, every weight came back changed, and as a local run would.
    assert len(remote.losses) == 4
    assert all(not torch.equal(before[k], v) for k, v in remote.state_dict().items()), "some weight did not train"
    trainer(epochs=1).fit(local, data())
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)
    warned = [r for r in caplog.records if "allow_plaintext_allreduce=True" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING", caplog.text


def test_a_lightningcli_yaml_config_sets_the_keys(keyring, monkeypatch):
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse: pip install -e '.[examples]'")
    from test_examples import CONFIGS, load_example

    monkeypatch.setattr(sys, "argv", ["cli.py"])
    config = os.path.join(CONFIGS, "multi_machine_curve.yaml")
    publics = [keyring.public("w0"), keyring.public("w1")]
    args = ["--config", config, "--trainer.strategy.init_args.curve.secret_key", keyring.secret("driver")]
    args += ["--trainer.strategy.init_args.curve.worker_public_keys", json.dumps(publics)]
    built = load_example("cli").main(args, run=False)  # builds the Trainer; contacts nobody, reads no key
    strategy = built.trainer.strategy
    assert isinstance(strategy, RemoteModelParallelStrategy) and strategy.session is None
    assert strategy.curve == CurveOptions(keyring.secret("driver"), publics)
    keys, worker_keys = load_keys(strategy.curve, strategy.topology)  # what setup reads
    assert keys == keyring.pair("driver")
    assert list(worker_keys.values()) == [keyring.public_key("w0"), keyring.public_key("w1")]
    assert list(worker_keys) == ["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"]
