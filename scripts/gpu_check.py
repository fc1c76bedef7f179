"""For whoever has a GPU: check lrmp's CUDA paths and measure them against torch.distributed.pipelining.

CI has no GPU, so the tests of the GPU data path (pinned buffers, side streams, sends that wait
on an event for their tensors: `lightning_remote_mp.worker.device_io`) skip there. This script
runs them, then the throughput benchmark on the GPU for the overhead-bound small model (width 128,
where lrmp's per-message cost decides) and the wide one (width 1024), and prints every table::

    python scripts/gpu_check.py            # tests + both benchmarks (several minutes)
    python scripts/gpu_check.py --quick    # tests + a short benchmark run

It exits non-zero when a test fails or a benchmark cannot run. Paste its output into
``benchmarks/README.md`` (section "On a GPU") with the GPU's name.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_TESTS = ["tests/test_device_io.py"]
SMALL = ["--width", "128", "--batch", "64", "--depth", "8", "--lrmp-m", "1", "4", "--torch-m", "4"]
WIDE = ["--width", "1024", "--batch", "256", "--depth", "8", "--lrmp-m", "1", "4", "8", "--torch-m", "4", "8"]


def run(title: str, cmd: list[str]) -> int:
    print(f"\n## {title}\n\n`{' '.join(cmd)}`\n", flush=True)
    return subprocess.run([sys.executable, *cmd], cwd=ROOT).returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short benchmark run (one round, few steps)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device is visible to torch here: nothing to check", file=sys.stderr)
        return 2
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"# lrmp on {len(names)} GPU(s): {', '.join(names)}; torch {torch.__version__}")
    failed = run("CUDA tests", ["-m", "pytest", "-q", "-rs", *CUDA_TESTS])
    timing = ["--rounds", "1", "--steps", "30", "--warmup", "5"]
    if not args.quick:
        timing = ["--rounds", "3", "--steps", "100", "--warmup", "10"]
    with tempfile.TemporaryDirectory(prefix="lrmp-gpu-check-") as out:
        for title, shape in (("Small, fast stages (width 128)", SMALL), ("Wide stages (width 1024)", WIDE)):
            bench = ["benchmarks/throughput.py", "--device", "cuda", *shape, *timing, "--out", out]
            failed |= run(title, bench)
    print("\nall checks passed" if not failed else "\nSOME CHECKS FAILED", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
