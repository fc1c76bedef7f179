"""The GPU data path: a CUDA stage's copies through side streams (`worker.device_io`), and the
worker's held sends that wait for them (`worker.outbox.Outbox`).

The held sends are plain Python over real sockets and are tested on any machine, with a
``threading.Event`` standing in for the CUDA event a GPU stage records; everything that needs a GPU
skips cleanly without one (``scripts/gpu_check.py`` runs it where there is one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import lightning as L
import pytest
import torch
import zmq
from test_strategy import assert_same_forward_and_backward
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_remote_mp import LocalWorkerOptions, RemoteModelParallelStrategy, SpecSequential
from lightning_remote_mp.wire import protocol, sockets
from lightning_remote_mp.worker.outbox import Outbox
from lightning_remote_mp.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(120)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Copy:
    """What the outbox asks of a GPU stage's event (``query``, ``synchronize``), finished by the test."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def finish(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        assert self._done.wait(10), "the copy never finished"


@pytest.fixture
def outbox() -> Iterator[tuple[Outbox, zmq.Socket]]:
    """An outbox on a real (not serving) worker socket, and the driver's DEALER connected to it."""
    server = WorkerServer("tcp://127.0.0.1:*")
    driver = sockets.dealer(server.endpoint)
    driver.send_multipart(protocol.encode(protocol.PING, 1, "s"))
    assert server.sock.poll(5000), "the worker socket heard nothing from the driver"
    peer_id = server.sock.recv_multipart()[0]
    box = Outbox(server, server._wake_serving)
    box.driver_peer, box.session = peer_id, "s"
    try:
        yield box, driver
    finally:
        box.close()
        driver.close(0)
        server.sock.disable_monitor()
        server._monitor.close(0)
        server.sock.close(0)


def _arrived(driver: zmq.Socket, wait_ms: int = 2000) -> list[protocol.Message]:
    messages = []
    while driver.poll(wait_ms if not messages else 200):
        messages.append(protocol.decode(driver.recv_multipart(copy=False)))
    return messages


def test_held_messages_leave_in_order_once_their_copy_is_done(outbox):
    box, driver = outbox
    copy = Copy()
    box.to_driver(protocol.RESULT, {"mb": 0, "x": torch.ones(3)}, ready=copy, about={"mb": 0})
    assert box.held
    box.to_driver(protocol.RESULT, {"mb": 1})  # no copy of its own, but behind one: held too
    box.hold_reply(box.driver_peer, protocol.encode(protocol.OK, 7, "s", {"step": True}))
    box.flush()
    assert _arrived(driver, wait_ms=300) == [], "a message left before its tensors were copied"
    copy.finish()
    box.flush()
    got = _arrived(driver)
    assert [(m.kind, m.id) for m in got] == [("result", 0), ("result", 0), ("ok", 7)]
    assert [m.body.get("mb") for m in got[:2]] == [0, 1] and got[0].body["x"].tolist() == [1.0] * 3
    assert not box.held
    box.to_driver(protocol.RESULT, {"mb": 2})  # nothing held: it goes at once
    assert [m.body["mb"] for m in _arrived(driver)] == [2]


def test_the_serving_loop_is_woken_when_a_copy_is_done_not_before(outbox):
    box, driver = outbox
    copy = Copy()
    box.to_driver(protocol.RESULT, {"mb": 0}, ready=copy)
    wake = box.holder._serving_rx  # what the serving loop polls besides its socket
    assert not wake.poll(300), "woken before the copy was done"
    copy.finish()
    assert wake.poll(5000), "not woken when the copy was done"
    wake.recv()
    assert box.flush() is None and not box.held
    assert [m.body["mb"] for m in _arrived(driver)] == [0]


def test_a_held_send_that_fails_is_reported_for_its_micro_batch(outbox):
    box, driver = outbox
    box.peer_timeout = 0.3
    gone = sockets.context().socket(zmq.ROUTER)
    nobody = f"tcp://127.0.0.1:{gone.bind_to_random_port('tcp://127.0.0.1')}"
    gone.close(0)  # a port that was free a moment ago: nobody listens there
    copy = Copy()
    copy.finish()
    box.to_peer(nobody, protocol.FORWARD, {"x": torch.ones(2)}, ready=copy, about={"key": "net", "call": 4, "mb": 1})
    box.to_driver(protocol.RESULT, {"mb": 2})  # behind it
    retry = box.flush()
    assert retry is not None and retry < 0.1, "a peer that cannot take a message yet blocks the serving loop"
    assert _arrived(driver, wait_ms=100) == [], "reported before peer_timeout"
    deadline = time.monotonic() + 5
    while box.held and time.monotonic() < deadline:
        time.sleep(retry)
        retry = box.flush()
    error, after = _arrived(driver)
    assert error.kind == protocol.ERROR and error.body["type"] == "PeerUnreachableError"
    assert (error.body["key"], error.body["call"], error.body["mb"]) == ("net", 4, 1)
    assert nobody in error.body["message"]
    assert after.kind == protocol.RESULT and after.body["mb"] == 2


