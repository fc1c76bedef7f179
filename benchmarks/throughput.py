"""Training throughput: one process versus lrmp's 2-stage pipeline versus torch.distributed.pipelining.

The model is an MLP of ``depth`` x (Linear(width, width) + ReLU) -- 8 x 1024 by default, 16 layers --
trained with SGD and an MSE loss on one fixed float32 batch of 256 samples. Every process computes
with ONE torch thread, so two pipeline stages can at best use the machine's two cores.

Configurations (all in the same run, interleaved round by round, median over rounds reported):

(a) ``plain``: this process, a plain PyTorch loop (forward, loss, backward, step, zero_grad);
(b) ``lrmp m=M``: Lightning's Trainer with RemoteModelParallelStrategy(balance=[8, 8],
    microbatches=M) (its default ``split_backward="auto"``; for comparison, ``split_backward=False``:
    plain autograd on the workers, and ``split_backward=True``: every linear call deferred)
    on two lrmp-worker processes (``LocalWorkers(2, threads=1)``, the same workers the
    strategy starts for ``local_workers=LocalWorkerOptions(threads=1)``; started once and reused by every fit so that
    the rounds can alternate), timed by a callback over the steps after the warm-up;
(b') ``lrmp-inside m=M`` (``--lrmp-inside-m``): the same MLP as an unchanged ``nn.Module`` whose
    forward returns its MSE loss, traced (``split=["model"]``) and run with ``schedule="1f1b"``: the
    loss on the last stage, as torch.distributed.pipelining computes it, so a step costs the driver
    one message each way (the inputs and targets out, the losses back);
(b'') ``lrmp-inside-pre m=M`` (``--lrmp-inside-pre-m``): (b') behind a Linear on the driver, whose
    gradient needs the model's input's: the loss's gradient goes at once up the pipeline and stage 0
    answers with the input's gradients (`requests.LossGrad.answer`);
(c) ``torch <Schedule> m=M``: torch.distributed.pipelining, ``PipelineStage`` built by hand on each of
    two processes talking gloo over 127.0.0.1 (NCCL with ``--device cuda``), with ScheduleGPipe and
    Schedule1F1B.

Two load-robust columns explain the results: "micro-batch CPU penalty" is the CPU time of one
step of the whole model run as M micro-batches with gradient accumulation (this process, one
thread) over that of one full batch -- compute that every M-micro-batch pipeline with a plain
backward does -- and "GPipe ceiling" is the best speed-up over (a) such a 2-stage pipeline could
reach on two idle cores, ``2M / (M + 1) / penalty`` (1F1B has the same bubble). lrmp's split
backward is not bound by it: it pays the weight gradients once per batch, not per micro-batch,
and computes them while the other stage still works. CPU ms per step (all processes, from /proc) shows what each
configuration costs independently of how busy the machine is.

    python benchmarks/throughput.py            # full run (a few minutes)
    python benchmarks/throughput.py --quick    # smoke run (seconds)
    python benchmarks/throughput.py --device cuda --width 128 --batch 64   # on a GPU (scripts/gpu_check.py)

With ``--device cuda`` the plain loop, the two lrmp workers and the torch ranks compute on the GPU
(the lrmp driver, which holds no layers, stays on the CPU). lrmp's workers use ``cuda:0`` and
``cuda:1`` where there are two GPUs, else both ``cuda:0``; torch's ranks need two GPUs (NCCL
refuses two ranks on one), so with one GPU its configurations are left out, and lrmp's two workers
time-slice that GPU. The "micro-batch CPU penalty" and "GPipe ceiling" columns are CPU measures:
ignore them on a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

LR = 1e-3


# --- the model and the data -------------------------------------------------------------------
def spec(width: int, depth: int, batch: int) -> list:
    entries = []
    for _ in range(depth):
        entries.append(("torch.nn.Linear", {"in_features": width, "out_features": width}, (batch, width)))
        entries.append(("torch.nn.ReLU", {}, (batch, width)))
    return entries


def plain_mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def make_batch(width: int, batch: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, width, generator=g).to(device), torch.randn(batch, width, generator=g).to(device)


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work, so that a timer reads finished steps."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --- (a) one process ---------------------------------------------------------------------------
def run_plain(cfg: dict[str, Any]) -> tuple[float, list[float]]:
    """Wall and CPU seconds of ``steps`` training steps after ``warmup`` steps, in this process."""
    torch.manual_seed(0)
    device = cfg["device"]
    model = plain_mlp(cfg["width"], cfg["depth"]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_batch(cfg["width"], cfg["batch"], device)

    def step() -> None:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(cfg["warmup"]):
        step()
    synchronize(device)
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    synchronize(device)
    return time.perf_counter() - t0, [time.process_time() - c0]


def microbatch_cpu(cfg: dict[str, Any], m: int, repeats: int = 3) -> float:
    """CPU seconds (this thread) of one training step of the whole model run as ``m`` micro-batches
    with gradient accumulation: the compute any m-micro-batch pipeline does, with no transfers."""
    torch.manual_seed(0)
    model = plain_mlp(cfg["width"], cfg["depth"])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_batch(cfg["width"], cfg["batch"])
    samples = []
    for i in range(repeats + 1):
        c0 = time.thread_time()
        for xb, yb in zip(x.tensor_split(m), y.tensor_split(m)):
            (F.mse_loss(model(xb), yb) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # the first is a warm-up
            samples.append(time.thread_time() - c0)
    return _common.median(samples)


def ceiling(m: int, penalty: float) -> float:
    """Best speed-up over (a) of a 2-stage GPipe on two otherwise idle cores: the busiest stage is
    busy ``m`` of ``m + 1`` slots forward and backward, and micro-batching costs ``penalty`` x
    the compute of one full batch (small GEMMs, gradient accumulation)."""
    return 2 * m / (m + 1) / penalty


# --- (b) lrmp through Lightning ------------------------------------------------------------------
def run_lrmp(
    cfg: dict[str, Any],
    addresses: list[str],
    pids: list[int],
    m: int,
    split: bool | str = "auto",
    inside: bool = False,
    schedule: str = "1f1b",
    pre: bool = False,
) -> tuple[float, list[float]]:
    """Wall seconds, and CPU seconds of the driver and of each worker, of the steps after the warm-up."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_remote_mp import RemoteModelParallelStrategy, SpecSequential

    class LitMLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = SpecSequential(spec(cfg["width"], cfg["depth"], cfg["batch"]))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class WithLoss(nn.Module):
        """The MLP whose forward returns its loss, as a model called with ``labels=`` does."""

        def __init__(self) -> None:
            super().__init__()
            self.net = plain_mlp(cfg["width"], cfg["depth"])

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.mse_loss(self.net(x), y)

    class LitInside(LitMLP):
        def __init__(self) -> None:
            L.LightningModule.__init__(self)
            self.model = WithLoss()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(*batch)

    class LitInsidePre(LitInside):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(cfg["width"], cfg["width"])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return self.model(self.pre(x), y)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.cpu: list[float] = []
            self.messages: list[tuple[int, int]] = []  # ZeroMQ messages the driver sent and received so far

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())
            if len(self.ends) in (cfg["warmup"], total):
                self.cpu.append([time.process_time(), *(_common.process_cpu(p) for p in pids)])
                conns = trainer.strategy.session.conns
                self.messages.append((sum(c.sent_messages for c in conns), sum(c.received_messages for c in conns)))

    class Repeat(torch.utils.data.IterableDataset):
        def __init__(self, n: int) -> None:
            self.n = n
            self.batch = make_batch(cfg["width"], cfg["batch"])

        def __iter__(self):
            for _ in range(self.n):
                yield self.batch

    total = cfg["warmup"] + cfg["steps"]
    torch.manual_seed(0)
    timer = StepTimer()
    if inside:
        strategy = RemoteModelParallelStrategy(hosts=addresses, split=["model"], microbatches=m, schedule=schedule)
    else:
        strategy = RemoteModelParallelStrategy(
            hosts=addresses, balance=[cfg["depth"], cfg["depth"]], microbatches=m, split_backward=split
        )
    trainer = _common.timed_trainer(strategy, total, [timer])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = (LitInsidePre() if pre else LitInside()) if inside else LitMLP()
        trainer.fit(module, torch.utils.data.DataLoader(Repeat(total), batch_size=None))
    if len(timer.ends) != total:
        raise RuntimeError(f"lrmp m={m}: {len(timer.ends)} steps ran, expected {total}")
    (sent0, received0), (sent1, received1) = timer.messages
    name = f"loss in the model{', input grad' if pre else ''}, {schedule}, m={m}" if inside else f"m={m}"
    MESSAGES[name] = ((sent1 - sent0) / cfg["steps"], (received1 - received0) / cfg["steps"])
    return timer.ends[-1] - timer.ends[cfg["warmup"] - 1], [b - a for a, b in zip(*timer.cpu)]


