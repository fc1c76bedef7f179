"""An emulated LAN for tests: hosts as network namespaces joined by a bridge, each link shaped to a
bandwidth with tc's token bucket filter.

Host 0 is this process's own network namespace, joined to the bridge by a veth pair, so a test runs
its Trainer (the driver) here; hosts 1.. are namespaces of their own, where ``lrmp-worker``
processes run (`Lan.start_worker`). Addresses come from 198.18.0.0/15, the range set aside for
network benchmarks (RFC 2544): a /24 of it per LAN, picked at random, so that LANs of tests that
run at once stay apart. Names carry a random token. `Lan.close` stops every process the LAN
started and removes every namespace and interface it made, whatever happened; `make_lan` skips the
test where namespaces cannot be made (not root, no iproute2, no tc, a sandbox that forbids them).
There is no latency shaping (the kernel here has no netem): bandwidth only.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from lightning_remote_mp.driver.launch import WorkerOutput

#: How a test's worker process reports: its output piped (`WorkerOutput` reads the ready line).
WORKER_OUTPUT = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}


def worker_command(*args: str) -> list[str]:
    """``lrmp-worker`` with one torch thread and ``args``, importing what this process imports."""
    return [
        "env",
        f"PYTHONPATH={os.pathsep.join(sys.path)}",
        sys.executable,
        "-m",
        "lightning_remote_mp.worker",
        "--threads",
        "1",
        *args,
    ]


def free_port() -> int:
    """A TCP port free on this machine now (for a listener the test's workers dial before it exists)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LanUnavailable(RuntimeError):
    """Network namespaces cannot be made here."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


class Lan:
    """``hosts`` hosts (host 0 is this process's namespace), every link shaped to ``rate``."""

    def __init__(self, hosts: int, rate: str = "1gbit") -> None:
        if os.geteuid() != 0:
            raise LanUnavailable("network namespaces need root")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise LanUnavailable(f"{tool} (iproute2) is not installed")
        self.token = secrets.token_hex(3)
        self.net = random.randint(1, 254)  # 198.18.<net>.0/24
        self.hosts = hosts
        self.rate = rate
        self.switch = f"lrmp-{self.token}-sw"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces, to remove
        self._host_link = f"l{self.token}r"  # host 0's end of its veth pair, in this namespace
        self._hosts_files: list[str] = []
        try:
            self._make()
        except BaseException as err:
            self.close()
            if isinstance(err, subprocess.CalledProcessError):
                raise LanUnavailable(f"could not make the LAN: {err.stderr.strip() or err}") from None
            raise

    def namespace(self, i: int) -> str | None:
        """Host ``i``'s namespace (``None`` for host 0: this process's)."""
        return None if i == 0 else f"lrmp-{self.token}-h{i}"

    def addr(self, i: int) -> str:
        return f"198.18.{self.net}.{i + 1}"

    def _make(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i in range(self.hosts):
            port = f"l{self.token}p{i}"
            if i == 0:
                _ip("link", "add", self._host_link, "type", "veth", "peer", "name", port)
                _ip("addr", "add", f"{self.addr(0)}/24", "dev", self._host_link)
                _ip("link", "set", self._host_link, "up")
            else:
                ns, inside = self.namespace(i), f"l{self.token}h{i}"
                assert ns is not None
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", inside, "type", "veth", "peer", "name", port)
                _ip("link", "set", inside, "netns", ns)
                _ip("-n", ns, "link", "set", inside, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            self.shape(i, self.rate)

    def _host_device(self, i: int) -> tuple[list[str], str]:
        """The command prefix that runs in host ``i``, and its link's device there."""
        ns = self.namespace(i)
        return (["ip", "netns", "exec", ns] if ns else []), ("eth0" if ns else self._host_link)

    def shape(self, i: int, rate: str) -> None:
        """Host ``i``'s link, both ways, at ``rate`` (``"1gbit"``, ``"100mbit"``...)."""
        prefix, device = self._host_device(i)
        for cmd in (
            [
                *prefix,
                "tc",
                "qdisc",
                "replace",
                "dev",
                device,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            ],
            [
                "ip",
                "netns",
                "exec",
                self.switch,
                "tc",
                "qdisc",
                "replace",
                "dev",
                f"l{self.token}p{i}",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            ],
        ):
            subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)

    def unplug(self, i: int) -> None:
        """Pull host ``i``'s cable (its link goes down)."""
        _ip("-n", self.switch, "link", "set", f"l{self.token}p{i}", "down")

    def plug(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"l{self.token}p{i}", "up")

    def block(self, i: int, j: int) -> None:
        """Host ``i`` can no longer reach host ``j`` (both still reach everyone else)."""
        _ip("-n", self.namespace(i) or "", "route", "add", "blackhole", f"{self.addr(j)}/32")

    def listening(self, i: int) -> list[str]:
        """The TCP ports host ``i`` listens on (``ss -ltn`` there), as ``address:port``."""
        prefix, _ = self._host_device(i)
        out = subprocess.run([*prefix, "ss", "-ltnH"], capture_output=True, text=True, timeout=30, check=True)
        return [line.split()[3] for line in out.stdout.splitlines() if line.strip()]

    def name_host(self, i: int, name: str, on: int) -> None:
        """Host ``on`` resolves ``name`` to host ``i``'s address (``ip netns exec`` mounts
        /etc/netns/<namespace>/hosts over /etc/hosts for what runs there)."""
        ns = self.namespace(on)
        if ns is None:
            raise ValueError("host 0 is this process's namespace: its /etc/hosts is the machine's")
        folder = f"/etc/netns/{ns}"
        os.makedirs(folder, exist_ok=True)
        self._hosts_files.append(folder)
        with open(f"{folder}/hosts", "a") as f:
            f.write(f"127.0.0.1 localhost\n{self.addr(i)} {name}\n")

    def popen(self, i: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Run ``argv`` on host ``i``; stopped by `close`."""
        prefix, _ = self._host_device(i)
        proc = subprocess.Popen([*prefix, *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def start_worker(self, i: int, *args: str, timeout: float = 120.0, dial: str | None = None) -> str:
        """An ``lrmp-worker`` on host ``i`` (extra flags in ``args``); returns its address. With
        ``dial`` (``tcp://host:port``) it dials the driver there as ``h<i>`` and listens on nothing;
        its address is then ``dial://h<i>``."""
        where = ["--connect", dial, "--name", f"h{i}"] if dial else ["--bind", f"tcp://{self.addr(i)}:*"]
        proc = self.popen(i, worker_command(*where, *args), **WORKER_OUTPUT)
        return WorkerOutput(proc, index=i).wait_ready(time.monotonic() + timeout)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()
        _ip("link", "del", self._host_link, check=False)  # and its peer with it
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        for folder in self._hosts_files:
            shutil.rmtree(folder, ignore_errors=True)
        self._hosts_files.clear()
