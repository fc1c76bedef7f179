"""Layers the tests ship to workers (allowed there with --allow-module lrmp_testlayers)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn


class PidProbe(nn.Module):
    """Identity that records, in a buffer, the id of the process that last ran it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("pid", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pid.fill_(os.getpid())
        return x


class ScaleBy(nn.Module):
    """Multiplies by a learnable scalar; with ``dependencies`` adds them, with ``out_variables`` publishes."""

    def __init__(self, init: float = 1.0, out_variables=(), dependencies=()) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(init)))
        self.out_variables = list(out_variables)
        self.dependencies = list(dependencies)

    def forward(self, x, *residuals):
        out = x * self.scale
        for r in residuals:
            out = out + r
        if self.out_variables:
            return out, [(n, out) for n in self.out_variables]
        return out


class SetupGate(nn.Module):
    """Identity. Built in any process but ``driver_pid`` (that is: on a worker, at SETUP), it creates
    the file ``marker`` and then waits ``seconds``: a window in which a test stops or kills the worker."""

    def __init__(self, marker: str = "", driver_pid: int = 0, seconds: float = 1.0) -> None:
        super().__init__()
        if marker and os.getpid() != driver_pid:
            open(marker, "w").close()
            time.sleep(min(float(seconds), 10.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class FailingSGD(torch.optim.SGD):
    """SGD that refuses its ``fail_at``-th step (counting steps that had gradients): on a worker,
    where the gradients are, while the driver's share (no gradients) steps fine."""

    def __init__(self, params, lr: float = 0.1, fail_at: int = 0, **sgd) -> None:
        super().__init__(params, lr=lr, **sgd)
        self.defaults["fail_at"] = self.fail_at = fail_at  # defaults travel to the workers' copies
        self.steps_with_grads = 0

    def step(self, closure=None):
        if any(p.grad is not None for g in self.param_groups for p in g["params"]):
            self.steps_with_grads += 1
            if self.steps_with_grads == self.fail_at:
                raise RuntimeError(f"step {self.fail_at} refused")
        return super().step(closure)


class BrokenWeightGradients(nn.Module):
    """A linear layer whose input storage is freed as soon as its input gradient is computed: plain
    autograd has the weight gradient by then; a worker that defers it fails when it computes it."""

    def __init__(self, features: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 1.0  # nothing else keeps h for backward
        if h.requires_grad:

            def free(grad: torch.Tensor) -> None:
                h.untyped_storage().resize_(0)

            h.register_hook(free)
        return torch.nn.functional.linear(h, self.weight)


class SignSGD(torch.optim.Optimizer):
    """A user-defined optimizer (not in torch.optim): steps by the sign of the gradient, with a
    step counter in its state."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["steps"] = state.get("steps", 0) + 1
                    p.add_(p.grad.sign(), alpha=-group["lr"])
        return None


class SlowIdentity(nn.Module):
    """Identity whose forward first sleeps ``seconds``: a layer that, for a test, never returns."""

    def __init__(self, seconds: float = 60.0) -> None:
        super().__init__()
        self.seconds = float(seconds)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_meta:  # the driver's setup check runs every layer once on the meta device
            time.sleep(self.seconds)
        return x


class ChattyIdentity(nn.Module):
    """Identity that prints ``lines`` numbered lines of ``width`` characters per forward, each
    starting with ``marker``: a layer whose output would fill (and block) an unread pipe."""

    def __init__(self, marker: str = "chatty", lines: int = 2000, width: int = 100) -> None:
        super().__init__()
        self.marker, self.lines, self.width = marker, int(lines), int(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.lines):
            line = f"{self.marker} {i} "
            print(line + "x" * max(0, self.width - len(line)))
        return x


class Explode(nn.Module):
    """Identity on the meta device (so setup's dry run passes); raises on real data, as a layer with a
    bug only real inputs reach would. ``as_cuda_error``: raises what torch raises after a GPU fault."""

    def __init__(self, as_cuda_error: bool = False) -> None:
        super().__init__()
        self.as_cuda_error = as_cuda_error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            return x
        if self.as_cuda_error:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (exploded on purpose)")
        raise ValueError("exploded on purpose")


class SlowStepSGD(torch.optim.SGD):
    """SGD whose step takes ``seconds`` in any process but ``driver_pid``: a worker's optimizer step
    that makes no progress for a while."""

    def __init__(self, params, lr: float = 0.1, driver_pid: int = 0, seconds: float = 10.0) -> None:
        super().__init__(params, lr=lr)
        self.defaults["driver_pid"], self.defaults["seconds"] = driver_pid, seconds  # travel to the workers
        self.driver_pid, self.seconds = driver_pid, seconds

    def step(self, closure=None):
        if os.getpid() != self.driver_pid:
            time.sleep(self.seconds)
        return super().step(closure)


class BackwardHook(nn.Module):
    """Identity whose backward, counted where it runs, sleeps ``sleep`` seconds every time and raises
    at the ``fail_at``-th (0: never): a stage whose backward is slow, or fails, after its forward
    went fine."""

    def __init__(self, sleep: float = 0.0, fail_at: int = 0) -> None:
        super().__init__()
        self.sleep, self.fail_at = float(sleep), int(fail_at)
        self.backwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        if y.requires_grad and y.device.type != "meta":

            def hook(grad: torch.Tensor) -> torch.Tensor:
                self.backwards += 1
                time.sleep(self.sleep)
                if self.backwards == self.fail_at:
                    raise ValueError(f"backward {self.fail_at} failed on purpose")
                return grad

            y.register_hook(hook)
        return y
