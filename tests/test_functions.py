"""Custom autograd Functions in a traced model (`lightning_remote_mp.model.functions`): workers
differentiate the operators of a Function's forward, never its own backward. A Function whose
backward is its forward's derivative trains as locally; one whose backward is not (a
straight-through estimator, a forward under ``no_grad``) is refused at the trace, before any worker
runs it, with the way to write the same gradient in plain operators, and that way trains as locally."""

from __future__ import annotations

import pytest
import torch
from lrmp_traced import Trained
from test_operators import CLASSES, DIM, _flat
from test_zoo import remote_equals_local
from torch import nn

from lightning_remote_mp import RemoteModelParallelStrategy
from lightning_remote_mp.errors import TraceError
from lightning_remote_mp.model.trace import trace_module


class Scaled(torch.autograd.Function):
    """``x * w`` with a hand-written backward that is its derivative (a memory-saving kernel's kind)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class StraightThrough(torch.autograd.Function):
    """Rounds, and passes the gradient through as if it had not: not the derivative of ``round``."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Untracked(torch.autograd.Function):
    """A forward computed under ``no_grad`` (a kernel autograd cannot see), with its own backward."""

    @staticmethod
    def forward(x):
        with torch.no_grad():
            return torch.tanh(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(output)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class Net(nn.Module):
    def __init__(self, how: str = "scaled") -> None:
        super().__init__()
        self.how = how
        self.first = nn.Linear(DIM, DIM)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))
        self.second = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.how == "scaled":
            h = Scaled.apply(h, self.scale)
        elif self.how == "straight-through":
            h = StraightThrough.apply(h)
        elif self.how == "detach":  # the same gradient as StraightThrough, in plain operators
            h = h + (torch.round(h * 4) / 4 - h).detach()
        else:
            h = Untracked.apply(h)
        return self.second(h)


@pytest.mark.parametrize("how", ["scaled", "detach"])
def test_a_function_whose_backward_is_its_derivative_and_the_detach_idiom_train_as_locally(twin, pool, how):
    remote_equals_local(
        lambda: Trained(Net(how)),
        _flat,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2, split=["model"]),
    )


@pytest.mark.parametrize(("how", "function"), [("straight-through", "StraightThrough"), ("untracked", "Untracked")])
def test_a_function_whose_backward_the_workers_cannot_reproduce_is_refused_at_the_trace(how, function):
    with pytest.raises(TraceError) as refused:
        trace_module(Net(how), (torch.randn(4, DIM),), {}, "model")
    message = str(refused.value)
    assert f"the autograd.Function {__name__}.{function} ({__file__}:" in message, message
    assert "has a backward that is not the derivative of its forward" in message
    assert "x + (torch.round(x) - x).detach()" in message


class Gelu(torch.autograd.Function):
    """BLOOM's GELU: the tanh approximation, with its derivative written by hand."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return grad * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class WithIndex(torch.autograd.Function):
    """Two outputs, the second marked non-differentiable (an index, as a float)."""

    @staticmethod
    def forward(ctx, x):
        index = x.argmax(-1).to(x.dtype)
        ctx.mark_non_differentiable(index)
        return x * 2, index

    @staticmethod
    def backward(ctx, grad, _):
        return grad * 2


class Kept(nn.Module):
    def __init__(self, how: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.how, self.lin = how, nn.Linear(DIM, DIM).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.how == "gelu":
            return Gelu.apply(h)
        if self.how == "no_grad":  # no backward to run: the workers run the same forward
            with torch.no_grad():
                target = StraightThrough.apply(h)
            return h - target
        if self.how == "index":
            y, index = WithIndex.apply(h)
            return y + index[:, None]
        rows = h[h[:, 0] > 0]  # a size the data decides
        return Scaled.apply(rows, torch.ones(DIM)).sum(0, keepdim=True).expand_as(h)


@pytest.mark.parametrize(
    ("how", "dtype"),
    [
        ("gelu", torch.bfloat16),
        ("gelu", torch.float16),
        ("no_grad", torch.float32),
        ("index", torch.float32),
        ("rows", torch.float32),
    ],
)
def test_functions_whose_backward_the_workers_reproduce_are_kept(how, dtype):
    """In half precision (checked in float32), applied without grad, with an output marked
    non-differentiable, with inputs whose size the data decides: none is refused."""
    traced = trace_module(Kept(how, dtype), (torch.randn(4, DIM, dtype=dtype),), {}, "model")
    assert traced.entries
