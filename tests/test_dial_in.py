"""Workers that dial in (``lrmp-worker --connect``): they listen on nothing, the driver listens
(``listen=``), and everything they exchange takes their one connection; what another worker sends
one goes through the driver's switchboard. Real workers on loopback, and on an emulated LAN
(network namespaces, `lrmp_lan.Lan`) where the worker hosts listen on no port at all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import lightning as L
import pytest
import torch
import zmq
from lrmp_lan import free_port
from test_strategy import Net, assert_same_losses, assert_same_weights, data, residual_spec, trainer

from lightning_remote_mp import ConfigurationError, CurveOptions, RemoteModelParallelStrategy, WorkerLostError
from lightning_remote_mp.wire import protocol, sockets
from lightning_remote_mp.wire.keys import generate_keypair, load_keypair, load_public_key, write_public_key
from lightning_remote_mp.wire.requests import Hello
from lightning_remote_mp.wire.switchboard import Switchboard


def _fit_both(twin, strategy, epochs: int = 2, microbatches: int = 2) -> None:
    torch.manual_seed(0)
    local = Net(residual_spec())
    remote = twin(local)
    trainer(epochs=epochs).fit(local, data())
    trainer(strategy, epochs=epochs).fit(remote, data())
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)


def test_workers_that_dial_in_train_as_local_training_and_serve_the_next_driver(dial_in, twin):
    port = free_port()
    hosts = [dial_in(port, "a"), dial_in(port, "b")]
    assert hosts == ["dial://a", "dial://b"]
    listen = f"tcp://127.0.0.1:{port}"
    # The residual variable crosses from stage 0 to stage 1: a peer message relayed by the driver.
    _fit_both(twin, RemoteModelParallelStrategy(hosts=["a", "b"], listen=listen, microbatches=2, balance=[4, 8]))
    # The next driver listens anew; the workers' links reconnect by themselves.
    _fit_both(twin, RemoteModelParallelStrategy(hosts=hosts, listen=listen, microbatches=1), epochs=1)


@pytest.mark.parametrize("dial_in_first", [True, False], ids=["dial-in-then-listening", "listening-then-dial-in"])
def test_a_dial_in_worker_beside_one_that_listens(dial_in, twin, pool, dial_in_first):
    """Towards the worker that listens, messages go straight to it; towards the one that dialed
    in, through the driver (at this machine's address on the route to the sender)."""
    port = free_port()
    dialed = dial_in(port, "a")
    hosts = [dialed, pool[0]] if dial_in_first else [pool[0], dialed]
    strategy = RemoteModelParallelStrategy(hosts=hosts, listen=f"tcp://0.0.0.0:{port}", microbatches=2, balance=[4, 8])
    _fit_both(twin, strategy)


class _Kill(L.Callback):
    def __init__(self, pid: int) -> None:
        self.pid, self.at = pid, 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            os.kill(self.pid, signal.SIGKILL)
            self.at = time.monotonic()


def test_a_dial_in_worker_that_dies_is_named_within_the_heartbeat_timeout(dial_in):
    port = free_port()
    dial_in(port, "a")
    dial_in(port, "b")
    kill = _Kill(dial_in.pids["b"])
    strategy = RemoteModelParallelStrategy(
        hosts=["a", "b"], listen=f"tcp://127.0.0.1:{port}", microbatches=2, heartbeat_timeout=3.0
    )
    with pytest.raises(WorkerLostError) as info:
        trainer(strategy, epochs=3, callbacks=[kill]).fit(Net(residual_spec()), data())
    assert info.value.address == "dial://b", str(info.value)
    assert time.monotonic() - kill.at < 3.0 + 3.0


def test_a_worker_that_has_not_dialed_in_is_named(dial_in):
    port = free_port()
    dial_in(port, "a")
    strategy = RemoteModelParallelStrategy(hosts=["a", "b"], listen=f"tcp://127.0.0.1:{port}", connect_timeout=3.0)
    start = time.monotonic()
    with pytest.raises(WorkerLostError) as info:
        trainer(strategy, epochs=1).fit(Net(residual_spec()), data())
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "b has not dialed in" in message and "dialed in: a (from 127.0.0.1" in message, message
    assert f"--connect tcp://<this machine>:{port} --name NAME" in message, message
    assert info.value.address == "dial://b"


def _keys(tmp_path, *names: str):
    """A driver key pair, the directory of the public keys workers accept, and a pair per name."""
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    _, driver_secret = generate_keypair(tmp_path, "driver")
    write_public_key(authorized / "driver.key", load_keypair(driver_secret).public)
    return driver_secret, authorized, {n: generate_keypair(tmp_path, n) for n in names}


def test_curve_authenticates_both_directions(dial_in, twin, tmp_path, capfd):
    driver_secret, authorized, pairs = _keys(tmp_path, "a", "b")
    port = free_port()
    for name, (_, secret) in pairs.items():
        dial_in(port, name, "--secret-key", str(secret), "--authorized-keys", str(authorized))
    curve = CurveOptions(str(driver_secret), [str(pairs["a"][0]), str(pairs["b"][0])])
    listen = f"tcp://127.0.0.1:{port}"
    _fit_both(twin, RemoteModelParallelStrategy(hosts=["a", "b"], listen=listen, microbatches=2, curve=curve))
    # A worker dialing in under its own name with another worker's key is refused and named; one
    # whose key is none of the workers' is refused at the handshake, and counted.
    port = free_port()
    dial_in(port, "c", "--secret-key", str(pairs["a"][1]), "--authorized-keys", str(authorized))
    _, stranger = generate_keypair(tmp_path, "stranger")
    dial_in(port, "d", "--secret-key", str(stranger), "--authorized-keys", str(authorized))
    curve = CurveOptions(str(driver_secret), [str(pairs["b"][0]), str(pairs["a"][0])])
    strategy = RemoteModelParallelStrategy(
        hosts=["c", "d"], listen=f"tcp://127.0.0.1:{port}", curve=curve, connect_timeout=60
    )
    started = time.monotonic()
    with pytest.raises(WorkerLostError) as info:
        trainer(strategy, epochs=1).fit(Net(residual_spec()), data())
    assert time.monotonic() - started < 20, "a refused worker must end setup without waiting out connect_timeout"
    message = str(info.value)
    assert "c, d have not dialed in" in message and "refused: c (its key is not the one given for it)" in message
    assert "1 connection key that none of the workers has" in message, message
    assert "until one was refused" in message, message
    assert "refused this worker's key" in capfd.readouterr().err  # the refused worker says so in its log


def test_a_peer_relayed_by_the_driver_may_send_only_its_pipeline(dial_in):
    """The worker tells the driver's messages from a relaying peer's by the origin the switchboard
    writes: a peer cannot start a session, and cannot pass for the driver."""
    port = free_port()
    switchboard = Switchboard(f"tcp://127.0.0.1:{port}")
    peer = sockets.context().socket(zmq.DEALER)
    forger = sockets.context().socket(zmq.DEALER)
    try:
        dial_in(port, "a")
        switchboard.wait_for(["a"], 60)
        hello = Hello("mallory", protocol.PROTOCOL_VERSION, "?", torch.__version__, 9.0).body()
        for sock, routing_id in ((peer, b"r:a/mallory"), (forger, b"d:a/mallory")):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_multipart(protocol.encode(protocol.HELLO, 1, "evil-session", hello))
        assert peer.poll(20_000), "the relayed HELLO got no answer"
        reply = protocol.decode(peer.recv_multipart())
        assert reply.kind == protocol.ERROR and reply.body["type"] == "PermissionError", reply.body
        assert not forger.poll(1000), "a worker-side socket passing for the driver was answered"
    finally:
        peer.close(0)
        forger.close(0)
        switchboard.close()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"hosts": ["dial://a", "b:5555"]}, "listen is not set"),
        ({"hosts": ["b:5555"], "listen": "tcp://0.0.0.0:7000"}, "hosts names none"),
        ({"hosts": ["a"], "listen": "0.0.0.0"}, "listen must be an address"),
        ({"hosts": ["a:b"], "listen": "tcp://0.0.0.0:7000"}, "needs a port"),
    ],
)
def test_dial_in_configuration_errors_name_the_argument(arguments, message):
    with pytest.raises(ConfigurationError, match=message):
        RemoteModelParallelStrategy(**arguments)


