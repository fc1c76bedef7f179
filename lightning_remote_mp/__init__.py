"""lightning_remote_mp: train one model split layer by layer across machines, from Lightning's Trainer.

The worker side imports only torch; the strategy (and with it Lightning) is imported when first
used, so ``lrmp-worker`` starts fast.
"""

from __future__ import annotations

import sys
from typing import Any

__version__ = "0.1.0"

from lightning_remote_mp.errors import (  # noqa: E402
    AuthenticationError,
    LrmpError,
    ProtocolError,
    ProtocolVersionError,
    RefusedClassError,
    SpecError,
    WorkerError,
    WorkerLostError,
)
from lightning_remote_mp.spec import SpecSequential  # noqa: E402

__all__ = [
    "AuthenticationError",
    "LrmpError",
    "ProtocolError",
    "ProtocolVersionError",
    "RefusedClassError",
    "RemoteModelParallelStrategy",
    "SpecError",
    "SpecSequential",
    "WorkerError",
    "WorkerLostError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "RemoteModelParallelStrategy":
        from lightning_remote_mp.strategy import RemoteModelParallelStrategy

        return RemoteModelParallelStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# A program that already uses Lightning gets the strategy registered as "remote_mp" right away.
if "lightning" in sys.modules or "pytorch_lightning" in sys.modules:
    from lightning_remote_mp.strategy import RemoteModelParallelStrategy  # noqa: E402,F401
