"""Long work shown while it runs: the workers reading their stages' weights from files at setup,
writing a sharded checkpoint. Minutes at the sizes lrmp exists for, so the driver logs, at most
once a second, the bytes each worker has done out of its total (what its heartbeat answers say,
`lightning_remote_mp.wire.heartbeat.Heartbeat.progress`), and at the end how long it all took.

>>> _size(1_500_000_000), _size(2_000_000)
('1.50 GB', '2.0 MB')
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from lightning_remote_mp.wire.heartbeat import Heartbeat
from lightning_remote_mp.wire.transport import Connection

log = logging.getLogger(__name__)

#: Seconds between two progress lines, at least.
INTERVAL = 1.0


@contextmanager
def shown(heartbeat: Heartbeat | None, conns: Sequence[Connection], what: str) -> Iterator[None]:
    """While the block runs, log ``what`` has come on the workers of ``conns`` (once a worker reports
    progress); after it, how long it took (when anything was reported)."""
    if heartbeat is None:
        yield
        return
    started = time.monotonic()
    stop = threading.Event()
    workers: dict[str, str] = {}
    for c in conns:
        workers.setdefault(c.address, c.where())
    seen: dict[str, tuple[int, int]] = {}

    def run() -> None:
        said: dict[str, tuple[int, int]] = {}
        while not stop.wait(INTERVAL):
            for address in workers:
                if (p := heartbeat.progress.get(address)) is not None:
                    seen[address] = (p[1], p[2])
                elif address in seen:  # its work ended (a checkpoint file counts once written)
                    seen[address] = (seen[address][1], seen[address][1])
            if seen and seen != said:
                said = dict(seen)
                done, total = (sum(v[i] for v in said.values()) for i in (0, 1))
                each = "; ".join(f"{workers[a]} {_size(d)} of {_size(t)}" for a, (d, t) in said.items())
                log.info("%s: %s of %s (%s), %.0f s", what, _size(done), _size(total), each, time.monotonic() - started)

    thread = threading.Thread(target=run, name="lrmp-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if seen:
            log.info("%s: done in %.1f s", what, time.monotonic() - started)


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
