"""Type-checked, never run: the public API used the way users write it (`.ci/run` runs mypy on this
file; the package ships ``py.typed``). A change that breaks a user's type checks fails CI here."""

from __future__ import annotations

import lightning as L
import torch

import lightning_remote_mp as lrmp
from lightning_remote_mp import (
    ConfigurationError,
    CurveOptions,
    LocalWorkerOptions,
    RecoveryOptions,
    RemoteModelParallelStrategy,
    SpecSequential,
    WorkerError,
    WorkerLostError,
)


def zero_config() -> L.Trainer:
    return L.Trainer(strategy=RemoteModelParallelStrategy(), max_steps=1)


def configured(hosts: list[str]) -> RemoteModelParallelStrategy:
    local = RemoteModelParallelStrategy(
        local_workers=LocalWorkerOptions(count=4, devices=["cpu"] * 4, threads=1),
        replicas=2,
        microbatches=4,
        checkpoint="except_last",
        deferred_batch_norm=True,
        balance="time",
        split_backward="auto",
    )
    remote = RemoteModelParallelStrategy(
        hosts,
        curve=CurveOptions(secret_key="driver.key_secret", worker_public_keys=["w.key"]),
        balance={"net": [2, 2]},
        call_timeout=None,
        split=["model"],
    )
    recovering = RemoteModelParallelStrategy(hosts, recovery=RecoveryOptions(spares=["gpu-c:5555"], wait=30.0))
    assert RemoteModelParallelStrategy(recovery=True).recovery == RecoveryOptions()
    return local if remote.hosts is None else recovering


def spec() -> SpecSequential:
    net = SpecSequential(
        [
            ("torch.nn.Linear", {"in_features": 4, "out_features": 8}, (2, 4)),
            ("torch.nn.ReLU", {}, (2, 8)),
        ]
    )
    y: torch.Tensor = net(torch.ones(2, 4))
    assert y.shape[0] == 2 and net.is_remote is False
    return net


def errors(trainer: L.Trainer, model: L.LightningModule) -> str:
    try:
        trainer.fit(model)
    except WorkerLostError as err:
        return f"{err.where}: {err.address} stage {err.stage} replica {err.replica}"
    except WorkerError as err:
        layer: int | None = err.layer
        return f"{err.remote_type} at layer {layer}: {err.remote_message}"
    except ConfigurationError as err:
        return str(err)
    return lrmp.__version__
