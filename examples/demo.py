"""Train the DistributedTraining residual model split across two lrmp workers.

    python examples/demo.py                       # starts two local workers by itself
    python examples/demo.py --hosts tcp://10.0.0.5:5555 tcp://10.0.0.6:5555   # workers you started

The task, 1-D binary classification: x is drawn from [0, 1) and its label is 1 on the bands
[0, 0.25) and [0.5, 0.75). The mean training loss per epoch falls from about 0.65 towards 0.1.
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import lightning as L
import torch
from residual_model import residual_spec  # examples/ is on sys.path when this file runs as a script
from torch.utils.data import DataLoader, TensorDataset

from lightning_remote_mp import RemoteModelParallelStrategy, SpecSequential


class ResidualNet(L.LightningModule):
    def __init__(self, width: int = 512) -> None:
        super().__init__()
        self.net = SpecSequential(residual_spec(width))
        self._epoch_losses: list[float] = []
        self._started = time.monotonic()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.binary_cross_entropy(self(x), y)
        self._epoch_losses.append(loss.item())
        return loss

    def on_train_epoch_end(self) -> None:
        mean = sum(self._epoch_losses) / len(self._epoch_losses)
        took = time.monotonic() - self._started
        print(f"epoch {self.current_epoch + 1:2d}  mean loss {mean:.4f}  ({took:.1f} s elapsed)", flush=True)
        self._epoch_losses.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hosts",
        nargs="+",
        metavar="ADDR",
        help="worker addresses, one stage each, in order (default: start 2 local workers)",
    )
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=512, help="training examples (batches of 32)")
    args = parser.parse_args()

    # Keep Lightning's banner quiet, and still show where lrmp put the layers (its logger takes
    # Lightning's level unless it has its own).
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning_remote_mp").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")  # a Lightning/torch deprecation notice, not ours

    torch.manual_seed(0)
    x = torch.rand(args.samples, 1)
    y = ((x % 0.5) < 0.25).float()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

    model = ResidualNet()
    strategy = RemoteModelParallelStrategy(hosts=args.hosts)  # hosts=None: two local workers
    trainer = L.Trainer(
        strategy=strategy,
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)

    # After fit the trained weights are back in `model`, so it runs locally from here.
    with torch.no_grad():
        accuracy = ((model(x) > 0.5).float() == y).float().mean().item()
    print(f"training accuracy of the returned model: {accuracy:.1%}")


if __name__ == "__main__":
    main()
