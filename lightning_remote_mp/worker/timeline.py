"""What a worker did and when: compute spans and transfers per micro-batch, for the driver's timeline.

Recording is off unless the driver asks for it; events are wall-clock seconds on this machine
(the driver corrects for clock offsets) and the log is bounded, oldest events dropped first.
"""

from __future__ import annotations

import collections
from typing import Any


class EventLog:
    def __init__(self, limit: int = 100_000) -> None:
        self.events: collections.deque[list[Any]] = collections.deque(maxlen=limit)

    def span(self, what: str, key: str, stage: int, call: int, mb: int, start: float, end: float) -> None:
        """A compute span: ``what`` is "forward" or "backward"."""
        self.events.append([what, key, stage, call, mb, start, end])

    def transfer(self, key: str, src: int, dst: int, call: int, mb: int, sent: float, arrived: float) -> None:
        self.events.append(["transfer", key, src, dst, call, mb, sent, arrived])

    def drain(self) -> list[list[Any]]:
        out = list(self.events)
        self.events.clear()
        return out
