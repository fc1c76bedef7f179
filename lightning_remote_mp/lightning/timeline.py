"""A per-stage timeline of training: forward, backward, transfers and idle time per micro-batch,
written as Chrome trace JSON (open it in https://ui.perfetto.dev), and the pipeline's bubble
fraction logged through Lightning's logger as ``lrmp/bubble_fraction``.

Each stage of each replica is one row (a trace "process"), named like ``net replica 1 stage 0 @
tcp://10.0.0.5:5555`` (``net stage 0 @ ...`` without replicas); the bubble fraction averages over
every row that computed.

Enable it with ``RemoteModelParallelStrategy(timeline="trace.json")``. Workers timestamp with
their own clocks; the driver measures each worker's offset (the sample with the shortest round
trip of a few) and puts every event on its own clock.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl

from lightning_remote_mp.driver.pipeline import RemoteStage, confirm_outstanding
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.requests import Timeline
from lightning_remote_mp.wire.transport import Connection, broadcast

log = logging.getLogger(__name__)


def clock_offset(conn: Connection, rounds: int = 5) -> float:
    """Seconds to subtract from the worker's clock to get this process's clock."""
    best = (float("inf"), 0.0)
    for _ in range(rounds):
        t0 = time.time()
        worker_time = conn.request(protocol.TIMELINE, Timeline("clock").body())["time"]
        t1 = time.time()
        best = min(best, (t1 - t0, worker_time - (t0 + t1) / 2))
    return best[1]


def bubble_fraction(spans: Sequence[tuple[Any, float, float]], start: float, end: float) -> float:
    """1 minus the mean share of ``[start, end]`` each row spent computing; ``spans`` holds
    ``(row, begin, finish)``, a row being one stage of one replica."""
    if end <= start:
        return 0.0
    busy: dict[Any, float] = {}
    for stage, a, b in spans:
        busy[stage] = busy.get(stage, 0.0) + max(0.0, min(b, end) - max(a, start))
    if not busy:
        return 1.0
    return 1.0 - sum(min(v, end - start) for v in busy.values()) / (len(busy) * (end - start))


class TimelineCallback(pl.Callback):
    """Added by the strategy when ``timeline`` is set; not meant to be added by hand."""

    def __init__(self, path: str, strategy: Any) -> None:
        self.path = path
        self.strategy = strategy
        self.events: list[dict[str, Any]] = []
        self.origin = time.time()
        self._offsets: dict[str, float] = {}
        self._pids: dict[tuple[str, int, int], int] = {}  # (key, replica, stage) -> row
        self._conns_at: dict[tuple[str, int, int], Connection] = {}
        self._replica_of: dict[int, int] = {}  # id(connection) -> its replica
        self._step_start = 0.0

    def _conns(self) -> list[Connection]:
        session = self.strategy.session
        return session.conns if session is not None else []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        conns = self._conns()
        self._offsets = {c.address: clock_offset(c) for c in conns}
        broadcast(conns, protocol.TIMELINE, Timeline("start").body())
        self._meta(0, "driver")
        self._add_rows()

    def _add_rows(self) -> None:
        """A row per stage and replica of every placed module not seen yet (a traced module is
        placed at its first call)."""
        session = self.strategy.session
        if session is None:
            return
        for key in session.placements:
            rows = session.placed_stages(key)
            for r, rs in ((r, rs) for r, row in enumerate(rows) for rs in row):
                if (key, r, rs.stage.index) not in self._pids:
                    self._add_row(key, r if len(rows) > 1 else None, rs)

    def _add_row(self, key: str, replica: int | None, rs: RemoteStage) -> None:
        where = (key, replica or 0, rs.stage.index)
        self._pids[where] = pid = len(self._pids) + 1
        self._conns_at[where] = rs.conn
        self._replica_of[id(rs.conn)] = replica or 0
        named = f" replica {replica}" if replica is not None else ""
        self._meta(pid, f"{key}{named} stage {rs.stage.index} @ {rs.address}")

    def _meta(self, pid: int, name: str) -> None:
        self.events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
        self.events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "compute"}})
        self.events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 2, "args": {"name": "transfers in"}})

    def _span(self, name: str, cat: str, pid: int, tid: int, start: float, end: float, **args: Any) -> None:
        self.events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "pid": pid,
                "tid": tid,
                "ts": round((start - self.origin) * 1e6, 1),
                "dur": round(max(0.0, end - start) * 1e6, 1),
                "args": args,
            }
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_start = time.time()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        conns = self._conns()
        confirm_outstanding(conns)  # the step's backward, which the driver did not wait for, is part of it
        end = time.time()
        self._add_rows()
        spans: list[tuple[Any, float, float]] = []
        for conn, reply in zip(conns, broadcast(conns, protocol.TIMELINE, Timeline("fetch").body())):
            offset = self._offsets.get(conn.address, 0.0)
            r = self._replica_of.get(id(conn), 0)  # a worker's events are its replica's
            for event in reply["events"]:
                if event[0] == "transfer":
                    _, key, src, dst, call, mb, sent, arrived = event
                    src_conn = self._conns_at.get((key, r, src))  # peers are in the same replica
                    src_offset = self._offsets.get(src_conn.address, 0.0) if src_conn else offset
                    pid = self._pids.get((key, r, dst), 0)
                    self._span(
                        f"{src}->{dst} mb{mb}", "transfer", pid, 2, sent - src_offset, arrived - offset, call=call
                    )
                else:
                    what, key, stage, call, mb, a, b = event
                    pid = self._pids.get((key, r, stage), 0)
                    label = f"{what[0].upper()}{mb}" if mb >= 0 else what[0].upper()  # weights: whole batch
                    self._span(label, what, pid, 1, a - offset, b - offset, call=call)
                    spans.append(((key, r, stage), a - offset, b - offset))
        self._span(f"step {trainer.global_step}", "step", 0, 1, self._step_start, end)
        self._idle(spans, self._step_start, end)
        bubble = bubble_fraction(spans, self._step_start, end)
        pl_module.log("lrmp/bubble_fraction", bubble, on_step=True, on_epoch=True, prog_bar=False)

    def _idle(self, spans: list[tuple[Any, float, float]], start: float, end: float) -> None:
        for stage_key, pid in self._pids.items():
            t = start
            for _, a, b in sorted(s for s in spans if s[0] == stage_key):
                if a > t:
                    self._span("idle", "idle", pid, 1, t, a)
                t = max(t, b)
            if end > t:
                self._span("idle", "idle", pid, 1, t, end)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write()

    def write(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with open(self.path, "w") as f:
            json.dump({"traceEvents": self.events, "displayTimeUnit": "ms"}, f)
        log.info("timeline with %d events written to %s", len(self.events), self.path)
