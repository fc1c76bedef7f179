"""Faults injected into real runs: workers killed (SIGKILL), hung (SIGSTOP) or cut off (a relay that
drops everything) in each phase of training, a driver killed under a worker, a stage that cannot
reach the next one, a layer that never returns (the worker still answers heartbeats: call_timeout);
and a run that resumes from its last checkpoint on a replacement worker.

Every lost worker must be reported as a WorkerLostError naming its address and stage within the
heartbeat timeout (plus slack for a loaded 2-core machine), whatever the driver was waiting for.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import lightning as L
import lrmp_testlayers
import pytest
import torch
import zmq
from lightning.pytorch.callbacks import ModelCheckpoint
from lrmp_relay import Relay, wait_for
from test_strategy import Net, assert_same_losses, assert_same_weights, data, residual_spec, trainer

from lightning_remote_mp import RemoteModelParallelStrategy, WorkerError, WorkerLostError
from lightning_remote_mp.driver.launch import LocalWorkers
from lightning_remote_mp.driver.session import DriverSession
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.wire import protocol

pytestmark = pytest.mark.timeout(120)

#: The tests use a short heartbeat timeout to stay fast; LRMP_FAULT_HEARTBEAT=10 runs them with the default.
HEARTBEAT = float(os.environ.get("LRMP_FAULT_HEARTBEAT", "2.0"))
SLACK = 4.0
BALANCE = [4, 6]  # residual_spec(probe=False): 10 layers; res_1 crosses from stage 0 to stage 1

#: Detection times measured by these tests (each also printed: run with -s to see them).
DETECTED: dict[str, float] = {}


def _record(name: str, seconds: float) -> None:
    DETECTED[name] = seconds
    print(f"\ndetected: {name}: {seconds:.2f} s")


class _Inject(L.Callback):
    """Runs ``action`` once, in Lightning hook ``hook``, at global step ``step``."""

    def __init__(self, hook: str, action, step: int = 1) -> None:
        self.action, self.step = action, step
        self.at: float | None = None
        setattr(self, hook, self._maybe)

    def _maybe(self, trainer, *args, **kwargs):
        if self.at is None and trainer.global_step >= self.step:
            self.action()
            self.at = time.monotonic()


def _signal(pid: int, sig: int):
    return lambda: os.kill(pid, sig)


class _Clock(L.Callback):
    """When Lightning first heard of the exception (before its teardown)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def on_exception(self, trainer, pl_module, exception):
        self.at = time.monotonic()


def _expect_lost(run, injected_at, *, address: str, stage: int, during: str, name: str) -> WorkerLostError:
    clock = _Clock()
    with pytest.raises(WorkerLostError) as info:
        run(clock)
    at = injected_at()
    assert at is not None, "the fault was never injected"
    detected, ended = clock.at - at, time.monotonic() - at
    err = info.value
    text = str(err)
    assert err.address == address and err.stage == stage, text
    assert address in text and f"stage {stage}" in text and re.search(f"during {during}", text), text
    assert detected < HEARTBEAT + SLACK, f"{name}: detected after {detected:.1f} s"
    # Then Lightning's teardown brought the weights back from the other worker and released it.
    assert ended < HEARTBEAT + 2 * SLACK, f"{name}: the run ended {ended:.1f} s after the fault"
    _record(name, detected)
    return err


#: Tests that spend a worker (each kills, stops or cuts off one).
VICTIMS = 6


@dataclasses.dataclass
class Victim:
    address: str
    pid: int


@pytest.fixture(scope="module")
def _spares():
    """Fresh workers for the tests to spend, started together (on 2 cores, much faster than one by one)."""
    workers = LocalWorkers(VICTIMS, devices=["cpu"] * VICTIMS, threads=1, allow_modules=("lrmp_testlayers",))
    workers.start()
    taken = iter(range(VICTIMS))
    yield workers, taken
    for p in workers.procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)  # a stopped worker must run to handle its SIGTERM
    workers.stop()


