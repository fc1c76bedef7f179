"""Data parallel over pipelines: replicas of the same stages, gradients all-reduced through torch.distributed."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from test_strategy import (
    Net,
    _fit_with_checkpoint,
    _KillAt,
    assert_same_losses,
    assert_same_weights,
    data,
    probe_pids,
    residual_spec,
    trainer,
)

from lightning_remote_mp import LocalWorkerOptions, RemoteModelParallelStrategy, WorkerLostError


def test_two_replicas_of_two_stages_train_like_local(pool, twin):
    torch.manual_seed(21)
    local = Net(residual_spec(), local_head=True, lr=1e-2)
    remote = twin(local)
    # 100 samples, batch 31: batches of 31 split 16 + 15 between replicas (uneven), the last of 7 splits 4 + 3.
    trainer(epochs=2, gradient_clip_val=0.5).fit(local, data(batch_size=31))
    a = pool
    strategy = RemoteModelParallelStrategy(hosts=[[a[0], a[1]], [a[2], a[3]]], balance=[4, 8], microbatches=2)
    trainer(strategy, epochs=2, gradient_clip_val=0.5).fit(remote, data(batch_size=31))
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)
    assert os.getpid() not in probe_pids(remote)


def test_replicas_sum_their_gradients_in_the_carried_step_even_when_one_gets_no_share(pool, twin):
    """Without clipping, the replicas' gradients are summed by the step itself, which travels with the
    next batch's micro-batches (`Carry`). The last batch (100 = 3 x 33 + 1) has one sample: the second
    replica gets no share and no micro-batch, so its step goes to it straight with the first's
    (`Connection.carry`'s ``linked``), or the first replica's step would wait for it in the sum (it
    fails, after gloo's timeout, when they are not linked)."""
    torch.manual_seed(24)
    local = Net(residual_spec(), lr=1e-2)
    remote = twin(local)
    trainer(epochs=2).fit(local, data(batch_size=33))
    a = pool
    strategy = RemoteModelParallelStrategy(hosts=[[a[0], a[1]], [a[2], a[3]]], balance=[4, 8], microbatches=2)
    trainer(strategy, epochs=2).fit(remote, data(batch_size=33))
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)


def test_checkpoint_holds_one_copy_and_resumes_with_another_replica_count(pool, tmp_path, twin):
    torch.manual_seed(22)
    base = Net(residual_spec(probe=False))
    straight = twin(base)
    trainer(epochs=3).fit(straight, data())
    a = pool
    two = RemoteModelParallelStrategy(hosts=[[a[0], a[1]], [a[2], a[3]]], balance=[5, 5])
    model = twin(base)
    ckpt = _fit_with_checkpoint(model, two, 2, tmp_path)
    state = torch.load(ckpt, weights_only=True)
    assert state["state_dict"].keys() == base.state_dict().keys()
    assert len(state["optimizer_states"][0]["state"]) == len(list(base.parameters()))
    one = RemoteModelParallelStrategy(hosts=[a[1], a[3]], balance=[5, 5])  # a single pipeline now
    resumed = twin(base)
    trainer(one, epochs=3).fit(resumed, data(), ckpt_path=ckpt)
    assert_same_weights(straight, resumed)
    assert_same_losses(straight.losses[-4:], resumed.losses)


def test_lost_replica_worker_is_named_with_its_replica(start_workers):
    workers = start_workers(2)
    a = workers.addresses
    strategy = RemoteModelParallelStrategy(hosts=[[a[0]], [a[1]]], heartbeat_timeout=2.0)  # 2 one-stage replicas
    killer = _KillAt(lambda t: workers.procs[1].pid, step=1, sig=signal.SIGKILL)
    with pytest.raises(WorkerLostError) as info:
        trainer(strategy, epochs=1, callbacks=[killer]).fit(Net(residual_spec(probe=False)), data())
    assert a[1] in str(info.value) and "stage 0, replica 1" in str(info.value)
    assert (info.value.address, info.value.stage, info.value.replica) == (a[1], 0, 1)


def test_local_default_can_run_replicas(twin):
    torch.manual_seed(23)
    local = Net(residual_spec(probe=False))
    remote = twin(local)
    trainer(epochs=1).fit(local, data())
    # Two local workers forming two one-stage pipelines.
    strategy = RemoteModelParallelStrategy(local_workers=LocalWorkerOptions(count=2), replicas=2, balance=[10])
    trainer(strategy, epochs=1).fit(remote, data())
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)


def test_replica_rows_must_match():
    from lightning_remote_mp.errors import LrmpError

    with pytest.raises(LrmpError, match="same number of stages"):
        RemoteModelParallelStrategy(hosts=[["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"]])
    with pytest.raises(LrmpError, match="repeat"):
        RemoteModelParallelStrategy(hosts=[["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:1", "127.0.0.1:4"]])


def test_timeline_has_a_row_per_replica_and_stage(pool, tmp_path):
    import json

    from lightning_remote_mp.wire.addresses import normalize_address

    torch.manual_seed(24)
    hosts = [[pool[0], pool[1]], [pool[2], pool[3]]]
    path = tmp_path / "trace.json"
    strategy = RemoteModelParallelStrategy(hosts=hosts, balance=[4, 6], microbatches=2, timeline=str(path))
    t = trainer(strategy, epochs=1)
    t.fit(Net(residual_spec(probe=False)), data())

    events = json.loads(path.read_text())["traceEvents"]
    rows = {e["args"]["name"]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    expected = {f"net replica {r} stage {s} @ {normalize_address(hosts[r][s])}" for r in range(2) for s in range(2)}
    assert set(rows) == expected | {"driver"}
    spans = [e for e in events if e["ph"] == "X"]
    for name in expected:
        mine = [e for e in spans if e["pid"] == rows[name]]
        # 4 steps (the short last batch of 4 splits too), each replica's share in 2 micro-batches.
        assert sum(e["cat"] == "forward" for e in mine) == 4 * 2, name
        assert sum(e["cat"] == "backward" for e in mine) == 4 * 2, name
        assert any(e["cat"] == "transfer" for e in mine), name  # stage 1 gets activations, stage 0 gradients
    assert not [e for e in spans if e["pid"] == rows["driver"] and e["cat"] != "step"]
    assert 0.0 < t.callback_metrics["lrmp/bubble_fraction_epoch"].item() < 1.0
