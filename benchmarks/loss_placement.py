"""Where the loss is computed: the bytes a step moves to the driver, and its time, for the ways a
``training_step`` writes a causal LM's loss.

The model is the one issue 25 measured: an unchanged HuggingFace Llama (vocabulary 32,000, hidden
128, 4 layers, sequence 128, batch 8), split over two local lrmp workers with two micro-batches.
Each batch is padded (``-100`` labels at the padding). Three ``training_step`` bodies train it from
the same weights and data, in rotating order, in the same run:

- ``labels=``: ``self.model(ids, attention_mask=mask, labels=labels).loss``, the loss inside the
  model: the last stage computes it; the logits stay there.
- ``F.cross_entropy``: the logits from ``self.model(ids, attention_mask=mask).logits``, shifted and
  flattened, into ``F.cross_entropy``: computed on the last stage (``docs/loss.md``); the logits
  stay there.
- ``read first``: the same loss after ``logits * 1.0``, an operation that reads the logits, so they
  are fetched and the loss computed on the driver. This is what every step did before the loss
  moved to the last stage.

Printed per body: bytes to the driver per step (the tensors of the pipeline's results, of fetched
outputs and of the losses' answers, counted by the driver), seconds per step (median after a
warm-up step), and the last step's loss (the three must agree). On loopback bytes cost little
time; ``benchmarks/lan.py`` shows what they cost on a shaped link.

    python benchmarks/loss_placement.py            # 2 rounds x 3 bodies x 5 steps (~2 min on 2 cores)
    python benchmarks/loss_placement.py --quick    # a small vocabulary (seconds)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

BODIES = ("labels=", "F.cross_entropy", "read first")


def make_model(vocab: int, hidden: int, layers: int) -> Any:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return transformers.LlamaForCausalLM(config)


def make_data(vocab: int, seq: int, batch: int, steps: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch * steps, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (batch * steps,), generator=g)
    mask = (torch.arange(seq) < lengths[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, mask, labels), batch_size=batch)


def run(body: str, model: Any, data: Any, steps: int) -> dict[str, float]:
    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_remote_mp import RemoteModelParallelStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.losses: list[float] = []
            self.times: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            ids, mask, labels = batch
            self.times.append(time.perf_counter())
            if body == "labels=":
                loss = self.model(ids, attention_mask=mask, labels=labels).loss
            else:
                logits = self.model(ids, attention_mask=mask).logits
                if body == "read first":
                    logits = logits * 1.0
                vocab = logits.size(-1)
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
            self.losses.append(loss.item())
            return loss

        def on_train_batch_end(self, *args: Any) -> None:
            self.times.append(time.perf_counter())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Bytes(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            remote = trainer.strategy.session.placements["model"].remote
            self.total = remote.result_bytes + remote.fetched_bytes + remote.losses.reply_bytes
            self.computed = remote.losses.computed

    module, counted = Module(), Bytes()
    strategy = RemoteModelParallelStrategy(split=["model"], microbatches=2)
    _common.timed_trainer(strategy, steps, [counted]).fit(module, data)
    seconds = [module.times[i + 1] - module.times[i] for i in range(2, len(module.times), 2)]  # after step 0
    return {
        "bytes": counted.total / steps,
        "s": _common.median(seconds),
        "loss": module.losses[-1],
        "on_last_stage": counted.computed,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a small vocabulary and model, one round")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import torch

    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    vocab, hidden, layers, seq, batch = (1000, 32, 2, 32, 8) if args.quick else (32000, 128, 4, 128, 8)
    rounds = 1 if args.quick else args.rounds
    args.steps = 3 if args.quick else args.steps
    torch.set_num_threads(1)
    print(_common.environment())
    print(f"Llama: vocabulary {vocab}, hidden {hidden}, {layers} layers; batch {batch} x {seq}")
    print("2 local workers, 2 micro-batches")
    torch.manual_seed(0)
    start = make_model(vocab, hidden, layers)
    results: dict[str, list[dict[str, float]]] = {b: [] for b in BODIES}
    for r in range(rounds):
        for body in BODIES[r % len(BODIES) :] + BODIES[: r % len(BODIES)]:
            got = run(body, copy.deepcopy(start), make_data(vocab, seq, batch, args.steps), args.steps)
            results[body].append(got)
            print(f"  round {r}: {body:16s} {got['bytes']:13,.0f} bytes/step  {got['s']:.3f} s/step", flush=True)
    logits_mb = batch * seq * vocab * 4 / 1e6
    rows = []
    for body in BODIES:
        runs = results[body]
        seconds = [x["s"] for x in runs]
        rows.append(
            [
                body,
                "last stage" if runs[0]["on_last_stage"] or body == "labels=" else "driver",
                f"{_common.median(x['bytes'] for x in runs):,.0f}",
                f"{_common.median(seconds):.3f} ({min(seconds):.3f}-{max(seconds):.3f})",
                f"{runs[-1]['loss']:.4f}",
            ]
        )
    table = _common.markdown_table(
        ["lrmp, loss written as", "computed on", "bytes to the driver per step", "s/step (min-max)", "last loss"], rows
    )
    print()
    print(f"The logits are {logits_mb:.1f} MB a step.")
    print(table)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "loss_placement.txt"), "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