@pytest.fixture
def victim(_spares) -> Victim:
    """A fresh worker to kill, stop or cut off. Its partner stage is one of the suite's shared
    workers, which the failed run's teardown releases."""
    workers, taken = _spares
    i = next(taken, None)
    assert i is not None, f"more tests spend a worker than VICTIMS={VICTIMS}"
    return Victim(workers.addresses[i], workers.procs[i].pid)


def _hosts(pool: list[str], victim: Victim, stage: int) -> list[str]:
    hosts = [pool[0], pool[0]]
    hosts[stage] = victim.address
    return hosts


def _fit(hosts: list[str], callbacks, epochs: int = 2, spec=None, **kwargs):
    balance = kwargs.pop("balance", BALANCE)
    strategy = RemoteModelParallelStrategy(hosts=hosts, balance=balance, heartbeat_timeout=HEARTBEAT)
    model = Net(spec or residual_spec(probe=False))
    return lambda clock: trainer(strategy, epochs=epochs, callbacks=[*callbacks, clock], **kwargs).fit(model, data())


def test_hung_worker_during_setup(victim, pool, tmp_path):
    marker = tmp_path / "building"
    spec = residual_spec(probe=False)
    gate = ("lrmp_testlayers.SetupGate", {"marker": str(marker), "driver_pid": os.getpid(), "seconds": 3}, (32, 16))
    spec.insert(5, gate)  # stage 1 builds it
    stopped: dict[str, float] = {}

    def stop_when_building():
        if wait_for(marker.exists, 60):
            os.kill(victim.pid, signal.SIGSTOP)
            stopped["at"] = time.monotonic()

    watcher = threading.Thread(target=stop_when_building, daemon=True)
    watcher.start()
    _expect_lost(
        _fit(_hosts(pool, victim, 1), [], spec=spec, balance=[4, 7]),
        lambda: stopped.get("at"),
        address=victim.address,
        stage=1,
        during="setup",
        name="SIGSTOP during setup",
    )
    watcher.join(5)


def test_killed_worker_during_backward(victim, pool):
    inject = _Inject("on_before_backward", _signal(victim.pid, signal.SIGKILL))
    _expect_lost(
        _fit(_hosts(pool, victim, 1), [inject]),
        lambda: inject.at,
        address=victim.address,
        stage=1,
        during="backward",
        name="SIGKILL during backward",
    )


def test_hung_worker_during_optimizer_step(victim, pool):
    inject = _Inject("on_before_optimizer_step", _signal(victim.pid, signal.SIGSTOP))
    err = _expect_lost(
        _fit(_hosts(pool, victim, 0), [inject]),
        lambda: inject.at,
        address=victim.address,
        stage=0,
        # The driver waits neither for the backward (nothing flows back to it) nor for the step: the
        # next forward finds the worker silent, or, stopped before its backward was done, the
        # confirmation of that backward before the next forward goes.
        during=r"(forward|backward of call \d+) \(",
        name="SIGSTOP during optimizer step",
    )
    # The step is answered only if it fails, and the heartbeat that would have said it ran never came
    # (zero_grad may be named too: its run is confirmed the same way).
    assert re.search(r"\((zero_grad, )?optim_step still unanswered\)", str(err)), str(err)


@pytest.mark.parametrize("fail_at", [2, 4])
def test_failed_optimizer_step_is_reported_although_the_driver_did_not_wait(pool, fail_at):
    from lrmp_testlayers import FailingSGD

    class FailingNet(Net):
        def configure_optimizers(self):
            return FailingSGD(self.parameters(), lr=0.1, fail_at=fail_at)

    # One epoch of 4 steps. Step 2 fails while the driver already sends step 3's forward; step 4,
    # the last, fails while the driver already tears down: both are raised, naming the worker.
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], balance=[4, 6])
    model = FailingNet(residual_spec(probe=False))
    with pytest.raises(WorkerError) as info:
        trainer(strategy, epochs=1).fit(model, data())
    text = str(info.value)
    assert f"step {fail_at} refused" in text and "optim_step" in text and "reported late" in text, text
    assert info.value.address in pool[:2] and info.value.stage in (0, 1)
    assert strategy.session is None  # cleaned up, and the model and optimizer are local again
    assert not model.net.is_remote and type(model.trainer.optimizers[0]) is FailingSGD


