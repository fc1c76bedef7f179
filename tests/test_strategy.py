"""End to end: real Trainers, real lrmp-worker processes, compared step by step with local runs."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_remote_mp import (
    ConfigurationError,
    CurveOptions,
    LocalWorkerOptions,
    RemoteModelParallelStrategy,
    SpecSequential,
    WorkerError,
    WorkerLostError,
)
from lightning_remote_mp.driver.session import DriverSession
from lightning_remote_mp.errors import LrmpError
from lightning_remote_mp.layers import WrappedLinear
from lightning_remote_mp.worker.deferred_grads import MIN_MACS_ENV

WIDTH = 16
TOL = 1e-5


def residual_spec(width: int = WIDTH, probe: bool = True) -> list:
    """The original DistributedTraining residual model, with PidProbes that record where they ran."""
    spec = [
        ("torch.nn.Linear", {"in_features": 1, "out_features": width}, (32, 1)),
        ("torch.nn.ReLU", {}, (32, width)),
        (WrappedLinear, {"in_features": width, "out_features": width, "out_variables": ["res_1"]}, (32, width)),
        ("torch.nn.ReLU", {}, (32, width)),
        ("torch.nn.Linear", {"in_features": width, "out_features": width}, (32, width)),
        ("torch.nn.ReLU", {}, (32, width)),
        (WrappedLinear, {"in_features": width, "out_features": width, "dependencies": ["res_1"]}, [(32, width)] * 2),
        ("torch.nn.ReLU", {}, (32, width)),
        ("torch.nn.Linear", {"in_features": width, "out_features": 1}, (32, width)),
        ("torch.nn.Sigmoid", {}, (32, 1)),
    ]
    if probe:
        spec.insert(2, ("lrmp_testlayers.PidProbe", {}, (32, width)))  # index 2: stage 0 with balance [4, ...]
        spec.insert(8, ("lrmp_testlayers.PidProbe", {}, (32, width)))  # index 8: a later stage
    return spec


class Net(L.LightningModule):
    def __init__(self, spec: list, lr: float = 3e-3, local_head: bool = False, scheduler: bool = False) -> None:
        super().__init__()
        self.head = nn.Linear(1, 1) if local_head else None  # stays on the driver
        self.net = SpecSequential(spec)
        self.lr = lr
        self.scheduler = scheduler
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            x = self.head(x)
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.binary_cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.binary_cross_entropy(self(x), y)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        groups = [{"params": self.net.parameters()}]
        if self.head is not None:
            groups.append({"params": self.head.parameters(), "lr": self.lr * 2})
        opt = torch.optim.Adam(groups, lr=self.lr)
        if not self.scheduler:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)}


def data(n: int = 100, batch_size: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 1, generator=g)
    y = (x > 0.5).float()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)  # 100 = 3 * 32 + 4: the last batch is short


def trainer(strategy=None, epochs: int = 2, **kwargs) -> L.Trainer:
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("num_sanity_val_steps", 0)
    return L.Trainer(
        max_epochs=epochs,
        strategy=strategy or "auto",
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def assert_same_weights(a: nn.Module, b: nn.Module, tol: float = TOL) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if k.endswith(".pid"):
            continue
        assert torch.allclose(sa[k].float(), sb[k].float(), atol=tol, rtol=0), f"{k} differs"


def assert_same_forward_and_backward(
    remote: nn.Module, local: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, tol: float = 1e-6
) -> None:
    """One forward and backward of ``remote`` (placed on workers) and of its ``local`` twin from the
    same input: the outputs and the input's gradients are equal."""
    xr = x.detach().clone().requires_grad_(True)
    xl = x.detach().clone().requires_grad_(True)
    y, yl = remote(xr), local(xl)
    assert torch.allclose(y, yl, atol=tol)
    y.backward(grad_out)
    yl.backward(grad_out)
    assert torch.allclose(xr.grad, xl.grad, atol=tol)


