"""Where a decode step's time goes between the driver and the stages, hop by hop (issue #48).

``benchmarks/generate.py`` splits a token's time into compute, stage-to-stage transfers and the
rest. This script takes the rest apart: the driver and each worker note the monotonic clock (one
clock for every process of a machine) each time a message passes a point on its way, and the
script prints the median of each interval over the decode steps, in the order a token goes:

- the driver: from ``generation_step`` to the send (working out the micro-batches, the message,
  its encoding), the send, then from the result's receipt to the step's return;
- each worker: from the receipt to decoding the frames (``protocol.decode_all``), reading the
  typed message (``request.parse``), the dispatch to the stage's action (runtime, route, executor),
  the stage's program (``run_layers``), what follows it up to the encoding of the output, the
  encoding, the send;
- between them: from a send to the receiver's receipt (ZeroMQ's I/O threads, the kernel, the
  receiver's wake-up).

Then the same code once more in this process, on a message shaped like the one stage 1 receives
(the hidden state of one token, the attention mask, the positions): ``decode_all`` and ``parse``
timed back to back (warm caches), after streaming 64 MB through the caches (what a decode step's
weights do to them), and after sleeping 20 ms (a stage's turn between two of its own).

A generation with the model of ``benchmarks/generate.py`` (a 22 M-parameter Llama) through 2 local
workers, one torch thread each, the driver one: a warm-up, then ``--repeats`` timed generations of
``--new-tokens`` tokens after a prompt of ``--prompt``. The workers note the clock through a
``sitecustomize`` module that this script puts first on their path (``LRMP_HOPS`` names where they
write); nothing in lightning_remote_mp changes. The wrappers cost about a microsecond a point.

    python benchmarks/hops.py            # about a minute on 2 cores
    python benchmarks/hops.py --quick    # a tiny model
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MARKS: list[tuple[str, int]] = []


def mark(name: str) -> None:
    MARKS.append((name, time.monotonic_ns()))


def _around(owner: Any, name: str, label: str) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        mark(label + " <")
        try:
            return fn(*args, **kwargs)
        finally:
            mark(label + " >")

    setattr(owner, name, timed)


def install(role: str) -> None:
    """Note the clock in this process (``role``: "driver" or "worker") where a message passes."""
    import zmq

    from lightning_remote_mp.wire import protocol, sockets, transport

    recv = zmq.Socket.recv_multipart

    def recv_multipart(self: Any, *args: Any, **kwargs: Any) -> Any:
        frames = recv(self, *args, **kwargs)
        mark("received")
        return frames

    zmq.Socket.recv_multipart = recv_multipart  # type: ignore[method-assign]
    _around(sockets, "send_frames", "send")  # every send: the workers' (by the module), the driver's (its own name)
    transport.send_frames = sockets.send_frames
    _around(protocol, "encode", "encode")
    _around(protocol, "decode_all", "decode")
    if role == "worker":
        from lightning_remote_mp.worker import server, stage

        _around(server, "parse", "parse")
        _around(stage, "run_layers", "program")
    else:
        from lightning_remote_mp.driver.pipeline import RemoteSpec

        _around(RemoteSpec, "generation_step", "step")


def install_from_env() -> None:
    """In a worker started with ``LRMP_HOPS`` set: `install`, and write the notes there each second."""
    folder = os.environ.get("LRMP_HOPS")
    if not folder or "lightning_remote_mp.worker" not in " ".join(getattr(sys, "orig_argv", sys.argv)):
        return
    install("worker")
    path = os.path.join(folder, f"worker-{os.getpid()}.txt")

    def write() -> None:
        done = 0
        while True:
            time.sleep(1.0)
            upto = len(MARKS)
            with open(path, "a") as f:
                f.writelines(f"{n} {t}\n" for n, t in MARKS[done:upto])
            done = upto

    threading.Thread(target=write, daemon=True).start()


def _steps(events: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """The events of each decode step: from a driver's ``step <`` to its ``step >``."""
    steps, current = [], None
    for ev in events:
        if ev[1] == "driver" and ev[2] == "step <":
            current = [ev]
        elif current is not None:
            current.append(ev)
            if ev[1] == "driver" and ev[2] == "step >":
                steps.append(current)
                current = None
    return steps


def _common_steps(events: list[tuple[int, str, str]]) -> list[list[tuple[int, str, str]]]:
    """The decode steps that went the most common way (no heartbeat among their messages)."""
    steps = _steps(sorted(events))
    shapes = Counter(tuple((who, what) for _, who, what in s) for s in steps)
    shape = shapes.most_common(1)[0][0]
    return [s for s in steps if tuple((who, what) for _, who, what in s) == shape]