def test_failed_deferred_weight_gradients_fail_the_step(pool):
    # Stage 1 computes its weight gradients after stage 0 has reported the backward done: the
    # failure must still reach the driver (through the optimizer step), not vanish.
    spec = residual_spec(probe=False)
    spec.insert(5, ("lrmp_testlayers.BrokenWeightGradients", {"features": 16}, (32, 16)))
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], balance=[4, 7], split_backward=True)
    model = Net(spec)
    with pytest.raises(WorkerError) as info:
        trainer(strategy, epochs=1).fit(model, data())
    text = str(info.value)
    assert "weight gradients after the last backward failed" in text and "optim_step" in text, text
    assert info.value.address == pool[1] and info.value.stage == 1 and info.value.replica is None
    assert strategy.session is None and not model.net.is_remote
    # The same model trains with split_backward=False, where autograd takes the weight gradient in time.
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], balance=[4, 7], split_backward=False)
    trainer(strategy, epochs=1).fit(Net(spec), data())


class _TailNet(Net):
    """`Net` with a layer of the driver's own after the split module: it steps on the driver."""

    def __init__(self, spec: list) -> None:
        super().__init__(spec)
        self.tail = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.tail(self.net(x)))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


@pytest.mark.parametrize("tail", [False, True], ids=["all-remote", "driver-layer-after"])
def test_a_failed_backward_the_driver_did_not_wait_for_is_raised_and_the_step_after_it_never_runs(pool, tail):
    # The second backward fails on stage 1. The driver, which did not wait for it, learns so before
    # its next message (the third forward), or before a layer of its own steps: it raises the
    # failure, and the optimizer's step never runs, there or on the workers. The weights brought
    # back are one step's, as locally.
    spec = residual_spec(probe=False)
    spec.insert(8, ("lrmp_testlayers.BackwardHook", {"fail_at": 2}, (32, 16)))
    torch.manual_seed(3)
    local = _TailNet(spec) if tail else Net(spec)
    remote = copy.deepcopy(local)
    with pytest.raises(ValueError, match="backward 2 failed on purpose"):
        trainer(epochs=1).fit(local, data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], balance=[4, 7])
    with pytest.raises(WorkerError) as info:
        trainer(strategy, epochs=1).fit(remote, data())
    text = str(info.value)
    assert "backward 2 failed on purpose" in text and "during backward of call 2" in text, text
    # The error quotes the stage's action list for the call, the failing action marked.
    assert "stage 1's actions for call 2 (gpipe): 1F0 [1B0] 1W0" in text, text
    assert info.value.address == pool[1] and info.value.stage == 1, text
    assert len(local.losses) == len(remote.losses) == 2
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)
    assert strategy.session is None and not remote.net.is_remote


def test_killed_worker_during_checkpoint_save(victim, pool, tmp_path):
    # Lightning runs ModelCheckpoint's epoch-end hook after every other callback's: the fault comes
    # right before the checkpoint gathers the weights from the workers.
    inject = _Inject("on_train_epoch_end", _signal(victim.pid, signal.SIGKILL))
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1, save_on_train_epoch_end=True)
    _expect_lost(
        _fit(_hosts(pool, victim, 1), [inject, ckpt], enable_checkpointing=True),
        lambda: inject.at,
        address=victim.address,
        stage=1,
        # Or while the last step's backward was still running there (the driver does not wait for it).
        during=f"({protocol.GET_STATE}|backward)",
        name="SIGKILL during checkpoint save",
    )
    assert not (tmp_path / "last.ckpt").exists()  # no checkpoint with stale weights was written


