"""Outputs the last stage keeps: a model's logits stay on the worker that computed them until the
driver reads them.

A language model that computes its loss itself (``model(ids, labels=labels).loss``) also returns
its logits: batch x sequence x vocabulary, 131 MB per step for a 32k vocabulary at batch 8 x 128.
A step that reads only the loss needs none of it on the driver. So when a traced module returns a
loss, the driver asks the last stage to keep the outputs that carry the batch
(`lightning_remote_mp.wire.messages.Forward.keep`); the result brings their shapes, and the module's
output holds a `Kept` tensor for each: one with the right shape, dtype and device and no data.
The first operation on it (``out.logits.argmax(-1)``, printing it, logging a metric of it) fetches
the call's kept outputs from the last stage of every replica, once, and works on those. Reading it
under autograd links the fetched value to the pipeline's output, so a loss computed from the
logits on the driver still sends their gradient back to the workers. Never missing, never stale:
the value is the forward's, and before a session ends every kept output still referenced is
fetched.

Reshaping and slicing a kept output (``logits[:, :-1].reshape(-1, vocab)``, as a language model's
shifted loss does) fetches nothing: it gives another `Kept` tensor that records the steps. A loss
from ``torch.nn.functional`` over a kept output (``F.cross_entropy(logits.view(-1, V), y.view(-1))``,
or ``nn.CrossEntropyLoss`` calling it) is computed on the last stage (`lightning_remote_mp.driver.losses`):
only the targets travel there and the loss comes back. Whatever else reads it fetches it.

>>> kept = _Stub(torch.arange(6.0).view(2, 3))
>>> t = Kept.of(kept, 0, (2, 3), torch.float32, torch.device("cpu"))
>>> t.shape, kept.fetches
(torch.Size([2, 3]), 0)
>>> t.sum().item(), kept.fetches
(15.0, 1)
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree


class _Read(torch.autograd.Function):
    """The fetched value of a `Kept` tensor, linked to it in the autograd graph."""

    @staticmethod
    def forward(ctx: Any, placeholder: torch.Tensor, source: Any, position: int) -> torch.Tensor:
        return source.value(position)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


log = logging.getLogger(__name__)

#: What a `Kept` tensor answers without fetching: its metadata.
_METADATA = frozenset(
    [
        *(
            getattr(torch.Tensor, name).__get__
            for name in ("shape", "dtype", "device", "requires_grad", "grad_fn", "is_leaf", "ndim", "layout")
        ),
        *(getattr(torch.Tensor, name).__get__ for name in ("is_cuda", "is_cpu", "is_meta", "is_sparse")),
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.ndimension,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.__len__,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.requires_grad_,
        _Read.apply,
    ]
)


#: A step on a kept output that gives another kept output, recorded, not run: reshapes that keep
#: the rows in batch order, slices, casts (see `_lazy`).
_STEPS = frozenset(
    [
        torch.Tensor.view,
        torch.Tensor.reshape,
        torch.reshape,
        torch.Tensor.flatten,
        torch.flatten,
        torch.Tensor.contiguous,
        torch.Tensor.__getitem__,
        torch.Tensor.float,
        torch.Tensor.double,
        torch.Tensor.to,
        torch.Tensor.transpose,
        torch.transpose,
        torch.Tensor.permute,
        torch.permute,
    ]
)

#: Losses whose target pairs with the output element by element (a broadcast would pair rows
#: across the batch, which micro-batches cannot: `lightning_remote_mp.driver.losses` declines it).
ELEMENTWISE = frozenset(
    [
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits,
        F.soft_margin_loss,
    ]
)
#: The losses computed where the output is (`lightning_remote_mp.driver.losses` runs them).
LOSSES = frozenset([F.cross_entropy, F.nll_loss]) | ELEMENTWISE

Step = tuple[Any, tuple, dict]  # (function, the arguments after the tensor, keyword arguments)


def _plain(value: Any) -> bool:
    """An argument a recorded step may take: numbers, slices, dtypes and tuples of them."""
    if isinstance(value, (tuple, list, torch.Size)):
        return all(_plain(v) for v in value)
    return value is None or value is Ellipsis or isinstance(value, (int, slice, torch.dtype))


def _keeps_rows(func: Any, rest: tuple, kwargs: dict, ndim: int) -> bool:
    """Whether a step leaves dim 0 the batch's rows in order (or rows of the batch's rows, in order)."""
    if func is torch.Tensor.__getitem__:
        index = rest[0] if isinstance(rest[0], tuple) else (rest[0],)
        if not index:
            return False
        if index[0] is Ellipsis:
            return sum(i is not None and i is not Ellipsis for i in index) < ndim
        return isinstance(index[0], slice) and index[0] == slice(None)
    if func in (torch.Tensor.permute, torch.permute):
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else rest or kwargs.get("dims", ())
        return bool(dims) and isinstance(dims[0], int) and dims[0] % max(ndim, 1) == 0
    if func in (torch.Tensor.transpose, torch.transpose):
        dims = [*rest, *kwargs.values()]
        return len(dims) == 2 and all(isinstance(d, int) and d % max(ndim, 1) != 0 for d in dims)
    if func is torch.Tensor.to:
        return not kwargs and len(rest) == 1 and isinstance(rest[0], torch.dtype)
    return True  # reshapes keep the rows' order; whether dim 0 still counts rows is `losses`' to check


def _batch_free(func: Any, rest: tuple, same: Callable[[tuple], bool]) -> tuple:
    """A reshape's sizes with the first written as ``-1`` where that gives the same shape
    (``same``): ``view(B * T, C)`` becomes ``view(-1, C)``, which each micro-batch can take too."""
    if func not in (torch.Tensor.view, torch.Tensor.reshape, torch.reshape) or not rest:
        return rest
    nested = len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size))
    sizes = list(rest[0] if nested else rest)
    if not sizes or not all(isinstance(s, int) for s in sizes) or -1 in sizes:
        return rest
    free = tuple([-1, *sizes[1:]])
    candidate = (free,) if nested else free
    try:
        return candidate if same(candidate) else rest
    except Exception:
        return rest


def replay(value: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
    """``value`` taken through recorded ``steps``."""
    for func, rest, kwargs in steps:
        value = func(value, *rest, **kwargs)
    return value


class Kept(torch.Tensor):
    """A model output the last stage kept: shape, dtype and device here, its values there, fetched
    at the first operation on it (see the module docstring). A `Kept` made by reshaping another
    records the steps (``steps``) from the output as the model returned it (``root``)."""

    _source: Any
    _position: int
    _read: torch.Tensor | None
    _root: Kept | None  # None for the output itself: a reference to itself would keep it alive until
    # the cyclic garbage collector ran, and the last stage would keep its value (one call's logits)
    # as long, and fetch it when the session ends
    steps: tuple[Step, ...]

    @staticmethod
    def of(source: Any, position: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Kept:
        """The output at ``position`` of what ``source`` (a `KeptOutputs`) fetches."""
        t = torch.Tensor._make_wrapper_subclass(Kept, tuple(shape), dtype=dtype, device=device)  # type: ignore[attr-defined]
        t._source, t._position, t._read, t._root, t.steps = source, position, None, None, ()
        return t

    @property
    def root(self) -> Kept:
        """The output as the model returned it, which this one was made from by ``steps``."""
        return self if self._root is None else self._root

    @property
    def position(self) -> int:
        return self._position

    def read(self) -> torch.Tensor:
        """The fetched value (an ordinary tensor), linked to this one in the autograd graph, even
        when first read under ``no_grad`` (a metric's update): the value is kept for later reads,
        and a loss computed from it afterwards must still reach the workers."""
        if self._read is None:
            with torch._C.DisableTorchFunctionSubclass(), torch.set_grad_enabled(self.root.requires_grad):
                if self.root is self:
                    self._read = _Read.apply(self, self._source, self._position)
                else:
                    self._read = replay(self.root.read(), self.steps)
        return self._read

    def _lazy(self, func: Any, rest: tuple, kwargs: dict) -> Kept | None:
        """This output taken through one more step, recorded (``None`` where it is not one to record)."""
        if not (_plain(rest) and _plain(tuple(kwargs.values()))) or not _keeps_rows(func, rest, kwargs, self.dim()):
            return None
        root = torch.empty(self.root.shape, dtype=self.root.dtype, device="meta")
        try:
            meta = replay(root, (*self.steps, (func, rest, kwargs)))
        except Exception:  # the step does not apply here: run it on the value, to raise its own error
            return None
        rest = _batch_free(func, rest, lambda r: replay(root, (*self.steps, (func, r, kwargs))).shape == meta.shape)
        steps = (*self.steps, (func, rest, dict(kwargs)))
        t = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            Kept, tuple(meta.shape), dtype=meta.dtype, device=self.device, requires_grad=self.root.requires_grad
        )
        t._source, t._position, t._read, t._root, t.steps = self._source, self._position, None, self.root, steps
        return t

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _STEPS and args and type(args[0]) is Kept and args[0]._read is None:
            with torch._C.DisableTorchFunctionSubclass():
                lazy = args[0]._lazy(func, tuple(args[1:]), kwargs)
            if lazy is not None:
                return lazy
        if func in LOSSES and args and type(args[0]) is Kept:
            with torch._C.DisableTorchFunctionSubclass():
                loss = args[0]._source.loss(args[0], func, tuple(args[1:]), kwargs)
            if loss is not None:
                return loss
        kept = next((a for a in pytree.tree_leaves((args, kwargs)) if type(a) is Kept), None)
        if kept is not None and kept._read is None and not kept._source.fetched:
            _say_read(func, kept)
        args, kwargs = pytree.tree_map_only(Kept, Kept.read, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Below autograd (an operation that reached ATen without passing the Python API): the value alone.
        args, kwargs = pytree.tree_map_only(
            Kept, lambda k: replay(k._source.value(k._position), k.steps), (args, kwargs or {})
        )
        return func(*args, **kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        return repr(self.read())


_SAID: set[str] = set()


def _say_read(func: Any, kept: Kept) -> None:
    """Log, once per operation, that it fetches a kept output to the driver (and so would the loss
    computed from its result): a user who wonders where the bytes went reads why here."""
    short = getattr(func, "__name__", None) or repr(func)
    qualname = getattr(func, "__qualname__", "") or ""
    module = getattr(func, "__module__", None)
    if qualname.startswith(("TensorBase.", "Tensor.", "_TensorBase.")):
        name = f"torch.Tensor.{short}"
    else:
        name = f"{module}.{short}" if module else short
    if name in _SAID or not torch.is_grad_enabled():  # predict, say: fetching the output is the point
        return
    _SAID.add(name)
    log.info(
        "%s reads a model output kept on the last stage (%s, %.1f MB): it is fetched to the driver. "
        "A loss from torch.nn.functional over the output itself, after reshapes and slices only, is "
        "computed on the last stage instead (docs/loss.md)",
        name,
        "x".join(map(str, kept.root.shape)),
        kept.root.numel() * kept.root.element_size() / 1e6,
    )


class KeptOutputs:
    """The outputs the last stages kept of one call, fetched once, for all its `Kept` tensors.

    Args:
        fetch: returns the kept outputs (by position, each the whole batch's, joined) when called.
        device: where the values go on the driver.
        release: called once no `Kept` tensor of the call is left, or once fetched: the last
            stages may forget them.
        loss: computes a loss from ``torch.nn.functional`` (`LOSSES`) over a `Kept` tensor of the
            call where it is, ``(kept, function, the other arguments, keyword arguments)``; returns
            ``None`` where it cannot (the value is then fetched and the loss computed here).
    """

    def __init__(
        self,
        fetch: Callable[[], dict[int, torch.Tensor]],
        device: torch.device,
        release: Callable[[], None],
        loss: Callable[[Kept, Any, tuple, dict], torch.Tensor | None] | None = None,
    ):
        self._fetch = fetch
        self._loss = loss
        self.device = device
        self._values: dict[int, torch.Tensor] | None = None
        self._finalizer = weakref.finalize(self, release)

    @property
    def fetched(self) -> bool:
        return self._values is not None

    def value(self, position: int) -> torch.Tensor:
        self.fetch_now()
        assert self._values is not None
        return self._values[position]

    def loss(self, kept: Kept, func: Any, rest: tuple, kwargs: dict) -> torch.Tensor | None:
        """``func(kept, *rest, **kwargs)`` computed where the output is, or ``None`` (see ``loss`` above)."""
        return None if self._loss is None or self.fetched else self._loss(kept, func, rest, kwargs)

    def fetch_now(self) -> None:
        """Fetch the values, unless fetched already."""
        if self._values is None:
            self._values = {i: t.to(self.device) for i, t in self._fetch().items()}
            self._finalizer()  # the driver has them now: the last stages may forget them

    def tensors(self, shapes: dict[int, Sequence[int]], dtypes: dict[int, torch.dtype]) -> dict[int, Kept]:
        """A `Kept` tensor for each kept position."""
        return {i: Kept.of(self, i, shapes[i], dtypes[i], self.device) for i in shapes}


class _Stub:
    """For the module docstring: a source that fetches a fixed tensor, counting its fetches."""

    def __init__(self, value: torch.Tensor) -> None:
        self._value, self.fetches, self.fetched = value, 0, False

    def loss(self, kept: Kept, func: Any, rest: tuple, kwargs: dict) -> None:
        return None

    def value(self, position: int) -> torch.Tensor:
        self.fetches += 1
        return self._value
