"""Transport round trips: a float32 tensor goes to an echo in another process and comes back.

Methods (all over 127.0.0.1 TCP unless said otherwise, all measured in the same run, interleaved):

- ``raw pyzmq``: DEALER -> ROUTER echo, ``send_multipart([buffer], copy=False)`` both ways,
  ``recv_multipart(copy=False)`` -- the floor any ZeroMQ protocol pays;
- ``lrmp protocol``: lrmp's own :class:`~lightning_remote_mp.wire.transport.Connection` (``send`` /
  ``recv``: ``protocol.encode`` + zero-copy send, poll + ``protocol.decode``) against an echo that
  decodes each request and encodes the tensor back with ``protocol`` (one thread, like raw);
- ``lrmp worker``: a real ``lrmp-worker`` holding a one-layer stage (``torch.nn.Identity``), driven
  through ``DriverSession`` / ``RemoteSpec`` under ``torch.no_grad()``: FORWARD to the worker's
  I/O thread, hand-off to its compute thread, RESULT back through the I/O thread -- everything a
  pipelined forward pays per message, with no compute;
- ``torch RPC (TCP)``: ``torch.distributed.rpc.rpc_sync`` of an echo function on a second process,
  TensorPipe restricted to its ``uv`` (TCP) transport and ``basic`` channel;
- ``torch RPC (default)``: the same with TensorPipe's defaults, which on one host pick shared memory.

Bandwidth is payload bytes moved per second: ``2 x size / round-trip time`` (MB = 10^6 bytes).

    python benchmarks/transport.py            # full run (about a minute)
    python benchmarks/transport.py --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

KIB = 1024
SIZES = {"4 KiB": 4 * KIB, "64 KiB": 64 * KIB, "1 MiB": 1024 * KIB, "16 MiB": 16 * 1024 * KIB}
IDLE_EXIT_S = 120.0  # an echo server whose client went quiet this long exits by itself


# --- servers (child processes) ------------------------------------------------------------------
def serve_zmq(kind: str) -> int:
    """Echo on a ROUTER socket until told to quit, the parent dies, or nothing arrives for a while."""
    import zmq

    if kind == "lrmp":
        from lightning_remote_mp.wire import protocol, sockets

        sock, _ = sockets.bind_router("tcp://127.0.0.1:*")
    else:
        protocol = None
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind("tcp://127.0.0.1:*")
    _common.echo_until_quit(sock, protocol, IDLE_EXIT_S)
    return 0


def _echo(t: Any) -> Any:
    return t


def serve_rpc(store: str, transports: str) -> int:
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    print("ready", flush=True)
    rpc.init_rpc("echo", rank=1, world_size=2, rpc_backend_options=_rpc_options(store, transports))
    rpc.shutdown()  # waits for the client's shutdown
    sys.stdout.flush()
    os._exit(0)


def _rpc_options(store: str, transports: str) -> Any:
    import torch.distributed.rpc as rpc

    kwargs: dict[str, Any] = {"init_method": f"file://{store}", "num_worker_threads": 4, "rpc_timeout": 120}
    if transports == "tcp":
        kwargs.update(_transports=["uv"], _channels=["basic"])
    return rpc.TensorPipeRpcBackendOptions(**kwargs)


# --- clients ---------------------------------------------------------------------------------------
class Child:
    """A child process started from this script, reporting ``ready [endpoint]`` on stdout."""

    def __init__(self, *args: str, stdin: bool = False) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="lrmp-bench-child-", suffix=".log")
        self.proc = subprocess.Popen(
            [_common.python(), os.path.abspath(__file__), *args],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=_common.child_env(1),
            text=True,
        )
        self.reader = _common.LineReader(self.proc)

    def readline(self, timeout: float) -> str:
        line = self.reader.readline(timeout)
        if line is None:
            self.log.seek(0)
            raise RuntimeError(f"process {self.proc.args[2:]} failed or timed out:\n{self.log.read()[-3000:]}")
        return line.strip()

    def ready(self, timeout: float = 120.0) -> str:
        line = self.readline(timeout)
        if not line.startswith("ready"):
            raise RuntimeError(f"process {self.proc.args[2:]} said {line!r:.200} instead of ready")
        return line.split()[1] if len(line.split()) > 1 else ""

    def stop(self) -> None:
        _common.stop_processes([self.proc])
        self.log.close()


class RawClient:
    name = "raw pyzmq"

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def roundtrip(self, t: Any) -> Any:
        import torch

        self.sock.send_multipart([memoryview(t.numpy())], copy=False)
        frames = self.sock.recv_multipart(copy=False)
        return torch.frombuffer(frames[0].buffer, dtype=torch.float32)

    def close(self) -> None:
        self.sock.send_multipart([b"quit"])
        self.sock.close(1000)


class LrmpProtocolClient:
    name = "lrmp protocol"

    def __init__(self, endpoint: str) -> None:
        from lightning_remote_mp.wire import protocol
        from lightning_remote_mp.wire.transport import Connection

        self.kind = protocol.FORWARD
        self.conn = Connection(endpoint)

    def roundtrip(self, t: Any) -> Any:
        return self.conn.recv(self.conn.send(self.kind, {"x": t}))["x"]

    def close(self) -> None:
        self.conn._sock.send_multipart([b"quit"])
        self.conn.close()


class LrmpWorkerClient:
    name = "lrmp worker"

    def __init__(self, endpoint: str, numel: int) -> None:
        from lightning_remote_mp.driver.session import DriverSession
        from lightning_remote_mp.model.spec import SpecSequential

        self.session = DriverSession([endpoint])
        self.net = SpecSequential([("torch.nn.Identity", {}, (1, numel))])
        self.session.place("echo", self.net, [1], microbatches=1)

    def roundtrip(self, t: Any) -> Any:
        import torch

        with torch.no_grad():
            return self.net(t.view(1, -1))

    def close(self) -> None:
        self.session.close()


def rpc_client_main(store: str, transports: str) -> int:
    """The RPC client (rank 0), a child process of its own: TensorPipe can be set up once per process.
    Reads one JSON command per line (size, budget, max iterations), answers the round-trip times."""
    import torch
    import torch.distributed.rpc as rpc

    torch.set_num_threads(1)
    print("ready", flush=True)
    rpc.init_rpc("client", rank=0, world_size=2, rpc_backend_options=_rpc_options(store, transports))

    class Client:
        def roundtrip(self, t: Any) -> Any:
            return rpc.rpc_sync("echo", _echo, args=(t,))

    client = Client()
    print("connected", flush=True)
    try:
        for _ in range(100_000):
            line = sys.stdin.readline()
            if not line or line.strip() == "quit":
                break
            cmd = json.loads(line)
            t = torch.randn(cmd["bytes"] // 4)
            ok = torch.equal(client.roundtrip(t), t)
            times = measure(client, t, cmd["budget"], cmd["max_iters"])
            print(json.dumps({"ok": ok, "times": times}), flush=True)
    finally:
        rpc.shutdown()
        sys.stdout.flush()
        os._exit(0)


class RpcClient:
    """Drives an RPC client process and its echo process."""

    def __init__(self, tmp: str, transports: str) -> None:
        self.name = "torch RPC (TCP)" if transports == "tcp" else "torch RPC (default)"
        store = os.path.join(tmp, f"store-{transports}")
        self.server = Child("--serve", "rpc", "--rpc-store", store, "--rpc-transports", transports)
        self.client = Child("--rpc-client", "--rpc-store", store, "--rpc-transports", transports, stdin=True)

    def ready(self) -> None:
        self.server.ready()
        self.client.ready()
        self.client.readline(120.0)  # "connected"

    def measure(self, nbytes: int, budget: float, max_iters: int) -> list[float]:
        assert self.client.proc.stdin is not None
        self.client.proc.stdin.write(json.dumps({"bytes": nbytes, "budget": budget, "max_iters": max_iters}) + "\n")
        self.client.proc.stdin.flush()
        reply = json.loads(self.client.readline(120.0 + 10 * budget))
        if not reply["ok"]:
            raise RuntimeError(f"{self.name} did not echo the tensor")
        return reply["times"]

    def close(self) -> None:
        try:
            if self.client.proc.poll() is None and self.client.proc.stdin is not None:
                self.client.proc.stdin.write("quit\n")
                self.client.proc.stdin.flush()
                self.client.proc.wait(15)
                self.server.proc.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.client.stop()
        self.server.stop()


def measure(client: Any, t: Any, budget_s: float, max_iters: int) -> list[float]:
    """Round-trip times (s) of at least 3 and at most ``max_iters`` trips, within about ``budget_s``."""
    client.roundtrip(t)  # warm: connections, buffers
    times: list[float] = []
    end = time.perf_counter() + budget_s
    while len(times) < max_iters and (len(times) < 3 or time.perf_counter() < end):
        t0 = time.perf_counter()
        client.roundtrip(t)
        times.append(time.perf_counter() - t0)
    return times


# --- the run ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run: two sizes, one short round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=float, default=0.4, help="seconds of round trips per method, size and round")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--no-rpc-default", action="store_true", help="skip torch RPC with TensorPipe's shared memory")
    p.add_argument("--out", default=_common.RESULTS, help="folder for transport.png and transport.json")
    p.add_argument("--serve", choices=["raw", "lrmp", "rpc"], help=argparse.SUPPRESS)
    p.add_argument("--rpc-store", help=argparse.SUPPRESS)
    p.add_argument("--rpc-transports", default="tcp", help=argparse.SUPPRESS)
    p.add_argument("--rpc-client", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.budget, args.sizes, args.no_rpc_default = 1, 0.05, ["4 KiB", "1 MiB"], True
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack (to the child's log)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.rpc_client:
        return rpc_client_main(args.rpc_store, args.rpc_transports)
    if args.serve == "rpc":
        return serve_rpc(args.rpc_store, args.rpc_transports)
    if args.serve:
        return serve_zmq(args.serve)

    import torch

    from lightning_remote_mp.driver.launch import LocalWorkers

    _common.exit_on_sigterm()

    torch.set_num_threads(1)
    print(f"# Transport round trips ({'quick' if args.quick else 'full'} run)")
    print(
        f"float32 tensors to an echo in another process and back over 127.0.0.1; {args.rounds} round(s) of "
        f"~{args.budget:g} s per method and size, interleaved; median round trip reported."
    )
    print(_common.environment(), flush=True)
    tmp = tempfile.mkdtemp(prefix="lrmp-bench-rpc-")
    children: list[Child] = []
    rpcs: list[RpcClient] = []
    base: list[Any] = []
    workers = LocalWorkers(1, devices=["cpu"], threads=1)
    started = time.perf_counter()
    samples: dict[tuple[str, str], list[float]] = {}
    round_medians: dict[tuple[str, str], list[float]] = {}
    try:
        # Start every child at once; they import torch while the others do.
        raw, lrmp = Child("--serve", "raw"), Child("--serve", "lrmp")
        children += [raw, lrmp]
        rpcs = [RpcClient(tmp, mode) for mode in (["tcp"] if args.no_rpc_default else ["tcp", "default"])]
        (worker_address,) = workers.start()
        base = [RawClient(raw.ready()), LrmpProtocolClient(lrmp.ready())]
        for rc in rpcs:
            rc.ready()
        names = [c.name for c in base] + ["lrmp worker"] + [rc.name for rc in rpcs]
        tensors = {s: torch.randn(SIZES[s] // 4) for s in args.sizes}
        max_iters = 20_000
        for r in range(args.rounds):
            for s in args.sizes:
                t = tensors[s]
                worker_client = LrmpWorkerClient(worker_address, t.numel())
                try:
                    for c in [*base, worker_client]:  # every method echoes correctly
                        if not torch.equal(c.roundtrip(t).reshape(-1), t):
                            raise RuntimeError(f"{c.name} did not echo the tensor")
                    methods: list[tuple[str, Any]] = [
                        *(
                            (c.name, lambda c=c, t=t: measure(c, t, args.budget, max_iters))
                            for c in (*base, worker_client)
                        ),
                        *((rc.name, lambda rc=rc, s=s: rc.measure(SIZES[s], args.budget, max_iters)) for rc in rpcs),
                    ]
                    k = r % len(methods)  # rotate the order every round
                    for name, run in methods[k:] + methods[:k]:
                        times = run()
                        samples.setdefault((name, s), []).extend(times)
                        round_medians.setdefault((name, s), []).append(_common.median(times))
                finally:
                    worker_client.close()
            print(f"  round {r + 1} of {args.rounds} done", flush=True)
    finally:
        for c in base:
            c.close()
        for rc in rpcs:
            rc.close()
        workers.stop()
        for c in children:
            c.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    rows, results = [], []
    for s in args.sizes:
        size = SIZES[s]
        raw_rt = round_medians[("raw pyzmq", s)]
        rpc_rt = round_medians[(rpcs[0].name, s)]
        for name in names:
            rts = round_medians[(name, s)]
            rt = _common.median(samples[(name, s)])
            vs_raw = _common.median([a / b for a, b in zip(raw_rt, rts)])
            vs_rpc = _common.median([a / b for a, b in zip(rpc_rt, rts)])
            rows.append([s, name, f"{rt * 1e6:,.0f}", f"{2 * size / rt / 1e6:,.0f}", f"{vs_raw:.0%}", f"{vs_rpc:.2f}x"])
            results.append(
                {
                    "size": s,
                    "bytes": size,
                    "method": name,
                    "rtt_median_s": rt,
                    "round_medians_s": rts,
                    "mb_per_s": 2 * size / rt / 1e6,
                    "of_raw": vs_raw,
                    "vs_rpc": vs_rpc,
                }
            )
    print()
    print(
        _common.markdown_table(["size", "method", "round trip (us)", "MB/s", "of raw pyzmq", f"x {rpcs[0].name}"], rows)
    )
    print("\n(ratios: median over rounds of the same-round ratio of median round trips)")
    print(f"wall time {time.perf_counter() - started:.0f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "transport.json"), "w") as f:
        json.dump({"rounds": args.rounds, "budget_s": args.budget, "results": results}, f, indent=1)
    plot(results, args, os.path.join(args.out, "transport.png"))
    return 0


def plot(results: list[dict[str, Any]], args: argparse.Namespace, path: str) -> None:
    plt = _common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    methods = list(dict.fromkeys(r["method"] for r in results))
    for name in methods:
        rs = [r for r in results if r["method"] == name]
        ax.plot([r["bytes"] for r in rs], [r["mb_per_s"] for r in rs], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks([r["bytes"] for r in results if r["method"] == methods[0]])
    ax.set_xticklabels([r["size"] for r in results if r["method"] == methods[0]])
    ax.set_xlabel("tensor size")
    ax.set_ylabel("MB/s (2 x size / median round trip)")
    ax.set_title(f"Round trip to an echo over 127.0.0.1, {args.rounds} rounds")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    _common.exit_now(main())
