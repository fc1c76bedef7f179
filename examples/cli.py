"""A LightningCLI entry point: the residual model of ``residual_model.py`` on lrmp workers, set up from YAML.

    python examples/cli.py fit --config examples/configs/local.yaml        # two local workers, started for you
    python examples/cli.py validate --config examples/configs/local.yaml --ckpt_path PATH.ckpt
    python examples/cli.py fit --config examples/configs/multi_machine.yaml  # lrmp-workers you started
    python examples/cli.py fit --config examples/configs/local.yaml --print_config   # the merged config

The strategy is named in the config by ``class_path: lightning_remote_mp.RemoteModelParallelStrategy``
with its constructor arguments under ``init_args``; any of them can be overridden on the command line,
e.g. ``--trainer.strategy.init_args.local_workers.count 3`` or ``--trainer.strategy remote_mp`` (the registered
name, all defaults). LightningCLI needs ``jsonargparse[signatures]``: ``pip install -e ".[examples]"``.

The task is demo.py's: x is drawn from [0, 1) and its label is 1 on the bands [0, 0.25) and [0.5, 0.75).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # residual_model.py sits beside this file
from residual_model import residual_spec  # noqa: E402

import lightning_remote_mp  # noqa: E402,F401  (registers the "remote_mp" strategy name)
from lightning_remote_mp import SpecSequential  # noqa: E402


class ResidualClassifier(L.LightningModule):
    """The residual model as a SpecSequential (split across the workers), its metric on the driver.

    Args:
        width: hidden width of the residual model.
        lr: Adam's learning rate.
    """

    def __init__(self, width: int = 128, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = SpecSequential(residual_spec(width))
        # Modules outside any SpecSequential (this metric) stay on the driver.
        self.val_acc = torchmetrics.classification.BinaryAccuracy()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.binary_cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        p = self(x)
        self.log("val_loss", torch.nn.functional.binary_cross_entropy(p, y), prog_bar=True)
        self.val_acc(p, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class BandsDataModule(L.LightningDataModule):
    """Random points of [0, 1) labelled 1 on [0, 0.25) and [0.5, 0.75).

    Args:
        samples: training examples.
        val_samples: validation examples.
        batch_size: batch size of both loaders.
        seed: seed of the generated data.
    """

    def __init__(self, samples: int = 512, val_samples: int = 256, batch_size: int = 32, seed: int = 0) -> None:
        super().__init__()
        self.samples, self.val_samples, self.batch_size, self.seed = samples, val_samples, batch_size, seed

    def _dataset(self, n: int, offset: int) -> TensorDataset:
        g = torch.Generator().manual_seed(self.seed + offset)
        x = torch.rand(n, 1, generator=g)
        return TensorDataset(x, ((x % 0.5) < 0.25).float())

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(self.samples, 0), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._dataset(self.val_samples, 1), batch_size=self.batch_size)


def main(args: Sequence[str] | None = None, run: bool = True) -> LightningCLI:
    """Run the CLI on ``args`` (default: the command line) and return it (``cli.trainer``, ``cli.model``...)."""
    return LightningCLI(
        ResidualClassifier,
        BandsDataModule,
        args=list(args) if args is not None else None,
        run=run,
        # fit then validate into the same log folder rewrites its config.yaml instead of failing.
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main()