# --- on a GPU -------------------------------------------------------------------------------------


@needs_cuda
def test_small_tensors_are_copied_at_once_and_large_ones_off_the_compute_stream():
    from lightning_remote_mp.worker.device_io import OVERLAP_FROM, DeviceIO

    io = DeviceIO(torch.device("cuda"))
    received = torch.arange(12.0).reshape(3, 4)[:, 1:]  # not contiguous, not pinned: as frames are not
    x = io.upload(received)
    assert x.device.type == "cuda" and torch.equal(x.cpu(), received)
    body, ready = io.to_host({"x": (x.t() * 2, None), "n": 3})
    assert ready is None, "a small tensor's copy was left to finish later"
    assert body["n"] == 3 and body["x"][1] is None and torch.equal(body["x"][0], received.t() * 2)
    large = torch.ones(OVERLAP_FROM // 4)
    body, ready = io.to_host({"small": x, "large": io.upload(large) * 2})
    ready.synchronize()
    assert body["large"].is_pinned() and torch.equal(body["large"], large * 2)
    assert not body["small"].is_pinned() and torch.equal(body["small"], received)


@needs_cuda
def test_uploads_and_downloads_go_through_side_streams_and_pinned_memory():
    from lightning_remote_mp.worker.device_io import DeviceIO

    io = DeviceIO(torch.device("cuda"), overlap_from=0)
    received = torch.arange(12.0).reshape(3, 4)[:, 1:]
    x = io.upload(received)
    assert x.device.type == "cuda" and torch.equal(x.cpu(), received)
    y = x.t() * 2
    host = io.download(y)
    io.ready().synchronize()
    assert host.is_pinned() and host.device.type == "cpu" and torch.equal(host, received.t() * 2)
    body, ready = io.to_host({"x": (y, None), "vars": {"r": y[0]}, "n": 3})
    ready.synchronize()
    assert body["n"] == 3 and body["x"][1] is None and torch.equal(body["vars"]["r"], received.t()[0] * 2)
    assert body["vars"]["r"].is_pinned()


@needs_cuda
def test_every_copy_waits_for_what_it_depends_on():
    """Each stream is held up in turn by a long GPU sleep: a missing wait or record_stream then
    reads unfinished data, or memory the allocator has already handed out again."""
    from lightning_remote_mp.worker.device_io import DeviceIO

    io = DeviceIO(torch.device("cuda"), overlap_from=0)
    n, cycles = 1 << 22, 100_000_000
    src = torch.arange(n, dtype=torch.float32)
    with torch.cuda.stream(io._upload):
        torch.cuda._sleep(cycles)
    x = io.upload(src)
    assert torch.equal((x + 0).cpu(), src), "the compute stream did not wait for the upload"
    torch.cuda._sleep(cycles)
    y = x * 2
    host = io.download(y)
    io.ready().synchronize()
    assert torch.equal(host, src * 2), "the download did not wait for the compute stream"
    y = x * 3
    with torch.cuda.stream(io._download):
        torch.cuda._sleep(cycles)
    host = io.download(y)
    del y  # without record_stream, its memory would go to the next allocation at once
    torch.full((n,), -1.0, device="cuda")
    io.ready().synchronize()
    assert torch.equal(host, src * 3), "the download read memory that was reused"
    torch.cuda._sleep(cycles)  # a synchronous copy waits for the compute stream by itself
    body, ready = DeviceIO(torch.device("cuda")).to_host({"y": x[:8] * 4})
    assert ready is None and torch.equal(body["y"], src[:8] * 4)


def _cnn_spec(batch: int, norm: tuple[str, dict]) -> list:
    x = (batch, 1, 8, 8)
    return [
        # No bias before a norm: its gradient is rounding noise, which AdamW would amplify into steps.
        ("torch.nn.Conv2d", {"in_channels": 1, "out_channels": 8, "kernel_size": 3, "padding": 1, "bias": False}, x),
        (*norm, (batch, 8, 8, 8)),
        ("torch.nn.ReLU", {}, (batch, 8, 8, 8)),
        ("torch.nn.Flatten", {}, (batch, 8, 8, 8)),
        ("torch.nn.Linear", {"in_features": 512, "out_features": 64}, (batch, 512)),
        ("torch.nn.ReLU", {}, (batch, 64)),
        ("torch.nn.Linear", {"in_features": 64, "out_features": 1}, (batch, 64)),
    ]


class _Cnn(L.LightningModule):
    def __init__(self, batch: int, norm: tuple[str, dict]) -> None:
        super().__init__()
        self.net = SpecSequential(_cnn_spec(batch, norm))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


# BatchNorm in training mode normalises each micro-batch by its own statistics: pipelined, the
# same model is compared with GroupNorm, which does not couple samples.
@needs_cuda
@pytest.mark.parametrize(
    ("microbatches", "norm"),
    [
        (1, ("torch.nn.BatchNorm2d", {"num_features": 8})),
        (4, ("torch.nn.GroupNorm", {"num_groups": 2, "num_channels": 8})),
    ],
)
def test_a_cnn_on_cuda_workers_trains_as_it_does_locally(microbatches, norm, monkeypatch):
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")  # full float32 convolutions on the workers, as on the CPU
    batch = 16
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(96, 1, 8, 8, generator=g), torch.randn(96, 1, generator=g)), batch)
    torch.manual_seed(0)
    local, remote = _Cnn(batch, norm), _Cnn(batch, norm)
    remote.load_state_dict(local.state_dict())
    common = dict(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False)
    common["enable_checkpointing"] = False
    L.Trainer(accelerator="cpu", **common).fit(local, data)
    strategy = RemoteModelParallelStrategy(
        local_workers=LocalWorkerOptions(count=2, devices=["cuda:0", f"cuda:{torch.cuda.device_count() - 1}"]),
        balance=[3, 4],
        microbatches=microbatches,
    )
    L.Trainer(strategy=strategy, accelerator="cpu", **common).fit(remote, data)
    assert len(remote.losses) == len(local.losses) == 12
    assert max(abs(a - b) for a, b in zip(remote.losses, local.losses)) < 1e-4
    for (name, a), b in zip(local.state_dict().items(), remote.state_dict().values()):
        assert torch.allclose(a, b.cpu(), atol=1e-4), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script runs for real")
