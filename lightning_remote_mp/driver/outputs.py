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

>>> kept = _Stub(torch.arange(6.0).view(2, 3))
>>> t = Kept.of(kept, 0, (2, 3), torch.float32, torch.device("cpu"))
>>> t.shape, kept.fetches
(torch.Size([2, 3]), 0)
>>> t.sum().item(), kept.fetches
(15.0, 1)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree


class _Read(torch.autograd.Function):
    """The fetched value of a `Kept` tensor, linked to it in the autograd graph."""

    @staticmethod
    def forward(ctx: Any, placeholder: torch.Tensor, source: Any, position: int) -> torch.Tensor:
        return source.value(position)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


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


class Kept(torch.Tensor):
    """A model output the last stage kept: shape, dtype and device here, its values there, fetched
    at the first operation on it (see the module docstring)."""

    _source: Any
    _position: int
    _read: torch.Tensor | None

    @staticmethod
    def of(source: Any, position: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Kept:
        """The output at ``position`` of what ``source`` (a `KeptOutputs`) fetches."""
        t = torch.Tensor._make_wrapper_subclass(Kept, tuple(shape), dtype=dtype, device=device)  # type: ignore[attr-defined]
        t._source, t._position, t._read = source, position, None
        return t

    def read(self) -> torch.Tensor:
        """The fetched value (an ordinary tensor), linked to this one in the autograd graph."""
        if self._read is None:
            with torch._C.DisableTorchFunctionSubclass():
                self._read = _Read.apply(self, self._source, self._position)
        return self._read

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = pytree.tree_map_only(Kept, Kept.read, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # Below autograd (an operation that reached ATen without passing the Python API): the value alone.
        args, kwargs = pytree.tree_map_only(Kept, lambda k: k._source.value(k._position), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __repr__(self) -> str:  # type: ignore[override]
        return repr(self.read())


class KeptOutputs:
    """The outputs the last stages kept of one call, fetched once, for all its `Kept` tensors.

    Args:
        fetch: returns the kept outputs (by position, each the whole batch's, joined) when called.
        device: where the values go on the driver.
        release: called once no `Kept` tensor of the call is left, or once fetched: the last
            stages may forget them.
    """

    def __init__(self, fetch: Callable[[], dict[int, torch.Tensor]], device: torch.device, release: Callable[[], None]):
        self._fetch = fetch
        self.device = device
        self._values: dict[int, torch.Tensor] | None = None
        self._finalizer = weakref.finalize(self, release)
        self.fetches = 0

    @property
    def fetched(self) -> bool:
        return self._values is not None

    def value(self, position: int) -> torch.Tensor:
        self.fetch_now()
        assert self._values is not None
        return self._values[position]

    def fetch_now(self) -> None:
        """Fetch the values, unless fetched already."""
        if self._values is None:
            self._values = {i: t.to(self.device) for i, t in self._fetch().items()}
            self.fetches += 1
            self._finalizer()  # the driver has them now: the last stages may forget them

    def tensors(self, shapes: dict[int, Sequence[int]], dtypes: dict[int, torch.dtype]) -> dict[int, Kept]:
        """A `Kept` tensor for each kept position."""
        return {i: Kept.of(self, i, shapes[i], dtypes[i], self.device) for i in shapes}


class _Stub:
    """For the module docstring: a source that fetches a fixed tensor, counting its fetches."""

    def __init__(self, value: torch.Tensor) -> None:
        self._value, self.fetches = value, 0

    def value(self, position: int) -> torch.Tensor:
        self.fetches += 1
        return self._value