#: For each micro-batch count, the ZeroMQ messages lrmp's driver sent and received per timed step
#: (the same in every round and for every split_backward: what a step costs in hand-offs).
MESSAGES: dict[str, tuple[float, float]] = {}


# --- (c) torch.distributed.pipelining ------------------------------------------------------------
def pp_rank(rank: int, store: str, cfg: dict[str, Any]) -> int:
    """One rank of the torch pipeline: serves commands (one JSON line each) read from stdin."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    on_gpu = torch.device(cfg["device"]).type == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    full = plain_mlp(cfg["width"], cfg["depth"])
    half = len(full) // 2
    module = (full[:half] if rank == 0 else full[half:]).to(device)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    x, y = make_batch(cfg["width"], cfg["batch"], str(device))
    schedules = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
    print("ready", flush=True)
    try:
        for _ in range(10_000):
            line = sys.stdin.readline()
            if not line:
                break
            cmd = json.loads(line)
            if cmd.get("cmd") == "quit":
                break
            stage = PipelineStage(module, rank, 2, device)
            schedule = schedules[cmd["schedule"]](stage, n_microbatches=cmd["m"], loss_fn=F.mse_loss)

            def step(schedule: Any = schedule) -> None:
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y)
                opt.step()
                opt.zero_grad(set_to_none=True)

            for _ in range(cmd["warmup"]):
                step()
            synchronize(str(device))
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(cmd["steps"]):
                step()
            synchronize(str(device))
            c1 = time.process_time()
            dist.barrier()
            print(json.dumps({"seconds": time.perf_counter() - t0, "cpu": c1 - c0}), flush=True)
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip the interpreter's slow teardown of torch


class TorchPipeline:
    """Two persistent torch.distributed.pipelining ranks, driven one configuration at a time."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.tmp = tempfile.mkdtemp(prefix="lrmp-bench-pp-")
        store = os.path.join(self.tmp, "store")
        self.logs = [open(os.path.join(self.tmp, f"rank{r}.log"), "w+") for r in range(2)]
        cmd = [_common.python(), os.path.abspath(__file__), "--pp-config", json.dumps(cfg), "--pp-store", store]
        self.procs = [
            subprocess.Popen(
                [*cmd, "--pp-rank", str(r)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.logs[r],
                env=_common.child_env(1),
                text=True,
            )
            for r in range(2)
        ]
        self.readers = [_common.LineReader(p) for p in self.procs]

    def wait_ready(self, timeout: float = 120.0) -> None:
        for p in self.procs:
            if self._readline(p, timeout) != "ready":
                raise RuntimeError("a torch pipeline rank did not start")

    def _readline(self, proc: subprocess.Popen, timeout: float) -> str:
        line = self.readers[self.procs.index(proc)].readline(timeout)
        if line is None:
            self._fail(proc)
        return line.strip()

    def _fail(self, proc: subprocess.Popen) -> NoReturn:
        r = self.procs.index(proc)
        self.logs[r].seek(0)
        tail = self.logs[r].read()[-3000:]
        raise RuntimeError(f"torch pipeline rank {r} failed or timed out (exit {proc.poll()}):\n{tail}")

    def run(self, schedule: str, m: int, warmup: int, steps: int, timeout: float = 300.0) -> tuple[float, list[float]]:
        """Wall seconds (rank 0, barrier to barrier) and CPU seconds of each rank of the timed steps."""
        msg = json.dumps({"schedule": schedule, "m": m, "warmup": warmup, "steps": steps}) + "\n"
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(msg)
            p.stdin.flush()
        results = [json.loads(self._readline(p, timeout)) for p in self.procs]
        return results[0]["seconds"], [r["cpu"] for r in results]

    def close(self) -> None:
        for p in self.procs:
            try:
                if p.poll() is None and p.stdin is not None:
                    p.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                    p.stdin.flush()
            except OSError:
                pass
        _common.stop_processes(self.procs, grace=10)
        for f in self.logs:
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# --- the run ---------------------------------------------------------------------------------------
def configurations(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    configs = [("plain", "", 1)]
    configs += [("lrmp", "", m) for m in args.lrmp_m]
    configs += [("lrmp-nosplit", "", m) for m in args.lrmp_nosplit_m]
    configs += [("lrmp-split", "", m) for m in args.lrmp_split_m]
    configs += [("lrmp-inside", s, m) for s in args.lrmp_inside_schedules for m in args.lrmp_inside_m]
    configs += [("lrmp-inside-pre", s, m) for s in args.lrmp_inside_schedules for m in args.lrmp_inside_pre_m]
    configs += [("torch", s, m) for s in args.schedules for m in args.torch_m]
    return configs


def label(kind: str, schedule: str, m: int) -> str:
    if kind == "plain":
        return "(a) plain PyTorch, 1 process"
    if kind == "lrmp":
        return f"(b) lrmp + Lightning, m={m}"
    if kind == "lrmp-nosplit":
        return f"(b) lrmp, m={m}, split_backward=False"
    if kind == "lrmp-split":
        return f"(b) lrmp, m={m}, split_backward=True"
    if kind == "lrmp-inside":
        return f"(b') lrmp, loss in the model, {schedule.upper().replace('_', '-')}, m={m}"
    if kind == "lrmp-inside-pre":
        return f"(b'') lrmp, (b') + input grad, {schedule.upper().replace('_', '-')}, m={m}"
    return f"(c) torch {schedule}, m={m}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run: small model, few steps, one round")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=8, help="blocks of Linear+ReLU (2 layers each)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from timing (>= 1)")
    p.add_argument("--steps", type=int, default=15, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds; each runs every configuration once")
    p.add_argument("--lrmp-m", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--lrmp-nosplit-m", type=int, nargs="*", default=[4], help="lrmp with split_backward=False")
    p.add_argument("--lrmp-split-m", type=int, nargs="*", default=[], help="lrmp with split_backward=True")
    p.add_argument(
        "--lrmp-inside-m", type=int, nargs="*", default=[], help="lrmp, the loss in the traced model, schedule='1f1b'"
    )
    p.add_argument("--lrmp-inside-pre-m", type=int, nargs="*", default=[], help="(b') behind a Linear on the driver")
    p.add_argument(
        "--lrmp-inside-schedules",
        nargs="+",
        default=["1f1b"],
        choices=["gpipe", "1f1b", "zero_bubble"],
        help="the schedules of --lrmp-inside-m",
    )
    p.add_argument("--torch-m", type=int, nargs="+", default=[4, 8])
    p.add_argument("--schedules", nargs="+", default=["GPipe", "1F1B"], choices=["GPipe", "1F1B"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model computes")
    p.add_argument("--out", default=_common.RESULTS, help="folder for throughput.png and throughput.json")
    p.add_argument("--pp-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--pp-store", help=argparse.SUPPRESS)
    p.add_argument("--pp-config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.batch, args.warmup, args.steps, args.rounds = 256, 64, 1, 3, 1
        args.lrmp_m, args.lrmp_nosplit_m, args.torch_m, args.lrmp_inside_m = [1, 2], [2], [2], [2]
    args.warmup = max(1, args.warmup)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device here")
        if torch.cuda.device_count() < 2 and args.torch_m:
            print("one GPU: torch.distributed.pipelining's configurations are left out (NCCL needs a GPU per rank)")
            args.torch_m = []
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pp_rank is not None:
        return pp_rank(args.pp_rank, args.pp_store, json.loads(args.pp_config))

    from lightning_remote_mp.driver.launch import LocalWorkers

    torch.set_num_threads(1)
    _common.exit_on_sigterm()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    cfg = {k: getattr(args, k) for k in ("width", "depth", "batch", "warmup", "steps", "device")}
    configs = configurations(args)
    print(f"# Training throughput ({'quick' if args.quick else 'full'} run)")
    print(
        f"MLP {args.depth} x (Linear({args.width}, {args.width}) + ReLU), batch {args.batch}, float32, SGD, "
        f"on {args.device}; "
        f"{args.warmup} warm-up + {args.steps} timed steps per configuration, {args.rounds} round(s)."
    )
    print(_common.environment(), flush=True)

    devices = ["cpu", "cpu"]
    if args.device == "cuda":
        devices = ["cuda:0", f"cuda:{min(1, torch.cuda.device_count() - 1)}"]
    workers = LocalWorkers(2, devices=devices, threads=1)
    pipeline: TorchPipeline | None = None
    seconds: dict[tuple[str, str, int], list[float]] = {c: [] for c in configs}
    cpu: dict[tuple[str, str, int], list[float]] = {c: [] for c in configs}  # CPU s per step, all processes
    cpu_split: dict[tuple[str, str, int], list[list[float]]] = {c: [] for c in configs}  # ... per process
    ratios: dict[tuple[str, str, int], list[float]] = {c: [] for c in configs}
    penalty: dict[int, list[float]] = {m: [] for m in sorted({1, *(c[2] for c in configs)})}
    best_vs_torch: list[float] = []
    started = time.perf_counter()
    try:
        # Start everything at once: the children import torch while this process imports Lightning.
        if any(c[0] == "torch" for c in configs):
            pipeline = TorchPipeline(cfg)
        addresses = workers.start()
        pids = [p.pid for p in workers.procs]
        import lightning  # noqa: F401

        if pipeline is not None:
            pipeline.wait_ready()
        for r in range(args.rounds):
            # Rotate the order every round so that no configuration always runs first or last.
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            this_round: dict[tuple[str, str, int], float] = {}
            for c in order:
                kind, schedule, m = c
                if kind == "plain":
                    s, cpu_s = run_plain(cfg)
                elif kind.startswith("lrmp"):
                    split = {"lrmp-split": True, "lrmp-nosplit": False}.get(kind, "auto")
                    inside = kind.startswith("lrmp-inside")
                    sched = schedule if inside else "1f1b"
                    s, cpu_s = run_lrmp(cfg, addresses, pids, m, split, inside, sched, kind == "lrmp-inside-pre")
                else:
                    assert pipeline is not None
                    s, cpu_s = pipeline.run(schedule, m, args.warmup, args.steps)
                seconds[c].append(s)
                cpu[c].append(sum(cpu_s) / args.steps)
                cpu_split[c].append([v / args.steps for v in cpu_s])
                this_round[c] = args.steps * args.batch / s
                print(f"  round {r + 1}: {label(*c):34s} {this_round[c]:10,.0f} samples/s", flush=True)
            # The micro-batching penalty, measured in this round: CPU time, so less sensitive to load.
            cpu_of = {m: microbatch_cpu(cfg, m, 1 if args.quick else 3) for m in penalty}
            for m in penalty:
                penalty[m].append(cpu_of[m] / cpu_of[1])
            base = this_round[configs[0]]
            for c in configs:
                ratios[c].append(this_round[c] / base)
            lrmp_best = max((v for c, v in this_round.items() if c[0].startswith("lrmp")), default=None)
            torch_best = max((v for c, v in this_round.items() if c[0] == "torch"), default=None)
            if lrmp_best and torch_best:
                best_vs_torch.append(lrmp_best / torch_best)
    finally:
        if pipeline is not None:
            pipeline.close()
        workers.stop()

    rows, results = [], []
    for c in configs:
        rates = [args.steps * args.batch / s for s in seconds[c]]
        rate = _common.median(rates)
        pen = _common.median(penalty[c[2]])
        ceil = ceiling(c[2], pen) if c[0] in ("torch", "lrmp-nosplit") else None
        rows.append(
            [
                label(*c),
                f"{rate:,.0f}",
                _common.spread(rates),
                f"{_common.median(ratios[c]):.2f}x",
                f"{pen:.2f}x",
                f"{ceil:.2f}x" if ceil else "-",
                f"{_common.median(cpu[c]) * 1e3:,.0f}",
            ]
        )
        results.append(
            {
                "config": label(*c),
                "kind": c[0],
                "schedule": c[1],
                "m": c[2],
                "samples_per_s": rates,
                "ratio_to_plain": ratios[c],
                "microbatch_penalty": penalty[c[2]],
                "ceiling_x_plain": ceil,
                "cpu_s_per_step": cpu[c],
                "cpu_s_per_step_by_process": cpu_split[c],
            }
        )
    print()
    print(
        _common.markdown_table(
            [
                "configuration",
                "samples/s (median)",
                "min-max",
                "x (a), same round",
                "micro-batch CPU penalty",
                "GPipe ceiling, x (a)",
                "CPU ms/step, all processes",
            ],
            rows,
        )
    )
    split_rows = []
    for c in configs:
        per = [_common.median(v) * 1e3 for v in zip(*cpu_split[c])]
        names = {"plain": ["process"], "torch": ["rank 0", "rank 1"]}.get(c[0], ["driver", "stage 0", "stage 1"])
        split_rows.append([label(*c), ", ".join(f"{n} {v:,.0f}" for n, v in zip(names, per))])
    print()
    print(_common.markdown_table(["configuration", "CPU ms per step, by process (median)"], split_rows))
    lrmp_cfgs = [c for c in configs if c[0].startswith("lrmp")]
    if lrmp_cfgs:
        best = max(lrmp_cfgs, key=lambda c: _common.median(ratios[c]))
        print(f"\nbest lrmp: {label(*best)} at {_common.median(ratios[best]):.2f}x (a) (target >= 1.25x)")
    if best_vs_torch:
        print(
            f"best lrmp / best torch schedule, same round: median {_common.median(best_vs_torch):.2f}x "
            f"(rounds: {', '.join(f'{v:.2f}' for v in best_vs_torch)})"
        )
    if MESSAGES:
        per_m = ", ".join(f"{m}: {out:g} out, {back:g} in" for m, (out, back) in sorted(MESSAGES.items()))
        print(f"driver's ZeroMQ messages per step (lrmp): {per_m}")
    print(f"wall time {time.perf_counter() - started:.0f} s")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "throughput.json"), "w") as f:
        json.dump(
            {"config": cfg, "rounds": args.rounds, "results": results, "best_vs_torch": best_vs_torch}, f, indent=1
        )
    plot(results, args, os.path.join(args.out, "throughput.png"))
    return 0


def plot(results: list[dict[str, Any]], args: argparse.Namespace, path: str) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    colors = {
        "plain": "tab:gray",
        "lrmp": "tab:blue",
        "lrmp-nosplit": "tab:cyan",
        "lrmp-split": "tab:purple",
        "torch": "tab:orange",
    }
    fig, ax = plt.subplots(figsize=(10, 5))
    names = [r["config"] for r in results]
    med = [_common.median(r["samples_per_s"]) for r in results]
    lo = [m - min(r["samples_per_s"]) for m, r in zip(med, results)]
    hi = [max(r["samples_per_s"]) - m for m, r in zip(med, results)]
    xs = range(len(results))
    ax.bar(xs, med, yerr=[lo, hi], capsize=4, color=[colors[r["kind"]] for r in results])
    ceil_x = [i for i, r in zip(xs, results) if r["ceiling_x_plain"]]
    if ceil_x:
        ceil_y = [results[i]["ceiling_x_plain"] * med[0] for i in ceil_x]
        ax.scatter(ceil_x, ceil_y, marker="_", s=600, color="black", zorder=3)
        ax.scatter([], [], marker="_", s=200, color="black", label="GPipe ceiling (plain backward) on 2 idle cores")
    ax.axhline(med[0], color="tab:gray", linestyle="--", linewidth=1, label="(a) one process")
    ax.axhline(1.25 * med[0], color="tab:green", linestyle=":", linewidth=1, label="1.25 x (a)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([n.split(" ", 1)[1] for n in names], rotation=30, ha="right")
    ax.set_ylabel("samples / s (median, bars: min-max)")
    ax.set_title(
        f"MLP {args.depth}x Linear({args.width})+ReLU, batch {args.batch}, 1 thread per process, {args.rounds} rounds"
    )
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    _common.exit_now(main())