def assert_same_losses(a: list[float], b: list[float], tol: float = TOL) -> None:
    assert len(a) == len(b) and len(a) > 0
    diffs = [abs(x - y) for x, y in zip(a, b)]
    assert max(diffs) <= tol, f"losses differ by up to {max(diffs)}"


def probe_pids(model: Net) -> list[int]:
    return [int(m.pid) for m in model.net.layers if hasattr(m, "pid")]


def test_residual_model_trains_remotely_as_it_does_locally(twin):
    torch.manual_seed(1)
    local = Net(residual_spec(), local_head=True, scheduler=True)
    remote = twin(local)
    trainer(epochs=3).fit(local, data())
    strategy = RemoteModelParallelStrategy(balance=[4, 8])  # res_1 (layer 4) crosses to stage 1
    trainer(strategy, epochs=3).fit(remote, data())

    assert len(remote.losses) == 12  # 4 batches a epoch, the last one short
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)
    # The probes ran in two different worker processes, not here.
    pids = probe_pids(remote)
    assert os.getpid() not in pids and len(set(pids)) == 2
    assert probe_pids(local) == [os.getpid()] * 2
    # After fit the module is local again and trains without workers.
    assert not remote.net.is_remote
    assert remote.lr_schedulers is not None


@pytest.mark.parametrize(("microbatches", "split_backward"), [(1, True), (3, True), (3, False)])
def test_residual_that_skips_a_whole_stage(twin, microbatches, split_backward, pool):
    torch.manual_seed(2)
    local = Net(residual_spec())
    remote = twin(local)
    trainer().fit(local, data())
    # Stage 0: layers 0-4 (res_1 made at 4); stage 1: 5-7; stage 2: 8-11 (res_1 used at 9).
    # With micro-batches, the last batch (4 samples) splits unevenly: 2, 1, 1.
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:3], balance=[5, 3, 4], microbatches=microbatches, split_backward=split_backward
    )
    trainer(strategy).fit(remote, data())
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)
    assert len(set(probe_pids(remote))) == 2 and os.getpid() not in probe_pids(remote)


def test_validate_and_predict_through_workers_equal_local(twin, pool):
    torch.manual_seed(3)
    spec = residual_spec(probe=False)
    spec.insert(1, ("torch.nn.BatchNorm1d", {"num_features": WIDTH}, (32, WIDTH)))  # train/eval differ
    local = Net(spec)
    remote = twin(local)
    trainer(epochs=1).fit(local, data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:2])
    t = trainer(strategy, epochs=1)
    t.fit(remote, data())
    assert_same_weights(local, remote)  # running statistics included

    local_val = trainer().validate(local, data(), verbose=False)
    remote_val = t.validate(remote, data(), verbose=False)
    assert abs(local_val[0]["val_loss"] - remote_val[0]["val_loss"]) <= TOL
    local_pred = torch.cat(trainer().predict(local, data()))
    remote_pred = torch.cat(t.predict(remote, data()))
    assert torch.allclose(local_pred, remote_pred, atol=TOL)
    assert remote.net.training is False or remote.net.training is True  # mode restored without error
    assert_same_weights(local, remote)  # evaluation did not touch running statistics


def _fit_with_checkpoint(model, strategy, epochs, dirpath, ckpt_path=None):
    cb = ModelCheckpoint(dirpath=dirpath, save_last=True, save_top_k=-1, every_n_epochs=1)
    trainer(strategy, epochs=epochs, enable_checkpointing=True, callbacks=[cb]).fit(model, data(), ckpt_path=ckpt_path)
    return os.path.join(dirpath, "last.ckpt")


