"""What the driver refuses before any worker is contacted, and the placement decisions it makes
from the same dry run: each error names the layer (index and class) and says what to do."""

from __future__ import annotations

import importlib
import logging
import sys
import time

import lightning as L
import pytest
import torch
from torch import nn

from lightning_remote_mp import (
    LocalWorkerOptions,
    RemoteModelParallelStrategy,
    SpecError,
    SpecSequential,
    WorkerError,
)
from lightning_remote_mp.driver.preflight import preflight
from lightning_remote_mp.driver.session import DriverSession

# Nothing listens here: a check that contacted the workers would fail with a connection error instead.
NOWHERE = ["tcp://127.0.0.1:9", "tcp://127.0.0.1:10"]


class _Model(L.LightningModule):
    def __init__(self, net: SpecSequential) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _refused_at_setup(net: SpecSequential, **strategy) -> SpecError:
    strategy.setdefault("hosts", NOWHERE)
    strategy.setdefault("connect_timeout", 60)
    trainer = L.Trainer(
        strategy=RemoteModelParallelStrategy(**strategy),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 4)), batch_size=4)
    started = time.monotonic()
    with pytest.raises(SpecError) as info:
        trainer.fit(_Model(net), data)
    assert time.monotonic() - started < 10, "refused only after trying to reach the workers"
    return info.value


def test_a_kwarg_that_cannot_travel_is_named_before_workers_are_contacted():
    spec = [
        ("torch.nn.Linear", {"in_features": 4, "out_features": 4}, (2, 4)),
        ("lightning_remote_mp.layers.Add", {"projection": nn.Linear(4, 4)}, (2, 4)),
    ]
    err = _refused_at_setup(SpecSequential(spec))
    text = str(err)
    assert "SpecSequential 'net', layer 1 (Add): kwarg 'projection'" in text
    assert "{'object': 'dotted.Path', 'kwargs'" in text


def test_the_same_kwarg_as_plain_data_is_built_on_both_sides():
    spec = [
        ("torch.nn.Linear", {"in_features": 4, "out_features": 4}, (2, 4)),
        (
            "lightning_remote_mp.layers.Add",
            {"projection": {"object": "torch.nn.Linear", "kwargs": {"in_features": 4, "out_features": 4}}},
            (2, 4),
        ),
    ]
    net = SpecSequential(spec)
    assert isinstance(net.layers[1].projection, nn.Linear)
    preflight(net)


def test_a_wrong_input_shape_names_both_layers_even_with_balance_time():
    spec = [
        ("torch.nn.Linear", {"in_features": 4, "out_features": 8}, (2, 4)),
        ("torch.nn.ReLU", {}, (2, 8)),
        ("torch.nn.Linear", {"in_features": 6, "out_features": 1}, (2, 6)),
    ]
    err = _refused_at_setup(SpecSequential(spec), balance="time")
    assert "layer 2 (Linear) declares input_shape (2, 6), but layer 1 (ReLU) produces (2, 8)" in str(err)


def test_a_layer_returning_a_tuple_is_named_with_the_fix():
    lstm = {"layer": "torch.nn.LSTM", "kwargs": {"input_size": 4, "hidden_size": 8, "batch_first": True}}
    head = ("torch.nn.Linear", {"in_features": 8, "out_features": 1}, (2, 3, 8))
    with pytest.raises(
        SpecError, match=r"layer 1 \(Linear\) fails on a tuple, what layer 0 \(LSTM\) returns.*'output': 0"
    ):
        preflight(SpecSequential([{**lstm, "input_shape": (2, 3, 4)}, head]))
    # Picking the output tensor fixes it, remotely and locally alike.
    net = SpecSequential([{**lstm, "input_shape": (2, 3, 4), "output": 0}, head])
    preflight(net)
    assert net(torch.zeros(2, 3, 4)).shape == (2, 3, 1)


def test_a_last_layer_returning_a_tuple_is_refused():
    lstm = {"layer": "torch.nn.LSTM", "kwargs": {"input_size": 4, "hidden_size": 8}, "input_shape": (2, 3, 4)}
    with pytest.raises(SpecError, match=r"layer 1 \(LSTM\), the last, returns a tuple"):
        preflight(SpecSequential([("torch.nn.Identity", {}, (2, 3, 4)), lstm]))


