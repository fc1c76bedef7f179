"""Starting ``lrmp-worker`` processes on this machine: the zero-config default of the strategy.

On Linux one process imports torch and the worker once and forks them all
(`lightning_remote_mp.worker.forkserver`); elsewhere each is a process of its own. Each worker binds
``tcp://127.0.0.1:*`` and prints the port it got, so there is no port race. What a worker writes
afterwards (its log, a layer's ``print``) reaches this process's stderr, each line prefixed with the
worker's index and address. The workers run in a session of their own: a ^C in this process's
terminal reaches this process alone, whose teardown brings the weights back before it stops them.

>>> workers = LocalWorkers(1, threads=1)
>>> addresses = workers.start()
>>> [a.startswith("tcp://127.0.0.1:") for a in addresses]
[True]
>>> workers.stop()
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from lightning_remote_mp.errors import ConfigurationError, WorkerStartError
from lightning_remote_mp.wire.transport import why_ended

log = logging.getLogger(__name__)

_READY = "lrmp-worker ready on "
_LINE_CAP = 64 * 1024  # a longer "line" (a progress bar's \r updates, say) is relayed in pieces
_TAIL_LINES = 20  # lines quoted when a worker fails to start
_RELAY_JOIN = 1.0  # seconds given to a relay to pass on the last words of a worker that ended
_SERVER_EXIT = 10.0  # seconds the fork server gets to stop its workers (it SIGKILLs them after 5) and exit
_write_lock = threading.Lock()  # keeps lines of different workers whole on this process's stderr
#: Whether local workers are forked by one server (`lightning_remote_mp.worker.forkserver`).
FORKS = sys.platform.startswith("linux")


class ForkedWorker:
    """A worker the fork server started, with what of `subprocess.Popen` the driver uses: ``pid``
    (``None`` until it is forked), ``stdout``, ``returncode``, `poll`, `wait`, `terminate`, `kill`.
    Signals go through a pidfd, which names this process even once the server has reaped it.

    Args:
        index: the worker's index among those the server forks.
        stdout: the read end of the pipe the worker writes its stdout and stderr to.
    """

    def __init__(self, index: int, stdout: IO[bytes]) -> None:
        self.index = index
        self.stdout = stdout
        self.pid: int | None = None
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._pidfd: int | None = None
        self._lock = threading.Lock()  # the pidfd is closed on the reports' thread

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"lrmp-worker {self.index}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        with self._lock, contextlib.suppress(ProcessLookupError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)

    def _forked(self, pid: int) -> None:
        with self._lock, contextlib.suppress(ProcessLookupError):
            self.pid = pid
            if self.returncode is None:
                self._pidfd = os.pidfd_open(pid)

    def _ended_with(self, code: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
            self.returncode = code
        self._ended.set()


class ForkServer:
    """The process that forks this machine's local workers (`lightning_remote_mp.worker.forkserver`)
    on the flags ``argvs`` gives each, and its reports of them, read on a daemon thread.

    Args:
        argvs: each worker's ``lrmp-worker`` flags.
        env: the server's environment (so the workers').
    """

    def __init__(self, argvs: Sequence[Sequence[str]], env: dict[str, str]) -> None:
        pipes = [os.pipe() for _ in argvs]
        spec = [{"argv": list(argv), "output": w} for argv, (_, w) in zip(argvs, pipes)]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "lightning_remote_mp.worker.forkserver"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                pass_fds=[w for _, w in pipes],
                start_new_session=True,  # a ^C in this process's terminal is this process's to handle
            )
        except BaseException:
            for r, _ in pipes:
                os.close(r)
            raise
        finally:
            for _, w in pipes:
                os.close(w)
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):  # it failed already: its workers' outputs end, saying why
            self.proc.stdin.write(json.dumps(spec).encode() + b"\n")
            self.proc.stdin.flush()
        self.workers = [ForkedWorker(i, open(r, "rb")) for i, (r, _) in enumerate(pipes)]
        self._reader = threading.Thread(target=self._read_reports, name="lrmp-fork-server", daemon=True)
        self._reader.start()

    def _read_reports(self) -> None:
        stream = self.proc.stdout
        assert stream is not None
        with stream, contextlib.suppress(OSError, ValueError):
            for line in stream:
                what, index, value = (line.decode("ascii", "replace").split() + ["", "", ""])[:3]
                if index.isdigit() and int(index) < len(self.workers) and value.lstrip("-").isdigit():
                    worker = self.workers[int(index)]
                    if what == "forked":
                        worker._forked(int(value))
                    elif what == "ended":
                        worker._ended_with(int(value))
        code = self.proc.wait()
        for worker in self.workers:
            # The server ended before these: the kernel SIGKILLed those it forked (PR_SET_PDEATHSIG).
            worker._ended_with(-signal.SIGKILL if worker.pid is not None else code)

    def end_input(self) -> None:
        """End the server's stdin: it SIGTERMs the workers left, and SIGKILLs them 5 s later."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()

    def stop(self, timeout: float) -> None:
        """`end_input`, and SIGKILL the server if it has not exited ``timeout`` seconds later."""
        self.end_input()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("local workers' fork server (pid %d) still ran %.1f s later: killed it", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.wait()
        self._reader.join(_RELAY_JOIN)


class WorkerOutput:
    """Reads one local worker's output (stdout and stderr merged) on a daemon thread, until it ends.

    Up to the ready line it is watched for the bound address; after it, every line goes to this
    process's stderr, prefixed like ``[lrmp-worker 0 127.0.0.1:40101] ``. Someone must keep reading:
    once the pipe's buffer (64 KiB on Linux) is full, a worker's next ``print`` blocks forever, while
    its main thread still answers heartbeats, so the driver would wait forever too. The relay therefore
    keeps draining even when writing to this process's stderr fails.

    Args:
        proc: a worker started with ``stdout=PIPE`` (``stderr=STDOUT`` to relay its log as well), or
            forked by the fork server.
        index: the worker's index among those started together, for the prefix.
    """

    def __init__(self, proc: subprocess.Popen | ForkedWorker, index: int = 0) -> None:
        self.proc = proc
        self.address: str | None = None
        self.prefix = f"[lrmp-worker {index}] "
        self._index = index
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self._ready = threading.Event()  # set at the ready line, or when the output ends without it
        self._thread = threading.Thread(target=self._run, name=f"lrmp-worker-{index}-output", daemon=True)
        self._thread.start()

    def wait_ready(self, deadline: float) -> str:
        """The address the worker reports once it serves; raises `WorkerStartError` (quoting its last
        lines) if it exits first or ``deadline`` (a ``time.monotonic()`` value) passes."""
        while not self._ready.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
            if self.proc.poll() is not None or time.monotonic() >= deadline:
                break
        if self.address is not None:
            return self.address
        self._thread.join(_RELAY_JOIN)  # the last lines explain the failure
        try:
            code = self.proc.wait(_RELAY_JOIN)  # its output has ended: it is exiting, or wedged
        except subprocess.TimeoutExpired:
            code = None
        why = f"exited with code {code}" if code is not None else "did not report ready in time"
        tail = "".join(f"\n  {line}" for line in self._tail) or " (no output)"
        pid = f" (pid {self.proc.pid})" if self.proc.pid is not None else ""
        raise WorkerStartError(f"local lrmp-worker {self._index}{pid} {why}; its last output:{tail}")

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the output to end (it ends when the worker exits)."""
        self._thread.join(timeout)

    def _run(self) -> None:
        stream = self.proc.stdout
        assert stream is not None
        try:
            with contextlib.suppress(OSError, ValueError):  # the pipe was closed under us: the worker is gone
                while line := stream.readline(_LINE_CAP):
                    self._on_line(line.decode("utf-8", "replace") if isinstance(line, bytes) else line)
        finally:
            self._ready.set()
            with contextlib.suppress(OSError, ValueError):
                stream.close()

    def _on_line(self, line: str) -> None:
        line = line.rstrip("\r\n")
        if self.address is None:
            if line.startswith(_READY):
                self.address = line[len(_READY) :].split()[0]
                self.prefix = f"[lrmp-worker {self._index} {self.address.removeprefix('tcp://')}] "
                self._ready.set()
                return
            self._tail.append(line)
        self._write(self.prefix + line + "\n")

    @staticmethod
    def _write(text: str) -> None:
        # sys.stderr is looked up each time: whoever replaced it (pytest's capture, say) gets the line.
        with contextlib.suppress(Exception), _write_lock:  # nowhere to write to: drop the line, keep draining
            sys.stderr.write(text)
            sys.stderr.flush()


class LocalWorkers:
    """``n`` worker processes on loopback, stopped by `stop` (or when this process exits).

    Args:
        n: how many workers.
        devices: one device per worker (``"cpu"``, ``"cuda:0"``...); default: CUDA devices round-robin
            when CUDA is available, else CPU.
        threads: torch threads per worker (default: this machine's cores shared among the workers).
        allow_modules: module prefixes the workers may build classes from, beyond the defaults.
        log_level: the workers' log level; their log lines reach this process's stderr.
        secret_keys: with ``authorized_keys``, each worker's ``.key_secret`` file: the workers then
            talk CURVE only.
        authorized_keys: directory of the public keys allowed to drive the workers.
        extra_args: more ``lrmp-worker`` flags for every worker (limits, ``--session-timeout``...).
    """

    def __init__(
        self,
        n: int,
        devices: Sequence[str] | None = None,
        threads: int | None = None,
        allow_modules: Sequence[str] = (),
        log_level: str = "WARNING",
        secret_keys: Sequence[str] | None = None,
        authorized_keys: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        if n < 1:
            raise ConfigurationError(f"LocalWorkers needs at least 1 worker, got n={n}")
        if (secret_keys is None) != (authorized_keys is None):
            raise ConfigurationError("secret_keys and authorized_keys go together")
        if secret_keys is not None and len(secret_keys) != n:
            raise ConfigurationError(f"{len(secret_keys)} secret keys given for {n} local workers")
        self.secret_keys = [str(k) for k in secret_keys] if secret_keys is not None else None
        self.authorized_keys = str(authorized_keys) if authorized_keys is not None else None
        self.extra_args = list(extra_args)
        if devices is None:
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            devices = [f"cuda:{i % count}" for i in range(n)] if count else ["cpu"] * n
        if len(devices) != n:
            raise ConfigurationError(f"{len(devices)} devices given for {n} local workers")
        self.devices = list(devices)
        self.threads = threads or max(1, (os.cpu_count() or 1) // n)
        self.allow_modules = list(allow_modules)
        self.log_level = log_level
        self.procs: list[subprocess.Popen[bytes] | ForkedWorker] = []
        self.outputs: list[WorkerOutput] = []
        self.addresses: list[str] = []
        self._server: ForkServer | None = None

    def start(self, timeout: float = 120.0) -> list[str]:
        """Start the workers and wait until each serves: their addresses."""
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the worker processes; `wait_ready` waits until they serve, while this process goes on."""
        env = dict(os.environ)
        # Let the workers import what this process can (the user's layer modules, for example).
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
        env["PYTHONUNBUFFERED"] = "1"  # a layer's print reaches the driver when printed, not at exit
        argvs = [self._flags(i, device) for i, device in enumerate(self.devices)]
        if FORKS:
            self._server = ForkServer(argvs, env)
            self.procs = list(self._server.workers)
        else:
            self.procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "lightning_remote_mp.worker", *argv],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,  # a ^C in this process's terminal is this process's to handle
                )
                for argv in argvs
            ]
        self.outputs = [WorkerOutput(proc, i) for i, proc in enumerate(self.procs)]

    def wait_ready(self, timeout: float = 120.0) -> list[str]:
        """The addresses of the workers `launch` started, once each serves (all stopped if one fails)."""
        try:
            deadline = time.monotonic() + timeout
            self.addresses = [out.wait_ready(deadline) for out in self.outputs]
        except BaseException:
            self.stop()
            raise
        log.info("started %d local lrmp-worker processes: %s", len(self.procs), ", ".join(self.addresses))
        return self.addresses

    def _flags(self, i: int, device: str) -> list[str]:
        cmd = [
            "--bind",
            "tcp://127.0.0.1:*",
            "--device",
            device,
            "--threads",
            str(self.threads),
            "--log-level",
            self.log_level,
            "--exit-with-parent",  # a driver killed without its teardown leaves no worker behind
        ]
        for prefix in self.allow_modules:
            cmd += ["--allow-module", prefix]
        if self.secret_keys is not None and self.authorized_keys is not None:
            cmd += ["--secret-key", self.secret_keys[i], "--authorized-keys", self.authorized_keys]
        return cmd + self.extra_args

    def why_dead(self, i: int) -> str | None:
        """``None`` while worker ``i`` runs, else how it ended."""
        return why_ended(self.procs[i])

    def stop(self, timeout: float = 2.0) -> None:
        """SIGTERM every worker, give them ``timeout`` seconds together to exit, then SIGKILL the rest.

        A worker exits within a fraction of a second of SIGTERM, even while a layer of its still
        runs (it does not wait for the layer); what needs the kill is a worker that cannot run at
        all (stopped with SIGSTOP, say).
        """
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        if self._server is not None:
            self._server.end_input()  # it SIGTERMs what it forks from now on
        deadline = time.monotonic() + timeout
        for p in self.procs:
            if p.pid is None:
                continue  # not forked yet: the server stops it once it is (below)
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("local lrmp-worker (pid %s) did not exit %.1f s after SIGTERM: killed it", p.pid, timeout)
                p.kill()
                if self._server is None:
                    p.wait()
        if self._server is not None:  # it stops any worker it forks still, and reports each end
            self._server.stop(_SERVER_EXIT)
            self._server = None
        deadline = time.monotonic() + _RELAY_JOIN
        for out in self.outputs:
            out.join(max(0.0, deadline - time.monotonic()))
        self.procs.clear()
        self.outputs.clear()
