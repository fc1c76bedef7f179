"""Versions users can check: lrmp's follows the wire protocol's (the policy atop CHANGELOG.md), and a
worker says both, with torch's, when asked (`lrmp-worker --version`) and when it starts; it also says
when only this machine can reach it, and why it stopped."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from lightning_remote_mp import __version__
from lightning_remote_mp.wire.protocol import PROTOCOL_VERSION
from lightning_remote_mp.worker.cli import loopback_hint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_minor_version_is_the_protocol_version():
    assert re.fullmatch(rf"0\.{PROTOCOL_VERSION}\.\d+", __version__), (
        f"lrmp {__version__} but wire protocol {PROTOCOL_VERSION}: a release that changes the protocol "
        f"is 0.{PROTOCOL_VERSION}.0 (CHANGELOG.md, Versions)"
    )


def test_the_changelog_heads_with_this_version():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        headings = re.findall(r"^## (\d.*)$", f.read(), re.M)
    assert headings and headings[0] == f"{__version__} (protocol {PROTOCOL_VERSION})", headings[:1]


def test_lrmp_worker_version_says_all_three_and_exits_0():
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_remote_mp.worker", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"lrmp-worker {__version__} (wire protocol {PROTOCOL_VERSION}, torch {torch.__version__})\n"


@pytest.mark.parametrize(
    "endpoint, hint",
    [
        ("tcp://127.0.0.1:5555", "--bind tcp://0.0.0.0:5555"),
        ("tcp://127.0.0.2:40101", "--bind tcp://0.0.0.0:40101"),
        ("tcp://localhost:6000", "--bind tcp://0.0.0.0:6000"),
        ("tcp://[::1]:7000", "--bind tcp://0.0.0.0:7000"),
        ("tcp://0.0.0.0:5555", None),
        ("tcp://10.0.0.5:5555", None),
        ("ipc:///tmp/lrmp-worker", None),
    ],
)
def test_the_loopback_hint(endpoint, hint):
    said = loopback_hint(endpoint)
    if hint is None:
        assert said is None
    else:
        assert said is not None and "only this machine can reach it" in said and hint in said


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX signals")
def test_a_worker_says_its_versions_when_ready_and_why_it_stopped():
    proc = subprocess.Popen(
        [sys.executable, "-m", "lightning_remote_mp.worker", "--bind", "tcp://127.0.0.1:*", "--log-level", "INFO"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 90
        while not any("ready on" in line for line in seen):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "the worker ended before it was ready:\n" + "\n".join(seen)
            seen.append(line)
        ready = seen[-1]
        m = re.fullmatch(r"lrmp-worker ready on (tcp://127\.0\.0\.1:(\d+)) (.*)", ready)
        assert m, ready
        assert f"lrmp={__version__} protocol={PROTOCOL_VERSION}" in m.group(3), ready
        assert "only this machine can reach it" in ready and f"--bind tcp://0.0.0.0:{m.group(2)}" in ready, ready
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        while (line := lines.get(timeout=10)) is not None:
            seen.append(line)
        assert any(line.endswith("lrmp-worker INFO stopped by SIGTERM") for line in seen), "\n".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
