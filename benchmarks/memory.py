"""Peak memory of the driver and the workers for a 50 MB and a 2 GB model built on the meta device,
and each stage's peak memory and step time under each activation recomputation mode.

The driver never materialises the SpecSequential's weights (``SpecSequential(spec, init_seed=0,
device="meta")``): each worker initialises its own layers. Each size runs in a fresh driver process
with two fresh local workers; the driver trains a few SGD steps through ``DriverSession`` (no
Lightning, so the figure is lrmp's own), then reports its peak RSS and each worker's.

The second table trains a deep MLP (Linear + ReLU blocks, 2 stages, 8 micro-batches) with
``checkpoint="never"``, ``"except_last"`` and ``"always"``, with ``split_backward`` on and off (it
keeps linear layers' inputs for the whole batch), on the same two workers; each worker's peak
RSS is reset (``/proc/PID/clear_refs``) once its stage is placed, and the table shows how far it rose
above that during a warm-up step and the timed steps: the activations a stage keeps, plus what
backward allocates.

The third table trains an MLP whose forward returns its loss, traced and split over 4 fresh workers,
under each schedule (``"gpipe"``, ``"1f1b"``, ``"zero_bubble"``, `lightning_remote_mp.schedule`),
at 8 and 16 micro-batches, with ``checkpoint="never"`` and ``"always"``: each worker's peak RSS
rise over the run (reset when training starts, before the stage is placed), the timeline's bubble
and the step time.

    python benchmarks/memory.py              # 50 MB and 2 GB; an MLP of 32 x 512-wide layers, batch 4096
    python benchmarks/memory.py --quick      # 32 MB only; small MLPs; the first two tables side by side
    python benchmarks/memory.py --schedules  # the schedules table alone
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from typing import IO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import exit_now, exit_on_sigterm, markdown_table, timed_trainer  # noqa: E402

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

    from lightning_remote_mp.driver.launch import LocalWorkers
    from lightning_remote_mp.driver.session import DriverSession
    from lightning_remote_mp.model.spec import SpecSequential

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


def _rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


CHECKPOINT_MODES = ("never", "except_last", "always")


def recompute_driver(width: int, blocks: int, batch: int, steps: int, every_config: int = 1) -> None:
    """Runs in its own process: prints one JSON line per recomputation mode."""
    import time

    import torch

    from lightning_remote_mp.driver.launch import LocalWorkers
    from lightning_remote_mp.driver.session import DriverSession
    from lightning_remote_mp.model.spec import SpecSequential

    torch.set_num_threads(1)
    spec = []
    for _ in range(blocks):
        spec.append(("torch.nn.Linear", {"in_features": width, "out_features": width}, (batch, width)))
        spec.append(("torch.nn.ReLU", {}, (batch, width)))
    workers = LocalWorkers(2, devices=["cpu"] * 2, threads=1)
    addresses = workers.start()
    x = torch.randn(batch, width)
    try:
        configs = [(m, split) for split in (True, False) for m in CHECKPOINT_MODES]
        if not every_config:  # --quick: the two ends
            configs = [("never", True), ("always", True)]
        for mode, split in configs:
            net = SpecSequential(spec, init_seed=0)
            opt = torch.optim.SGD(net.parameters(), lr=1e-4)
            session = DriverSession(addresses)
            try:
                session.place(
                    "net", net, balance=[blocks, blocks], microbatches=8, split_backward=split, checkpoint=mode
                )
                session.mirror_optimizer(0, opt)

                def step(net: SpecSequential = net, opt: torch.optim.Optimizer = opt) -> None:
                    net(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()

                # The previous mode's session ended with a malloc_trim on the workers: measured from here,
                # the rise is this mode's (the warm-up step included: workers keep freed memory for reuse).
                base = [_rss_of(p.pid) for p in workers.procs]
                for p in workers.procs:
                    _reset_peak(p.pid)
                step()
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                seconds = (time.perf_counter() - start) / steps
                rise = [_peak_rss_of(p.pid) - b for p, b in zip(workers.procs, base)]
                session.restore()
            finally:
                session.close()
            print(json.dumps({"mode": mode, "split": split, "rise": rise, "step_s": seconds}), flush=True)
    finally:
        workers.stop()


def recompute_sizes(quick: bool) -> tuple[int, int, int, int]:
    """width, blocks, batch, timed steps of the recomputation table's MLP."""
    return (256, 4, 1024, 2) if quick else (512, 16, 4096, 3)


def start_recompute(quick: bool, log: IO[bytes]) -> subprocess.Popen:
    """The recomputation measurements, in a fresh process with two fresh workers (its stderr to ``log``)."""
    sizes = [str(v) for v in (*recompute_sizes(quick), 0 if quick else 1)]
    cmd = [sys.executable, os.path.abspath(__file__), "--_recompute", *sizes]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)


