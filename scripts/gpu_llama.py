"""An HF Llama through lrmp on one GPU: remote == local, and throughput against local training.

Two checks, one table each:

1. **remote == local**: a small Llama (fp32, tied embeddings) fine-tuned with ``labels=`` on padded
   batches, AdamW, for a few steps, once in one process on the device and once through lrmp (two
   local workers on the same device, 2 micro-batches); the largest difference of the losses.
2. **throughput**: a Llama of ``--hidden`` (default 1024) in bf16, tokens per second of local
   training on the device against lrmp with 2 stages on that same device, at m = 1 and 4. With one
   GPU both stages share it, so this measures lrmp's overhead, not a speed-up.

    python scripts/gpu_llama.py                       # on cuda, a few minutes
    python scripts/gpu_llama.py --device cpu --quick  # the same code on the CPU, small
"""

from __future__ import annotations

import argparse
import sys
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset


class Tokens(Dataset):
    """Padded token batches: the last quarter of every other row is padding (label -100)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        mask = torch.ones_like(ids)
        if i % 2:
            mask[-len(ids) // 4 :] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class FineTune(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.losses: list[float] = []
        self.started: float | None = None
        self.warmup = 0

    def training_step(self, batch, batch_idx):
        if batch_idx == self.warmup:
            self.started = time.perf_counter()
        loss = self.model(**batch).loss
        self.losses.append(loss.item())  # waits for the step, in both runs
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def llama(hidden: int, layers: int, vocab: int, dtype: torch.dtype, tied: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 2),
        num_key_value_heads=max(hidden // 128, 1),
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).to(dtype).train()


def fit(model: torch.nn.Module, data: DataLoader, device: str, steps: int, m: int | None, warmup: int = 0):
    from lightning_remote_mp import LocalWorkerOptions, RemoteModelParallelStrategy

    module = FineTune(model)
    module.warmup = warmup
    kind = torch.device(device).type
    strategy = (
        RemoteModelParallelStrategy(
            split=["model"], microbatches=m, local_workers=LocalWorkerOptions(devices=[device, device])
        )
        if m
        else "auto"
    )
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="gpu" if kind == "cuda" else "cpu",
        devices=1,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(module, data)
    seconds = time.perf_counter() - module.started if module.started is not None else float("nan")
    return module.losses, seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed steps, after --warmup")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a small model, few steps (to try the script)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.batch, args.seq, args.steps, args.warmup = 128, 2, 4, 32, 3, 1
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device is visible to torch here: nothing to check", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # remote == local compares fp32 runs
    torch.backends.cudnn.allow_tf32 = False
    failed = False

    small = Tokens(16, 32, 1000)
    local, _ = fit(llama(64, 2, 1000, torch.float32, True), DataLoader(small, batch_size=8), args.device, 4, None)
    remote, _ = fit(llama(64, 2, 1000, torch.float32, True), DataLoader(small, batch_size=8), args.device, 4, 2)
    worst = max(abs(a - b) for a, b in zip(local, remote))
    ok = len(local) == len(remote) == 4 and worst < 1e-4
    failed |= not ok
    print("\n## remote == local: a tied Llama with labels= on padded batches, AdamW, 4 steps\n")
    print("| device | steps | largest loss difference | within 1e-4 |\n|---|---|---|---|")
    print(f"| {args.device} | {len(remote)} | {worst:.2e} | {'yes' if ok else 'NO'} |")

    vocab, steps = 32000, args.warmup + args.steps
    tokens = Tokens(args.batch * steps, args.seq, vocab)
    rows, base = [], None
    for m in (None, 1, 4):
        model = llama(args.hidden, args.layers, vocab, torch.bfloat16, False)
        losses, seconds = fit(model, DataLoader(tokens, batch_size=args.batch), args.device, steps, m, args.warmup)
        rate = args.batch * args.seq * args.steps / seconds
        base = base or rate
        rows.append(f"| {'local' if m is None else 'lrmp, 2 stages'} | {m or '-'} | {rate:,.0f} | {rate / base:.2f} |")
        del model
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
    print(
        f"\n## throughput: Llama hidden {args.hidden}, {args.layers} layers, vocab {vocab}, bf16, batch "
        f"{args.batch} x {args.seq}, {args.steps} steps after {args.warmup}\n"
    )
    print("| run | m | tokens/s | x local |\n|---|---|---|---|")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