def test_unreachable_worker_mid_training(victim, pool):
    relay = Relay(victim.address)  # every connection to stage 1 (the driver's, stage 0's) crosses it
    try:
        inject = _Inject("on_train_batch_start", relay.partition, step=2)
        _expect_lost(
            _fit([pool[0], relay.address], [inject]),
            lambda: inject.at,
            address=relay.address,
            stage=1,
            # Or the confirmation of the last backward, which may still cross the relay then.
            during="(forward|backward)",
            name="network partition during forward",
        )
    finally:
        relay.close()


def test_a_stage_that_cannot_reach_the_next_reports_it(pool):
    """The driver reaches both workers, but stage 0 cannot reach stage 1 (here: a dead address):
    stage 0 gives up after the driver's heartbeat timeout and the driver hears why."""
    worker = pool[0]
    dead = zmq.Context.instance().socket(zmq.ROUTER)
    dead_address = f"tcp://127.0.0.1:{dead.bind_to_random_port('tcp://127.0.0.1')}"
    dead.close(0)  # nobody listens there any more
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(worker)
    session = uuid.uuid4().hex
    try:
        sock.send_multipart(protocol.encode(protocol.HELLO, 1, session, {"driver": "t", "heartbeat_timeout": 1.0}))
        assert sock.poll(10_000) and protocol.decode(sock.recv_multipart()).kind == protocol.OK
        setup = {
            "key": "net",
            "stage": 0,
            "stages": 2,
            "start": 0,
            "entries": [["torch.nn.Identity", {}, [2]]],
            "exports": [],
            "init_seed": 0,
            "sources": [[-1, []]],
            "targets": [[1, []]],
            "peers": {1: dead_address},
        }
        sock.send_multipart(protocol.encode(protocol.SETUP, 2, session, setup))
        assert sock.poll(10_000) and protocol.decode(sock.recv_multipart()).kind == protocol.OK
        forward = {"key": "net", "call": 1, "mb": 0, "from": -1, "x": torch.ones(2), "vars": {}, "grad": False}
        start = time.monotonic()
        sock.send_multipart(protocol.encode(protocol.FORWARD, 3, session, forward))
        assert sock.poll(10_000), "no error within 10 s"
        err = protocol.decode(sock.recv_multipart())
        assert err.kind == protocol.ERROR and err.body["type"] == "PeerUnreachableError", err.body
        assert dead_address in err.body["message"] and err.body["call"] == 1
        assert 0.9 < time.monotonic() - start < 1.0 + SLACK
        sock.send_multipart(protocol.encode(protocol.BYE, 4, session))
        assert sock.poll(10_000)
    finally:
        sock.close(0)


