"""A pipelined message's cost in the driver's and the workers' Python: a 1F1B micro-batch's `Forward`
from the driver to stage 0 and a `Backward` from stage 1 to stage 0, built, written (``body()``),
encoded (`protocol.encode`), decoded (`protocol.decode_all`) and read as the worker reads it
(`worker.request.parse`), µs per message, send and receive together (median of rounds of 5,000,
the garbage collector on, as a worker runs). The tensors travel as zero-copy frames on every
version, so what is timed is the metadata's handling.

``--base DIR`` times another checkout beside this one (its root on ``PYTHONPATH`` in a child
process), e.g. ``git worktree add /tmp/base 0f607a1``.

    python benchmarks/messages.py                     # this checkout (about 20 s)
    python benchmarks/messages.py --base /tmp/base    # and another one, in the same run
    python benchmarks/messages.py --quick             # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import timeit
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def child(rounds: int, number: int) -> dict[str, dict[str, float]]:
    """The timings in this process, of the lrmp on its path."""
    import dataclasses

    import torch

    from lightning_remote_mp.wire import protocol
    from lightning_remote_mp.wire.messages import Backward, Forward
    from lightning_remote_mp.worker.request import parse

    g = torch.Generator().manual_seed(0)
    inputs = (torch.randint(0, 512, (8, 128), generator=g), torch.randint(0, 512, (8, 128), generator=g))
    grad = torch.randn(8, 128, 64, generator=g)
    names = getattr(Forward, "__struct_fields__", None) or [f.name for f in dataclasses.fields(Forward)]
    loss = {"loss_output": 0} if "loss_output" in names else {"seed": 0}  # its name before 0.17

    def forward() -> Any:
        return Forward(
            key="model",
            call=41,
            mb=1,
            sender=-1,
            fence={0: 17, 1: 12},
            microbatches=4,
            x=inputs,
            requires_grad={"x": [False, False]},
            grad=True,
            modes=True,
            schedule="1f1b",
            **loss,
        )

    def backward() -> Any:
        return Backward(key="model", call=41, mb=1, sender=1, grad_out=grad, fence={0: 17, 1: 12}, microbatches=4)

    out = {}
    for name, build in (("Forward", forward), ("Backward", backward)):
        msg = build()
        body = msg.body()
        frames = protocol.encode(msg.KIND, 3, "session", body)
        decoded = protocol.decode_all(frames)

        def whole(build: Any = build) -> Any:
            m = build()
            return [parse(b"peer", d) for d in protocol.decode_all(protocol.encode(m.KIND, 3, "session", m.body()))]

        phases = {
            "whole": whole,
            "build": build,
            "body()": msg.body,
            "encode": lambda msg=msg, body=body: protocol.encode(msg.KIND, 3, "session", body),
            "decode": lambda frames=frames: protocol.decode_all(frames),
            "parse": lambda decoded=decoded: [parse(b"peer", d) for d in decoded],
        }
        out[name] = {phase: _us(fn, rounds, number) for phase, fn in phases.items()}
    return out


def _us(fn: Any, rounds: int, number: int) -> float:
    """µs per call: the median of ``rounds`` rounds of ``number`` calls, the collector on."""
    return 1e6 * statistics.median(timeit.repeat(fn, repeat=rounds, number=number, setup="gc.enable()")) / number


def run(path: str | None, rounds: int, number: int) -> dict[str, dict[str, float]]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if path:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(rounds), str(number)]
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=path or ROOT, timeout=600)
    if got.returncode:
        raise RuntimeError(got.stderr[-3000:])
    return json.loads(got.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="another checkout of lrmp (its repository root), timed beside this one")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results"), help="folder for messages.json")
    p.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        import lightning_remote_mp

        print(json.dumps({"from": os.path.dirname(lightning_remote_mp.__file__), **child(*args.child)}))
        return
    rounds, number = (3, 200) if args.quick else (7, 5000)
    runs = {"this checkout": run(None, rounds, number)}
    if args.base:
        runs[f"at {os.path.basename(os.path.normpath(args.base))}"] = run(os.path.abspath(args.base), rounds, number)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "messages.json"), "w") as f:
        json.dump(runs, f, indent=1)
    for name, r in runs.items():
        print(f"{name}: lrmp from {r.pop('from')}")
    for message in ("Forward", "Backward"):
        print(f"\n{message}, µs per message")
        phases = list(next(iter(runs.values()))[message])
        print("| phase | " + " | ".join(runs) + (" | ratio |" if len(runs) == 2 else " |"))
        print("|---" * (len(runs) + 1 + (len(runs) == 2)) + "|")
        for phase in phases:
            values = [r[message][phase] for r in runs.values()]
            ratio = f" | {values[1] / values[0]:.2f}x" if len(values) == 2 else ""
            print(f"| {phase} | " + " | ".join(f"{v:,.1f}" for v in values) + ratio + " |")


if __name__ == "__main__":
    main()