def program_times(events: list[tuple[int, str, str]]) -> list[float]:
    """Each stage's median program time in a decode step, ms, in the stages' order."""
    same = _common_steps(events)
    out = []
    for k, (_, _who, what) in enumerate(same[0]):
        if what == "program <":
            out.append(statistics.median((s[k + 1][0] - s[k][0]) / 1e6 for s in same))
    return out


def totals(events: list[tuple[int, str, str]]) -> list[float]:
    """Each common decode step's time from the driver's ``step <`` to its ``step >``, µs."""
    return [(s[-1][0] - s[0][0]) / 1e3 for s in _common_steps(events)]


def table(events: list[tuple[int, str, str]]) -> str:
    steps, same = _steps(sorted(events)), _common_steps(events)
    shape, count = tuple((who, what) for _, who, what in same[0]), len(same)
    rows = ["| from | to | µs (median) | share |", "|---|---|---|---|"]
    total = statistics.median((s[-1][0] - s[0][0]) / 1e3 for s in same)
    program = 0.0
    for k in range(1, len(shape)):
        us = statistics.median((s[k][0] - s[k - 1][0]) / 1e3 for s in same)
        if shape[k - 1][1] == "program <":
            program += us
        rows.append(f"| {' '.join(shape[k - 1])} | {' '.join(shape[k])} | {us:,.1f} | {us / total:.1%} |")
    rows.append(f"| step < | step > | {total:,.1f} | 100% |")
    return (
        f"{count} of {len(steps)} decode steps went the most common way (the others also carried a heartbeat);"
        f" the stages' programs took {program / 1e3:.2f} ms of {total / 1e3:.2f}, the rest "
        f"{(total - program) / 1e3:.2f} ms.\n\n" + "\n".join(rows)
    )


def hot_and_cold(prompt: int, hidden: int) -> str:
    """``decode_all`` and ``parse`` of a stage's decode-step input: warm, after 64 MB, after 20 ms asleep."""
    import torch
    import zmq

    from lightning_remote_mp.wire import protocol
    from lightning_remote_mp.wire.messages import Forward, Generation
    from lightning_remote_mp.worker.request import parse

    x = (torch.randn(1, 1, hidden), torch.ones(1, prompt + 1, dtype=torch.long), torch.tensor([[prompt]]))
    step = Generation(1, prompt + 8, None)
    body = Forward(key="model", call=7, mb=0, sender=0, x=x, modes=[False] * 12, generation=step)
    frames = [zmq.Frame(bytes(f)) for f in protocol.encode(protocol.FORWARD, 9, "session", body.body())]
    junk = torch.ones(16 * 1024 * 1024)

    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        messages = protocol.decode_all(frames)
        t1 = time.perf_counter()
        for m in messages:
            parse(b"peer", m)
        return (t1 - t0) * 1e6, (time.perf_counter() - t1) * 1e6

    def streamed() -> tuple[float, float]:
        junk.mul_(1.0)
        return once()

    def slept() -> tuple[float, float]:
        time.sleep(0.02)
        return once()

    rows = ["| caches | decode_all µs | parse µs |", "|---|---|---|"]
    for name, fn, n in (
        ("warm (back to back)", once, 300),
        ("after 64 MB", streamed, 100),
        ("after 20 ms asleep", slept, 60),
    ):
        times = [fn() for _ in range(n)]
        rows.append(
            f"| {name} | {statistics.median(a for a, _ in times):.1f} | {statistics.median(b for _, b in times):.1f} |"
        )
    return "\n".join(rows)


