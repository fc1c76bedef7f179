"""lightning_remote_mp: train one model split layer by layer across machines, from Lightning's Trainer.

The worker side imports only torch; the strategy (and with it Lightning) is imported when first
used, so ``lrmp-worker`` starts fast.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

from lightning_remote_mp._version import __version__
from lightning_remote_mp.driver.options import CurveOptions, LocalWorkerOptions
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


_LIGHTNING = ("lightning.pytorch",)  # the strategy is a lightning.pytorch Strategy


class _RegisterWithLightning(importlib.abc.MetaPathFinder):
    """Registers the strategy as "remote_mp" as soon as ``lightning.pytorch`` finishes importing,
    whether a program imports it before or after this package; ``lrmp-worker`` never imports it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _LIGHTNING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)  # type: ignore[attr-defined]
        # The strategy module registers itself when it finishes; it may be what imports Lightning now.
        if module.__name__ == "lightning.pytorch" and "lightning_remote_mp.lightning.strategy" not in sys.modules:
            try:
                from lightning_remote_mp.lightning.strategy import RemoteModelParallelStrategy  # noqa: F401  (registers it)
            except Exception as err:  # never break `import lightning` itself
                import warnings

                warnings.warn(f"lightning_remote_mp could not register strategy 'remote_mp': {err}", stacklevel=2)

    def __getattr__(self, name: str) -> Any:
        # Resource readers, get_data, get_source...: what the real loader offers.
        return getattr(self.loader, name)


if any(name in sys.modules for name in _LIGHTNING):
    # A program that already uses Lightning gets the strategy registered right away.
    from lightning_remote_mp.lightning.strategy import RemoteModelParallelStrategy  # noqa: F401
elif not any(isinstance(f, _RegisterWithLightning) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithLightning())
