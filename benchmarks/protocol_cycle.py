"""Evidence for a finding of benchmarks/transport.py: ``protocol.decode`` (and ``encode``) leave a
reference cycle behind, so a decoded message's tensors -- and the ZeroMQ buffers under them --
outlive their last use until Python's cyclic garbage collector runs.

``decode`` defines two closures that refer to each other (``ext_hook`` calls ``_unpack``,
``_unpack`` passes ``ext_hook`` to msgpack) and both close over the list of received tensors;
``encode`` does the same with ``default`` / ``_pack`` and the outgoing frames. Each call thus
leaves a garbage cycle holding the message's buffers. Effects measured here:

1. in process: after ``del`` of the last reference, the decoded tensor is still alive (weakref);
2. on the wire: every large receive lands in freshly mapped memory (minor page faults per round
   trip, counted from /proc), and the collector runs far more often;
3. the same round trips with a copy of ``protocol`` whose closures are cleared before returning
   (two added lines, built at run time from the library's source: no library file is changed).

    python benchmarks/protocol_cycle.py            # full run (about a minute)
    python benchmarks/protocol_cycle.py --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time
import types
import weakref
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

KIB = 1024
SIZES = {"1 MiB": 1024 * KIB, "16 MiB": 16 * 1024 * KIB}
IDLE_EXIT_S = 120.0

# The two-line fix, applied to a copy of the library's source: clear the closures' cells before
# returning, which breaks the cycle (the nested functions are then freed by reference counting).
_PATCHES = [
    (
        "    return [header, *frames]\n",
        "    default = _pack = None  # noqa: F841  (breaks the closure cycle)\n    return [header, *frames]\n",
    ),
    (
        "    return Message(kind=kind, id=req_id, session=session, body=body)\n",
        "    ext_hook = _unpack = None  # noqa: F841  (breaks the closure cycle)\n"
        "    return Message(kind=kind, id=req_id, session=session, body=body)\n",
    ),
]


def protocol_module(variant: str) -> Any:
    """lrmp's protocol module (``"lrmp"``), or a copy of it with the cycle broken (``"lrmp-nocycle"``);
    None when the patch no longer applies to the library's source."""
    from lightning_remote_mp.wire import protocol

    if variant == "lrmp":
        return protocol
    source = inspect.getsource(protocol)
    for old, new in _PATCHES:
        if source.count(old) != 1:
            return None
        source = source.replace(old, new)
    module = types.ModuleType("lrmp_protocol_nocycle")
    module.__file__ = protocol.__file__
    sys.modules[module.__name__] = module
    exec(compile(source, "<lightning_remote_mp.wire.protocol without the closure cycle>", "exec"), module.__dict__)
    return module


def cycle_check(protocol: Any) -> dict[str, Any]:
    """Decode a message, drop it, and see whether its tensor survived without the collector."""
    import torch

    frames = [bytearray(bytes(f)) for f in protocol.encode("forward", 1, "s", {"x": torch.ones(256)})]
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        msg = protocol.decode(frames)
        ref = weakref.ref(msg.body["x"])
        del msg
        decoded_alive = ref() is not None
        decode_garbage = gc.collect()
        protocol.encode("forward", 1, "s", {"x": torch.ones(256), "t": (1, 2)})
        encode_garbage = gc.collect()
    finally:
        if enabled:
            gc.enable()
    return {
        "decoded tensor alive after del": decoded_alive,
        "objects the collector frees after one decode": decode_garbage,
        "objects the collector frees after one encode": encode_garbage,
    }


# --- echo server ----------------------------------------------------------------------------------
def serve(variant: str) -> int:
    import zmq

    protocol = protocol_module(variant) if variant != "raw" else None
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    _common.echo_until_quit(sock, protocol, IDLE_EXIT_S)
    return 0


def minor_faults(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])
    except OSError:
        return 0


