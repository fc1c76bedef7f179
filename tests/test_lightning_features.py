"""Trainer features through remote stages, each compared with a local run of the same module."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BaseFinetuning, ModelSummary, RichModelSummary, StochasticWeightAveraging
from test_strategy import Net, assert_same_losses, assert_same_weights, data, residual_spec, trainer
from torch import nn

from lightning_remote_mp import RemoteModelParallelStrategy
from lightning_remote_mp.errors import LrmpError


def run_both(make, twin, pool, epochs: int = 2, strategy_kwargs=None, **trainer_kwargs):
    torch.manual_seed(11)
    local = make()
    remote = twin(local)
    trainer(epochs=epochs, **trainer_kwargs).fit(local, data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], **(strategy_kwargs or {"balance": [4, 8]}))
    trainer(strategy, epochs=epochs, **trainer_kwargs).fit(remote, data())
    assert_same_losses(local.losses, remote.losses)
    assert_same_weights(local, remote)
    return local, remote


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_spans_every_stage(twin, algorithm, pool):
    # A small clip value so that clipping changes every step; the local head's gradients count too.
    run_both(
        lambda: Net(residual_spec(), lr=1e-2, local_head=True),
        twin,
        pool,
        gradient_clip_val=0.05,
        gradient_clip_algorithm=algorithm,
    )


def test_gradient_accumulation(twin, pool):
    run_both(lambda: Net(residual_spec()), twin, pool, accumulate_grad_batches=3)


class EpochScheduled(Net):
    def configure_optimizers(self):
        opt = torch.optim.SGD(
            [
                {"params": self.net.layers[:6].parameters(), "lr": 0.1},
                {"params": self.net.layers[6:].parameters(), "lr": 0.02, "momentum": 0.9},
            ],
            lr=0.05,
        )
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1, 2], gamma=0.3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "epoch"}}


def test_per_epoch_scheduler_and_param_groups(twin, pool):
    run_both(lambda: EpochScheduled(residual_spec()), twin, pool, epochs=3)


class TwoOptimizersManual(Net):
    """Manual optimization: two optimizers over different stages, user-driven zero_grad and clipping."""

    def __init__(self, spec):
        super().__init__(spec, local_head=True)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        loss = nn.functional.binary_cross_entropy(self(x), y)
        self.losses.append(loss.item())
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(first, gradient_clip_val=0.1, gradient_clip_algorithm="norm")
        first.step()
        if batch_idx % 2 == 0:  # the second steps every other batch: its gradients accumulate meanwhile
            second.step()

    def configure_optimizers(self):
        first = torch.optim.Adam(list(self.head.parameters()) + list(self.net.layers[:5].parameters()), lr=1e-2)
        second = torch.optim.SGD(self.net.layers[5:].parameters(), lr=0.05, momentum=0.5)
        return [first, second]


def test_manual_optimization_with_two_optimizers(twin, pool):
    run_both(lambda: TwoOptimizersManual(residual_spec()), twin, pool)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_bf16_precision(twin, precision, pool):
    run_both(lambda: Net(residual_spec()), twin, pool, precision=precision)


def test_16_mixed_is_refused_at_setup():
    from lightning.pytorch.plugins import MixedPrecision

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(LrmpError, match="GradScaler"):
        trainer(RemoteModelParallelStrategy(), plugins=[plugin]).fit(Net(residual_spec()), data())


def test_frozen_layers_stay_frozen_on_workers(twin, pool):
    def make():
        net = Net(residual_spec())
        net.net.layers[0].requires_grad_(False)
        return net

    local, remote = run_both(make, twin, pool)
    torch.manual_seed(11)
    assert torch.equal(make().net.layers[0].weight, remote.net.layers[0].weight)


class FreezeFirst(BaseFinetuning):
    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.net.layers[0])

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.net.layers[0], optimizer)


@pytest.mark.parametrize(
    "callback", [StochasticWeightAveraging(swa_lrs=1e-2), FreezeFirst()], ids=["swa", "finetuning"]
)
def test_callbacks_that_need_local_parameters_are_refused(callback):
    with pytest.raises(LrmpError, match=f"{type(callback).__name__} is not supported"):
        trainer(RemoteModelParallelStrategy(), callbacks=[callback]).fit(Net(residual_spec()), data())


def test_model_summary_shows_remote_layers_and_where_they_live(caplog, pool):
    model = Net(residual_spec(), local_head=True)
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], balance=[4, 8])
    with caplog.at_level("INFO", logger="lightning.pytorch.callbacks.model_summary"):
        trainer(strategy, epochs=1, callbacks=[ModelSummary(max_depth=3)]).fit(model, data())
    text = caplog.text
    assert "Where" in text and "driver" in text
    assert "stage 0 @ tcp://127.0.0.1:" in text and "stage 1 @ tcp://127.0.0.1:" in text
    total = sum(p.numel() for p in model.parameters())
    assert "Total params" in text and str(total) in text.replace(",", "") or f"{total / 1000:.1f} K" in text


def test_the_rich_model_summary_says_where_the_layers_live_too(caplog, pool):
    """Lightning's default summary where rich is installed lays out only the columns it knows: the
    strategy uses its own plain one instead, with the Where column."""
    pytest.importorskip("rich")
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], balance=[4, 8])
    with caplog.at_level("INFO", logger="lightning.pytorch.callbacks.model_summary"):
        trainer(strategy, epochs=1, callbacks=[RichModelSummary(max_depth=3)]).fit(Net(residual_spec()), data())
    summary = "\n".join(r.getMessage() for r in caplog.records if r.name.endswith("model_summary"))
    assert "Where" in summary and "stage 1 @ tcp://127.0.0.1:" in summary


class FindsLR(Net):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_lr_find_restores_the_model_and_training_continues(twin, pool, tmp_path, state_dict_type):
    """The Tuner saves a checkpoint, tries rates, and restores it into the placed workers: a sharded
    one is sent to them from its files."""
    from lightning.pytorch.tuner import Tuner

    torch.manual_seed(12)
    model = FindsLR(residual_spec())
    before = twin(model)
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], state_dict_type=state_dict_type)
    t = trainer(strategy, epochs=1, default_root_dir=tmp_path)
    finder = Tuner(t).lr_find(
        model,
        train_dataloaders=data(n=640),
        min_lr=1e-4,
        max_lr=1.0,
        num_training=16,
        early_stop_threshold=None,
        update_attr=True,
        attr_name="lr",
    )
    assert finder is not None and len(finder.results["lr"]) == 16
    assert finder.suggestion() is not None and model.lr == finder.suggestion()
    # The tuner's trial steps were undone on the workers too: the weights are the starting ones.
    assert_same_weights(before, model)
    # And a normal fit with the suggested rate equals a local one.
    local = twin(before)
    local.lr = model.lr
    model.losses.clear()
    trainer(epochs=1).fit(local, data())
    trainer(RemoteModelParallelStrategy(hosts=pool[2:]), epochs=1).fit(model, data())
    assert_same_losses(local.losses, model.losses)


def test_registered_as_remote_mp():
    t = L.Trainer(strategy="remote_mp", accelerator="cpu", logger=False)
    assert isinstance(t.strategy, RemoteModelParallelStrategy)


class RawOptimizerManual(Net):
    """Manual optimization on the optimizer object itself (no LightningOptimizer): the user's own
    ``step``/``zero_grad`` calls, gradients accumulated over two batches, a scheduler stepped by hand."""

    def __init__(self, spec):
        super().__init__(spec, local_head=True)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers(use_pl_optimizer=False)
        x, y = batch
        loss = nn.functional.binary_cross_entropy(self(x), y)
        self.losses.append(loss.item())
        self.manual_backward(loss)
        if batch_idx % 2 == 1:
            opt.step()
            opt.zero_grad()
            self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.5)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]


def test_manual_optimization_on_the_raw_optimizer(twin, pool):
    local, remote = run_both(lambda: RawOptimizerManual(residual_spec()), twin, pool)
    # After the fit, the wrapper Lightning built during it works locally again.
    remote.optimizers().zero_grad()