def _start_driver(program: str, *args: str, **popen) -> subprocess.Popen:
    """A driver interpreter, started before the workers it is to use: it imports torch meanwhile (seconds
    of CPU), then reads their addresses, one line, from its stdin (`_hand_over`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    return subprocess.Popen([sys.executable, "-c", program, *args], stdin=subprocess.PIPE, text=True, env=env, **popen)


def _hand_over(driver: subprocess.Popen, addresses: list[str]) -> None:
    driver.stdin.write(" ".join(addresses) + "\n")
    driver.stdin.close()


def _end(driver: subprocess.Popen) -> None:
    if driver.poll() is None:
        driver.kill()
        driver.wait(10)
    if driver.stdin is not None and not driver.stdin.closed:
        driver.stdin.close()


DRIVER_SCRIPT = """
import sys, time, torch
from lightning_remote_mp.driver.session import DriverSession
from lightning_remote_mp.model.spec import SpecSequential
session = DriverSession(sys.stdin.readline().split(), connect_timeout=30)
net = SpecSequential([("torch.nn.Linear", {"in_features": 3, "out_features": 3}, (2, 3))] * 2)
session.place("net", net)
net(torch.ones(2, 3)).sum().backward()
print("trained", flush=True)
time.sleep(60)
"""


def test_a_worker_frees_itself_from_a_killed_driver(start_workers):
    session_timeout = 2.0
    driver = _start_driver(DRIVER_SCRIPT, stdout=subprocess.PIPE)
    try:
        worker = start_workers(1, extra_args=["--session-timeout", str(session_timeout)]).addresses[0]
        _hand_over(driver, [worker])
        assert _read_line(driver, 60) == "trained"
        driver.kill()
        killed_at = time.monotonic()
        driver.wait(10)
        refusals = 0
        admitted = None
        while time.monotonic() - killed_at < session_timeout + 10:
            try:
                admitted = DriverSession([worker], connect_timeout=10)
                break
            except WorkerError as err:
                assert err.remote_type == "WorkerBusy", err
                refusals += 1
                time.sleep(0.2)
        assert admitted is not None, "the worker never dropped the dead driver's session"
        waited = time.monotonic() - killed_at
        _record("worker frees itself from a killed driver", waited)
        # The new driver waited for the dead driver's session to be dropped instead of failing...
        assert refusals == 0
        assert waited < session_timeout + 1.0 + SLACK  # ...which took --session-timeout at most
        try:
            net = SpecSequential([("torch.nn.Linear", {"in_features": 3, "out_features": 3}, (2, 3))])
            admitted.place("net", net)
            assert net(torch.ones(2, 3)).shape == (2, 3)
        finally:
            admitted.close()
    finally:
        _end(driver)
        driver.stdout.close()


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if sel.select(timeout):
            return proc.stdout.readline().strip()
        return ""
    finally:
        sel.close()


def test_resume_from_the_last_checkpoint_on_a_replacement_worker(victim, pool, tmp_path, twin):
    """A worker is killed mid-epoch; the script runs again with ckpt_path="last" and another worker
    in its place, and ends exactly where an uninterrupted run ends."""
    w0, doomed, replacement = pool[0], victim.address, pool[1]
    torch.manual_seed(21)
    base = Net(residual_spec(probe=False), local_head=True)
    straight, interrupted, resumed = twin(base), twin(base), twin(base)
    epochs = 3

    def run(model, hosts, callbacks=(), **kwargs):
        strategy = RemoteModelParallelStrategy(hosts=hosts, balance=BALANCE, heartbeat_timeout=HEARTBEAT)
        checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1, save_on_train_epoch_end=True)
        t = trainer(strategy, epochs=epochs, enable_checkpointing=True, callbacks=[*callbacks, checkpoints])
        t.fit(model, data(), **kwargs)

    trainer(RemoteModelParallelStrategy(hosts=[w0, replacement], balance=BALANCE), epochs=epochs).fit(
        straight, data()
    )  # the uninterrupted reference
    kill = _Inject("on_train_batch_start", _signal(victim.pid, signal.SIGKILL), step=6)  # mid epoch 2
    with pytest.raises(WorkerLostError, match=doomed):
        run(interrupted, [w0, doomed], [kill])
    assert (tmp_path / "last.ckpt").exists()
    # A new run, as a restarted script would make it: w0 was released by the failed run's teardown.
    run(resumed, [w0, replacement], ckpt_path="last")
    assert resumed.losses == straight.losses[-len(resumed.losses) :]
    assert_same_weights(straight, resumed, tol=0.0)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_a_listener_that_never_answers_fails_the_connect_after_the_heartbeat_timeout():
    """Something accepts the TCP connection but never speaks (a stopped worker, another program):
    the driver gives up after heartbeat_timeout, not after the longer connect_timeout."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    try:
        start = time.monotonic()
        with pytest.raises(WorkerLostError, match="accepted the TCP connection") as info:
            DriverSession([address], heartbeat_timeout=HEARTBEAT, connect_timeout=60)
        elapsed = time.monotonic() - start
        assert info.value.address == address and "is the worker hung" in str(info.value)
        assert HEARTBEAT <= elapsed < HEARTBEAT + SLACK, elapsed
    finally:
        listener.close()