def test_tied_weights_are_refused():
    spec = [
        ("torch.nn.Embedding", {"num_embeddings": 10, "embedding_dim": 4}, (2, 3)),
        ("torch.nn.Linear", {"in_features": 4, "out_features": 10, "bias": False}, (2, 3, 4)),
    ]
    net = SpecSequential(spec)
    net.layers[1].weight = net.layers[0].weight
    err = _refused_at_setup(net)
    assert "layer 0 (Embedding) 'weight' and layer 1 (Linear) 'weight' are the same parameter" in str(err)


def test_a_class_from_main_is_refused():
    cls = type("Mine", (nn.Identity,), {"__module__": "__main__"})
    with pytest.raises(SpecError, match=r"layer 0 \(Mine\) uses Mine, defined in __main__"):
        preflight(SpecSequential([(cls, {}, (2, 4))]))


def test_more_workers_than_layers_is_refused_before_any_worker_starts():
    net = SpecSequential([("torch.nn.Linear", {"in_features": 4, "out_features": 4}, (2, 4))] * 3)
    err = _refused_at_setup(net, hosts=None, local_workers=LocalWorkerOptions(count=4))
    assert "has 3 layers but there are 4 stages" in str(err)


def test_a_stage_that_cannot_fit_its_worker_is_refused_at_placement(pool):
    big = [("torch.nn.Linear", {"in_features": 200_000, "out_features": 200_000}, (8, 200_000))]
    net = SpecSequential([*big, ("torch.nn.ReLU", {}, (8, 200_000))], init_seed=0, device="meta")
    session = DriverSession(pool[:2])
    try:
        with pytest.raises(SpecError) as info:
            session.place("net", net)
        assert not net.is_remote
    finally:
        session.close()
    text = str(info.value)
    assert "stage 0 (layers 0-0) needs about 596.1 GiB" in text and f"worker {pool[0]} (stage 0) has" in text
    assert "Add workers" in text and "meta device saves the driver's memory, not the workers'" in text


def test_the_default_split_gives_every_stage_compute(pool, caplog):
    """PyTorch's model-parallel tutorial MLP: splitting by memory alone put only Flatten on stage 0."""
    spec = [
        ("torch.nn.Flatten", {}, (64, 1, 28, 28)),
        ("torch.nn.Linear", {"in_features": 784, "out_features": 200}, (64, 784)),
        ("torch.nn.LogSoftmax", {"dim": 1}, (64, 200)),
        ("torch.nn.Linear", {"in_features": 200, "out_features": 10}, (64, 200)),
    ]
    session = DriverSession(pool[:2])
    try:
        with caplog.at_level(logging.INFO, logger="lightning_remote_mp"):
            stages = session.plan(SpecSequential(spec))
    finally:
        session.close()
    assert [len(s.layer_indices) for s in stages] == [2, 2]
    assert "evens out the estimated compute" in caplog.text and "GFLOP" in caplog.text


def test_a_long_lived_worker_with_older_layer_code_is_refused(start_workers, tmp_path, monkeypatch):
    module = "lrmp_stale_layers"
    source = tmp_path / f"{module}.py"
    body = "import torch\n\nclass Scale(torch.nn.Module):\n    def forward(self, x):\n        return x * {}\n"
    source.write_text(body.format(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module(module)
    workers = start_workers(2, allow_modules=(module,))
    spec = [(f"{module}.Scale", {}, (2, 4))] * 2
    session = DriverSession(workers.addresses)
    try:
        session.place("net", SpecSequential(spec))  # the workers import version 1
    finally:
        session.close()
    source.write_text(body.format(2))
    importlib.reload(sys.modules[module])
    session = DriverSession(workers.addresses)
    try:
        with pytest.raises(WorkerError) as info:
            session.place("net", SpecSequential(spec))
    finally:
        session.close()
    text = str(info.value)
    assert f"worker {workers.addresses[0]}" in text and f"runs another version of {module}" in text
    assert "restart this worker" in text
