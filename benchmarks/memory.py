"""Peak memory of the driver and the workers for a 50 MB and a 2 GB model built on the meta device.

The driver never materialises the SpecSequential's weights (``SpecSequential(spec, init_seed=0,
device="meta")``): each worker initialises its own layers. Each size runs in a fresh driver process
with two fresh local workers; the driver trains a few SGD steps through ``DriverSession`` (no
Lightning, so the figure is lrmp's own), then reports its peak RSS and each worker's.

    python benchmarks/memory.py            # 50 MB and 2 GB
    python benchmarks/memory.py --quick    # 5 MB and 50 MB
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table  # noqa: E402

WIDTH = 2048  # a Linear(2048, 2048) is 16 MiB of float32 weights


def _peak_rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def driver(layers: int, steps: int) -> None:
    """Runs in its own process: prints one JSON line with the peaks."""
    import torch

    from lightning_remote_mp.driver import DriverSession
    from lightning_remote_mp.launch import LocalWorkers
    from lightning_remote_mp.spec import SpecSequential

    torch.set_num_threads(1)
    spec = [("torch.nn.Linear", {"in_features": WIDTH, "out_features": WIDTH}, (8, WIDTH))] * layers
    workers = LocalWorkers(2, devices=["cpu"] * 2, threads=1)
    addresses = workers.start()
    try:
        net = SpecSequential(spec, init_seed=0, device="meta")
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)
        session = DriverSession(addresses)
        try:
            session.place("net", net, balance=[layers // 2, layers - layers // 2])
            session.mirror_optimizer(0, opt)
            x = torch.randn(8, WIDTH)
            for _ in range(steps):
                net(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            worker_peaks = [_peak_rss_of(p.pid) for p in workers.procs]
            session.restore()
        finally:
            session.close()
    finally:
        workers.stop()
    params = layers * (WIDTH * WIDTH + WIDTH)
    driver_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"params": params, "driver": driver_peak, "workers": worker_peaks}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="ignored; kept for the smoke test's interface")
    p.add_argument("--_driver", nargs=2, type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._driver:
        driver(*args._driver)
        return
    sizes = [(2, "32 MB"), (4, "64 MB")] if args.quick else [(3, "50 MB"), (128, "2 GB")]
    rows, results = [], []
    for layers, label in sizes:
        out = (
            subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--_driver", str(layers), "2"],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        r = json.loads(out)
        results.append(r)
        mib = 1024**2
        rows.append(
            [
                label,
                f"{r['params']:,}",
                f"{r['params'] * 4 / mib:,.0f}",
                f"{r['driver'] / mib:,.0f}",
                " / ".join(f"{w / mib:,.0f}" for w in r["workers"]),
            ]
        )
    print(
        f"lrmp driver and workers: Linear({WIDTH},{WIDTH}) layers on the meta device, 2 local workers, "
        "SGD, batch 8, 2 steps"
    )
    print(markdown_table(["model", "parameters", "weights MiB", "driver peak RSS MiB", "worker peak RSS MiB"], rows))
    small, big = results[0]["driver"], results[-1]["driver"]
    print(
        f"driver peak, largest model over smallest: {big / small:.3f}x "
        f"for {results[-1]['params'] / results[0]['params']:.0f}x the parameters"
    )


if __name__ == "__main__":
    main()
