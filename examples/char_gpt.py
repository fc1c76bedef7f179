"""A character-level GPT trained across lrmp workers, on a text that ships with Python.

    python examples/char_gpt.py                          # four local workers, started for you
    python examples/char_gpt.py --hosts tcp://10.0.0.5:5555 tcp://10.0.0.6:5555   # workers you started
    python examples/char_gpt.py --compression bf16       # activations travel as bfloat16 (slow links)

The text is the source of Python's own ``textwrap`` module (any installed Python has it; nothing is
downloaded). The model is a small decoder-only transformer written as a layer spec from torch.nn
and ``lightning_remote_mp.layers`` alone, so workers need no code of yours:

- ``nn.Embedding`` takes the integer character ids (the dry run at setup feeds it int64 ids);
- ``PositionalEmbedding`` adds learned positions;
- ``CausalMask`` passes the activations on and publishes the causal attention mask as the variable
  ``mask``;
- each ``nn.TransformerEncoderLayer`` entry says ``"dependencies": ["mask"]``, so it receives the mask
  as its second positional argument (``src_mask``) on whichever worker it lands: the mask travels
  from stage 0 to every stage that needs it;
- a ``LayerNorm`` and a ``Linear`` head give next-character logits.

With ``microbatches=4`` each batch flows through the stages in four pieces (pipelining). Training
uses AdamW, mirrored on every worker. At the end the trained model (local again) writes a sample.
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
import warnings
from collections.abc import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_remote_mp import LocalWorkerOptions, RemoteModelParallelStrategy, SpecSequential


def gpt_spec(vocab: int, dim: int = 64, heads: int = 4, blocks: int = 4, context: int = 64, batch: int = 32) -> list:
    """The decoder-only transformer as a layer spec (plain data: it could be YAML)."""
    shape = [batch, context, dim]
    block = {
        "layer": "torch.nn.TransformerEncoderLayer",
        "kwargs": {"d_model": dim, "nhead": heads, "dim_feedforward": 4 * dim, "dropout": 0.1, "batch_first": True},
        "input_shape": [shape, [context, context]],  # the main input, then the mask
        "dependencies": ["mask"],
    }
    return [
        {
            "layer": "torch.nn.Embedding",
            "kwargs": {"num_embeddings": vocab, "embedding_dim": dim},
            "input_shape": [batch, context],
        },
        {
            "layer": "lightning_remote_mp.layers.PositionalEmbedding",
            "kwargs": {"max_len": context, "dim": dim},
            "input_shape": shape,
        },
        {"layer": "lightning_remote_mp.layers.CausalMask", "kwargs": {}, "input_shape": shape},
        *[block] * blocks,
        {"layer": "torch.nn.LayerNorm", "kwargs": {"normalized_shape": dim}, "input_shape": shape},
        {"layer": "torch.nn.Linear", "kwargs": {"in_features": dim, "out_features": vocab}, "input_shape": shape},
    ]


class CharGPT(L.LightningModule):
    def __init__(self, vocab: int, context: int = 64, lr: float = 3e-3, blocks: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.gpt = SpecSequential(gpt_spec(vocab, context=context, blocks=blocks))
        self.losses: list[float] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt(ids)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, targets = batch
        logits = self(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        self.losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, length: int) -> torch.Tensor:
        """Greedy continuation of ``prompt`` (1-D character ids)."""
        self.eval()
        ids = prompt.clone()
        for _ in range(length):
            window = ids[-self.hparams.context :].unsqueeze(0)
            ids = torch.cat([ids, self(window)[0, -1].argmax().view(1)])
        return ids


def corpus() -> str:
    return inspect.getsource(textwrap)


def loaders(text: str, context: int = 64, batch: int = 32, windows: int = 2048, seed: int = 0):
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text])
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - context - 1, (windows,), generator=g)
    x = torch.stack([data[s : s + context] for s in starts])
    y = torch.stack([data[s + 1 : s + context + 1] for s in starts])
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, generator=g), chars


def main(
    steps: int = 200,
    hosts: Sequence[str] | None = None,
    workers: int = 4,
    seed: int = 0,
    progress_bar: bool = False,
    compression: str | None = None,
) -> tuple[CharGPT, str]:
    """Train for ``steps`` batches; return the (now local) model and a generated sample.

    ``compression``: ``None``, ``"bf16"`` or ``"int8"``: how activations and gradients travel
    (benchmarks/compression.py measures what each does to this model's loss curve).
    """
    L.seed_everything(seed, verbose=False)
    text = corpus()
    train, chars = loaders(text, seed=seed)
    model = CharGPT(vocab=len(chars), blocks=max(4, len(hosts or []) or workers))
    # Without hosts, `workers` local workers are started (and stopped after fit).
    local = None if hosts else LocalWorkerOptions(count=workers)
    strategy = RemoteModelParallelStrategy(
        hosts=list(hosts) if hosts else None, local_workers=local, microbatches=4, compression=compression
    )
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
    )
    trainer.fit(model, train)
    prompt = torch.tensor([chars.index(c) for c in "def "])
    sample = "".join(chars[int(i)] for i in model.generate(prompt, 120))
    return model, sample


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", nargs="+", metavar="ADDR", help="worker addresses (default: local workers)")
    parser.add_argument("--workers", type=int, default=4, help="local workers to start without --hosts")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--compression", choices=["bf16", "int8"], help="compress activations and gradients on the wire"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    model, sample = main(
        steps=args.steps, hosts=args.hosts, workers=args.workers, progress_bar=True, compression=args.compression
    )
    print(f"loss {sum(model.losses[:10]) / 10:.2f} -> {sum(model.losses[-10:]) / 10:.2f}")
    print("sample:\n" + sample)
