"""Long work shown while it runs (#35): a worker's heartbeat answers say how many bytes of its
stage's weights it has read, or of its checkpoint file it has written; the driver logs them at most
once a second, and how long it all took."""

from __future__ import annotations

import logging
import time

import torch

from lightning_remote_mp.driver import progress
from lightning_remote_mp.model.weights import iter_tensors, write_tensors
from lightning_remote_mp.wire.transport import Connection
from lightning_remote_mp.worker.weights import PROGRESS, Progress


def test_a_worker_counts_the_bytes_it_reads(tmp_path):
    directory = tmp_path / ".ckpt.lrmp-partial-x"
    directory.mkdir()
    size = write_tensors(str(directory), "s.safetensors", {"a": torch.randn(1000), "b": torch.randn(3, 100)})
    tracker = Progress()
    assert tracker.answer() == {}
    path = str(directory / "s.safetensors")
    seen = []
    with tracker.of("reading weights", 5200):
        for _, tensor in iter_tensors(
            {"x": (path, "a"), "y": (path, "b")},
            {"x": (torch.Size([1000]), torch.float32), "y": (torch.Size([3, 100]), torch.float32)},
        ):
            tracker.add(tensor.nbytes)  # as the worker counts what it reads (`read_stage_files`)
            seen.append(tracker.answer())
    assert seen == [{"progress": ["reading weights", 4000, 5200]}, {"progress": ["reading weights", 5200, 5200]}]
    assert tracker.answer() == {}  # nothing under way
    assert size > 5200 and PROGRESS.answer() == {}


class _Beats:
    """What `shown` reads of the driver's heartbeat: each worker's last reported progress."""

    def __init__(self) -> None:
        self.progress: dict[str, tuple[str, int, int]] = {}


def test_the_driver_logs_progress_at_most_once_an_interval_and_the_time_at_the_end(caplog, monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL", 0.05)
    conns = [Connection(f"tcp://127.0.0.1:{9 + s}", stage=s) for s in (0, 1)]  # nothing is sent
    beats = _Beats()
    try:
        with caplog.at_level(logging.INFO, logger="lightning_remote_mp.driver.progress"):
            with progress.shown(beats, conns, "reading weights"):  # type: ignore[arg-type]
                for done in (0, 500_000, 1_000_000):
                    beats.progress["tcp://127.0.0.1:9"] = ("reading weights", done, 2_000_000)
                    time.sleep(0.2)
                del beats.progress["tcp://127.0.0.1:9"]  # its work ended
                time.sleep(0.2)
    finally:
        for c in conns:
            c.close()
    lines = [r.getMessage() for r in caplog.records]
    assert any("1.0 MB of 2.0 MB" in line and "127.0.0.1:9 (stage 0) 1.0 MB" in line for line in lines), lines
    assert not any("stage 1" in line for line in lines), lines  # it reported nothing
    assert len([line for line in lines if " of 2.0 MB" in line]) <= 4  # only when something moved
    assert any("2.0 MB of 2.0 MB" in line for line in lines), lines
    assert "reading weights: done in" in lines[-1], lines