def _stuck_worker_stops_quickly(workers: LocalWorkers) -> None:
    start = time.monotonic()
    workers.stop()
    stopped = time.monotonic() - start
    print(f"stop() with a worker stuck in a layer: {stopped:.2f} s")
    assert stopped < 4.0, f"stop() took {stopped:.1f} s"


def _assert_overdue(err: WorkerLostError, address: str, stage: int, detected: float, call_timeout: float) -> str:
    """What every call_timeout failure says: the computing worker, the bound, what to do; in time."""
    text = str(err)
    assert err.address == address and err.stage == stage, text
    assert f"call_timeout={call_timeout:g} s" in text and "still computing" in text, text
    assert "raise call_timeout=" in text, text
    assert call_timeout <= detected < 20.0, detected
    return text


def test_a_layer_that_never_returns_fails_the_pipeline_after_call_timeout(start_workers):
    """Stage 1's layer sleeps for a minute while its worker answers every heartbeat: the forward
    fails after call_timeout, naming that worker (the one computing), not stage 0."""
    workers = start_workers(2)
    net = SpecSequential(
        [
            ("torch.nn.Linear", {"in_features": 3, "out_features": 3}, (2, 3)),
            ("lrmp_testlayers.SlowIdentity", {"seconds": 60}, (2, 3)),
        ]
    )
    # Stage 0 still counts as computing for about 2 s after its forward: its heartbeats report busy
    # for 1 s after a request, and the driver believes them for two ping intervals more. A second
    # beyond that, or both stages would be blamed.
    call_timeout = 1.0 + 2 * min(1.0, HEARTBEAT / 4) + 1.0
    session = DriverSession(workers.addresses, heartbeat_timeout=HEARTBEAT, call_timeout=call_timeout)
    try:
        session.place("net", net, balance=[1, 1])
        start = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            net(torch.ones(2, 3))
        detected = time.monotonic() - start
    finally:
        session.close()
    _record(f"a layer that never returns (call_timeout={call_timeout:g})", detected)
    text = _assert_overdue(info.value, workers.addresses[1], 1, detected, call_timeout)
    assert f"worker {workers.addresses[1]} (stage 1)" in text and workers.addresses[0] not in text, text
    assert "during forward" in text, text
    _stuck_worker_stops_quickly(workers)


def test_call_timeout_bounds_each_micro_batch_though_a_stage_answers_them_together(pool):
    """The last stage sends a call's results together, once it has them all: 4 micro-batches of
    0.6 s each (2.4 s in all, nothing arriving meanwhile) are no failure under call_timeout=1.5 s,
    which each of them is within."""
    net = SpecSequential([("lrmp_testlayers.SlowIdentity", {"seconds": 0.6}, (2, 3))])
    session = DriverSession(pool[:1], heartbeat_timeout=HEARTBEAT, call_timeout=1.5)
    try:
        session.place("net", net, microbatches=4)
        x = torch.randn(8, 3)
        start = time.monotonic()
        with torch.no_grad():
            assert torch.equal(net(x), x)
        assert time.monotonic() - start > 2.4
    finally:
        session.close()


