"""Training across real addresses: workers on hosts of an emulated LAN (network namespaces on a
bridge, every link shaped with tc; `lrmp_lan.Lan`), the driver on host 0, this process.

Skipped where namespaces cannot be made (not root, no iproute2); CI runs as root and runs them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import lightning as L
import pytest
import torch
from lrmp_lan import free_port
from test_strategy import Net, assert_same_losses, assert_same_weights, data, residual_spec, trainer

from lightning_remote_mp import CurveOptions, RemoteModelParallelStrategy, WorkerError, WorkerLostError
from lightning_remote_mp.wire.keys import generate_keypair, load_keypair, write_public_key


def _workers(lan, *hosts: int, args: tuple[str, ...] = ()) -> list[str]:
    return [lan.start_worker(i, "--allow-module", "lrmp_testlayers", *args) for i in hosts]


def test_training_across_hosts_equals_local_training(make_lan, twin):
    lan = make_lan(3, "1gbit")
    hosts = _workers(lan, 1, 2)
    assert all(h.startswith(f"tcp://198.18.{lan.net}.") for h in hosts)
    torch.manual_seed(0)
    local = Net(residual_spec())
    remote = twin(local)
    trainer(epochs=2).fit(local, data())
    trainer(RemoteModelParallelStrategy(hosts=hosts, microbatches=2, balance=[4, 8]), epochs=2).fit(remote, data())
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)


def test_curve_between_hosts(make_lan, twin, tmp_path):
    lan = make_lan(3, "1gbit")
    authorized = tmp_path / "authorized"
    authorized.mkdir()
    _, driver_secret = generate_keypair(tmp_path, "driver")
    write_public_key(authorized / "driver.key", load_keypair(driver_secret).public)
    pairs = [generate_keypair(tmp_path, f"worker{i}") for i in (1, 2)]
    hosts = [
        lan.start_worker(
            i, "--allow-module", "lrmp_testlayers", "--secret-key", str(secret), "--authorized-keys", str(authorized)
        )
        for i, (_, secret) in zip((1, 2), pairs)
    ]
    torch.manual_seed(0)
    local = Net(residual_spec())
    remote = twin(local)
    trainer(epochs=1).fit(local, data())
    curve = CurveOptions(secret_key=str(driver_secret), worker_public_keys=[str(public) for public, _ in pairs])
    trainer(RemoteModelParallelStrategy(hosts=hosts, microbatches=2, curve=curve), epochs=1).fit(remote, data())
    assert_same_losses(local.losses, remote.losses)


class _Unplug(L.Callback):
    """Pulls a host's cable after the second training step, and says when."""

    def __init__(self, lan, host: int) -> None:
        self.lan, self.host, self.at = lan, host, 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.lan.unplug(self.host)
            self.at = time.monotonic()


def test_a_pulled_cable_is_named_and_the_worker_serves_a_new_driver_once_plugged_back(make_lan):
    lan = make_lan(3, "1gbit")
    hosts = _workers(lan, 1, 2, args=("--session-timeout", "3"))
    unplug = _Unplug(lan, 2)
    strategy = RemoteModelParallelStrategy(hosts=hosts, heartbeat_timeout=3.0)
    with pytest.raises(WorkerLostError) as info:
        trainer(strategy, epochs=3, callbacks=[unplug]).fit(Net(residual_spec()), data())
    named_after = time.monotonic() - unplug.at
    assert info.value.address == hosts[1] and info.value.stage == 1, str(info.value)
    assert named_after < 3.0 + 2.0, f"named {named_after:.1f} s after the cable was pulled"
    lan.plug(2)
    # The worker drops the old session once its driver has been silent for --session-timeout, and
    # serves the next driver (which waits for that, at connect).
    model = Net(residual_spec())
    trainer(RemoteModelParallelStrategy(hosts=hosts, connect_timeout=30.0), epochs=1).fit(model, data())
    assert len(model.losses) == 4


