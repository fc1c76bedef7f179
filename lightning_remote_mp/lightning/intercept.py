"""Every place lrmp bends Lightning, in one room, and what it refuses because it cannot bend it.

Lightning's loop drives training unchanged: the strategy's hooks (`lightning_remote_mp.lightning.strategy`)
do most of the work. Six things no hook reaches are intercepted instead:

| # | what is intercepted | where | what breaks without it |
|---|---|---|---|
| 1 | ``import lightning.pytorch`` | `RegisterOnImport` | ``"remote_mp"`` is unknown unless the class was imported |
| 2 | the optimizer's ``zero_grad`` | its class (`lightning_remote_mp.driver.optim`) | remote gradients pile up |
| 3 | the precision plugin's clipping | `patch_clipping`, `unpatch_clipping` | only the driver's ``.grad`` is clipped |
| 4 | the default ``ModelSummary`` callback | `use_remote_summary` | the summary has no ``Where`` column |
| 5 | the strategy's ``optimizers`` setter | `mirror_assigned` | ``lr_find``'s optimizers step the driver's share only |
| 6 | ``fit`` run again after a loss | `lightning_remote_mp.lightning.recovery` | a lost worker ends the run |

Why each is intercepted rather than hooked:

1. ``Trainer(strategy="remote_mp")`` needs the name in Lightning's registry, whichever of the two
   packages a program imports first, and the worker must never import Lightning: the package face
   installs an import hook (`install_registration`) that imports the strategy, which registers itself.
2. torch has no ``zero_grad`` hook, and ``LightningOptimizer`` finds ``zero_grad`` on the optimizer's
   class, never on the instance. The swap lives in the driver because it also serves a
   `DriverSession` used without a Trainer, and a reference to the optimizer the user kept.
3. Lightning clips (``gradient_clip_val``, ``self.clip_gradients``) only through the precision
   plugin, over the local ``.grad``; a plugin subclass shipped with the strategy would silently
   replace the one ``precision=`` selects (``"bf16-mixed"`` would train in float32).
4. The summary should say where each layer lives; the default callback is swapped for
   `lightning_remote_mp.lightning.summary.RemoteModelSummary`.
5. Optimizers assigned while workers hold layers (the tuner does this) must be mirrored before
   Lightning builds its ``LightningOptimizer`` wrappers, which copy the optimizer's class.
6. With ``recovery=``, the strategy's launcher (a hook) runs ``fit`` again from a checkpoint after a
   loss; it recognises ``fit`` by ``Trainer._fit_impl``, tears the lost run down with
   ``Trainer._teardown`` (what Lightning does after any failure), sets the trainer's state as
   ``Trainer.fit`` does before calling ``_fit_impl`` again, and the train loader's wrapper
   checks ``fit_loop._combined_loader`` for a second train loader. These are private to Lightning
   (2.6), with the others lrmp uses: docs/private_apis.md lists each, what happens if it changes,
   and the test that fails then.

What cannot be bent is refused before anything starts (`refuse_unsupported`): the callbacks of
`refused_callbacks`, and a precision with a ``GradScaler``.

This module imports Lightning only inside its functions: the package face imports it to install
the import hook, and a worker never imports Lightning.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lightning_remote_mp.errors import LrmpError

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_remote_mp.driver.session import DriverSession

#: The module whose import registers the strategy: the strategy is a ``lightning.pytorch`` Strategy.
LIGHTNING = "lightning.pytorch"
_STRATEGY = "lightning_remote_mp.lightning.strategy"


# --- the import hook -------------------------------------------------------------------------------
class RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the strategy as ``"remote_mp"`` as soon as ``lightning.pytorch`` finishes importing,
    whether a program imports it before or after this package; ``lrmp-worker`` never imports it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != LIGHTNING:
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
        if module.__name__ == LIGHTNING and _STRATEGY not in sys.modules:
            try:
                importlib.import_module(_STRATEGY)  # registers it
            except Exception as err:  # never break `import lightning` itself
                import warnings

                warnings.warn(f"lightning_remote_mp could not register strategy 'remote_mp': {err}", stacklevel=2)

    def __getattr__(self, name: str) -> Any:
        # Resource readers, get_data, get_source...: what the real loader offers.
        return getattr(self.loader, name)


def install_registration() -> None:
    """Register the strategy now if Lightning is imported already, else when it is (once)."""
    if LIGHTNING in sys.modules:
        importlib.import_module(_STRATEGY)  # a program that already uses Lightning: registered right away
    elif not any(isinstance(f, RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, RegisterOnImport())


# --- the precision plugin's clipping ------------------------------------------------------------
def patch_clipping(plugin: Any) -> None:
    """Clip over every stage's gradients: Lightning's precision plugin only sees local ones (the
    table above). Optimizers without a mirror clip as before."""
    from lightning_remote_mp.driver.optim import mirror_of

    by_norm, by_value = plugin.clip_grad_by_norm, plugin.clip_grad_by_value

    def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
        mirror = mirror_of(optimizer)
        return mirror.clip_grad_norm(float(clip_val)) if mirror else by_norm(optimizer, clip_val)

    def clip_grad_by_value(optimizer: Any, clip_val: float) -> None:
        mirror = mirror_of(optimizer)
        return mirror.clip_grad_value(float(clip_val)) if mirror else by_value(optimizer, clip_val)

    plugin.clip_grad_by_norm = clip_grad_by_norm
    plugin.clip_grad_by_value = clip_grad_by_value


def unpatch_clipping(plugin: Any) -> None:
    """The plugin's own clipping again."""
    vars(plugin).pop("clip_grad_by_norm", None)
    vars(plugin).pop("clip_grad_by_value", None)