def test_a_request_that_never_returns_fails_after_call_timeout(start_workers, tmp_path):
    """The same for one request (an optimizer step that takes 10 s on the worker): its reply is
    overdue. Moving weights is exempt: a setup that takes longer than call_timeout still succeeds."""
    workers = start_workers(1)
    linear = ("torch.nn.Linear", {"in_features": 3, "out_features": 3}, (2, 3))
    # A fresh worker pays its first-use imports at start (sympy, torch._dynamo: seconds here); a
    # session without call_timeout waits for that, so that a short call_timeout fits the rest.
    warm_up = DriverSession(workers.addresses)
    try:
        net = SpecSequential([linear])
        warm_up.place("net", net)
        warm_up.mirror_optimizer(0, torch.optim.SGD(net.parameters(), lr=0.1))
    finally:
        warm_up.close()
    call_timeout = 1.5
    gate = {"marker": str(tmp_path / "building"), "driver_pid": os.getpid(), "seconds": 2 * call_timeout}
    net = SpecSequential([("lrmp_testlayers.SetupGate", gate, (2, 3)), linear])
    session = DriverSession(workers.addresses, heartbeat_timeout=HEARTBEAT, call_timeout=call_timeout)
    try:
        session.place("net", net)  # twice call_timeout to build: setup is not bounded by it
        opt = lrmp_testlayers.SlowStepSGD(net.parameters(), driver_pid=os.getpid(), seconds=10)
        session.mirror_optimizer(0, opt)
        net(torch.ones(2, 3)).sum().backward()
        opt.step()  # posted: the next forward's micro-batch waits for it on the worker
        start = time.monotonic()
        with pytest.raises(WorkerLostError) as info:
            net(torch.ones(2, 3))
        detected = time.monotonic() - start
    finally:
        session.close()
    _record(f"a request that never returns (call_timeout={call_timeout:g})", detected)
    text = _assert_overdue(info.value, workers.addresses[0], 0, detected, call_timeout)
    assert "the pipeline made no progress during forward" in text, text
    assert f"worker {workers.addresses[0]} (stage 0) (optim_step still unanswered) is still computing" in text, text
    _stuck_worker_stops_quickly(workers)


#: A driver that places two Linear stages, says so by creating the file its first argument names, and
#: runs forwards until it is stopped.
_RUNNING_DRIVER = (
    "import sys, time, torch\n"
    "from lightning_remote_mp.driver.session import DriverSession\n"
    "from lightning_remote_mp.model.spec import SpecSequential\n"
    "s = DriverSession(sys.stdin.readline().split())\n"
    "net = SpecSequential([('torch.nn.Linear', {'in_features': 4, 'out_features': 4}, (2, 4))] * 2)\n"
    "s.place('net', net)\n"
    "open(sys.argv[1], 'w').close()\n"
    "while True:\n"
    "    net(torch.ones(2, 4)); time.sleep(0.05)\n"
)


def _placed(driver: subprocess.Popen, addresses: list[str], ready: str) -> None:
    """Hand ``_RUNNING_DRIVER`` its workers and wait (60 s at most) until it has created ``ready``,
    having placed its model."""
    _hand_over(driver, addresses)
    deadline = time.monotonic() + 60
    while not os.path.exists(ready) and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.1)
    assert os.path.exists(ready), "the first driver never placed its model"


def test_a_killed_driver_frees_its_workers_at_once(start_workers, tmp_path):
    """SIGKILL the driver mid-run: its kernel closes its connections, the workers drop the session
    within seconds (not after --session-timeout), and a new driver is served without an error; a
    live session stays protected."""
    ready = str(tmp_path / "placed")
    driver = _start_driver(_RUNNING_DRIVER, ready, stderr=subprocess.DEVNULL)
    try:
        workers = start_workers(2, extra_args=["--session-timeout", "60"])
        _placed(driver, workers.addresses, ready)
        # A live session is protected: a second driver is refused (after a second look, 1-2 s later).
        with pytest.raises(WorkerError, match="busy"):
            DriverSession(workers.addresses[:1], connect_timeout=30)
        driver.kill()
        driver.wait(10)
        killed = time.monotonic()
        session = DriverSession(workers.addresses, connect_timeout=30)  # waits for the drop if needed
        reused = time.monotonic() - killed
        session.close()
    finally:
        _end(driver)
    print(f"workers reused {reused:.1f} s after the driver was killed (session timeout 60 s)")
    assert reused < 8, reused


