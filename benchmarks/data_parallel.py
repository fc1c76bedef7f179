"""Data parallel throughput: one pipeline of 2 stages against 2 replicas of it (4 workers).

Same model, same global batch, same number of steps; each worker has one torch thread. Prints
samples/s for both, their ratio measured in the same rounds, and the gradient bytes all-reduced
per step (counted by the driver's optimizer mirror from the workers' replies).

    python benchmarks/data_parallel.py            # 5 rounds of 20 steps
    python benchmarks/data_parallel.py --quick    # smoke run

On a 2-core machine 4 workers and a driver share 2 cores, so the ratio there says little about
machines with a core (or GPU) per worker; the all-reduced bytes do not depend on the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, median  # noqa: E402

from lightning_remote_mp.driver.launch import LocalWorkers  # noqa: E402
from lightning_remote_mp.driver.session import DriverSession  # noqa: E402
from lightning_remote_mp.model.spec import SpecSequential  # noqa: E402


def spec(width: int, blocks: int, batch: int) -> list:
    out = []
    for _ in range(blocks):
        out += [("torch.nn.Linear", {"in_features": width, "out_features": width}, (batch, width))]
        out += [("torch.nn.ReLU", {}, (batch, width))]
    return out


def run(hosts, width: int, blocks: int, batch: int, steps: int, warmup: int) -> tuple[float, int]:
    torch.manual_seed(0)
    net = SpecSequential(spec(width, blocks, batch))
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    session = DriverSession(hosts)
    try:
        session.place("net", net, balance=[blocks, blocks])
        mirror = session.mirror_optimizer(0, opt)
        x, y = torch.randn(batch, width), torch.randn(batch, width)
        for i in range(warmup + steps):
            if i == warmup:
                start, bytes_before = time.perf_counter(), mirror.allreduced_bytes
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        elapsed = time.perf_counter() - start
        per_step = (mirror.allreduced_bytes - bytes_before) // steps
        session.restore()
    finally:
        session.close()
    return batch * steps / elapsed, per_step


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=None, help="ignored; kept for the smoke test's interface")
    args = p.parse_args(argv)
    width, blocks, batch, steps, warmup, rounds = (1024, 4, 256, 20, 3, args.rounds)
    if args.quick:
        width, blocks, batch, steps, warmup, rounds = (128, 2, 64, 3, 1, 1)
    torch.set_num_threads(1)
    workers = LocalWorkers(4, devices=["cpu"] * 4, threads=1)
    a = workers.start()
    try:
        one, two, ratios, moved = [], [], [], 0
        for _ in range(rounds):
            s1, _ = run([a[0], a[1]], width, blocks, batch, steps, warmup)
            s2, moved = run([[a[0], a[1]], [a[2], a[3]]], width, blocks, batch, steps, warmup)
            one.append(s1)
            two.append(s2)
            ratios.append(s2 / s1)
    finally:
        workers.stop()
    params = blocks * (width * width + width)
    print(
        f"MLP {blocks} x (Linear({width},{width}) + ReLU), batch {batch}, SGD, 2 stages, 1 thread per worker, "
        f"{rounds} rounds of {steps} steps"
    )
    print(
        markdown_table(
            [
                "layout",
                "workers",
                "samples/s (median)",
                "x one pipeline (same round, median)",
                "bytes all-reduced / step",
            ],
            [
                ["1 replica x 2 stages", 2, f"{median(one):,.0f}", "1.00x", 0],
                ["2 replicas x 2 stages", 4, f"{median(two):,.0f}", f"{median(ratios):.2f}x", f"{moved:,}"],
            ],
        )
    )
    print(f"(all parameters in float32: {params * 4:,} bytes; each stage's replicas sum that stage's share)")


if __name__ == "__main__":
    main()
