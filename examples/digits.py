"""Classify scikit-learn's handwritten digits with an MLP split across two lrmp workers.

    python examples/digits.py                                  # two local workers, started for you
    python examples/digits.py --hosts tcp://10.0.0.5:5555 tcp://10.0.0.6:5555   # workers you started

The data is ``sklearn.datasets.load_digits``: 1,797 8x8 grey-level images of the digits 0-9, shipped
with scikit-learn (nothing is downloaded). A 64-256-256-10 MLP reaches about 97% validation accuracy
in 15 epochs; the accuracy is a torchmetrics metric logged through Lightning as ``val_acc``.

Compared with PyTorch's model-parallel tutorial ("Single-Machine Model Parallel Best Practices"):
there, the model places its layers by hand and moves activations between devices in ``forward``::

    class ToyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net1 = nn.Linear(10, 10).to("cuda:0")
            self.relu = nn.ReLU()
            self.net2 = nn.Linear(10, 5).to("cuda:1")

        def forward(self, x):
            x = self.relu(self.net1(x.to("cuda:0")))
            return self.net2(x.to("cuda:1"))

Here the MLP is written once, as a layer spec with no device in it, and trains as it is on one
machine. The strategy places the layers (``balance=[2, 3]``: layers 0-1 on the first worker, 2-4
on the second, like net1 + relu and net2 above), moves activations and gradients between the
workers and mirrors the optimizer (and its learning-rate schedule) onto them. The workers can be
processes on this machine, GPUs of one box (``LocalWorkerOptions.devices``) or separate machines (``--hosts``).
The metric, the loss and everything outside the ``SpecSequential`` run in this process (the driver).
"""

from __future__ import annotations

import argparse
import logging
import warnings
from collections.abc import Sequence

import lightning as L
import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

from lightning_remote_mp import RemoteModelParallelStrategy, SpecSequential


def mlp_spec(hidden: int = 256, batch: int = 64) -> list[tuple[str, dict, tuple[int, ...]]]:
    """The MLP as a layer spec: ``(layer, kwargs, example input shape)`` per layer, no device anywhere."""
    return [
        ("torch.nn.Linear", {"in_features": 64, "out_features": hidden}, (batch, 64)),
        ("torch.nn.ReLU", {}, (batch, hidden)),
        ("torch.nn.Linear", {"in_features": hidden, "out_features": hidden}, (batch, hidden)),
        ("torch.nn.ReLU", {}, (batch, hidden)),
        ("torch.nn.Linear", {"in_features": hidden, "out_features": 10}, (batch, hidden)),
    ]


class DigitsClassifier(L.LightningModule):
    def __init__(self, hidden: int = 256, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.mlp = SpecSequential(mlp_spec(hidden))  # its layers run on the workers
        self.val_acc = torchmetrics.Accuracy(task="multiclass", num_classes=10)  # stays on the driver

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y))
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        optimizer = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        # The workers' optimizers follow the schedule too: they step with the driver's current lr.
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_epochs)
        return {"optimizer": optimizer, "lr_scheduler": scheduler}


def digits_loaders(batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    """Train and validation loaders over scikit-learn's bundled digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0  # pixel values are 0..16
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return (
        DataLoader(TensorDataset(x[train], y[train]), batch_size=batch_size, shuffle=True),
        DataLoader(TensorDataset(x[val], y[val]), batch_size=256),
    )


def main(
    epochs: int = 15, hosts: Sequence[str] | None = None, seed: int = 0, progress_bar: bool = False
) -> dict[str, float]:
    """Train, and return the last validation metrics (``val_acc``, ``val_loss``) and ``train_loss``."""
    L.seed_everything(seed, verbose=False)
    train, val = digits_loaders(seed=seed)
    model = DigitsClassifier()
    # hosts=None starts two local workers (the default local_workers); balance: layers per stage, the
    # MLP's 5 layers split 2 + 3.
    strategy = RemoteModelParallelStrategy(hosts=list(hosts) if hosts else None, balance=[2, 3])
    trainer = L.Trainer(
        strategy=strategy,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, train, val)
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", nargs="+", metavar="ADDR", help="worker addresses (default: 2 local workers)")
    parser.add_argument("--epochs", type=int, default=15)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # Lightning's banner, but
    logging.getLogger("lightning_remote_mp").setLevel(logging.INFO)  # still where the layers went
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    metrics = main(epochs=args.epochs, hosts=args.hosts, progress_bar=True)
    print(f"validation accuracy {metrics['val_acc']:.1%}  (loss {metrics['val_loss']:.3f})")