def _bare_stage(i: int, works_ms: list[float], endpoints: list[str], back: str, sizes: list[int]) -> None:
    """One stage of `bare_chain`: wait for a message, compute for its time (a busy loop), pass it on."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoints[i])
    out = ctx.socket(zmq.DEALER)
    out.connect(endpoints[i + 1] if i + 1 < len(works_ms) else back)
    payload = bytes(sizes[i])
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[1].bytes == b"stop":
            out.send_multipart([b"stop"])
            return
        start = time.perf_counter()
        while time.perf_counter() - start < works_ms[i] / 1e3:
            pass
        out.send_multipart([b"h" * 300, payload], copy=False)


def bare_chain(works_ms: list[float], tokens: int = 300) -> float:
    """The same hops with no lrmp at all: this process sends a token to stage 0 and waits for the
    last stage's answer, over pyzmq's DEALER and ROUTER sockets on loopback TCP as lrmp's, each stage
    a process that computes (a busy loop) for its program's measured time, then sends a 1 kB hidden
    state on (the last stage 128 kB of logits). Returns the median of a token's time less the compute
    in µs: what the transport and the processes' wake-ups cost on this machine, the floor under
    lrmp's messages."""
    import multiprocessing

    import zmq

    held = [socket.socket() for _ in range(len(works_ms))]  # free ports, picked at run time
    for s in held:
        s.bind(("127.0.0.1", 0))
    endpoints = [f"tcp://127.0.0.1:{s.getsockname()[1]}" for s in held]
    for s in held:
        s.close()
    ctx = zmq.Context()
    answers = ctx.socket(zmq.ROUTER)
    answers.bind("tcp://127.0.0.1:*")
    back = answers.getsockopt_string(zmq.LAST_ENDPOINT)
    sizes = [1024] * (len(works_ms) - 1) + [128_000]
    spawn = multiprocessing.get_context("spawn")
    work = (works_ms, endpoints, back, sizes)
    stages = [spawn.Process(target=_bare_stage, args=(i, *work)) for i in range(len(works_ms))]
    for p in stages:
        p.start()
    first = ctx.socket(zmq.DEALER)
    first.connect(endpoints[0])
    try:
        for _ in range(20):  # until every stage is up: the first round trips wait for the processes to start
            first.send_multipart([b"h" * 300, b"x" * 8])
            if not answers.poll(30_000):
                raise RuntimeError("the bare chain's stages did not answer")
            answers.recv_multipart()
        over = []
        for _ in range(tokens):
            start = time.perf_counter()
            first.send_multipart([b"h" * 300, b"x" * 8, b"m" * 520], copy=False)
            answers.recv_multipart(copy=False)
            over.append((time.perf_counter() - start) * 1e6 - sum(works_ms) * 1e3)
            time.sleep(0.001)  # generate()'s own loop between two tokens
    finally:
        first.send_multipart([b"stop"])
        for p in stages:
            p.join(5)
            if p.is_alive():
                p.kill()
        ctx.destroy(0)
    return statistics.median(over)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a tiny model, 16 new tokens")
    args = p.parse_args(argv)
    import logging
    import warnings

    import _common
    import generate

    warnings.filterwarnings("ignore")
    import lightning as L
    import torch

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "lightning_remote_mp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from lightning_remote_mp import RemoteModelParallelStrategy
    from lightning_remote_mp.driver.launch import LocalWorkers

    shape = generate.parse_args(["--quick"] if args.quick else [])
    model = generate.make_model(shape)
    new = 16 if args.quick else args.new_tokens
    ids = generate.make_prompts(1, 16 if args.quick else args.prompt, shape.vocab)
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(prefix="lrmp-hops-")
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(f"import sys\nsys.path.insert(0, {HERE!r})\nimport hops\nhops.install_from_env()\n")
    sys.path.insert(0, folder)  # the workers' path is the driver's (`LocalWorkers`)
    os.environ["LRMP_HOPS"] = folder
    install("driver")
    workers = LocalWorkers(2, threads=1)

    class Writer(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def predict_step(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                MARKS.clear()
            self.model.generate(batch, **generate.greedy(batch, new if batch_idx else 2))

    try:
        hosts = workers.start()
        strategy = RemoteModelParallelStrategy(hosts=hosts, split=["model"], microbatches=1)
        trainer = _common.timed_trainer(strategy, max_steps=-1, callbacks=())
        started = time.perf_counter()
        trainer.predict(Writer(), torch.utils.data.DataLoader([ids] * (1 + args.repeats), batch_size=None))
        ran = time.perf_counter() - started
        time.sleep(2.5)  # each worker writes its notes once a second
    finally:
        workers.stop()
    try:
        events = [(t, "driver", n) for n, t in MARKS]
        names = sorted(f for f in os.listdir(folder) if f.startswith("worker-"))
        stage_of = {}  # a worker is the stage whose program runs first in a step
        for name in names:
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    what, t = line.rsplit(" ", 1)
                    events.append((int(t), name, what))
        for _, who, what in sorted(events):
            if what == "program <" and who not in stage_of:
                stage_of[who] = f"stage {len(stage_of)}"
        events = [(t, stage_of.get(who, who), what) for t, who, what in events]
        print(_common.environment())
        print(
            f"generate(): {new} new tokens after {ids.shape[1]} (greedy, batch 1), {args.repeats} times, through 2 "
            f"local workers (one torch thread each) in {ran:.0f} s\n"
        )
        print(table(events))
        print(f"\nThe same in this process, a stage's input (hidden {shape.hidden}, a mask of {ids.shape[1] + 1}):\n")
        print(hot_and_cold(ids.shape[1], shape.hidden))
        works = program_times(events)
        floor, rest = bare_chain(works), statistics.median(totals(events)) - sum(works) * 1e3
        print(
            "\nThe same hops with no lrmp (`bare_chain`: pyzmq DEALER/ROUTER on loopback TCP, each stage a process "
            f"computing {' and '.join(f'{w:.1f}' for w in works)} ms in a busy loop, the same message sizes): "
            f"a token costs {floor:,.0f} µs beyond the compute, against {rest:,.0f} µs through lrmp."
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
