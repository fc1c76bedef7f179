"""HuggingFace's GPT-2, unchanged, trained split across two lrmp workers by tracing it.

    python examples/hf_gpt2.py                               # two local workers, started for you
    python examples/hf_gpt2.py --split-at transformer.h.1    # stage 1 starts at the second block
    python examples/hf_gpt2.py --hosts tcp://10.0.0.5:5555 tcp://10.0.0.6:5555   # workers you started
    python examples/hf_gpt2.py --compression bf16            # activations travel as bfloat16 (slow links)

The LightningModule holds a plain ``transformers.GPT2LMHeadModel`` as ``self.model``; nothing in it is
written for lrmp. ``RemoteModelParallelStrategy(split=["model"])`` traces it with ``torch.export`` at
its first call (in train and in eval mode), cuts the graph at module boundaries into units
(``transformer.wte``, ``transformer.wpe``, ``transformer.drop``, ``transformer.h.0`` ...
``transformer.h.3``, ``transformer.ln_f``, ``lm_head``: the placement log lists them) and ships each
stage's units to its worker as programs of ATen operators. The workers run no code of this script and
need no ``transformers`` (this script does: ``pip install -e ".[hf]"``). ``training_step`` calls
``self.model(ids, labels=ids).loss``, the loss inside the model, as HuggingFace fine-tuning does.

The config is transformers' own, but for the vocabulary, the size and dropout, so the two
settings that used to matter for splitting are left as transformers makes them:

- ``tie_word_embeddings`` (on): GPT-2 uses one matrix for the input embedding (``transformer.wte``, the
  first unit) and the output head (``lm_head``, the last unit). The two stages each hold a copy, and
  the copies sum their gradients before every optimizer step, so they stay one weight; after fit
  ``model.lm_head.weight is model.transformer.wte.weight`` still holds.
- ``use_cache`` (on): lrmp passes ``use_cache=False`` at every call, so no key/value cache is built
  (the output's ``past_key_values`` is ``None``).

With ``microbatches=2`` each micro-batch returns its loss as a sum and a count, and the driver divides
the totals: the whole batch's mean, as one local call computes it.

The data is the source of Python's own ``textwrap`` module as UTF-8 bytes (a vocabulary of 256), the
text ``char_gpt.py`` uses: a pure-Python module of the standard library, so every CPython install that
ships the library's sources has it, and nothing is downloaded.
``LICENSE.txt`` is not as safe a choice: it is not under ``sysconfig.get_paths()["stdlib"]`` on every
layout (Windows installs keep it beside ``python.exe``, not in ``Lib``). Training prints the loss as it
falls, from about 5.5 (ln 256: any byte) to about 2.6 in the default 60 steps; after fit the model is
local again, with its own ``forward`` and the trained weights, and continues ``def `` greedily. After
60 steps it knows mostly which bytes are frequent (the sample is mostly spaces); ``--steps 400`` gets
word-like bytes.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import textwrap
import time
import warnings
from collections.abc import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_remote_mp import LocalWorkerOptions, RemoteModelParallelStrategy

VOCAB = 256  # bytes


def gpt2_config(context: int = 64, layers: int = 4) -> GPT2Config:
    """A tiny GPT-2 over bytes (about 0.25 M parameters), otherwise as transformers makes it."""
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=context,
        n_embd=64,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # GPT-2's 50256 is outside a byte vocabulary
        eos_token_id=None,
    )


class ByteGPT2(L.LightningModule):
    def __init__(self, context: int = 64, layers: int = 4, lr: float = 3e-3, log_every: int = 10) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT2LMHeadModel(gpt2_config(context, layers))  # unchanged: split by tracing
        self.losses: list[float] = []
        self._started = time.monotonic()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(ids, labels=ids).loss  # the loss inside the model: it shifts the labels itself
        self.losses.append(loss.item())
        self.log("train_loss", loss, prog_bar=True)
        every = self.hparams.log_every
        if every and len(self.losses) % every == 0:
            mean = sum(self.losses[-every:]) / every
            took = time.monotonic() - self._started
            print(f"step {len(self.losses):3d}  loss {mean:.3f}  ({took:.1f} s elapsed)", flush=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)

    @torch.no_grad()
    def generate(self, prompt: bytes, length: int) -> bytes:
        """Greedy continuation of ``prompt``, run here (after fit the model is local again)."""
        self.eval()
        ids = torch.tensor(list(prompt))
        for _ in range(length):
            window = ids[-self.hparams.context :].unsqueeze(0)
            ids = torch.cat([ids, self.model(window).logits[0, -1].argmax().view(1)])
        return bytes(ids.tolist())


def corpus() -> bytes:
    return inspect.getsource(textwrap).encode("utf-8")


def loader(data: bytes, context: int = 64, batch: int = 16, windows: int = 1024, seed: int = 0) -> DataLoader:
    """Random windows of ``context`` bytes (the model's own labels are its inputs, shifted inside it)."""
    ids = torch.tensor(list(data))
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - context, (windows,), generator=g)
    x = torch.stack([ids[s : s + context] for s in starts])
    return DataLoader(TensorDataset(x), batch_size=batch, shuffle=True, generator=g, drop_last=True)


def main(
    steps: int = 60,
    hosts: Sequence[str] | None = None,
    workers: int = 2,
    microbatches: int = 2,
    split_at: Sequence[str] | None = None,
    seed: int = 0,
    log_every: int = 10,
    sample_bytes: int = 60,
    compression: str | None = None,
) -> tuple[ByteGPT2, bytes]:
    """Train for ``steps`` batches; return the (now local) LightningModule and a greedy sample.

    ``split_at``: the units where stages 1, 2, ... start (``balance={"model": split_at}``); default:
    ``balance="memory"``, which evens out the estimated compute. ``compression``: ``None``,
    ``"bf16"`` or ``"int8"`` (benchmarks/compression.py measures each on this model).
    """
    L.seed_everything(seed, verbose=False)
    module = ByteGPT2(log_every=log_every)
    strategy = RemoteModelParallelStrategy(
        hosts=list(hosts) if hosts else None,
        local_workers=None if hosts else LocalWorkerOptions(count=workers),
        split=["model"],
        microbatches=microbatches,
        balance={"model": list(split_at)} if split_at else None,
        compression=compression,
    )
    trainer = L.Trainer(
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader(corpus(), seed=seed))
    return module, module.generate(b"def ", sample_bytes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", nargs="+", metavar="ADDR", help="worker addresses (default: local workers)")
    parser.add_argument("--workers", type=int, default=2, help="local workers to start without --hosts")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument(
        "--compression", choices=["bf16", "int8"], help="compress activations and gradients on the wire"
    )
    parser.add_argument(
        "--split-at",
        nargs="+",
        metavar="UNIT",
        help="units where stages 1, 2, ... start, e.g. transformer.h.2 (default: balance by estimated compute)",
    )
    args = parser.parse_args()
    # Keep Lightning's banner quiet, and still show the units and where they went.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning_remote_mp").setLevel(logging.INFO)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    started = time.monotonic()
    module, sample = main(
        steps=args.steps,
        hosts=args.hosts,
        workers=args.workers,
        microbatches=args.microbatches,
        split_at=args.split_at,
        compression=args.compression,
    )
    print(f"loss {sum(module.losses[:5]) / 5:.2f} -> {sum(module.losses[-5:]) / 5:.2f}")
    print(f"sample: {sample.decode('utf-8', 'replace')!r}")
    print(f"took {time.monotonic() - started:.1f} s")
