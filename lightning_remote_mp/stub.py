"""The driver side of remote stages: an autograd Function that relays activations, residual
variables and their gradients through the workers holding one SpecSequential.

Forward sends the input to stage 0, each stage's output to the next, and each residual variable
from the stage that produces it to every later stage that consumes it. Backward walks the stages
in reverse; a variable's gradient is the sum of what its consumers return, handed to its
producer together with the gradient of the producer's output. Each forward under grad has a call
id; the workers keep what backward needs under that id until the backward, or until the driver's
graph is dropped without one (then a release follows with the next message).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from lightning_remote_mp import protocol
from lightning_remote_mp.partition import Stage
from lightning_remote_mp.transport import Connection, broadcast


@dataclasses.dataclass
class RemoteStage:
    """One stage of one SpecSequential, held by the worker behind ``conn``."""

    key: str
    stage: Stage
    conn: Connection

    @property
    def address(self) -> str:
        return self.conn.address


@dataclasses.dataclass
class _Call:
    saved: list[bool]  # per stage: whether the worker kept state for backward
    x_grad: list[bool]  # per stage: whether the stage's input wants a gradient
    var_grad: dict[str, bool]  # per residual variable: whether it carries a gradient


def _autocast_state(device_type: str) -> dict[str, Any] | None:
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return {"enabled": True, "dtype": torch.get_autocast_dtype(device_type)}


class RemoteSpec:
    """Runs a SpecSequential's stages on workers; the module's ``forward`` delegates here."""

    def __init__(self, key: str, stages: Sequence[RemoteStage]) -> None:
        self.key = key
        self.stages = list(stages)
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._to_release: collections.deque[int] = collections.deque()
        # A leaf that requires grad, so the Function's output joins the graph even when the input
        # does not require grad: the remote parameters are invisible to the driver's autograd.
        self._anchor = torch.zeros((), requires_grad=True)

    def __repr__(self) -> str:
        return "[" + ", ".join(f"stage {s.stage.index} @ {s.address}" for s in self.stages) + "]"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"SpecSequential {self.key!r}: a remote SpecSequential takes one tensor, got {type(x).__name__}"
            )
        if torch.is_grad_enabled():
            return _RemoteSpecFunction.apply(self, _autocast_state(x.device.type), x, self._anchor)
        y, _ = self.forward(x, grad=False, x_needs_grad=False, autocast=_autocast_state(x.device.type))
        return y

    def set_mode(self, train: bool) -> None:
        conns = {id(s.conn): s.conn for s in self.stages}.values()
        broadcast(conns, protocol.SET_MODE, {"train": train})

    # --- forward / backward -------------------------------------------------------------
    def _flush_releases(self) -> None:
        calls = []
        while self._to_release:
            call = self._to_release.popleft()
            record = self._calls.pop(call, None)
            if record is not None:
                calls.append((call, record))
        for i, rs in enumerate(self.stages):
            ids = [c for c, r in calls if r.saved[i]]
            if ids:
                rs.conn.request(protocol.RELEASE, {"calls": {self.key: ids}})

    def forward(
        self, x: torch.Tensor, *, grad: bool, x_needs_grad: bool, autocast: dict[str, Any] | None
    ) -> tuple[torch.Tensor, int]:
        self._flush_releases()
        call = next(self._ids) if grad else 0
        record = _Call(saved=[], x_grad=[], var_grad={})
        variables: dict[str, torch.Tensor] = {}
        h, h_grad = x, x_needs_grad
        for rs in self.stages:
            imports = {n: variables[n] for n in rs.stage.imports}
            needs = {"x": h_grad, **{n: record.var_grad.get(n, False) for n in rs.stage.imports}}
            reply = rs.conn.request(
                protocol.FORWARD,
                {
                    "key": self.key,
                    "call": call,
                    "x": h,
                    "imports": imports,
                    "grad": grad,
                    "needs_grad": needs,
                    "autocast": autocast,
                },
            )
            record.x_grad.append(h_grad)
            record.saved.append(bool(reply["saved"]))
            h, h_grad = reply["y"], bool(reply["requires_grad"].get("y"))
            for n, t in reply["exports"].items():
                variables[n] = t
                record.var_grad[n] = bool(reply["requires_grad"].get(n))
        if grad:
            self._calls[call] = record
        return h.to(x.device), call

    def backward(self, call: int, grad_y: torch.Tensor | None) -> torch.Tensor | None:
        record = self._calls.pop(call)
        grad_vars: dict[str, torch.Tensor] = {}
        g = grad_y
        for i in range(len(self.stages) - 1, -1, -1):
            rs = self.stages[i]
            grad_exports = {n: grad_vars.pop(n) for n in rs.stage.exports if n in grad_vars}
            if not record.saved[i]:
                g = None
                continue
            reply = rs.conn.request(
                protocol.BACKWARD, {"key": self.key, "call": call, "grad_y": g, "grad_exports": grad_exports}
            )
            g = reply["grad_x"] if record.x_grad[i] else None
            for n, t in reply["grad_imports"].items():
                grad_vars[n] = grad_vars[n] + t if n in grad_vars else t
        return g

    def release_later(self, call: int) -> None:
        self._to_release.append(call)


class _CallGuard:
    """Queues a release of the workers' saved state if the graph dies without a backward."""

    def __init__(self, spec: RemoteSpec, call: int) -> None:
        self._finalizer = weakref.finalize(self, spec.release_later, call)

    def done(self) -> None:
        self._finalizer.detach()


class _RemoteSpecFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: RemoteSpec, autocast: dict[str, Any] | None, x: torch.Tensor, anchor: torch.Tensor):
        y, call = spec.forward(x, grad=True, x_needs_grad=x.requires_grad, autocast=autocast)
        ctx.spec, ctx.call = spec, call
        ctx.guard = _CallGuard(spec, call)
        ctx.x_dtype, ctx.x_device = x.dtype, x.device
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor):
        ctx.guard.done()
        grad_x = ctx.spec.backward(ctx.call, grad_y)
        if grad_x is not None and ctx.needs_input_grad[2]:
            grad_x = grad_x.to(device=ctx.x_device, dtype=ctx.x_dtype)
        else:
            grad_x = None
        return None, None, grad_x, None