class Client:
    """DEALER client: ``encode`` + zero-copy send, poll, zero-copy receive + ``decode`` (what
    ``transport.Connection`` does per request), or raw frames for ``raw``."""

    def __init__(self, variant: str, endpoint: str, pid: int) -> None:
        import zmq

        self.zmq, self.name, self.pid = zmq, variant, pid
        self.protocol = protocol_module(variant) if variant != "raw" else None
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def roundtrip(self, t: Any) -> None:
        if self.protocol is None:
            self.sock.send_multipart([memoryview(t.numpy())], copy=False)
            self.sock.recv_multipart(copy=False)
            return
        self.sock.send_multipart(self.protocol.encode("forward", 1, "s", {"x": t}), copy=False)
        while not self.sock.poll(50, self.zmq.POLLIN):
            pass
        self.protocol.decode(self.sock.recv_multipart(copy=False))

    def close(self) -> None:
        self.sock.send_multipart([b"quit"])
        self.sock.close(1000)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1 MiB only, one short round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--trips", type=int, default=200, help="round trips per method, size and round (1 MiB)")
    p.add_argument("--out", default=_common.RESULTS, help="folder for protocol_cycle.json")
    p.add_argument("--serve", choices=["raw", "lrmp", "lrmp-nocycle"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.trips = 1, 20
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve:
        return serve(args.serve)
    import subprocess

    import torch

    _common.exit_on_sigterm()

    torch.set_num_threads(1)
    print(f"# protocol.decode/encode reference cycle ({'quick' if args.quick else 'full'} run)")
    print(_common.environment(), flush=True)
    variants = ["raw", "lrmp"] + (["lrmp-nocycle"] if protocol_module("lrmp-nocycle") is not None else [])
    checks = {v: cycle_check(protocol_module(v)) for v in variants if v != "raw"}
    print()
    print(_common.markdown_table(["check", *checks], [[k, *(c[k] for c in checks.values())] for k in checks["lrmp"]]))
    if len(variants) < 3:
        print("\n(the patch no longer applies to lightning_remote_mp/wire/protocol.py: the code changed)")
    sizes = ["1 MiB"] if args.quick else list(SIZES)
    procs: dict[str, subprocess.Popen] = {}
    readers: dict[str, _common.LineReader] = {}
    clients: dict[str, Client] = {}
    rtts: dict[tuple[str, str], list[float]] = {}
    faults: dict[tuple[str, str], list[float]] = {}
    collections: dict[tuple[str, str], list[float]] = {}
    counter = {"n": 0}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            counter["n"] += 1

    gc.callbacks.append(on_gc)
    try:
        for v in variants:
            procs[v] = subprocess.Popen(
                [_common.python(), os.path.abspath(__file__), "--serve", v],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                env=_common.child_env(1),
                text=True,
            )
            readers[v] = _common.LineReader(procs[v])
        for v in variants:
            line = readers[v].readline(120.0)
            if not line or not line.startswith("ready"):
                raise RuntimeError(f"echo server {v} did not start")
            clients[v] = Client(v, line.split()[1], procs[v].pid)
        for r in range(args.rounds):
            for s in sizes:
                t = torch.randn(SIZES[s] // 4)
                trips = max(5, args.trips // (SIZES[s] // SIZES["1 MiB"]))
                k = r % len(variants)
                for v in variants[k:] + variants[:k]:
                    c = clients[v]
                    for _ in range(3):
                        c.roundtrip(t)
                    f0 = minor_faults(os.getpid()) + minor_faults(c.pid)
                    g0, times = counter["n"], []
                    for _ in range(trips):
                        t0 = time.perf_counter()
                        c.roundtrip(t)
                        times.append(time.perf_counter() - t0)
                    rtts.setdefault((v, s), []).append(statistics.median(times))
                    faults.setdefault((v, s), []).append((minor_faults(os.getpid()) + minor_faults(c.pid) - f0) / trips)
                    collections.setdefault((v, s), []).append((counter["n"] - g0) * 1000 / trips)
    finally:
        gc.callbacks.remove(on_gc)
        for c in clients.values():
            c.close()
        _common.stop_processes(procs.values())

    rows, results = [], []
    for s in sizes:
        raw = rtts[("raw", s)]
        for v in variants:
            rt = statistics.median(rtts[(v, s)])
            of_raw = statistics.median(a / b for a, b in zip(raw, rtts[(v, s)]))
            pf, gcs = statistics.median(faults[(v, s)]), statistics.median(collections[(v, s)])
            rows.append(
                [
                    s,
                    v,
                    f"{rt * 1e6:,.0f}",
                    f"{2 * SIZES[s] / rt / 1e6:,.0f}",
                    f"{of_raw:.0%}",
                    f"{pf:,.0f}",
                    f"{gcs:,.0f}",
                ]
            )
            results.append(
                {"size": s, "variant": v, "rtt_s": rt, "of_raw": of_raw, "minor_faults": pf, "gc_per_1000": gcs}
            )
    print()
    print(
        _common.markdown_table(
            [
                "size",
                "echo (client and server)",
                "round trip (us)",
                "MB/s",
                "of raw",
                "minor page faults / trip",
                "client GC runs / 1000 trips",
            ],
            rows,
        )
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "protocol_cycle.json"), "w") as f:
        json.dump({"checks": checks, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    _common.exit_now(main())
