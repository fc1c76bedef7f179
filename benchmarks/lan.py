"""LAN: lrmp against torch.distributed.pipelining across emulated hosts, at several link rates.

Hosts are network namespaces on a bridge, every link shaped with tc's token bucket filter
(``tests/lrmp_lan.py``; needs root and iproute2, as the suite's LAN tests do). Host 0 is this
process; hosts 1 and 2 hold the two pipeline stages. The model is a causal LM with a real
vocabulary (32,000 tokens): embedding and learned positions, ``depth`` pre-LN transformer blocks,
a LayerNorm and the LM head, the cross-entropy loss computed inside the module (as HF's
``labels=``). Both sides split it the same way (after block ``depth // 2``), run GPipe over the
same micro-batches, and compute the loss on the last stage:

(a) ``lrmp``: an unchanged ``nn.Module`` inside a LightningModule, ``Trainer(strategy=
    RemoteModelParallelStrategy(hosts=[host 1, host 2], split=["model"], balance=...))``; the
    driver on host 0 sends the token ids and labels and receives the loss. ``lrmp bf16`` adds
    ``compression="bf16"`` (activations and their gradients travel as bfloat16);
    With ``--dial-in``, ``lrmp dial-in`` runs workers that dial the driver (``lrmp-worker
    --connect``; they listen on nothing), so the boundary goes host 1 -> host 0 -> host 2, relayed
    by the driver's switchboard: what a pipeline of workers behind NAT costs;
(b) ``torch``: ``torch.distributed.pipelining``, a hand-built ``PipelineStage`` per host (rank 0 on
    host 1 reads the batch, rank 1 on host 2 computes the loss), ``ScheduleGPipe``, gloo over the
    same links.

Every process computes with one torch thread. For each link rate the links are reshaped (after
lrmp's first step: placing the stages ships the weights, 33 MB here, which is setup, not step
time) and each configuration runs ``--warmup`` steps and then ``--steps`` timed steps. Printed per
rate and configuration: steps/s (median over rounds), the same round's ratio to torch, and the
bytes per step that crossed each host's interface (received + sent, from the kernel's counters),
over the timed steps only. A first table measures each rate's raw TCP throughput between hosts 1
and 2, for the model in ``benchmarks/README.md``.

    python benchmarks/lan.py             # 10gbit, 1gbit, 100mbit and 10mbit; 3 rounds (~10 min)
    python benchmarks/lan.py --quick     # smoke run (one rate, tiny model; ~40 s)
    python benchmarks/lan.py --dial-in --rates 1gbit,100mbit   # and workers that dial in
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
import _common  # noqa: E402

LR = 1e-3
CONFIGS = ("lrmp", "lrmp bf16", "torch")


# --- the model ---------------------------------------------------------------------------------
class Block(nn.Module):
    """A pre-LN transformer block under a causal mask it makes itself (so only the hidden state
    crosses a stage boundary)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(h.shape[1], device=h.device)
        return self.layer(h, src_mask=mask, is_causal=False)


