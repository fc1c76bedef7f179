"""Compression on the wire: what ``compression="bf16"`` and ``"int8"`` do to a loss curve.

Two of the examples train from the same seed with each setting, on two local lrmp workers (one
torch thread each), all else equal:

- ``char_gpt``: ``examples/char_gpt.py``, a character-level GPT written as a layer spec (AdamW,
  4 micro-batches, dropout 0.1: the workers draw the same masks whatever the compression);
- ``hf_gpt2``: ``examples/hf_gpt2.py``, HuggingFace's GPT-2 unchanged, traced (AdamW, 2
  micro-batches, ``labels=`` loss inside the model, tied embeddings).

Printed per model and setting: the mean loss over the first and the last ``--window`` steps, the
largest and the mean absolute difference from the uncompressed run's loss at the same step, and
the wall time. A last run without compression from another seed (other initial weights, another
data order) is the yardstick: how far two runs drift apart for reasons that do not matter.
Compression acts on the bytes between processes only; on loopback it costs the conversion and
saves little, so the time column is no speed measurement (``benchmarks/lan.py``
measures speed on shaped links).

    python benchmarks/compression.py            # 200 + 100 steps, four runs each (~4 min on 2 cores)
    python benchmarks/compression.py --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import _common  # noqa: E402

#: (compression, seed): the last row is no compression from another seed, the yardstick: how far two
#: runs drift apart when nothing but the seed differs.
SETTINGS = ((None, 0), ("bf16", 0), ("int8", 0), (None, 1))


def train(model: str, steps: int, compression: str | None, seed: int) -> tuple[list[float], float]:
    started = time.perf_counter()
    if model == "char_gpt":
        import char_gpt

        module, _ = char_gpt.main(steps=steps, workers=2, seed=seed, compression=compression)
    else:
        import hf_gpt2

        module, _ = hf_gpt2.main(
            steps=steps, workers=2, seed=seed, log_every=0, sample_bytes=1, compression=compression
        )
    return list(module.losses), time.perf_counter() - started


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--char-steps", type=int, default=200)
    p.add_argument("--hf-steps", type=int, default=100)
    p.add_argument("--window", type=int, default=10, help="steps averaged at the start and at the end")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=_common.RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.char_steps, args.hf_steps, args.window = 4, 3, 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_remote_mp").setLevel(logging.WARNING)
    print(_common.environment())
    curves: dict[str, dict[str, list[float]]] = {}
    rows = []
    for model, steps in (("char_gpt", args.char_steps), ("hf_gpt2", args.hf_steps)):
        curves[model] = {}
        base: list[float] = []
        for setting, seed in SETTINGS:
            losses, seconds = train(model, steps, setting, seed)
            label = str(setting) if seed == 0 else f"{setting} (seed {seed})"
            curves[model][label] = losses
            if setting is None and seed == 0:
                base = losses
            w = args.window
            diffs = [abs(a - b) for a, b in zip(losses, base)]
            rows.append(
                [
                    model,
                    label,
                    len(losses),
                    f"{sum(losses[:w]) / w:.4f}",
                    f"{sum(losses[-w:]) / w:.4f}",
                    f"{max(diffs):.4f}",
                    f"{sum(diffs) / len(diffs):.4f}",
                    f"{seconds:.0f}",
                ]
            )
            print(f"  {model} {label}: {rows[-1][3]} -> {rows[-1][4]}", flush=True)
    header = [
        "model",
        "compression",
        "steps",
        "first steps' loss",
        "last steps' loss",
        "max |diff|",
        "mean |diff|",
        "s",
    ]
    table = _common.markdown_table(header, rows)
    print()
    print("lrmp training loss with compression on the wire; |diff| is per step against the run without")
    print(table)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compression.json"), "w") as f:
            json.dump(curves, f)
        with open(os.path.join(args.out, "compression.txt"), "w") as f:
            f.write(table + "\n")
        plot(curves, os.path.join(args.out, "compression.png"))
    return 0


def plot(curves: dict[str, dict[str, list[float]]], path: str) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.5))
    for ax, (model, by) in zip(axes, curves.items()):
        for setting, losses in by.items():
            ax.plot(losses, label=f"compression={setting}", linewidth=1)
        ax.set_title(model)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