def test_checkpoints_match_local_and_resume_exactly_on_fresh_workers(tmp_path, twin, pool):
    torch.manual_seed(4)
    base = Net(residual_spec(probe=False), local_head=True)
    straight, local, remote = twin(base), twin(base), twin(base)
    trainer(epochs=4).fit(straight, data())  # uninterrupted reference

    local_ckpt = _fit_with_checkpoint(local, None, 2, tmp_path / "local")
    remote_ckpt = _fit_with_checkpoint(remote, RemoteModelParallelStrategy(hosts=pool[:2]), 2, tmp_path / "remote")
    lc = torch.load(local_ckpt, weights_only=True)
    rc = torch.load(remote_ckpt, weights_only=True)
    assert lc["state_dict"].keys() == rc["state_dict"].keys()
    for k in lc["state_dict"]:
        assert torch.allclose(lc["state_dict"][k], rc["state_dict"][k], atol=TOL), k
    lo, ro = lc["optimizer_states"][0], rc["optimizer_states"][0]
    assert lo["state"].keys() == ro["state"].keys() and len(ro["state"]) == len(list(base.parameters()))
    for i in lo["state"]:
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(lo["state"][i][k], ro["state"][i][k], atol=TOL), (i, k)

    # Remote checkpoint -> remote resume on fresh workers; and the two cross-overs.
    resumed = {
        "remote->remote": (twin(base), remote_ckpt, RemoteModelParallelStrategy()),  # fresh worker processes
        "local->remote": (twin(base), local_ckpt, RemoteModelParallelStrategy(hosts=pool[2:])),
        "remote->local": (twin(base), remote_ckpt, None),
    }
    for name, (model, ckpt, strategy) in resumed.items():
        trainer(strategy, epochs=4).fit(model, data(), ckpt_path=ckpt)
        assert_same_weights(straight, model), name
        assert_same_losses(straight.losses[-8:], model.losses), name


class _KillAt(L.Callback):
    """Kills a worker process at a given training step."""

    def __init__(self, pid_of, step: int, sig: int = signal.SIGKILL) -> None:
        self.pid_of, self.step, self.sig = pid_of, step, sig
        self.killed_at: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.killed_at is None:
            os.kill(self.pid_of(trainer), self.sig)
            self.killed_at = time.monotonic()


def test_killed_local_worker_is_named_promptly():
    torch.manual_seed(5)
    # A long heartbeat timeout: a local worker's death is seen from its process, not from silence.
    strategy = RemoteModelParallelStrategy(heartbeat_timeout=30.0)
    killer = _KillAt(lambda t: t.strategy._workers.local.procs[1].pid, step=2)
    with pytest.raises(WorkerLostError) as info:
        trainer(strategy, epochs=2, callbacks=[killer]).fit(Net(residual_spec(probe=False)), data())
    assert time.monotonic() - killer.killed_at < 15.0  # teardown included, on a loaded machine
    assert "stage 1" in str(info.value) and info.value.address in str(info.value)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_lost_remote_worker_is_named_within_heartbeat_timeout(start_workers, pool, sig):
    # Stage 0 is a fresh worker to lose; stage 1 one of the suite's shared workers, which the failed
    # run's teardown releases (fresh workers cost seconds of CPU each).
    victim = start_workers(1)
    heartbeat = 2.0
    strategy = RemoteModelParallelStrategy(hosts=[victim.addresses[0], pool[0]], heartbeat_timeout=heartbeat)
    killer = _KillAt(lambda t: victim.procs[0].pid, step=1, sig=sig)
    try:
        with pytest.raises(WorkerLostError) as info:
            trainer(strategy, epochs=2, callbacks=[killer]).fit(Net(residual_spec(probe=False)), data())
        elapsed = time.monotonic() - killer.killed_at
        assert elapsed < heartbeat + 5.0, elapsed
        assert victim.addresses[0] in str(info.value) and "stage 0" in str(info.value)
        assert info.value.stage == 0
    finally:
        if sig == signal.SIGSTOP:
            os.kill(victim.procs[0].pid, signal.SIGCONT)
    # The surviving worker was released: it serves the next session.
    DriverSession([pool[0]], connect_timeout=10).close()


class _BackwardSpans(L.Callback):
    """How long each ``loss.backward()`` took on the driver, and how many confirmations each of the
    session's connections holds for a send (`RequestOrder.before_send`) before and after it."""

    def __init__(self) -> None:
        self.began = 0.0
        self.spans: list[float] = []
        self.held: list[tuple[list[int], list[int]]] = []

    def on_before_backward(self, trainer, pl_module, loss):
        self.held.append(([len(c.order.before_send) for c in trainer.strategy.session.conns], []))
        self.began = time.monotonic()

    def on_after_backward(self, trainer, pl_module):
        self.spans.append(time.monotonic() - self.began)
        self.held[-1][1].extend(len(c.order.before_send) for c in trainer.strategy.session.conns)


