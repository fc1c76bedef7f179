"""Rate-limited warnings: a flood of bad input must not become a flood of log lines."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any


class Throttle:
    """At most one warning per ``interval`` seconds for each ``key``; the next one logged says how
    many were left out in between."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.log = logger
        self.interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self.interval) < self.interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            if len(self._last) > 1000:  # keys come from a bounded set, but stay safe
                self._last.clear()
            self._last[key] = now
            left_out = self._suppressed.pop(key, 0)
        if left_out:
            message += f" ({left_out} more like it in the last {self.interval:.0f} s not logged)"
        self.log.warning(message, *args)
