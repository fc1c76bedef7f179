"""Starting ``lrmp-worker`` processes on this machine: the zero-config default of the strategy.

Each worker binds ``tcp://127.0.0.1:*`` and prints the port it got, so there is no port race.

>>> workers = LocalWorkers(1, threads=1)
>>> addresses = workers.start()
>>> [a.startswith("tcp://127.0.0.1:") for a in addresses]
[True]
>>> workers.stop()
"""

from __future__ import annotations

import logging
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

_READY = "lrmp-worker ready on "


class LocalWorkers:
    """``n`` worker processes on loopback, stopped by `stop` (or when this process exits).

    Args:
        n: how many workers.
        devices: one device per worker (``"cpu"``, ``"cuda:0"``...); default: CUDA devices round-robin
            when CUDA is available, else CPU.
        threads: torch threads per worker (default: this machine's cores shared among the workers).
        allow_modules: module prefixes the workers may build classes from, beyond the defaults.
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
            raise ValueError(f"num_workers must be at least 1, got {n}")
        if (secret_keys is None) != (authorized_keys is None):
            raise ValueError("secret_keys and authorized_keys go together")
        if secret_keys is not None and len(secret_keys) != n:
            raise ValueError(f"{len(secret_keys)} secret keys given for {n} local workers")
        self.secret_keys = [str(k) for k in secret_keys] if secret_keys is not None else None
        self.authorized_keys = str(authorized_keys) if authorized_keys is not None else None
        self.extra_args = list(extra_args)
        if devices is None:
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            devices = [f"cuda:{i % count}" for i in range(n)] if count else ["cpu"] * n
        if len(devices) != n:
            raise ValueError(f"{len(devices)} devices given for {n} local workers")
        self.devices = list(devices)
        self.threads = threads or max(1, (os.cpu_count() or 1) // n)
        self.allow_modules = list(allow_modules)
        self.log_level = log_level
        self.procs: list[subprocess.Popen[str]] = []
        self.addresses: list[str] = []

    def start(self, timeout: float = 120.0) -> list[str]:
        env = dict(os.environ)
        # Let the workers import what this process can (the user's layer modules, for example).
        env["PYTHONPATH"] = os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p)
        for i, device in enumerate(self.devices):
            cmd = [
                sys.executable,
                "-m",
                "lightning_remote_mp.worker",
                "--bind",
                "tcp://127.0.0.1:*",
                "--device",
                device,
                "--threads",
                str(self.threads),
                "--log-level",
                self.log_level,
            ]
            for prefix in self.allow_modules:
                cmd += ["--allow-module", prefix]
            if self.secret_keys is not None and self.authorized_keys is not None:
                cmd += ["--secret-key", self.secret_keys[i], "--authorized-keys", self.authorized_keys]
            cmd += self.extra_args
            self.procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, text=True)
            )
        try:
            self.addresses = [self._wait_ready(p, time.monotonic() + timeout) for p in self.procs]
        except BaseException:
            self.stop()
            raise
        log.info("started %d local lrmp-worker processes: %s", len(self.procs), ", ".join(self.addresses))
        return self.addresses

    @staticmethod
    def _wait_ready(proc: subprocess.Popen[str], deadline: float) -> str:
        assert proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while (left := deadline - time.monotonic()) > 0:
                if sel.select(min(left, 0.5)):
                    line = proc.stdout.readline()
                    if line.startswith(_READY):
                        return line[len(_READY) :].split()[0]
                    if not line and proc.poll() is not None:
                        break
                elif proc.poll() is not None:
                    break
        finally:
            sel.close()
        code = proc.poll()
        why = f"exited with code {code}" if code is not None else "did not report ready in time"
        raise RuntimeError(f"local lrmp-worker (pid {proc.pid}) {why}; its stderr above says why")

    def why_dead(self, i: int) -> str | None:
        """``None`` while worker ``i`` runs, else how it ended."""
        code = self.procs[i].poll()
        return None if code is None else f"its process (pid {self.procs[i].pid}) exited with code {code}"

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            if p.stdout is not None:
                p.stdout.close()
        self.procs.clear()