def test_the_gpu_check_says_plainly_that_there_is_no_gpu():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "no CUDA device" in done.stderr


class SlowCopies:
    """A GPU stage's `DeviceIO` as the serving loop sees it, on CPU: tensors stay where they are,
    and every message's "copy" completes ``delay`` seconds after it was queued."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def to_host(self, body: object) -> tuple[object, Copy]:
        copy = Copy()
        threading.Timer(self.delay, copy.finish).start()
        return body, copy


def _in_process_pipeline_equals_local(device: str, make_io) -> None:
    """Two in-process workers on ``device`` whose stages copy through ``make_io(stage.device)``:
    micro-batches, results, gradients and the replies behind them all arrive, in order, some held
    for their copies, and forward and backward equal a local run."""
    import copy as copying

    from lightning_remote_mp.driver.session import DriverSession

    servers = [WorkerServer("tcp://127.0.0.1:*", device=device) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    torch.manual_seed(0)
    spec = [
        ("torch.nn.Linear", {"in_features": 4, "out_features": 8}, (8, 4)),
        ("torch.nn.ReLU", {}, (8, 8)),
        ("torch.nn.Linear", {"in_features": 8, "out_features": 2}, (8, 8)),
    ]
    net = SpecSequential(spec)
    local = copying.deepcopy(net)
    session = DriverSession([s.endpoint for s in servers], connect_timeout=30)
    try:
        session.place("net", net, balance=[2, 1], microbatches=4)
        for server in servers:  # the serving threads are idle between requests
            for stage in server._session.stages.values():
                stage.io = make_io(stage.device)
        for _ in range(2):
            assert_same_forward_and_backward(net, local, torch.randn(8, 4), torch.randn(8, 2))
        assert all(s._outbox._copies is not None for s in servers), "no message was held for its copy"
        # A held message leaves the outbox just after it is sent: the driver may have it a moment before.
        deadline = time.monotonic() + 2.0
        while any(s._outbox.held for s in servers) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not any(s._outbox.held for s in servers)
    finally:
        session.close()
        for server in servers:
            server.stop()
        for t in threads:
            t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)


def test_a_pipeline_whose_sends_wait_for_copies_computes_what_a_local_run_does():
    """As GPU stages hold messages for their copies, with a slow (simulated) copy on CPU."""
    _in_process_pipeline_equals_local("cpu", lambda device: SlowCopies(0.02))


@needs_cuda
def test_a_pipeline_whose_copies_all_overlap_computes_what_a_local_run_does():
    """Real CUDA stages, every copy (however small) off the compute stream and every send held for it."""
    from lightning_remote_mp.worker.device_io import DeviceIO

    _in_process_pipeline_equals_local("cuda:0", lambda device: DeviceIO(device, overlap_from=0))