def test_replicas_of_dial_in_workers_are_refused_before_any_is_contacted():
    strategy = RemoteModelParallelStrategy(hosts=[["a", "b"], ["c", "d"]], listen=f"tcp://127.0.0.1:{free_port()}")
    with pytest.raises(ConfigurationError, match="replicas sum their gradients through torch.distributed"):
        trainer(strategy, epochs=1).fit(Net(residual_spec()), data())


def test_the_worker_command_refuses_a_dial_in_that_cannot_work(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "lightning_remote_mp.worker", *args], capture_output=True, text=True, timeout=120
        )

    both = run("--connect", "tcp://127.0.0.1:7000", "--bind", "tcp://127.0.0.1:*")
    assert both.returncode == 2 and "--connect and --bind exclude each other" in both.stderr
    (tmp_path / "authorized").mkdir()
    for name in ("d1", "d2"):
        public, _ = generate_keypair(tmp_path, name)
        write_public_key(tmp_path / "authorized" / f"{name}.key", load_public_key(public))
    _, secret = generate_keypair(tmp_path, "w")
    two = run(
        "--connect",
        "tcp://127.0.0.1:7000",
        "--secret-key",
        str(secret),
        "--authorized-keys",
        str(tmp_path / "authorized"),
    )
    assert two.returncode == 2 and "name it with --driver-key FILE" in two.stderr


# --- on an emulated LAN: the worker hosts accept no connection at all ------------------------------


def test_workers_that_accept_no_connection_train_across_hosts_with_curve(make_lan, twin, tmp_path):
    lan = make_lan(3, "1gbit")
    driver_secret, authorized, pairs = _keys(tmp_path, "h1", "h2")
    port = free_port()
    dial = f"tcp://{lan.addr(0)}:{port}"
    hosts = [
        lan.start_worker(
            i,
            "--allow-module",
            "lrmp_testlayers",
            "--secret-key",
            str(secret),
            "--authorized-keys",
            str(authorized),
            dial=dial,
        )
        for i, (_, secret) in zip((1, 2), pairs.values())
    ]
    assert hosts == ["dial://h1", "dial://h2"]
    assert lan.listening(1) == [] and lan.listening(2) == [], "a worker that dials in listens on nothing"
    curve = CurveOptions(str(driver_secret), [str(public) for public, _ in pairs.values()])
    _fit_both(twin, RemoteModelParallelStrategy(hosts=hosts, listen=dial, microbatches=2, balance=[4, 8], curve=curve))


def test_a_dial_in_worker_and_a_listening_one_on_other_hosts(make_lan, twin):
    lan = make_lan(3, "1gbit")
    port = free_port()
    dialed = lan.start_worker(1, "--allow-module", "lrmp_testlayers", dial=f"tcp://{lan.addr(0)}:{port}")
    listening = lan.start_worker(2, "--allow-module", "lrmp_testlayers")
    assert lan.listening(1) == []
    strategy = RemoteModelParallelStrategy(
        hosts=[listening, dialed], listen=f"tcp://0.0.0.0:{port}", microbatches=2, balance=[4, 8]
    )
    _fit_both(twin, strategy)