def test_the_driver_goes_on_while_the_workers_run_a_backward_that_returns_it_nothing(twin, pool):
    # Stage 1's backward takes 0.8 s. No input needs a gradient, so loss.backward() returns as soon
    # as the backward is sent; Lightning's step and the next batch go on meanwhile, and the driver
    # confirms the backward before its next message. The training is the same.
    spec = residual_spec(probe=False)
    spec.insert(8, ("lrmp_testlayers.BackwardHook", {"sleep": 0.8}, (32, WIDTH)))
    torch.manual_seed(3)
    local = Net(spec)
    remote = twin(local)
    trainer(epochs=1, max_steps=2).fit(local, data())
    spans = _BackwardSpans()
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], balance=[4, 7])
    trainer(strategy, epochs=1, max_steps=2, callbacks=[spans]).fit(remote, data())
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)
    assert len(spans.spans) == 2 and max(spans.spans) < 0.4, spans.spans
    # The unwaited backward has every connection confirm it before a send; the next forward confirms
    # it from the driver, which removes that again (the wire then calls nothing of the driver's).
    assert spans.held == [([0, 0], [1, 1]), ([0, 0], [1, 1])], spans.held


def test_worker_exception_reaches_driver_with_layer_and_stage(pool):
    workers = SimpleNamespace(addresses=pool[:2])
    spec = [
        ("torch.nn.Linear", {"in_features": 1, "out_features": 8}, (32, 1)),
        ("torch.nn.ReLU", {}, (32, 8)),
        ("lrmp_testlayers.Explode", {}, (32, 8)),
        ("torch.nn.Sigmoid", {}, (32, 8)),
    ]
    strategy = RemoteModelParallelStrategy(hosts=workers.addresses, balance=[2, 2])
    with pytest.raises(WorkerError) as info:
        trainer(strategy).fit(Net(spec), data())
    err = info.value
    assert err.stage == 1 and err.layer == 2 and err.address == workers.addresses[1]
    assert "layer 2 (Explode)" in str(err) and "stage 1" in str(err) and "exploded on purpose" in err.remote_message
    # Both workers stay up and train a correct model right after.
    good = Net(residual_spec(probe=False))
    trainer(RemoteModelParallelStrategy(hosts=workers.addresses), epochs=1).fit(good, data())
    assert err.address in pool  # and the pool fixture checks that every worker is still alive


def test_refused_class_is_a_clear_error_and_the_worker_survives(start_workers):
    workers = start_workers(2, allow_modules=())
    strategy = RemoteModelParallelStrategy(hosts=workers.addresses)
    with pytest.raises(WorkerError) as info:
        trainer(strategy).fit(Net(residual_spec()), data())
    assert "lrmp_testlayers.PidProbe" in str(info.value) and "--allow-module lrmp_testlayers" in str(info.value)
    good = Net(residual_spec(probe=False))
    trainer(RemoteModelParallelStrategy(hosts=workers.addresses), epochs=1).fit(good, data())
    assert len(good.losses) == 4


def test_bad_configuration_errors_name_the_culprit(pool):
    with pytest.raises(LrmpError, match="balance"):
        trainer(RemoteModelParallelStrategy(hosts=pool[:2], balance=[1, 2])).fit(Net(residual_spec()), data())
    with pytest.raises(LrmpError, match=r"balance names \['nope'\]"):
        trainer(RemoteModelParallelStrategy(hosts=pool[:2], balance={"nope": [6, 6]})).fit(Net(residual_spec()), data())
    with pytest.raises(ValueError, match="needs a port"):
        RemoteModelParallelStrategy(hosts=["10.0.0.5"])


