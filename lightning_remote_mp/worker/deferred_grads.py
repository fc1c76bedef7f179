"""Split backward: a stage sends input gradients on at once and computes linear layers' weight
gradients later, once per batch.

In a pipeline, the previous stage waits for nothing but the input gradient, so a stage that
computes only ``grad_input = grad_output @ W`` per micro-batch, sends it, and leaves
``grad_W = grad_outputᵀ @ input`` for later, hands the previous stage its work sooner and fills
its own idle time at the end of the backward with the weight gradients (the "B/W split" of
zero-bubble pipeline schedules). Doing the weight gradient of all micro-batches as one product
also removes most of the cost of micro-batching: a ``[1024 x 64]ᵀ @ [64 x 1024]`` per micro-batch
re-reads and re-writes the whole weight gradient each time, one product over the whole batch does
it once. The gradients are the same sums, computed as local training computes them (over the whole
batch).

Deferring costs each linear call a Python autograd Function (forward and backward) and a copy
of its output gradient: tens of microseconds, more than a small product saves. With
``split_backward="auto"`` (the default) a call defers only when its weight-gradient product has
at least `auto_min_macs` multiply-adds (rows x in x out); smaller ones take plain autograd.

It applies to every ``torch.nn.functional.linear`` call (``nn.Linear``, ``WrappedLinear``, custom
layers that call ``F.linear``) whose weight is a trainable parameter of the stage, outside autocast
and outside activation checkpointing (``torch.utils.checkpoint``, saved-tensor hooks). Everything
else goes through autograd as usual. A stage whose only 2-d weights are plain ``nn.Linear`` (and
``nn.Embedding``) layers defers through their forward; any other finds its ``F.linear`` calls with a
TorchFunctionMode, which costs each op of the forward a Python call (135 us of an 8-layer MLP's
~300 us forward, measured).

>>> import torch
>>> layer = torch.nn.Linear(3, 2)
>>> deferred = DeferredWeightGrads(layer)
>>> with deferred.recording():
...     y = layer(torch.ones(4, 3))
>>> with deferred.filing_backward():
...     y.sum().backward()
>>> layer.weight.grad is None
True
>>> deferred.flush()
True
>>> layer.weight.grad
tensor([[4., 4., 4.],
        [4., 4., 4.]])
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Hashable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_remote_mp.errors import ConfigurationError

#: ``split_backward="auto"`` on a CPU stage: the smallest weight-gradient product (multiply-adds)
#: that defers. Measured on a 2-core x86 VM (``benchmarks/README.md``, section 1f): below about
#: 2 M multiply-adds the Function's Python costs more than batching the product saves.
CPU_MIN_MACS = 2**21

#: How many input signatures `DeferredWeightGrads` remembers as too small to defer (then it starts over).
_MAX_SIGNATURES = 256

#: Overrides `auto_min_macs` for every device (a count of multiply-adds; ``0`` defers every call).
MIN_MACS_ENV = "LRMP_SPLIT_BACKWARD_MIN_MACS"


def auto_min_macs(device: torch.device) -> int:
    """The smallest product that ``split_backward="auto"`` defers on ``device``: `CPU_MIN_MACS`
    on CPU; 0 (every call, as ``split_backward=True``) on an accelerator, where it is not measured
    yet. The environment variable `MIN_MACS_ENV`, where set on the worker, overrides both (the
    worker checks it at start). The rows are a micro-batch's: more micro-batches, smaller calls.

    A stage whose linear calls go through the TorchFunctionMode (`_may_call_linear`: ``WrappedLinear``,
    custom ``F.linear`` callers, traced programs) leaves the mode out of a forward whose inputs have
    the shapes of one that deferred nothing (`DeferredWeightGrads.recording`)."""
    override = os.environ.get(MIN_MACS_ENV, "").strip()
    if override:
        try:
            value = int(override)
        except ValueError:
            value = -1
        if value < 0:
            raise ConfigurationError(f"{MIN_MACS_ENV} must be a count of multiply-adds (an int >= 0), got {override!r}")
        return value
    return CPU_MIN_MACS if device.type == "cpu" else 0


class _Pending:
    """What one (weight, bias) pair's weight gradient still needs: each micro-batch's input
    (flattened to rows) and output gradient (as autograd handed it over), filed by bucket (the
    owner's, while its backward files: ``None`` for plain backwards, a call's id for one that runs
    early, `lightning_remote_mp.worker.runtime`), each with the number of the backward that filed it."""

    __slots__ = ("owner", "weight", "bias", "filed")

    def __init__(self, owner: DeferredWeightGrads, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.owner = owner
        self.weight = weight
        self.bias = bias
        self.filed: dict[Hashable, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}


class _LinearInputGrad(torch.autograd.Function):
    """``F.linear`` whose backward returns only the input's gradient and files the rest."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pending: _Pending):
        ctx.save_for_backward(x, weight)
        ctx.pending = pending
        out = F.linear(x, weight, bias)
        # With a bias and an input of 3 or more dims, F.linear returns its 2-d product viewed as the
        # input's shape, and autograd refuses to let a view made inside a Function be modified in place
        # (``y.add_(1)`` after a Linear). The same memory as a tensor of its own: what matmul returns.
        return out if out._base is None else torch.ops.aten._unsafe_view(out, out.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        pending: _Pending = ctx.pending
        inputs = x.reshape(-1, x.shape[-1])
        if not pending.owner.filing or torch.is_grad_enabled():
            # Not the stage's own backward (autograd run inside a layer's forward, or a double
            # backward): the weight gradients are due now, as plain autograd gives them.
            rows = grad_out.reshape(-1, grad_out.shape[-1])
            grad_w = rows.t().mm(inputs) if ctx.needs_input_grad[1] else None
            grad_b = rows.sum(0) if ctx.needs_input_grad[2] else None
            return grad_x, grad_w, grad_b, None
        # The tensor autograd handed over, not a view of it: while it is referenced here, autograd
        # neither makes it a parameter's .grad (it steals only unreferenced buffers) nor adds into
        # it in place. A view of another buffer could still be stolen through its base: a copy.
        grad = grad_out if grad_out._base is None else grad_out.clone()
        owner = pending.owner
        pending.filed.setdefault(owner.bucket, []).append((owner.filings, inputs, grad))
        return grad_x, None, None, None


class _Intercept(TorchFunctionMode):
    def __init__(self, owner: DeferredWeightGrads) -> None:
        super().__init__()
        self.owner = owner
        self.deferred = 0  # calls deferred in this block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            pending = self.owner._pending_for(*args, **kwargs)
            if pending is not None:
                self.deferred += 1
                x = args[0] if args else kwargs["input"]
                return _LinearInputGrad.apply(x, pending.weight, pending.bias, pending)
        return func(*args, **kwargs)


class _DirectLinear:
    """A plain ``nn.Linear``'s forward while its stage records: the deferring linear, reached without
    a TorchFunctionMode (which costs every op of the stage a Python call)."""

    def __init__(self, owner: DeferredWeightGrads, layer: torch.nn.Linear) -> None:
        self.owner = owner
        self.layer = layer

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        weight, bias = self.layer.weight, self.layer.bias
        if self.owner._direct:
            pending = self.owner._pending_for(input, weight, bias)
            if pending is not None:
                return _LinearInputGrad.apply(input, weight, bias, pending)
        return F.linear(input, weight, bias)


def _plain_linear(m: torch.nn.Module) -> bool:
    return isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward


def _may_call_linear(module: torch.nn.Module) -> bool:
    """Whether some layer of ``module`` may call ``F.linear`` on a weight of its own other than through
    a plain ``nn.Linear``: a 2-d parameter held by anything but a plain ``nn.Linear`` or an
    ``nn.Embedding`` (``WrappedLinear``, attention with packed projections, custom layers)."""
    for m in module.modules():
        if _plain_linear(m) or isinstance(m, torch.nn.Embedding):
            continue
        if any(p.dim() == 2 for p in m.parameters(recurse=False)):
            return True
    return False


class DeferredWeightGrads:
    """Defers the weight (and bias) gradients of linear layers of ``module`` until `flush`.

    Plain ``nn.Linear`` layers defer through their own forward. Where some other layer may call
    ``F.linear`` on a weight (`_may_call_linear`), a TorchFunctionMode catches every call instead.
    With ``min_macs``, a forward whose inputs have the ``signature`` (their shapes) of one that
    deferred nothing runs without the mode, which costs every op of the forward a Python call: its
    calls are as small again where shapes decide them, and plain autograd gives the same gradients.
    Where they do not (tokens routed or masked by value), a later forward of those shapes that could
    defer runs with plain autograd: slower than it could be, never wrong.

    Args:
        module: whose parameters may defer (those it holds when `recording` starts: loading a
            state dict with ``assign=True`` replaces them); frozen ones never do.
        min_macs: a call defers only if its weight-gradient product has at least this many
            multiply-adds (rows x in_features x out_features); smaller ones take plain autograd.
    """

    def __init__(self, module: torch.nn.Module, min_macs: int = 0) -> None:
        self.module = module
        self.min_macs = min_macs
        self.filing = False
        self.bucket: Hashable = None  # where the backward running now files (`filing_backward`)
        self.filings = 0  # backwards filed so far: each filed entry carries its backward's number
        self._params: set[int] | None = None  # ids of the module's parameters, while they stay the same
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._intercept = _may_call_linear(module)
        self._small: set[Hashable] = set()  # signatures of forwards under the mode that deferred nothing
        self._direct = False  # recording without the mode: plain nn.Linear layers defer by themselves
        if not self._intercept:
            for m in module.modules():
                if _plain_linear(m):
                    m.forward = _DirectLinear(self, m)

    @contextlib.contextmanager
    def recording(self, signature: Hashable = None) -> Iterator[None]:
        """Within this block, eligible ``F.linear`` calls under grad defer their weight gradients.
        ``signature``: what decides the size of the block's calls (its inputs' shapes), if known."""
        if not torch.is_grad_enabled():
            yield
            return
        if self._params is None:
            self._params = {id(p) for p in self.module.parameters()}
        if self._intercept:
            known = signature is not None and self.skips_small
            if known and signature in self._small:
                yield  # a forward of these shapes deferred nothing: no mode, plain autograd
                return
            with _Intercept(self) as mode:
                yield
            if known and mode.deferred == 0:
                if len(self._small) >= _MAX_SIGNATURES:
                    self._small.clear()
                self._small.add(signature)
            return
        self._direct = True
        try:
            yield
        finally:
            self._direct = False

    @property
    def skips_small(self) -> bool:
        """Whether `recording` uses a signature: under the mode, with a threshold."""
        return self._intercept and self.min_macs > 0

    def parameters_replaced(self) -> None:
        """The module's parameters are new objects (a state dict loaded with ``assign=True``)."""
        self._params = None
        self._small.clear()

    @contextlib.contextmanager
    def filing_backward(self, bucket: Hashable = None) -> Iterator[int]:
        """The stage's backward runs in this block: only there are weight gradients filed for
        `flush`, in ``bucket``; any other backward through a recorded linear gets them at once.
        Yields the backward's number (`flush`'s ``through``)."""
        self.filing, self.bucket = True, bucket
        self.filings += 1
        try:
            yield self.filings
        finally:
            self.filing, self.bucket = False, None

    def _pending_for(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> _Pending | None:
        params = self._params or set()
        if (
            id(weight) not in params
            or weight.dim() != 2  # F.linear takes a 1-d weight too; the deferred products assume 2-d
            or input.numel() * weight.shape[0] < self.min_macs  # before the costlier checks: small calls stop here
            or not torch.is_grad_enabled()
            or _saved_tensor_hooks_active()
            or _functorch_active()
            or not weight.requires_grad
            or not weight.is_floating_point()  # complex gradients need conjugates; plain autograd has them
            or _has_grad_hooks(weight)
            or (bias is not None and (id(bias) not in params or not bias.requires_grad or _has_grad_hooks(bias)))
            or torch.is_autocast_enabled(input.device.type)
            or input.dtype != weight.dtype
            or input.dim() == 0
        ):
            return None
        key = (id(weight), id(bias))
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(self, weight, bias)
        return pending

    @property
    def waiting(self) -> bool:
        """Whether some plain backward (bucket ``None``) filed weight gradients that `flush` has not added yet."""
        return any(p.filed.get(None) for p in self._pending.values())

    @torch.no_grad()
    def flush(self, bucket: Hashable = None, through: int | None = None) -> bool:
        """Add the weight and bias gradients filed in ``bucket`` to ``.grad`` (with ``through``,
        only those of backwards numbered up to it); returns whether there were any. A layer's filed
        tensors are dropped only once its gradients are added: after a failure (out of memory, say)
        the rest is still there, and a later flush adds it."""
        flushed = False
        for pending in self._pending.values():
            filed = pending.filed.get(bucket)
            if not filed:
                continue
            due = filed if through is None else [f for f in filed if f[0] <= through]
            if not due:
                continue
            # One product per micro-batch, summed in place: no copy of the filed tensors (for an LM
            # head, the output gradients are batch x vocabulary).
            grad_w: torch.Tensor | None = None
            grad_b: torch.Tensor | None = None
            for _, inputs, grad in due:
                rows = grad.reshape(-1, grad.shape[-1])
                grad_w = rows.t().mm(inputs) if grad_w is None else grad_w.addmm_(rows.t(), inputs)
                if pending.bias is not None:
                    grad_b = rows.sum(0) if grad_b is None else grad_b.add_(rows.sum(0))
            assert grad_w is not None
            accumulate_grad(pending.weight, grad_w)
            if pending.bias is not None:
                accumulate_grad(pending.bias, grad_b)
            rest = filed[len(due) :]
            if rest:
                pending.filed[bucket] = rest
            else:
                del pending.filed[bucket]
            flushed = True
        return flushed

    def discard(self, bucket: Hashable) -> None:
        """Forget what backwards filed in ``bucket`` (a call given up on)."""
        for pending in self._pending.values():
            pending.filed.pop(bucket, None)


def _saved_tensor_hooks_active() -> bool:
    """Activation checkpointing (and offloading) pack what ops save for backward and recompute it
    without this module's interception, so a deferred linear there would be matched with the wrong
    recomputed tensors: such regions use plain autograd. If torch offers no way to tell, assume so."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


def _functorch_active() -> bool:
    """vmap, grad and the other torch.func transforms need autograd Functions with setup_context."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def _has_grad_hooks(t: torch.Tensor) -> bool:
    """Hooks on a parameter's gradient expect it during backward, as autograd computes it."""
    return bool(getattr(t, "_backward_hooks", None)) or bool(getattr(t, "_post_accumulate_grad_hooks", None))


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``param.grad`` (or make it ``param.grad``), as autograd accumulates."""
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
