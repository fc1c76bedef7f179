"""Host memory allocation on the worker: keep freed memory for the next step.

A training step allocates and frees the same large buffers every time: activations, gradients,
received tensors. glibc's malloc serves blocks above a (dynamic) threshold with fresh ``mmap``
and hands memory at the top of its heap back to the kernel when it is freed, so each step maps
much of that memory again and pays a page fault on every 4 KiB page it touches. The worker asks
malloc to keep up to 1 GiB of freed heap for reuse, and `release` gives it back when a session
ends.

A block of 1 MiB or more that the heap's free memory cannot serve is mapped apart, and unmapped
when freed, rather than growing the heap (a fixed threshold, not glibc's dynamic one, which rises
to 32 MiB once such blocks are freed). Grown into the heap, a long sequence's activations (a few
MB each) leave holes the next micro-batch's do not fit, and a stage peaked far above the tensors it
held, by an amount that changed from run to run: the last stage of a QLoRA Llama (2,048 tokens,
benchmarks/memory_plan.py) at 1,003 MB with 32 MiB, 897 MB with 4 MiB and 517 MB with 1 MiB. With
1 MiB every stage measured is within 14% of the tensors its plan counts, run after run. What it
costs is speed where a step's tensors are of 1 MiB and more: each is mapped afresh and its pages
faulted in again. benchmarks/throughput.py's wide MLP (width 1,024, batch 256, 1F1B, one run of 2
rounds each) steps at 0.88x the plain loop at m=1 and 0.95x at m=4, against 1.05x and 1.04x with
32 MiB (its stages' CPU time per step 65/70 against 53/60 ms at m=1); 2 MiB gives 1.00x and 1.05x,
but the QLoRA stages above peak at 1.15x and 1.09x their plan (620 and 612 MB). Memory first: a
long sequence's activations are what a worker runs out of.
Where malloc is not glibc's, this does nothing.

>>> keep_freed_memory() in (True, False)
True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 20  # blocks this large and larger are mapped apart (see above)
_TRIM_THRESHOLD = 1 << 30


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Tune malloc as described above; returns whether it took effect."""
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1
    log.debug("malloc keeps freed memory for reuse: %s", ok)
    return ok


def device_memory(device: torch.device) -> tuple[int, int]:
    """The memory of ``device`` still available, and in all, in bytes (a GPU's; the host's for the CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, int(info["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0, 0


def release() -> None:
    """Give the freed memory kept for reuse back to the kernel."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