def recompute_table(quick: bool, proc: subprocess.Popen, log: IO[bytes]) -> None:
    width, blocks, batch, steps = recompute_sizes(quick)
    stdout, _ = proc.communicate()
    if proc.returncode:
        log.seek(0)
        tail = log.read().decode(errors="replace")[-3000:]
        raise RuntimeError(f"the recomputation run failed (exit {proc.returncode}):\n{tail}")
    out = stdout.strip().splitlines()
    results = [json.loads(line) for line in out if line.startswith("{")]
    mib = 1024**2
    activations = 2 * blocks * batch * width * 4 / mib  # Linear input and ReLU input per block, float32
    rows = [
        [r["mode"], str(r["split"]), *(f"{v / mib:,.0f}" for v in r["rise"]), f"{r['step_s'] * 1e3:,.0f}"]
        for r in results
    ]
    print()
    print(
        f"activation recomputation: {2 * blocks} x (Linear({width},{width}) + ReLU) over 2 stages, batch {batch} "
        f"in 8 micro-batches, SGD, {steps} timed steps; a stage's activations for the whole batch are "
        f"about {activations:,.0f} MiB"
    )
    print(
        markdown_table(
            ["checkpoint", "split_backward", "stage 0 peak rise MiB", "stage 1 peak rise MiB", "step ms"],
            rows,
        )
    )


# --- schedules: each stage's peak under each schedule ------------------------------------------
SCHEDULES = ("gpipe", "1f1b", "zero_bubble")


def schedule_sizes(quick: bool) -> tuple[int, int, int, int, list[int]]:
    """width, blocks per stage, batch, stages, micro-batch counts of the schedules table's MLP."""
    return (128, 2, 512, 4, [8]) if quick else (512, 4, 4096, 4, [8, 16])


def _held(trace: str) -> list[int]:
    """From a timeline, the most micro-batches each stage held at once (forward run, backward not yet)."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    rows = {
        e["pid"]: int(e["args"]["name"].split(" stage ")[1].split()[0])
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name" and " stage " in e["args"]["name"]
    }
    peaks = [0] * len(rows)
    for pid, stage in rows.items():
        spans = sorted((e["ts"], e["name"]) for e in events if e.get("pid") == pid and e["ph"] == "X")
        held = 0
        for _, name in spans:
            if name[:1] in ("F", "B") and name[1:].isdigit():
                held += 1 if name[0] == "F" else -1
                peaks[stage] = max(peaks[stage], held)
    return peaks


def schedule_driver(width: int, blocks: int, batch: int, stages: int, steps: int, counts: str) -> None:
    """Runs in its own process: for each schedule, micro-batch count and recomputation mode, trains an
    MLP whose forward returns its loss (traced, split over ``stages`` fresh workers) and prints one
    JSON line: each worker's peak RSS rise over the run, the step time and the timeline's bubble."""
    import tempfile
    import time

    import lightning as L
    import torch
    import torch.nn.functional as F

    from lightning_remote_mp import RemoteModelParallelStrategy
    from lightning_remote_mp.driver.launch import LocalWorkers

    torch.set_num_threads(1)

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.Sequential(
                *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(blocks * stages)]
            )

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.blocks(x), y)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = MLP()

        def training_step(self, batch, batch_idx):
            return self.model(*batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    class Measure(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.base = [_rss_of(p.pid) for p in workers.procs]
            for p in workers.procs:
                _reset_peak(p.pid)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == 1:  # after the first step: tracing, placement, warm-up
                self.start = time.perf_counter()

        def on_train_end(self, trainer, pl_module) -> None:
            self.step_s = (time.perf_counter() - self.start) / steps
            self.rise = [_peak_rss_of(p.pid) - b for p, b in zip(workers.procs, self.base)]

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
    data = torch.utils.data.TensorDataset(x.repeat(steps + 1, 1), y.repeat(steps + 1, 1))
    workers = LocalWorkers(stages, devices=["cpu"] * stages, threads=1)
    addresses = workers.start()
    try:
        modes = ("never", "always") if counts != "bubble" else ("never",)
        runs = [
            (m, c, n)
            for m in ([8] if counts == "bubble" else map(int, counts.split(",")))
            for c in modes
            for n in SCHEDULES
        ]
        # The first run's rise also holds what a fresh worker allocates once: run it again, unprinted, first.
        for i, (m, checkpoint, name) in enumerate([runs[0], *runs]):
            measure = Measure()
            with tempfile.TemporaryDirectory() as tmp:
                strategy = RemoteModelParallelStrategy(
                    hosts=addresses,
                    split=["model"],
                    microbatches=m,
                    schedule=name,
                    checkpoint=checkpoint,
                    split_backward=True,
                    timeline=os.path.join(tmp, "trace.json"),
                )
                trainer = timed_trainer(strategy, steps + 1, [measure])  # a warm-up step and the timed ones
                trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=batch))
                bubble = trainer.callback_metrics["lrmp/bubble_fraction_epoch"].item()
                held = _held(os.path.join(tmp, "trace.json"))
            if i:
                row = {"schedule": name, "m": m, "checkpoint": checkpoint, "rise": measure.rise, "held": held}
                print(json.dumps({**row, "step_s": measure.step_s, "bubble": bubble}), flush=True)
    finally:
        workers.stop()


def start_schedules(quick: bool, log: IO[bytes], bubble: bool = False) -> subprocess.Popen:
    """The schedules' memory run (4 stages), or with ``bubble`` their bubble run: 2 stages, one per
    CPU, so that the workers do not wait for each other's CPU."""
    width, blocks, batch, stages, counts = schedule_sizes(quick)
    steps = 1 if quick else 2
    if bubble:
        blocks, stages, steps = blocks * 2, 2, steps + 1
    rows = "bubble" if bubble else ",".join(map(str, counts))
    args = [str(v) for v in (width, blocks, batch, stages, steps)] + [rows]
    cmd = [sys.executable, os.path.abspath(__file__), "--_schedules", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)


