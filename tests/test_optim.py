"""The optimizer mirror: every torch.optim class (and a user-defined one) steps the workers' share
exactly as it steps a local model."""

from __future__ import annotations

from collections.abc import Callable

import lrmp_testlayers
import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_remote_mp import LrmpError, SpecSequential
from lightning_remote_mp.driver.session import DriverSession

WIDTH = 8
SPEC = [("torch.nn.Linear", {"in_features": WIDTH, "out_features": WIDTH, "bias": False}, (4, WIDTH))] * 2 + [
    ("torch.nn.Tanh", {}, (4, WIDTH)),
    ("torch.nn.Linear", {"in_features": WIDTH, "out_features": WIDTH, "bias": False}, (4, WIDTH)),
]

#: Constructor arguments where a class's defaults would not exercise it (or need something special).
KWARGS: dict[str, dict] = {
    "SGD": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "AdamW": {"lr": 0.01, "weight_decay": 0.1},
    "Adam": {"lr": 0.01, "amsgrad": True},
    "Muon": {"lr": 0.02},
    "Adafactor": {"lr": 0.01},
}
SKIPPED = {
    "LBFGS": "re-evaluates the model through a closure: refused, tested below",
    "SparseAdam": "needs sparse gradients (Embedding(sparse=True)), which this dense model has none of",
}
OPTIMIZERS = sorted(
    (name, cls)
    for name, cls in vars(torch.optim).items()
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
)


def _train(net: SpecSequential, opt: torch.optim.Optimizer, steps: int = 3) -> list[float]:
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, WIDTH)
        loss = net(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _params(net: SpecSequential) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("name,cls", OPTIMIZERS, ids=[n for n, _ in OPTIMIZERS])
def test_every_torch_optimizer_is_mirrored_exactly(name, cls, pool, twin):
    if name in SKIPPED:
        pytest.skip(SKIPPED[name])
    local = SpecSequential(SPEC, init_seed=0)
    remote = twin(local)
    kwargs = KWARGS.get(name, {})
    local_losses = _train(local, cls(local.parameters(), **kwargs))
    session = DriverSession(pool[:2])
    try:
        session.place("net", remote)
        opt = cls(remote.parameters(), **kwargs)
        session.mirror_optimizer(0, opt)
        remote_losses = _train(remote, opt)
        state = opt.state_dict()
        session.restore()
    finally:
        session.close()
    assert remote_losses == pytest.approx(local_losses, rel=1e-5, abs=1e-6)
    for k, v in _params(local).items():
        torch.testing.assert_close(_params(remote)[k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
    assert len(state["state"]) == 3, f"{name}: the workers' optimizer state did not come back"


def test_a_user_defined_optimizer_is_mirrored(pool, twin):
    local = SpecSequential(SPEC, init_seed=0)
    remote = twin(local)
    local_losses = _train(local, lrmp_testlayers.SignSGD(local.parameters(), lr=0.01))
    session = DriverSession(pool[:2])
    try:
        session.place("net", remote)
        opt = lrmp_testlayers.SignSGD(remote.parameters(), lr=0.01)
        session.mirror_optimizer(0, opt)
        remote_losses = _train(remote, opt)
        steps = [s["steps"] for s in opt.state_dict()["state"].values()]
        session.restore()
    finally:
        session.close()
    assert remote_losses == pytest.approx(local_losses, rel=1e-6)
    assert steps == [3, 3, 3]
    for k, v in _params(local).items():
        torch.testing.assert_close(_params(remote)[k], v)


def test_lbfgs_is_refused_with_the_reason(pool):
    net = SpecSequential(SPEC, init_seed=0)
    session = DriverSession(pool[:2])
    try:
        session.place("net", net)
        with pytest.raises(LrmpError, match=r"optimizer 0 \(LBFGS\) cannot be mirrored: LBFGS re-evaluates"):
            session.mirror_optimizer(0, torch.optim.LBFGS(net.parameters()))
    finally:
        session.close()


def _train_accumulating(net: SpecSequential, opt, sched, zero_grad: Callable[[], None], steps: int = 6) -> list[float]:
    """Gradients accumulated over two batches, the scheduler stepped after each optimizer step."""
    torch.manual_seed(1)
    losses = []
    for i in range(steps):
        loss = net(torch.randn(4, WIDTH)).pow(2).mean()
        loss.backward()
        if i % 2:
            opt.step()
            zero_grad()
            sched.step()
        losses.append(loss.item())
    return losses


def _sgd_with_scheduler(net: SpecSequential) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def test_scheduler_built_before_the_mirror_and_lightnings_wrapper_reach_the_workers(pool, twin):
    # The two callers optim.py's docstring gives as the reasons for its mechanisms: a scheduler
    # replaces opt.step on the instance (so step is a hook), and LightningOptimizer finds zero_grad
    # on the class (so the class is swapped, before the wrapper is built).
    local = SpecSequential(SPEC, init_seed=0)
    remote = twin(local)
    opt, sched = _sgd_with_scheduler(local)
    local_losses = _train_accumulating(local, opt, sched, opt.zero_grad)
    opt, sched = _sgd_with_scheduler(remote)  # the scheduler wraps opt.step before the mirror exists
    session = DriverSession(pool[:2])
    try:
        session.place("net", remote)
        session.mirror_optimizer(0, opt)
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
        wrapper = LightningOptimizer(opt)
        remote_losses = _train_accumulating(remote, opt, sched, wrapper.zero_grad)
        session.restore()
    finally:
        session.close()
    assert type(opt) is torch.optim.SGD
    assert remote_losses == pytest.approx(local_losses, rel=1e-6)
    for k, v in _params(local).items():
        torch.testing.assert_close(_params(remote)[k], v)
    # A wrapper built during the session zeroes locally once the session is over.
    remote.layers[0].weight.grad = torch.ones_like(remote.layers[0].weight)
    wrapper.zero_grad()
    assert remote.layers[0].weight.grad is None
