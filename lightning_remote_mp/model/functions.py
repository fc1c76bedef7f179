"""Custom ``torch.autograd.Function``s in a traced module: which ones the trace can keep.

torch.export records a Function as the operators its ``forward`` runs, and the workers
differentiate those operators: they run no user code, so never the Function's own ``backward``.
That trains as locally when the backward computes the forward's derivative (a memory-saving
kernel, BLOOM's GELU, a reversible layer) and silently otherwise (a straight-through estimator, a
gradient reversal or scaling, a forward computed under ``no_grad``). `recording` notes the
Functions a forward applies while it is exported; `check` runs each one here on random inputs of
the traced shapes, once with its backward and once differentiating its forward, and refuses one
whose gradients differ, naming it and the way to write the same gradient in plain operators.

>>> class Round(torch.autograd.Function):  # a straight-through estimator
...     forward = staticmethod(lambda ctx, x: torch.round(x))
...     backward = staticmethod(lambda ctx, g: g)
>>> with recording() as seen:
...     _ = Round.apply(torch.randn(3, requires_grad=True))
>>> check(seen, "model")  # doctest: +IGNORE_EXCEPTION_DETAIL
Traceback (most recent call last):
TraceError: module 'model': the autograd.Function ...Round ... has a backward that is not ...
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_remote_mp.errors import TraceError

log = logging.getLogger(__name__)

#: The most elements a Function's random inputs may have for `check` to run it.
CHECK_ELEMENTS = 1 << 24
#: What a size the data decides stands in as, in `check`'s random inputs.
DATA_SIZE = 3


class _Tensor:
    """A tensor argument as traced: what a random stand-in needs. Its size is the traced call's; a
    size the data decides (rows picked by a mask) has none, and stands in as `DATA_SIZE`.
    Half-precision inputs are checked in float32, whose rounding the comparison's tolerance fits."""

    def __init__(self, t: torch.Tensor) -> None:
        sizes = [s.node.hint if isinstance(s, torch.SymInt) else s for s in t.shape]
        self.shape = [DATA_SIZE if s is None else int(s) for s in sizes]
        self.dtype, self.requires_grad = t.dtype, t.requires_grad

    def make(self, g: torch.Generator) -> torch.Tensor:
        if self.dtype.is_floating_point or self.dtype.is_complex:
            dtype = torch.float32 if self.dtype.is_floating_point and self.dtype.itemsize < 4 else self.dtype
            return torch.randn(self.shape, generator=g, dtype=dtype).requires_grad_(self.requires_grad)
        if self.dtype == torch.bool:
            return torch.rand(self.shape, generator=g) > 0.5
        return torch.zeros(self.shape, dtype=self.dtype)  # indices: 0 is valid for any size


@contextlib.contextmanager
def recording() -> Iterator[dict[type, tuple[tuple, dict]]]:
    """While inside, the first call of each Function defined outside torch is noted: its class and
    its arguments (tensors as `_Tensor`)."""
    seen: dict[type, tuple[tuple, dict]] = {}
    apply = torch.autograd.Function.apply.__func__  # type: ignore[attr-defined]

    def noting(cls: type, *args: Any, **kwargs: Any) -> Any:
        # One applied without grad has no backward to run: the workers run its forward, as here.
        if cls not in seen and not cls.__module__.startswith("torch.") and torch.is_grad_enabled():
            seen[cls] = pytree.tree_map_only(torch.Tensor, _Tensor, (args, kwargs))
        return apply(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(noting)  # type: ignore[method-assign,assignment]
    try:
        yield seen
    finally:
        torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]


class _Context:
    """What a Function's ``forward`` may ask of its ``ctx`` when it runs outside ``apply``."""

    def __init__(self, needs: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *args: Any) -> None: ...
    def mark_non_differentiable(self, *args: Any) -> None: ...
    def set_materialize_grads(self, value: bool) -> None: ...


def _gradients(
    cls: type, args: tuple, kwargs: dict, differentiable: list[bool] | None
) -> tuple[list[torch.Tensor], list[bool]]:
    """The gradients of a random weighting of ``cls``'s floating outputs with respect to its inputs
    that need one: through its ``backward`` (``differentiable`` None), or differentiating the
    operators of its ``forward`` (over the outputs its ``backward`` took as ``differentiable``: not
    those it marks non-differentiable). Returns them and which outputs took a gradient."""
    g = torch.Generator().manual_seed(0)
    a, k = pytree.tree_map_only(_Tensor, lambda t: t.make(g), (args, kwargs))
    wanted = [t for t in pytree.tree_leaves((a, k)) if isinstance(t, torch.Tensor) and t.requires_grad]
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.default_generator.manual_seed(0)  # a forward drawing random numbers draws the same ones both ways
        if differentiable is None:
            out = cls.apply(*a, **k)  # type: ignore[attr-defined]
        elif _has_setup_context(cls):  # a forward without ctx
            out = cls.forward(*a, **k)  # type: ignore[attr-defined]
        else:
            needs = tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in a)
            out = cls.forward(_Context(needs), *a, **k)  # type: ignore[attr-defined]
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    weights = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in outs]
    taken = [o.requires_grad for o in outs] if differentiable is None else differentiable
    live = [(o, w) for o, w, t in zip(outs, weights, taken) if t and o.requires_grad]
    grads = (
        torch.autograd.grad([o for o, _ in live], wanted, [w for _, w in live], allow_unused=True)
        if live and wanted
        else [None] * len(wanted)
    )
    return [torch.zeros_like(x) if d is None else d for d, x in zip(grads, wanted)], taken


def _has_setup_context(cls: type) -> bool:
    return cls.setup_context is not torch.autograd.Function.setup_context  # type: ignore[attr-defined]


def _where(cls: type) -> str:
    try:
        return f"{inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]}"
    except (OSError, TypeError):
        return cls.__module__


def check(seen: dict[type, tuple[tuple, dict]], name: str) -> None:
    """Refuse a Function among ``seen`` whose backward is not its forward's derivative (module ``name``)."""
    for cls, (args, kwargs) in seen.items():
        what = f"the autograd.Function {cls.__module__}.{cls.__qualname__} ({_where(cls)})"
        size = sum(math.prod(t.shape) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, _Tensor))
        try:
            if size > CHECK_ELEMENTS:
                raise ValueError(f"its inputs have {size:,} elements")
            own, taken = _gradients(cls, args, kwargs, None)
            derived, _ = _gradients(cls, args, kwargs, taken)
        except Exception as err:  # noqa: BLE001 - any failure means: not checked
            log.warning(
                "module %r: the workers differentiate the operators of %s's forward, never its own backward; "
                "lrmp could not check that they agree (%s: %s)",
                name,
                what,
                type(err).__name__,
                err,
            )
            continue
        for a, b in zip(own, derived):
            scale = max(a.abs().nan_to_num().max().item(), b.abs().nan_to_num().max().item(), 1e-6) if a.numel() else 1
            if not torch.allclose(a, b, rtol=1e-3, atol=1e-4 * scale, equal_nan=True):
                raise TraceError(
                    f"module {name!r}: {what} has a backward that is not the derivative of its forward "
                    f"(the gradients of its inputs differ on random inputs). Workers run the traced forward's "
                    "operators and differentiate them, never a Function's own backward (they run no code of "
                    "yours), so this model would train differently than locally. Write the gradient you want "
                    "with plain operators and detach(): a straight-through estimator is "
                    "x + (torch.round(x) - x).detach(), a gradient scale s is x * s + (x * (1 - s)).detach()."
                )