class CausalLM(nn.Module):
    """``forward(ids, labels)`` returns the mean cross-entropy of the next-token logits."""

    def __init__(self, vocab: int, width: int, heads: int, depth: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def trunk(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids) + self.pos[: ids.shape[1]]

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.trunk(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class FirstStage(nn.Module):
    def __init__(self, lm: CausalLM, cut: int) -> None:
        super().__init__()
        self.lm, self.cut = lm, cut

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.lm.trunk(ids)
        for block in self.lm.blocks[: self.cut]:
            h = block(h)
        return h


class LastStage(nn.Module):
    def __init__(self, lm: CausalLM, cut: int) -> None:
        super().__init__()
        self.blocks, self.norm, self.head = lm.blocks[cut:], lm.norm, lm.head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def make_lm(cfg: dict[str, Any]) -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(cfg["vocab"], cfg["width"], cfg["heads"], cfg["depth"], cfg["seq"])


def make_batch(cfg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    return ids, ids.roll(-1, dims=1)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# --- the emulated LAN's counters -----------------------------------------------------------------
def link_bytes(lan: Any) -> list[int]:
    """Bytes received + sent so far on each host's interface."""
    out = []
    for i in range(lan.hosts):
        ns = lan.namespace(i)
        device = "eth0" if ns else lan._host_link
        cmd = ["ip", "-s", "-j", *(["-n", ns] if ns else []), "link", "show", "dev", device]
        stats = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout)
        s64 = stats[0]["stats64"]
        out.append(s64["rx"]["bytes"] + s64["tx"]["bytes"])
    return out


def shape_all(lan: Any, rate: str) -> None:
    for i in range(lan.hosts):
        lan.shape(i, rate)


# --- raw link throughput ---------------------------------------------------------------------------
SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if t0 is None: t0 = time.perf_counter()
    if not b: break
    n += len(b)
print(n, time.perf_counter() - t0, flush=True)
"""
SOURCE = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=120)
block = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])): c.sendall(block)
c.close()
"""


def raw_throughput(lan: Any, rate_bps: float) -> float:
    """MB/s of one TCP stream from host 1 to host 2 (about 2 s of data at the nominal rate)."""
    mib = max(2, min(256, int(rate_bps / 8 * 2 / (1 << 20))))
    sink = lan.popen(2, [sys.executable, "-c", SINK, lan.addr(2)], stdout=subprocess.PIPE, text=True)
    reader = _common.LineReader(sink)
    port = reader.readline(30)
    if port is None:
        raise RuntimeError("the throughput sink did not start")
    source = lan.popen(1, [sys.executable, "-c", SOURCE, lan.addr(2), port.strip(), str(mib)])
    source.wait(120)
    done = reader.readline(120)
    if done is None:
        raise RuntimeError("the throughput sink did not finish")
    n, seconds = done.split()
    return int(n) / float(seconds) / 1e6


def rate_bps(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"link rate {rate!r}: write it as tc does, e.g. 100mbit or 1gbit")


# --- (a) lrmp ----------------------------------------------------------------------------------------
def run_lrmp(
    cfg: dict[str, Any], lan: Any, hosts: list[str], rate: str, compression: str | None, listen: str | None = None
) -> dict[str, Any]:
    import lightning as L

    from lightning_remote_mp import RemoteModelParallelStrategy

    warmup, steps = cfg["warmup"], cfg["steps"]
    ids, labels = make_batch(cfg)
    cut = cfg["depth"] // 2

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_lm(cfg)
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = self.model(*batch)
            self.losses.append(float(loss))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.t0 = self.t1 = 0.0
            self.b0: list[int] = []
            self.b1: list[int] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:  # the stages are placed (weights shipped) during the first step
                shape_all(lan, rate)
            if batch_idx == warmup:
                self.b0, self.t0 = link_bytes(lan), time.perf_counter()
            if batch_idx == warmup + steps:
                self.t1 = time.perf_counter()
                self.b1 = link_bytes(lan)
                shape_all(lan, "10gbit")  # fit's end brings the weights back: setup, not step time

    total = 1 + warmup + steps
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(ids.repeat(total, 1), labels.repeat(total, 1)), batch_size=cfg["batch"]
    )
    clock = Clock()
    module = Module()
    strategy = RemoteModelParallelStrategy(
        hosts=hosts,
        split=["model"],
        balance={"model": [f"blocks.{cut}"]},
        microbatches=cfg["m"],
        compression=compression,
        connect_timeout=60.0,
        listen=listen,
    )
    trainer = _common.timed_trainer(strategy, total, [clock])
    shape_all(lan, "10gbit")
    try:
        trainer.fit(module, data)
    finally:
        shape_all(lan, "10gbit")
    seconds = clock.t1 - clock.t0
    return {
        "steps_per_s": steps / seconds,
        "bytes": [(b - a) / steps for a, b in zip(clock.b0, clock.b1)],
        "first_loss": module.losses[0],
    }


# --- (b) torch.distributed.pipelining ----------------------------------------------------------------
def pp_rank(rank: int, init: str, cfg: dict[str, Any]) -> int:
    """One rank of the torch pipeline, on its own host: serves commands (a JSON line each) from stdin."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    lm = make_lm(cfg)
    cut = cfg["depth"] // 2
    module: nn.Module = FirstStage(lm, cut) if rank == 0 else LastStage(lm, cut)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    ids, labels = make_batch(cfg)
    print("ready", flush=True)
    try:
        for _ in range(10_000):
            cmd = json.loads(sys.stdin.readline() or '{"cmd": "quit"}')
            if cmd["cmd"] == "quit":
                break
            stage = PipelineStage(module, rank, 2, torch.device("cpu"))
            schedule = ScheduleGPipe(stage, n_microbatches=cfg["m"], loss_fn=lm_loss)
            first: list[float] = []  # the first step's loss (the schedule's list holds the last step's)

            def step(schedule: Any = schedule, first: list = first) -> None:
                losses: list[torch.Tensor] = []
                if rank == 0:
                    schedule.step(ids)
                else:
                    schedule.step(target=labels, losses=losses)
                    if not first:
                        first.append(float(torch.stack(losses).mean()))
                opt.step()
                opt.zero_grad(set_to_none=True)

            for _ in range(cmd["warmup"]):
                step()
            dist.barrier()
            print("warm", flush=True)
            sys.stdin.readline()  # the parent has read the counters
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(cmd["steps"]):
                step()
            dist.barrier()
            seconds = time.perf_counter() - t0
            print(json.dumps({"seconds": seconds, "first_loss": first[0] if first else None}), flush=True)
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)


class TorchPipeline:
    """Two persistent torch pipeline ranks, on hosts 1 and 2."""

    def __init__(self, cfg: dict[str, Any], lan: Any) -> None:
        init = f"tcp://{lan.addr(1)}:{random.randint(20000, 60000)}"
        cmd = [_common.python(), os.path.abspath(__file__), "--pp-config", json.dumps(cfg), "--pp-init", init]
        env = {**_common.child_env(1), "GLOO_SOCKET_IFNAME": "eth0", "PYTHONPATH": os.pathsep.join(sys.path)}
        self.procs = [
            lan.popen(
                r + 1,
                [*cmd, "--pp-rank", str(r)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
            )
            for r in range(2)
        ]
        self.readers = [_common.LineReader(p) for p in self.procs]
        for r in range(2):
            self._expect(r, "ready", 120)

    def _line(self, r: int, timeout: float) -> str:
        line = self.readers[r].readline(timeout)
        if line is None:
            raise RuntimeError(f"torch pipeline rank {r} failed or timed out (exit {self.procs[r].poll()})")
        return line.strip()

    def _expect(self, r: int, word: str, timeout: float) -> None:
        line = self._line(r, timeout)
        if line != word:
            raise RuntimeError(f"torch pipeline rank {r}: expected {word!r}, read {line!r}")

    def _send(self, msg: str) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(msg + "\n")
            p.stdin.flush()

    def run(self, lan: Any, rate: str, warmup: int, steps: int) -> dict[str, Any]:
        shape_all(lan, rate)
        try:
            self._send(json.dumps({"cmd": "run", "warmup": warmup, "steps": steps}))
            for r in range(2):
                self._expect(r, "warm", 600)
            b0 = link_bytes(lan)
            self._send("go")
            results = [json.loads(self._line(r, 600)) for r in range(2)]
            b1 = link_bytes(lan)
        finally:
            shape_all(lan, "10gbit")
        return {
            "steps_per_s": steps / results[0]["seconds"],
            "bytes": [(b - a) / steps for a, b in zip(b0, b1)],
            "first_loss": results[1]["first_loss"],
        }

    def close(self) -> None:
        try:
            self._send(json.dumps({"cmd": "quit"}))
        except OSError:
            pass
        _common.stop_processes(self.procs, grace=10)


# --- the run -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="10gbit,1gbit,100mbit,10mbit", help="link rates, as tc writes them")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps per configuration and round")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="smoke run: one rate, a tiny model, one round")
    p.add_argument("--dial-in", action="store_true", help="also run workers that dial in (relayed by the driver)")
    p.add_argument("--out", default=_common.RESULTS)
    p.add_argument("--pp-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--pp-init", help=argparse.SUPPRESS)
    p.add_argument("--pp-config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.rounds, args.steps, args.warmup = "100mbit", 1, 1, 1
        args.width, args.depth, args.seq, args.batch, args.microbatches = 64, 2, 16, 4, 2
    return args


def model_bytes(cfg: dict[str, Any]) -> dict[str, float]:
    """What the model says crosses the links per step: the boundary's activations and gradients."""
    boundary = cfg["batch"] * cfg["seq"] * cfg["width"] * 4
    return {"boundary fp32 (fwd + bwd)": 2 * boundary, "boundary bf16 (fwd + bwd)": boundary}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pp_rank is not None:
        return pp_rank(args.pp_rank, args.pp_init, json.loads(args.pp_config))
    from lrmp_lan import Lan, LanUnavailable

    cfg = {
        "vocab": 32000,
        "width": args.width,
        "heads": 4,
        "depth": args.depth,
        "seq": args.seq,
        "batch": args.batch,
        "m": args.microbatches,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    for r in rates:
        rate_bps(r)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    print(_common.environment())
    print(
        f"causal LM: vocab {cfg['vocab']}, width {cfg['width']}, {cfg['depth']} blocks (cut after "
        f"{cfg['depth'] // 2}), batch {cfg['batch']} x seq {cfg['seq']}, {cfg['m']} micro-batches, GPipe; "
        f"{args.rounds} round(s) of {args.warmup} warm-up + {args.steps} timed steps"
    )

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        lan = Lan(3, "10gbit")
    except LanUnavailable as err:
        print(f"no emulated LAN here ({err}): run as root with iproute2")
        return 2
    pipeline = None
    try:
        raw = {}
        for r in rates:
            shape_all(lan, r)
            raw[r] = raw_throughput(lan, rate_bps(r))
        shape_all(lan, "10gbit")
        hosts = [lan.start_worker(i) for i in (1, 2)]
        configs = CONFIGS + (("lrmp dial-in",) if args.dial_in else ())
        listen = f"tcp://{lan.addr(0)}:{_common.free_port()}"
        dialed = [lan.start_worker(i, dial=listen) for i in (1, 2)] if args.dial_in else []
        pipeline = TorchPipeline(cfg, lan)
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for rnd in range(args.rounds):
            for r in rates:
                order = list(configs[rnd % len(configs) :] + configs[: rnd % len(configs)])
                for name in order:
                    if name == "torch":
                        res = pipeline.run(lan, r, 1 + args.warmup, args.steps)
                    elif name == "lrmp dial-in":
                        res = run_lrmp(cfg, lan, dialed, r, None, listen=listen)
                    else:
                        res = run_lrmp(cfg, lan, hosts, r, "bf16" if name.endswith("bf16") else None)
                    res["round"] = rnd
                    results.setdefault((r, name), []).append(res)
                    print(f"  round {rnd} {r:>8} {name:<10} {res['steps_per_s']:.3f} steps/s", flush=True)
    finally:
        if pipeline is not None:
            pipeline.close()
        lan.close()

    print("\nRaw TCP throughput, host 1 -> host 2 (one stream, Python sockets):\n")
    print(_common.markdown_table(["link", "MB/s"], [[r, f"{raw[r]:.1f}"] for r in rates]))
    print()
    rows = []
    for r in rates:
        torch_by_round = {x["round"]: x["steps_per_s"] for x in results[(r, "torch")]}
        for name in configs:
            runs = results[(r, name)]
            sps = [x["steps_per_s"] for x in runs]
            ratio = _common.median(x["steps_per_s"] / torch_by_round[x["round"]] for x in runs)
            per_host = [_common.median(x["bytes"][i] for x in runs) / 1e6 for i in range(3)]
            rows.append(
                [
                    r,
                    name,
                    f"{_common.median(sps):.3f}",
                    f"{min(sps):.3f}-{max(sps):.3f}",
                    f"{ratio:.2f}",
                    *[f"{b:.2f}" for b in per_host],
                ]
            )
    header = ["link", "config", "steps/s", "min-max", "x torch, same round", "MB/step host 0", "host 1", "host 2"]
    table = _common.markdown_table(header, rows)
    print(table)
    expected = model_bytes(cfg)
    print("\nper step, by the model: " + "; ".join(f"{k} {v / 1e6:.2f} MB" for k, v in expected.items()))
    first = {name: results[(rates[0], name)][0]["first_loss"] for name in configs}
    print("first step's loss: " + ", ".join(f"{k} {v:.4f}" for k, v in first.items() if v is not None))
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lan.json"), "w") as f:
            json.dump(
                {
                    "config": cfg,
                    "raw_MBps": raw,
                    "runs": {f"{r} | {n}": v for (r, n), v in results.items()},
                },
                f,
                indent=1,
            )
        with open(os.path.join(args.out, "lan.txt"), "w") as f:
            f.write(table + "\n")
    if any(math.isnan(float(row[2])) for row in rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
