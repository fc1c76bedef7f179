"""Soak test: many training steps on the local default (two local workers), watching memory.

    python scripts/soak.py --steps 2000

Trains a small residual model with RemoteModelParallelStrategy() and samples the resident memory
(RSS, from /proc) of the driver and of each worker process: at the first step, after a warm-up
(allocator pools and caches filled), every ``--every`` steps, and at the end. Prints a summary
(``--json`` for one JSON line) with the growth from the warm-up to the end; exits 1 if training
failed or if any process grew by more than ``--max-growth`` percent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_remote_mp import RemoteModelParallelStrategy, SpecSequential
from lightning_remote_mp.layers import WrappedLinear

WIDTH = 32


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = SpecSequential(
            [
                ("torch.nn.Linear", {"in_features": 1, "out_features": WIDTH}, (32, 1)),
                ("torch.nn.ReLU", {}, (32, WIDTH)),
                (WrappedLinear, {"in_features": WIDTH, "out_features": WIDTH, "out_variables": ["r"]}, (32, WIDTH)),
                ("torch.nn.ReLU", {}, (32, WIDTH)),
                ("torch.nn.Linear", {"in_features": WIDTH, "out_features": WIDTH}, (32, WIDTH)),
                (
                    WrappedLinear,
                    {"in_features": WIDTH, "out_features": WIDTH, "dependencies": ["r"]},
                    [(32, WIDTH)] * 2,
                ),
                ("torch.nn.ReLU", {}, (32, WIDTH)),
                ("torch.nn.Linear", {"in_features": WIDTH, "out_features": 1}, (32, WIDTH)),
                ("torch.nn.Sigmoid", {}, (32, 1)),
            ]
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.binary_cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class MemoryProbe(L.Callback):
    def __init__(self, warmup: int, every: int) -> None:
        self.warmup, self.every = warmup, every
        self.samples: list[dict[str, Any]] = []
        self.pids: dict[str, int] = {}
        self.losses: list[float] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        local = trainer.strategy._workers.local
        self.pids = {"driver": os.getpid(), **{f"worker{i}": p.pid for i, p in enumerate(local.procs)}}

    def sample(self, step: int) -> None:
        self.samples.append({"step": step, **{name: rss_bytes(pid) for name, pid in self.pids.items()}})

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == 1 or step == self.warmup or step % self.every == 0:
            self.sample(step)
        if step % 100 == 0:
            self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.samples or self.samples[-1]["step"] != trainer.global_step:
            self.sample(trainer.global_step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="step after which memory should stay flat")
    p.add_argument("--every", type=int, default=250, help="sample memory every this many steps")
    p.add_argument("--max-growth", type=float, default=5.0, help="percent of growth after warm-up that fails")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x = torch.rand(4096, 1)
    data = DataLoader(TensorDataset(x, (x > 0.5).float()), batch_size=32, shuffle=True)
    probe = MemoryProbe(args.warmup, args.every)
    trainer = L.Trainer(
        max_steps=args.steps,
        max_epochs=-1,
        strategy=RemoteModelParallelStrategy(),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    start = time.monotonic()
    error = None
    try:
        trainer.fit(Model(), data)
    except Exception as err:  # reported, not raised: the summary says what happened
        error = "".join(traceback.format_exception_only(type(err), err)).strip()
        traceback.print_exc()
    seconds = time.monotonic() - start
    by_step = {s["step"]: s for s in probe.samples}
    base = by_step.get(args.warmup)
    end = probe.samples[-1] if probe.samples else None
    growth = {}
    if base and end:
        growth = {name: round(100.0 * (end[name] - base[name]) / base[name], 2) for name in probe.pids}
    summary = {
        "steps": trainer.global_step,
        "seconds": round(seconds, 1),
        "error": error,
        "rss_mib": [{k: (round(v / 2**20, 1) if k != "step" else v) for k, v in s.items()} for s in probe.samples],
        "growth_after_warmup_percent": growth,
        "loss_every_100_steps": [round(v, 4) for v in probe.losses],
    }
    failed = error is not None or trainer.global_step < args.steps or any(g > args.max_growth for g in growth.values())
    summary["ok"] = not failed
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"{summary['steps']} steps in {summary['seconds']} s; error: {error}")
        names = list(probe.pids)
        print("step   " + "  ".join(f"{n:>10}" for n in names) + "   (RSS, MiB)")
        for s in summary["rss_mib"]:
            print(f"{s['step']:>5}  " + "  ".join(f"{s[n]:>10.1f}" for n in names))
        print(f"growth from step {args.warmup} to the end: " + ", ".join(f"{n} {g:+.2f}%" for n, g in growth.items()))
        print("OK" if not failed else "FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