TWO_HOSTS = ["127.0.0.1:5555", "127.0.0.1:5556"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (lambda: dict(local_workers=LocalWorkerOptions(count=0)), "local_workers.count must be at least 1, got 0"),
        (lambda: dict(local_workers=LocalWorkerOptions(devices=["cpu"])), "local_workers.devices names 1 device"),
        (lambda: dict(local_workers={"device": ["cpu"]}), "local_workers: no option 'device'; give count, devices"),
        (lambda: dict(local_workers={"count": 0}), "local_workers.count must be at least 1, got 0"),
        (lambda: dict(hosts=TWO_HOSTS, local_workers=LocalWorkerOptions()), "local_workers is for the workers"),
        (lambda: dict(hosts=TWO_HOSTS, curve=CurveOptions("driver.key_secret")), "curve.worker_public_keys is empty"),
        (lambda: dict(curve=CurveOptions("d.key_secret", ["w.key"])), "curve.worker_public_keys is for workers given"),
        (lambda: dict(local_workers=LocalWorkerOptions(count=3), replicas=2), "replicas=2 does not divide"),
        (lambda: dict(hosts=[TWO_HOSTS[:1], TWO_HOSTS[1:]], replicas=3), "replicas=3, but hosts has 2 row"),
        (lambda: dict(microbatches=0), "microbatches must be at least 1, got 0"),
        (lambda: dict(split_backward=1), "split_backward must be True, False or 'auto', got 1"),
        (lambda: dict(split_backward="yes"), "split_backward must be True, False or 'auto', got 'yes'"),
        (lambda: dict(checkpoint="sometimes"), "checkpoint must be one of 'never', 'except_last', 'always'"),
        (lambda: dict(balance=[5, 3, 2]), r"balance=\[5, 3, 2\] has 3 entries but there are 2 stages"),
        (lambda: dict(balance="speed"), "balance='speed' is unknown"),
        (lambda: dict(heartbeat_timeout=0), "heartbeat_timeout must be a positive number of seconds"),
        (lambda: dict(call_timeout=-1.0), "call_timeout must be a positive number of seconds"),
        (lambda: dict(split="model"), "split must be a list of submodule names"),
        (lambda: dict(hosts=["10.0.0.5"]), "needs a port"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_configuration_errors_are_raised_at_construction_naming_the_argument(arguments, message):
    with pytest.raises(ConfigurationError, match=message) as info:
        RemoteModelParallelStrategy(**arguments())
    assert isinstance(info.value, ValueError)


def test_construction_reads_no_file_and_a_missing_key_is_named_at_setup(monkeypatch):
    started = []
    monkeypatch.setattr("lightning_remote_mp.driver.workers.LocalWorkers", lambda *a, **k: started.append(a))
    missing = "/nonexistent/driver.key_secret"
    strategy = RemoteModelParallelStrategy(curve=CurveOptions(secret_key=missing))  # no error: nothing read yet
    assert strategy.curve.secret_key == missing and strategy._workers is None
    with pytest.raises(LrmpError, match="does not exist"):
        trainer(strategy, epochs=1).fit(Net(residual_spec(probe=False)), data())
    assert not started  # refused at setup before any worker was started


def test_unreachable_worker_fails_within_connect_timeout():
    import socket

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    strategy = RemoteModelParallelStrategy(hosts=[f"127.0.0.1:{port}"], connect_timeout=2.0)
    start = time.monotonic()
    with pytest.raises(WorkerLostError, match=f"127.0.0.1:{port}"):
        trainer(strategy).fit(Net(residual_spec(probe=False)), data())
    assert time.monotonic() - start < 10


def test_no_thread_or_process_left_behind():
    before = {t.name for t in threading.enumerate()}
    strategy = RemoteModelParallelStrategy()
    trainer(strategy, epochs=1).fit(Net(residual_spec(probe=False)), data())
    assert strategy._workers is None and strategy.session is None
    assert "lrmp-heartbeat" not in {t.name for t in threading.enumerate()} - before


class MetaNet(Net):
    """The SpecSequential is built on the meta device: its weights only ever exist on the workers."""

    def __init__(self, spec, meta: bool):
        super().__init__(spec)
        self.net = SpecSequential(spec, init_seed=7, device="meta" if meta else None)


def test_meta_model_is_initialised_by_the_workers_from_its_seed(tmp_path, pool):
    spec = residual_spec(probe=False)
    local = MetaNet(spec, meta=False)
    remote = MetaNet(spec, meta=True)
    assert all(p.is_meta for p in remote.net.parameters())
    trainer().fit(local, data())
    ckpt = _fit_with_checkpoint(remote, RemoteModelParallelStrategy(hosts=pool[:2], balance=[5, 5]), 2, tmp_path)
    assert_same_losses(local.losses, remote.losses)
    # The driver never held the weights; the checkpoint has them all, equal to the local run's.
    assert all(p.is_meta for p in remote.net.parameters())
    state = torch.load(ckpt, weights_only=True)["state_dict"]
    assert state.keys() == local.state_dict().keys()
    for k, v in local.state_dict().items():
        assert not state[k].is_meta and torch.allclose(state[k], v, atol=TOL), k
    # A fresh meta model resumes from it on fresh workers.
    resumed = MetaNet(spec, meta=True)
    trainer(RemoteModelParallelStrategy(hosts=pool[2:], balance=[5, 5]), epochs=3).fit(resumed, data(), ckpt_path=ckpt)
    # Validating the trained meta module again without its checkpoint would restart from the seed: refused.
    with pytest.raises(LrmpError, match="ckpt_path"):
        trainer(RemoteModelParallelStrategy(hosts=pool[:2], balance=[5, 5])).validate(resumed, data(), verbose=False)
    trainer(RemoteModelParallelStrategy(hosts=pool[:2], balance=[5, 5])).validate(
        resumed, data(), ckpt_path=ckpt, verbose=False
    )
    reference = MetaNet(spec, meta=False)
    trainer(epochs=3).fit(reference, data())
    assert_same_losses(reference.losses[-4:], resumed.losses)


def test_balance_by_time_follows_measurements_and_trains_like_local(twin, pool):
    big = ("torch.nn.Linear", {"in_features": 512, "out_features": 512}, (256, 512))
    spec = [big, ("torch.nn.Linear", {"in_features": 512, "out_features": 1}, (256, 512))]
    spec += [("torch.nn.Linear", {"in_features": 1, "out_features": 1}, (256, 1))] * 5
    spec += [("torch.nn.Sigmoid", {}, (256, 1))]

    class Wide(Net):
        def forward(self, x):
            return self.net(x.expand(-1, 512).contiguous())

    torch.manual_seed(9)
    local = Wide(spec)
    remote = twin(local)
    trainer(epochs=1).fit(local, data())
    seen = []

    class Placement(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.extend(rs.stage for rs in pl_module.net._remote.stages)

    strategy = RemoteModelParallelStrategy(hosts=pool[:2], balance="time")
    trainer(strategy, epochs=1, callbacks=[Placement()]).fit(remote, data())
    assert_same_losses(local.losses, remote.losses)
    # The 512x512 layer costs far more than the rest together: it gets a stage of its own.
    assert [s.stop - s.start for s in seen] == [1, 7]
    assert strategy.session is None


def test_timeline_records_every_stage_and_logs_the_bubble(tmp_path, twin, pool):
    import json

    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(10)
    local = Net(residual_spec(probe=False))
    remote = twin(local)
    trainer(epochs=1).fit(local, data())
    path = tmp_path / "trace.json"
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:2], balance=[4, 6], microbatches=2, split_backward=True, timeline=str(path)
    )
    t = L.Trainer(
        max_epochs=1,
        strategy=strategy,
        accelerator="cpu",
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path),
    )
    t.fit(remote, data())
    assert_same_losses(local.losses, remote.losses)  # recording changes nothing

    events = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert any(n.startswith("net stage 0 @ tcp://127.0.0.1:") for n in names) and "driver" in names
    # 4 steps x 2 micro-batches (the short last batch of 4 splits too) through 2 stages, both ways.
    assert sum(e["cat"] == "forward" for e in spans) == 4 * 2 * 2
    assert sum(e["cat"] == "backward" for e in spans) == 4 * 2 * 2
    # Each stage's linear layers got their weight gradients once per step, after its last micro-batch.
    assert sum(e["cat"] == "weights" for e in spans) == 4 * 2
    assert sum(e["cat"] == "transfer" for e in spans) >= 4 * 2 * 2  # stage to stage, both ways
    assert all(e["dur"] >= 0 for e in spans) and any(e["cat"] == "idle" for e in spans)
    bubble = t.callback_metrics["lrmp/bubble_fraction_epoch"].item()
    assert 0.0 < bubble < 1.0


