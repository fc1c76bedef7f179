"""lightning_remote_mp: train one model split layer by layer across machines, from Lightning's Trainer.

The worker side imports only torch; the strategy (and with it Lightning) is imported when first
used, so ``lrmp-worker`` starts fast.
"""

from __future__ import annotations

from typing import Any

from lightning_remote_mp._version import __version__
from lightning_remote_mp.driver.options import CurveOptions, LocalWorkerOptions, RecoveryOptions
from lightning_remote_mp.errors import (
    AuthenticationError,
    ConfigurationError,
    KeyFileError,
    LimitExceeded,
    LocatedError,
    LrmpError,
    ProtocolError,
    ProtocolVersionError,
    RefusedClassError,
    RefusedOperatorError,
    RemoteInputError,
    SpecError,
    TraceError,
    WorkerError,
    WorkerLostError,
    WorkerStartError,
)
from lightning_remote_mp.lightning import intercept
from lightning_remote_mp.model.spec import SpecSequential

__all__ = [
    "AuthenticationError",
    "ConfigurationError",
    "CurveOptions",
    "KeyFileError",
    "LimitExceeded",
    "LocalWorkerOptions",
    "LocatedError",
    "LrmpError",
    "ProtocolError",
    "ProtocolVersionError",
    "RecoveryOptions",
    "RefusedClassError",
    "RefusedOperatorError",
    "RemoteInputError",
    "RemoteModelParallelStrategy",
    "SpecError",
    "SpecSequential",
    "TraceError",
    "WorkerError",
    "WorkerLostError",
    "WorkerStartError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "RemoteModelParallelStrategy":
        from lightning_remote_mp.lightning.strategy import RemoteModelParallelStrategy

        return RemoteModelParallelStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


intercept.install_registration()  # lightning/intercept.py: the strategy registers when Lightning is imported