def schedules_table(quick: bool, proc: subprocess.Popen, log: IO[bytes], bubble: bool = False) -> None:
    width, blocks, batch, stages, counts = schedule_sizes(quick)
    if bubble:
        blocks, stages, counts = blocks * 2, 2, [8]
    stdout, _ = proc.communicate()
    if proc.returncode:
        log.seek(0)
        tail = log.read().decode(errors="replace")[-3000:]
        raise RuntimeError(f"the schedules run failed (exit {proc.returncode}):\n{tail}")
    results = [json.loads(line) for line in stdout.strip().splitlines() if line.startswith("{")]
    mib = 1024**2
    per_mb = 2 * blocks * (batch // counts[0]) * width * 4 / mib
    rows = [
        [
            r["schedule"],
            str(r["m"]),
            r["checkpoint"],
            *(f"{v / mib:,.0f}" for v in r["rise"]),
            "/".join(map(str, r["held"])),
            f"{r['bubble'] * 100:.0f}%",
            f"{r['step_s'] * 1e3:,.0f}",
        ]
        for r in results
    ]
    print()
    model = (
        f"an MLP of {blocks * stages} x (Linear({width},{width}) + ReLU) whose forward returns its MSE loss, traced "
        f"and split over {stages} workers on {os.cpu_count()} CPUs, batch {batch}, split_backward=True"
    )
    if bubble:
        print(
            f"lrmp schedules, bubble: {model}, 8 micro-batches. The timeline's bubble (the share of each step a "
            "stage did not compute) and the step time."
        )
    else:
        print(
            f"lrmp schedules, memory: {model}; each stage keeps about {per_mb:,.1f} MiB of activations per "
            f"micro-batch at m={counts[0]}. Peak RSS rise of each worker over the run (its weights, gradients and "
            "what it holds for backward); held: the most micro-batches each stage held at once (from the timeline: "
            "forward run, backward not yet); the timeline's bubble (more workers than CPUs: compare the memory, "
            "not the bubble) and the step time."
        )
    header = ["schedule", "m", "checkpoint", *(f"stage {s} MiB" for s in range(stages)), "held", "bubble", "step ms"]
    print(markdown_table(header, rows))


def driver_table(quick: bool) -> None:
    sizes = [(2, "32 MB")] if quick else [(3, "50 MB"), (128, "2 GB")]
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="ignored; kept for the smoke test's interface")
    p.add_argument("--_driver", nargs=2, type=int, help=argparse.SUPPRESS)
    p.add_argument("--_recompute", nargs=5, type=int, help=argparse.SUPPRESS)
    p.add_argument("--_schedules", nargs=6, help=argparse.SUPPRESS)
    p.add_argument("--schedules", action="store_true", help="only the schedules table")
    args = p.parse_args(argv)
    if args._driver or args._recompute or args._schedules:
        exit_on_sigterm()  # a terminated run still stops its workers
        if args._driver:
            driver(*args._driver)
        elif args._recompute:
            recompute_driver(*args._recompute)
        else:
            schedule_driver(*[int(v) for v in args._schedules[:5]], args._schedules[5])
        exit_now(0)  # its workers are stopped and its results printed
    if args.schedules:
        with tempfile.TemporaryFile() as log:
            schedules_table(args.quick, start_schedules(args.quick, log), log)
            schedules_table(args.quick, start_schedules(args.quick, log, bubble=True), log, bubble=True)
        return
    with tempfile.TemporaryFile() as log:
        # --quick: the recomputation run starts at once, beside the driver runs (each is a fresh process
        # importing torch and starting two workers: seconds of CPU; a smoke run's numbers mean nothing).
        # A full run keeps them apart, so that neither disturbs the other's memory and timings.
        recompute = start_recompute(True, log) if args.quick else None
        try:
            driver_table(args.quick)
            recompute = recompute or start_recompute(False, log)
            recompute_table(args.quick, recompute, log)
            schedules_table(args.quick, start_schedules(args.quick, log), log)
            if not args.quick:
                schedules_table(False, start_schedules(False, log, bubble=True), log, bubble=True)
        finally:
            if recompute is not None and recompute.poll() is None:
                recompute.terminate()
                recompute.wait()


if __name__ == "__main__":
    main()
