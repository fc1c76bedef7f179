"""Helpers shared by the benchmark scripts: statistics, markdown tables, plots, child processes.

Not a library: the scripts import it from beside them (``python benchmarks/<name>.py`` puts this
folder first on ``sys.path``).
"""

from __future__ import annotations

import atexit
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> str:
    """``min-max`` of a sample, for the tables."""
    return f"{min(xs):,.0f}-{max(xs):,.0f}" if xs else "-"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def environment() -> str:
    import torch

    try:
        load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except OSError:  # pragma: no cover
        load = "load average n/a"
    return (
        f"python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), {load} at start"
    )


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(plot skipped: matplotlib is not installed; pip install -e '.[bench]')")
        return None
    return plt


def free_port() -> int:
    """A free loopback TCP port (for torch's rendezvous, which wants a number)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(threads: int = 1) -> dict[str, str]:
    """Environment for a child process: one BLAS/OpenMP thread, loopback only for gloo/TensorPipe."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "GLOO_SOCKET_IFNAME": "lo",
            "NCCL_SOCKET_IFNAME": "lo",
            "TP_SOCKET_IFNAME": "lo",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def stop_processes(procs: Iterable[subprocess.Popen], timeout: float = 10.0, grace: float = 0.0) -> None:
    """Terminate the children this script started (by pid), then kill the ones that linger. With
    ``grace``, first wait that long for them to exit on their own (after being asked to quit)."""
    procs = [p for p in procs if p is not None]
    deadline = time.monotonic() + grace
    for p in procs if grace > 0 else ():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
        for stream in (p.stdin, p.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


def python() -> str:
    return sys.executable


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far; 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


class LineReader:
    """Lines of a child's stdout, read by a daemon thread, so that waiting for one can time out.

    (Selecting on a text pipe and then calling ``readline`` can hang: the first ``readline`` may
    buffer the next lines too, and the selector then waits for bytes that were already read.)
    """

    def __init__(self, proc: subprocess.Popen) -> None:
        import queue
        import threading

        self.proc = proc
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self.proc.stdout is not None
        try:
            for line in self.proc.stdout:
                self.lines.put(line.rstrip("\n"))
        except (OSError, ValueError):
            pass
        self.lines.put(None)

    def readline(self, timeout: float) -> str | None:
        """The next line; None when the child closed its stdout or nothing came within ``timeout``."""
        import queue

        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that a terminated script still runs its ``finally`` blocks
    and stops the processes it started."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


_ROOTS: list[str] = []  # timed_trainer's root directories, removed at exit (exit_now's too)


def _remove_roots() -> None:
    while _ROOTS:
        shutil.rmtree(_ROOTS.pop(), ignore_errors=True)


atexit.register(_remove_roots)


def exit_now(code: int | None = 0) -> NoReturn:
    """End this process without the interpreter's teardown of torch's (and Lightning's) module graph,
    which takes a second or two on a small machine (the lrmp-worker skips it too). Only for the end of
    a script whose children are stopped and whose files are written and closed."""
    import logging

    _remove_roots()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def echo_until_quit(sock: Any, protocol: Any | None, idle_exit_s: float) -> None:
    """Serve a ROUTER socket as an echo (raw frames, or decoded and re-encoded with ``protocol``)
    until a ``quit`` frame, the parent's death, or ``idle_exit_s`` without a message. Prints the
    ``ready ENDPOINT`` line the parent waits for, and closes the socket."""
    import zmq

    print(f"ready {sock.getsockopt(zmq.LAST_ENDPOINT).decode()}", flush=True)
    parent, last = os.getppid(), time.monotonic()
    try:
        while time.monotonic() - last < idle_exit_s and os.getppid() == parent:
            if not sock.poll(500, zmq.POLLIN):
                continue
            frames = sock.recv_multipart(copy=False)
            last = time.monotonic()
            if len(frames) == 2 and frames[1].bytes == b"quit":
                break
            if protocol is None:
                sock.send_multipart(frames, copy=False)
            else:
                msg = protocol.decode(frames[1:])
                reply = protocol.encode(protocol.OK, msg.id, msg.session, msg.body)
                sock.send_multipart([frames[0], *reply], copy=False)
    finally:
        sock.close(0)


def rss_anon(pid: int | str) -> int:
    """Process ``pid``'s anonymous memory in bytes (``RssAnon`` of ``/proc/PID/status``; ``"self"``
    for this one; pages of memory-mapped files apart), or 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def timed_trainer(strategy: Any, max_steps: int, callbacks: Sequence[Any], **options: Any) -> Any:
    """A Lightning Trainer for timing: CPU, ``max_steps`` in one epoch, no sanity check, logger,
    checkpoints, progress bar or summary, unless ``options`` (the Trainer's own) say otherwise
    (Lightning is imported here: not every script needs it). Its root directory is a temporary one,
    removed at exit: a model past ``gather_limit`` saves its last step there at the end of ``fit``,
    which would otherwise land, gigabytes of it, in the directory the benchmark ran from."""
    import lightning as L

    root = tempfile.mkdtemp(prefix="lrmp-bench-")
    _ROOTS.append(root)

    return L.Trainer(
        **{
            "max_steps": max_steps,
            "max_epochs": 1,
            "accelerator": "cpu",
            "strategy": strategy,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "callbacks": list(callbacks),
            "default_root_dir": root,
            **options,
        }
    )
