"""Smoke test of the benchmark scripts: each one's ``--quick`` mode runs in a subprocess, within a
bound of about twice its usual time on 2 cores, and prints its markdown table. The numbers
themselves are not checked (see benchmarks/README.md for real runs). Without matplotlib (the
``bench`` extra) the scripts skip the plot.

``LRMP_BENCH_SMOKE_TIMEOUT`` raises the bound on a machine that is busy with other work.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Tests that run beside it (pytest-xdist's workers) share the cores: the bound grows with their count.
BOUND_S = float(os.environ.get("LRMP_BENCH_SMOKE_TIMEOUT", "30")) * int(
    os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")
)
# memory.py starts a fresh driver and two fresh workers for its one quick model size and once more
# for its recomputation table (six torch imports; --quick runs the two side by side), then four
# workers and Lightning for its schedules table (seven short fits): ~21 s (more on a busy machine).
# tracing.py imports Lightning, starts two workers and traces a small LM with torch.export (the
# trace alone takes several seconds): ~25 s.
# lan.py builds an emulated LAN, starts two workers and two torch ranks on it, and traces a small LM
# for each of its two lrmp runs: ~25 s. compression.py trains two examples (one traced) three times
# each for a few steps, each run with two fresh workers: ~60 s.
# loss_placement.py trains a traced Llama three times, each with two fresh workers: ~25 s.
BOUNDS = {
    "memory.py": 3 * BOUND_S,
    "tracing.py": 4 / 3 * BOUND_S,
    "lan.py": 2 * BOUND_S,
    "compression.py": 4 * BOUND_S,
    "loss_placement.py": 3 * BOUND_S,
}
#: Exit status of a script that cannot run here (lan.py without root or iproute2).
CANNOT_RUN_HERE = 2
TABLE_ROW = re.compile(r"^\|.*\|\s*$", re.M)
SEPARATOR = re.compile(r"^\|(-+\|)+\s*$", re.M)


@pytest.mark.timeout(5 * BOUND_S + 30)
@pytest.mark.parametrize(
    "script",
    [
        "throughput.py",
        "transport.py",
        "protocol_cycle.py",
        "messages.py",
        "memory.py",
        "tracing.py",
        "split_backward.py",
        "lan.py",
        "compression.py",
        "loss_placement.py",
    ],
)
def test_quick_mode_prints_a_table(script, tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), "--quick", "--out", str(tmp_path)]
    bound = BOUNDS.get(script, BOUND_S)
    start = time.monotonic()
    # start_new_session: on a timeout the whole group (the script and the processes it started) is killed.
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{script} --quick took more than {bound:.0f} s\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}")
    elapsed = time.monotonic() - start
    if proc.returncode == CANNOT_RUN_HERE and "no emulated LAN here" in out:
        pytest.skip(out.strip().splitlines()[-1])
    assert proc.returncode == 0, f"{script} --quick failed ({elapsed:.0f} s):\n{out[-3000:]}\n{err[-3000:]}"
    rows = TABLE_ROW.findall(out)
    assert SEPARATOR.search(out) and len(rows) >= 4, f"no markdown table in the output of {script}:\n{out}"
    assert "lrmp" in out


def test_the_hops_script_still_finds_each_point_it_times():
    """``benchmarks/hops.py`` (too long for this smoke test) wraps functions of the driver's and the
    workers' message path by name: each is still there, in a process of its own (it patches ZeroMQ)."""
    code = "import sys; sys.path.insert(0, 'benchmarks'); import hops; hops.install('worker'); hops.install('driver')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