def test_split_backward_auto_defers_only_large_calls_and_trains_as_locally(twin, start_workers, monkeypatch, tmp_path):
    """Workers at a threshold that the square layers' full micro-batches reach and nothing else does
    (the first and last layers are narrow, the short last batch has 2 rows per micro-batch): the
    same layer defers in one batch and not in the next, and training equals local training. The
    short batch's second micro-batch runs without the TorchFunctionMode (its WrappedLinears need it):
    its first, of the same shapes, deferred nothing."""
    import json

    monkeypatch.setenv(MIN_MACS_ENV, str(16 * WIDTH * WIDTH))  # 16 rows: a full batch of 32, halved
    workers = start_workers(2)  # they read the threshold from their environment
    torch.manual_seed(10)
    local = Net(residual_spec(probe=False))
    remote = twin(local)
    trainer(epochs=1).fit(local, data())
    path = tmp_path / "trace.json"
    strategy = RemoteModelParallelStrategy(
        hosts=workers.addresses, balance=[4, 6], microbatches=2, split_backward="auto", timeline=str(path)
    )
    trainer(strategy, epochs=1).fit(remote, data())
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)
    spans = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    # Both stages deferred (and flushed) in the 3 full batches, neither in the short last one.
    assert sum(e["cat"] == "weights" for e in spans) == 3 * 2