@pytest.mark.parametrize("dial_in", [False, True], ids=["listening", "dial-in"])
def test_a_large_message_on_a_slow_link_is_no_stall(make_lan, twin, dial_in):
    """10 Mbit/s links and a 4 MiB activation: each transfer takes over 3 s, longer than the
    heartbeat timeout (2 s), while no worker computes and no message arrives. The bytes move all
    along (the kernel's TCP counters, in the heartbeats), so it is no stall. Heartbeats to workers
    that listen take connections of their own and never queue behind the activation; those to
    workers that dial in share their one connection with it (relayed by the driver, both ways),
    and wait behind it: moving bytes count there too."""
    lan = make_lan(3, "10mbit")
    listen = f"tcp://{lan.addr(0)}:{free_port()}" if dial_in else None
    hosts = [lan.start_worker(i, dial=listen) for i in (1, 2)] if dial_in else _workers(lan, 1, 2)
    width = 1024
    spec = [
        ("torch.nn.Linear", {"in_features": 8, "out_features": width}, (1024, 8)),
        ("torch.nn.ReLU", {}, (1024, width)),  # stage 0 ends here: 1024 x 1024 float32 cross to stage 1
        ("torch.nn.Linear", {"in_features": width, "out_features": 1}, (1024, width)),
        ("torch.nn.Sigmoid", {}, (1024, 1)),
    ]
    torch.manual_seed(0)
    local = Net(spec)
    remote = twin(local)
    x = torch.rand(1024, 8)
    batches = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, (x.sum(1, keepdim=True) > 4).float()), batch_size=1024
    )
    trainer(epochs=1).fit(local, batches)
    started = time.monotonic()
    strategy = RemoteModelParallelStrategy(hosts=hosts, balance=[2, 2], heartbeat_timeout=2.0, listen=listen)
    trainer(strategy, epochs=1).fit(remote, batches)
    took = time.monotonic() - started
    assert took > 2 * 3.0, f"the step took {took:.1f} s: the links were not slow enough to test anything"
    assert_same_losses(local.losses, remote.losses)


def test_a_peer_the_worker_cannot_reach_is_named(make_lan):
    """Stage 0's host cannot reach stage 1's (a blackhole route), though both reach the driver."""
    lan = make_lan(3, "1gbit")
    hosts = _workers(lan, 1, 2)
    lan.block(1, 2)
    started = time.monotonic()
    with pytest.raises((WorkerError, WorkerLostError)) as info:
        trainer(RemoteModelParallelStrategy(hosts=hosts, heartbeat_timeout=3.0), epochs=1).fit(
            Net(residual_spec()), data()
        )
    assert hosts[1].removeprefix("tcp://") in str(info.value), str(info.value)
    assert time.monotonic() - started < 60


def test_workers_reached_by_hostname(make_lan):
    """A driver on host 3 names its workers by hostnames its /etc/hosts gives them."""
    lan = make_lan(4, "1gbit")
    hosts = _workers(lan, 1, 2)
    lan.name_host(1, "gpu-one", on=3)
    lan.name_host(2, "gpu-two", on=3)
    named = [f"tcp://gpu-one:{hosts[0].rpartition(':')[2]}", f"tcp://gpu-two:{hosts[1].rpartition(':')[2]}"]
    script = textwrap.dedent(
        f"""
        import torch
        from lightning_remote_mp.driver.session import DriverSession
        from lightning_remote_mp.model.spec import SpecSequential
        torch.manual_seed(0)
        net = SpecSequential([("torch.nn.Linear", {{"in_features": 4, "out_features": 4}}, (2, 4))] * 2)
        expected = net(torch.ones(2, 4))
        session = DriverSession({named!r}, connect_timeout=30)
        session.place("net", net)
        assert torch.allclose(net(torch.ones(2, 4)), expected)
        print("placed on", [c.address for c in session.conns])
        session.close()
        """
    )
    proc = lan.popen(3, [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "placed on ['tcp://gpu-one:" in out, out


def test_the_lan_leaves_nothing_behind(make_lan):
    lan = make_lan(2, "1gbit")
    names = [lan.switch, lan.namespace(1)]
    lan.close()
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in left for n in names), left


def test_zeromq_closes_a_half_open_connection_within_its_heartbeat(make_lan):
    """A cable pulled leaves the TCP connection half-open: nothing closes it for minutes, and a
    socket would send into it. ZeroMQ's own heartbeat, on every link lrmp keeps, closes it after
    `sockets.ZMTP_TIMEOUT` of silence (a connecting socket then dials again once the peer is back)."""
    import zmq

    from lightning_remote_mp.wire import sockets

    lan = make_lan(2, "1gbit")
    (address,) = _workers(lan, 1)
    sock = sockets.dealer(address, connect=False)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sock.connect(address)

    def wait(event: int, within: float) -> float | None:
        started = time.monotonic()
        while time.monotonic() - started < within:
            if monitor.poll(200):
                if zmq.utils.monitor.recv_monitor_message(monitor)["event"] == event:
                    return time.monotonic() - started
        return None

    try:
        assert wait(zmq.EVENT_HANDSHAKE_SUCCEEDED, 30) is not None
        lan.unplug(1)
        closed = wait(zmq.EVENT_DISCONNECTED, sockets.ZMTP_TIMEOUT + 10)
        assert closed is not None, "the half-open connection stayed open"
        assert closed < sockets.ZMTP_TIMEOUT + 5, f"closed after {closed:.1f} s"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
