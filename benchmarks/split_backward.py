"""What split backward costs a stage in Python, per micro-batch, against plain autograd.

A worker with ``split_backward=True`` (and ``"auto"``, the default, for large enough calls)
computes each linear layer's weight gradient once per batch
(`lightning_remote_mp.worker.deferred_grads`). That needs every linear call of the stage's forward
to go through a custom autograd Function, found one of two ways:

- ``direct nn.Linear``: where the stage's only 2-d weights are plain ``nn.Linear`` (and
  ``nn.Embedding``) layers, each Linear's own forward defers;
- ``TorchFunctionMode``: otherwise (``WrappedLinear``, attention with packed projections, custom
  layers calling ``F.linear``) a mode sees every op of the forward, at a Python call each.

Each row times one micro-batch's forward, backward and weight-gradient flush on the stage's real
executor code (``run_layers`` under ``DeferredWeightGrads``), on CPU with one thread, the layers
small enough that Python overhead decides (as it does on a GPU). A second table times one
``Linear(width, width)`` per call size, plain against deferred: where deferring starts to pay is
the threshold of ``split_backward="auto"`` (``deferred_grads.CPU_MIN_MACS``).

    python benchmarks/split_backward.py            # full run (about a minute)
    python benchmarks/split_backward.py --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def models() -> dict[str, tuple[list, object]]:
    import torch
    import torch.nn.functional as F
    from torch import nn

    class LlamaMLP(nn.Module):
        """A Llama-style feed-forward block: RMSNorm (a 1-d weight), gate/up/down projections, SiLU."""

        def __init__(self, d: int = 128, hidden: int = 344) -> None:
            super().__init__()
            self.norm = nn.RMSNorm(d)
            self.gate = nn.Linear(d, hidden, bias=False)
            self.up = nn.Linear(d, hidden, bias=False)
            self.down = nn.Linear(hidden, d, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.norm(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    torch.manual_seed(0)
    return {
        "MLP 4 x (Linear(128, 128) + ReLU), batch 16": (
            [m for _ in range(4) for m in (nn.Linear(128, 128), nn.ReLU())],
            torch.randn(16, 128, requires_grad=True),
        ),
        "2 Llama-style MLP blocks, [4, 32, 128]": (
            [LlamaMLP(), LlamaMLP()],
            torch.randn(4, 32, 128, requires_grad=True),
        ),
    }


def measure(layers: list, x: object, repeats: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds per micro-batch (forward, backward, flush) for each way, ``rounds`` times, interleaved."""
    from torch import nn

    from lightning_remote_mp.model.wiring import run_layers
    from lightning_remote_mp.worker.deferred_grads import DeferredWeightGrads

    module = nn.ModuleDict({str(i): m for i, m in enumerate(layers)})
    deferred = DeferredWeightGrads(module)
    if deferred._intercept:
        raise RuntimeError("this model needs the TorchFunctionMode: it cannot show the direct path")

    def run() -> object:
        return run_layers(((int(k), m) for k, m in module.items()), x, {})

    def plain() -> None:
        run().sum().backward()

    def split(with_mode: bool, min_macs: int = 0) -> Callable[[], None]:
        def step() -> None:
            deferred._intercept = with_mode  # the mode the stage would need with any other 2-d weight
            deferred.min_macs = min_macs
            with deferred.recording(signature=x.shape):
                y = run()
            with deferred.filing_backward():
                y.sum().backward()
            deferred.flush()

        return step

    ways = {
        "plain autograd": plain,
        "split, TorchFunctionMode": split(True),
        "split, direct nn.Linear": split(False),
        # split_backward="auto" where no call is large enough: after the first forward, no mode either.
        '"auto", calls too small, TorchFunctionMode': split(True, min_macs=2**62),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, step in ways.items():
            for _ in range(max(1, repeats // 8)):
                step()
            start = time.perf_counter()
            for _ in range(repeats):
                step()
            times[name].append((time.perf_counter() - start) / repeats * 1e6)
    deferred._intercept, deferred.min_macs = False, 0
    return times


#: (width, rows per micro-batch) for the size table: products from 2**18 to 2**26 multiply-adds.
SIZES = [(128, 16), (128, 64), (256, 16), (256, 64), (512, 16), (512, 64), (1024, 16), (1024, 64)]


def measure_size(width: int, rows: int, m: int, repeats: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds per micro-batch of one ``Linear(width, width)``: ``m`` micro-batches of ``rows``
    forward, then backward, then the flush; plain autograd against every call deferred."""
    import torch
    from torch import nn

    from lightning_remote_mp.worker.deferred_grads import DeferredWeightGrads

    torch.manual_seed(0)
    layer = nn.Linear(width, width)
    deferred = DeferredWeightGrads(layer)
    xs = [torch.randn(rows, width, requires_grad=True) for _ in range(m)]
    g = torch.randn(rows, width)

    def step(split: bool) -> None:
        ys = []
        for x in xs:
            with deferred.recording() if split else contextlib.nullcontext():
                ys.append(layer(x))
        for y in ys:
            with deferred.filing_backward() if split else contextlib.nullcontext():
                y.backward(g)
        deferred.flush()
        layer.weight.grad = layer.bias.grad = None

    times: dict[str, list[float]] = {"plain": [], "split": []}
    for _ in range(rounds):
        for name in times:
            for _ in range(max(1, repeats // 8)):
                step(name == "split")
            start = time.process_time()
            for _ in range(repeats):
                step(name == "split")
            times[name].append((time.process_time() - start) / repeats / m * 1e6)
    return times


def size_table(repeats: int, rounds: int, quick: bool) -> None:
    """Where deferring starts to pay: ``split_backward="auto"``'s threshold (`CPU_MIN_MACS`)."""
    from lightning_remote_mp.worker.deferred_grads import CPU_MIN_MACS

    rows = []
    for width, r in SIZES[:2] if quick else SIZES:
        n = repeats if width <= 256 else max(1, repeats // 5)
        for m in (1, 4):
            times = measure_size(width, r, m, n, rounds)
            plain, split = (statistics.median(times[k]) for k in ("plain", "split"))
            macs = r * width * width
            rows.append(
                [f"Linear({width}, {width}), {r} rows", m, f"{macs:,}", "yes" if macs >= CPU_MIN_MACS else "no"]
                + [f"{plain:,.0f}", f"{split:,.0f}", f"{split - plain:+,.0f}"]
            )
    header = ["call", "m", "multiply-adds", '"auto" defers', "plain us/mb", "split us/mb", "split - plain"]
    print("\nOne linear layer, per micro-batch (CPU time; forward, backward and the flush's share):\n")
    print(_common.markdown_table(header, rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few repeats, one round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=200, help="micro-batches timed per way, model and round")
    p.add_argument("--out", default=None, help="ignored (no files are written); kept for the smoke test's interface")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rounds, repeats = (1, 10) if args.quick else (args.rounds, args.repeats)
    print(f"# lrmp split backward: Python cost per micro-batch ({'quick' if args.quick else 'full'} run)")
    print(_common.environment(), flush=True)
    rows = []
    for name, (layers, x) in models().items():
        times = measure(layers, x, repeats, rounds)
        base = statistics.median(times["plain autograd"])
        for way, ts in times.items():
            us = statistics.median(ts)
            rows.append([name, way, f"{us:,.0f}", _common.spread(ts), f"{us / base:.2f}x"])
    header = ["model", "way", "us per micro-batch (median)", "min-max", "x plain autograd"]
    print()
    print(_common.markdown_table(header, rows))
    print(f"\n{rounds} round(s) of {repeats} micro-batches each (forward, backward, weight-gradient flush).")
    size_table(repeats, rounds, args.quick)
    _common.exit_now(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