def test_a_slow_driver_link_cannot_let_the_pipeline_overtake_the_optimizer_step(twin, pool):
    # The driver does not wait for the optimizer step (it posts it), but stage 1 must not run the
    # next forward, which reaches it from stage 0, before that step: everything the driver sends
    # stage 1 arrives 50 ms late here, while stage 0's micro-batches reach it at once.
    from lrmp_relay import Relay

    torch.manual_seed(11)
    local = Net(residual_spec(probe=False))
    remote = twin(local)
    trainer(epochs=1).fit(local, data())
    relay = Relay(pool[1], delay=0.05)
    try:
        strategy = RemoteModelParallelStrategy(hosts=[pool[0], relay.address], balance=[4, 6], microbatches=2)
        trainer(strategy, epochs=1).fit(remote, data())
    finally:
        relay.close()
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)


def test_the_strategy_name_works_whatever_the_import_order():
    """``import lightning_remote_mp`` before ``import lightning`` used to leave "remote_mp" unregistered;
    the worker's own imports must still not pull Lightning in."""
    import subprocess
    import sys

    program = (
        "import lightning_remote_mp, sys\n"
        "assert 'lightning' not in sys.modules\n"
        "import lightning as L\n"
        "t = L.Trainer(strategy='remote_mp', logger=False, enable_progress_bar=False)\n"
        "print(type(t.strategy).__name__)\n"
        "import lightning_remote_mp.worker.server\n"
        "import os; sys.stdout.flush(); os._exit(0)  # skips the slow teardown of Lightning's modules (1-2 s)\n"
    )
    worker_program = "import lightning_remote_mp.worker.cli, sys; print('lightning' in sys.modules)"
    # Both at once: each is mostly a fresh interpreter importing torch.
    procs = [
        subprocess.Popen([sys.executable, "-c", p], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for p in (program, worker_program)
    ]
    (out, err), (worker_out, worker_err) = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0, err
    assert out.strip() == "RemoteModelParallelStrategy"
    assert worker_out.strip() == "False", worker_err