# --- the model summary, and the optimizers Lightning is given --------------------------------------
def use_remote_summary(trainer: pl.Trainer) -> None:
    """Swap Lightning's ``ModelSummary`` callback for one that says where each layer lives. Its
    ``RichModelSummary`` (the default where ``rich`` is installed) lays out only the columns it
    knows, so it becomes the plain one too."""
    from lightning.pytorch.callbacks import ModelSummary, RichModelSummary

    from lightning_remote_mp.lightning.summary import RemoteModelSummary

    for i, cb in enumerate(trainer.callbacks):
        if type(cb) in (ModelSummary, RichModelSummary):
            trainer.callbacks[i] = RemoteModelSummary(max_depth=cb._max_depth, **cb._summarize_kwargs)


def mirror_assigned(session: DriverSession | None, optimizers: Sequence[Any]) -> None:
    """Mirror optimizers assigned while workers hold layers, before Lightning wraps them."""
    if session is not None:
        for i, opt in enumerate(optimizers):
            session.mirror_optimizer(i, opt)


# --- what cannot be bent -----------------------------------------------------------------------------
def refused_callbacks() -> list[tuple[type, str]]:
    """The callbacks the strategy refuses, each with why."""
    from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging

    averaging = "it averages the LightningModule's local parameters, while the trained values live on the workers."
    refused: list[tuple[type, str]] = [
        (StochasticWeightAveraging, averaging),
        (
            BaseFinetuning,
            "it freezes layers and adds parameter groups to the optimizer while training, which the "
            "workers' optimizers would not see.",
        ),
    ]
    with contextlib.suppress(ImportError):  # Lightning >= 2.5
        from lightning.pytorch.callbacks import WeightAveraging

        refused.append((WeightAveraging, averaging))
    return refused


def refuse_unsupported(trainer: pl.Trainer) -> None:
    """Raise `LrmpError` for a callback or precision this strategy cannot serve, naming why."""
    for cb in trainer.callbacks:
        for cls, why in refused_callbacks():
            if isinstance(cb, cls):
                raise LrmpError(
                    f"{type(cb).__name__} is not supported by RemoteModelParallelStrategy: {why} "
                    "Remove the callback, or train without the strategy."
                )
    plugin = trainer.precision_plugin
    if getattr(plugin, "scaler", None) is not None:
        raise LrmpError(
            f"precision={getattr(plugin, 'precision', '16-mixed')!r} uses a GradScaler, which would have to "
            "unscale and check every stage's gradients; RemoteModelParallelStrategy does not provide that. "
            "Use precision='bf16-mixed' or 'bf16-true'."
        )
