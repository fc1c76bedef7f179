"""Connecting to the workers: setup waits the whole ``connect_timeout`` for a worker started late
without losing the sessions of those that answered, and tells a refused connection from a silent
one quickly. Real workers on 127.0.0.1."""

from __future__ import annotations

import logging
import subprocess
import threading
import time

import pytest
import torch
from lrmp_lan import WORKER_OUTPUT, free_port, worker_command
from test_strategy import Net, assert_same_losses, assert_same_weights, data, residual_spec, trainer

from lightning_remote_mp import ConfigurationError, RemoteModelParallelStrategy, WorkerLostError
from lightning_remote_mp.driver.launch import WorkerOutput
from lightning_remote_mp.driver.session import DriverSession

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def spawn():
    """``spawn(*args, after=seconds)`` starts an ``lrmp-worker`` (now, or from a thread ``after``
    seconds); every one is killed when the test ends."""
    procs: list[subprocess.Popen] = []
    timers: list[threading.Timer] = []

    def start(*args: str, after: float = 0.0) -> subprocess.Popen | None:
        argv = worker_command("--allow-module", "lrmp_testlayers", *args)
        if after:
            timer = threading.Timer(after, lambda: procs.append(subprocess.Popen(argv, **WORKER_OUTPUT)))
            timers.append(timer)
            timer.start()
            return None
        proc = subprocess.Popen(argv, **WORKER_OUTPUT)
        procs.append(proc)
        WorkerOutput(proc).wait_ready(time.monotonic() + 120)
        return proc

    yield start
    for timer in timers:
        timer.cancel()
        timer.join()
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait(10)


@pytest.mark.parametrize("late", ["listening", "dial-in"])
def test_setup_waits_for_a_late_worker_without_losing_the_early_one(spawn, twin, late):
    """The early worker drops a session whose driver is silent for 3 s (--session-timeout); the
    late one starts 8 s into a 20 s connect_timeout, so the driver must keep the early session
    alive while it waits (it used to drop it, and setup failed with a SessionError)."""
    early_port, late_port = free_port(), free_port()
    spawn("--bind", f"tcp://127.0.0.1:{early_port}", "--session-timeout", "3")
    if late == "listening":
        spawn("--bind", f"tcp://127.0.0.1:{late_port}", after=8.0)
        hosts, listen = [f"tcp://127.0.0.1:{early_port}", f"tcp://127.0.0.1:{late_port}"], None
    else:
        spawn("--connect", f"tcp://127.0.0.1:{late_port}", "--name", "late", after=8.0)
        hosts, listen = [f"tcp://127.0.0.1:{early_port}", "dial://late"], f"tcp://127.0.0.1:{late_port}"
    torch.manual_seed(0)
    local = Net(residual_spec())
    remote = twin(local)
    trainer(epochs=1).fit(local, data())
    strategy = RemoteModelParallelStrategy(
        hosts=hosts, listen=listen, connect_timeout=20, microbatches=2, balance=[4, 8]
    )
    started = time.monotonic()
    trainer(strategy, epochs=1).fit(remote, data())
    assert time.monotonic() - started > 8.0  # it did wait for the late worker
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)


def test_a_refused_connection_is_named_at_once_and_in_the_error(caplog):
    """Nothing listens on the port: a warning names the likely causes within a second or two (a
    worker may still start there, so setup waits), and the final error repeats them."""
    address = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="lightning_remote_mp"):
        with pytest.raises(WorkerLostError) as info:
            DriverSession([address], connect_timeout=4)
    warned = [r for r in caplog.records if "refuses connections" in r.getMessage()]
    assert warned, caplog.text
    assert warned[0].created - (time.time() - (time.monotonic() - started)) < 2.0
    message = str(info.value)
    assert address in message and "refuses connections" in message and "--bind tcp://0.0.0.0:PORT" in message


def test_a_worker_name_that_does_not_resolve_is_a_configuration_error():
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match="cannot resolve 'no-such-host.invalid'"):
        DriverSession(["tcp://no-such-host.invalid:6000"], connect_timeout=30)
    assert time.monotonic() - started < 10