def test_a_new_driver_waits_out_a_session_whose_driver_just_went_silent(start_workers, tmp_path):
    """A driver frozen mid-run (SIGSTOP: its connections stay open, its pings stop) was heard from
    a moment ago when a new driver asks for its workers: the new driver asks again when a live
    driver would have pinged, finds the session silent and waits for the workers to drop it
    (``--session-timeout 5``), instead of reporting them busy. A killed driver made the same race
    when a worker read its closed connection a second after the new driver asked (CI, once)."""
    ready = str(tmp_path / "placed")
    driver = _start_driver(_RUNNING_DRIVER, ready, stderr=subprocess.DEVNULL)
    try:
        workers = start_workers(2, extra_args=["--session-timeout", "5"])
        _placed(driver, workers.addresses, ready)
        driver.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        session = DriverSession(workers.addresses, connect_timeout=30)
        waited = time.monotonic() - stopped
        session.close()
    finally:
        _end(driver)  # SIGKILL ends a stopped process too
    print(f"a new driver was served {waited:.1f} s after the first one froze (session timeout 5 s)")
    assert 2 <= waited < 15, waited


def test_a_cuda_error_in_a_layer_is_reported_and_stops_the_worker(start_workers):
    """After a CUDA error the device's context is unusable: the worker reports the error for its
    micro-batch and then stops, instead of failing every later request on a broken GPU."""
    workers = start_workers(1)
    net = SpecSequential([("lrmp_testlayers.Explode", {"as_cuda_error": True}, (2, 3))])
    session = DriverSession(workers.addresses, heartbeat_timeout=HEARTBEAT)
    try:
        session.place("net", net)
        with pytest.raises(WorkerError) as info, torch.no_grad():
            net(torch.ones(2, 3))
        assert "CUDA error: an illegal memory access" in info.value.remote_message
        # A forward without grad runs its list of forwards too: the error marks the one that failed.
        assert "stage 0's actions for call 1 (gpipe): [0F0]" in str(info.value), str(info.value)
    finally:
        session.close()
    workers.procs[0].wait(timeout=20)  # raises TimeoutExpired if the worker serves on


def test_a_lost_posted_request_is_named_when_the_pipeline_stalls(pool):
    """A request the driver posted without waiting (the optimizer's step) never reaches stage 1:
    the micro-batch that must follow it waits there, and once every worker has been idle for a
    heartbeat timeout the driver says which stage waits for which request (not: check the network)."""
    net = SpecSequential(
        [
            ("torch.nn.Linear", {"in_features": 4, "out_features": 4}, (3, 4)),
            ("torch.nn.Linear", {"in_features": 4, "out_features": 2}, (3, 4)),
        ]
    )
    session = DriverSession(pool[:2], heartbeat_timeout=HEARTBEAT)
    stage1 = session.conns[1]
    try:
        session.place("net", net, balance=[1, 1])
        stage1.order.last_id += 1  # lost on the way: the driver counts it as posted, the worker never sees it
        lost = stage1.order.last_id
        stage1.order.unanswered[lost] = protocol.OPTIM_STEP
        start = time.monotonic()
        with pytest.raises(WorkerLostError) as info, torch.no_grad():
            net(torch.randn(3, 4))
        detected = time.monotonic() - start
    finally:
        stage1.order.unanswered.clear()  # nothing will ever answer it
        session.close()
    text = str(info.value)
    assert info.value.address == pool[1] and info.value.stage == 1, text
    assert f"holds back 1 micro-batch(es) until it has run the driver's request {lost} (optim_step" in text, text
    assert "reach each other" not in text, text
    assert detected < 5 * HEARTBEAT, detected
