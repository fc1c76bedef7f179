"""The driver side of remote stages: an autograd Function whose forward and backward run a
SpecSequential's stages on the workers, micro-batch by micro-batch.

Forward splits the batch into micro-batches and hands them all to stage 0; each worker sends its
output straight to the next stage and each residual variable straight to the stages that consume
it, so stages work on different micro-batches at once (GPipe). The last stage returns its outputs
to the driver, which concatenates them. Backward sends the output's gradient, micro-batch by
micro-batch, to the last stage; gradients flow back worker to worker (a variable's gradient is the
sum of what its consumers return) and stage 0 reports each micro-batch done, with the input's
gradient when one is needed. Each forward under grad has a call id; the workers keep what backward
needs under that id until the backward, or until the driver's graph is dropped without one (then
a release follows with the next forward).
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
from lightning_remote_mp.partition import DRIVER, Stage
from lightning_remote_mp.transport import Connection, broadcast, gather


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
    sizes: list[int]  # micro-batch sizes along dim 0
    x_grad: bool


def _autocast_state(device_type: str) -> dict[str, Any] | None:
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return {"enabled": True, "dtype": torch.get_autocast_dtype(device_type)}


class RemoteSpec:
    """Runs a SpecSequential's stages on workers; the module's ``forward`` delegates here.

    Args:
        key: the SpecSequential's name in the LightningModule (how workers tell stages apart).
        stages: its stages, in order.
        microbatches: how many micro-batches each batch is split into (fewer if the batch is smaller).
    """

    def __init__(self, key: str, stages: Sequence[RemoteStage], microbatches: int = 1) -> None:
        if microbatches < 1:
            raise ValueError(f"microbatches must be at least 1, got {microbatches}")
        self.key = key
        self.stages = list(stages)
        self.microbatches = microbatches
        self.conns = list({id(s.conn): s.conn for s in self.stages}.values())
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
        broadcast(self.conns, protocol.SET_MODE, {"train": train})

    # --- forward / backward -------------------------------------------------------------
    def _flush_releases(self) -> None:
        calls = []
        while self._to_release:
            call = self._to_release.popleft()
            if self._calls.pop(call, None) is not None:
                calls.append(call)
        if calls:
            broadcast(self.conns, protocol.RELEASE, {"calls": {self.key: calls}})

    def _abandon(self, call: int) -> None:
        """After a failure mid-call, let the workers drop what they hold for it (best effort)."""
        self._calls.pop(call, None)
        for conn in self.conns:
            if conn.lost_reason is None and not conn.closed:
                conn.send(protocol.RELEASE, {"calls": {self.key: [call]}})

    def forward(
        self, x: torch.Tensor, *, grad: bool, x_needs_grad: bool, autocast: dict[str, Any] | None
    ) -> tuple[torch.Tensor, int]:
        self._flush_releases()
        call = next(self._ids)
        chunks = [c for c in x.tensor_split(min(self.microbatches, max(1, x.shape[0])), dim=0) if c.shape[0] > 0] or [x]
        first, last = self.stages[0], self.stages[-1]
        try:
            for mb, chunk in enumerate(chunks):
                first.conn.send(
                    protocol.FORWARD,
                    {
                        "key": self.key,
                        "call": call,
                        "mb": mb,
                        "from": DRIVER,
                        "x": chunk,
                        "vars": {},
                        "requires_grad": {"x": x_needs_grad},
                        "grad": grad,
                        "autocast": autocast,
                    },
                )
            results = gather(
                self.conns,
                lambda c, m: m.kind == protocol.RESULT and c is last.conn and m.body.get("call") == call,
                len(chunks),
                call=call,
                what="forward",
            )
        except BaseException:
            self._abandon(call)
            raise
        outputs = sorted((m.body["mb"], m.body["x"]) for _, m in results)
        y = outputs[0][1] if len(outputs) == 1 else torch.cat([t for _, t in outputs], dim=0)
        if grad:
            self._calls[call] = _Call(sizes=[c.shape[0] for c in chunks], x_grad=x_needs_grad)
        return y.to(x.device), call

    def backward(self, call: int, grad_y: torch.Tensor | None) -> torch.Tensor | None:
        record = self._calls.pop(call)
        first, last = self.stages[0], self.stages[-1]
        grads = grad_y.split(record.sizes, dim=0) if grad_y is not None else [None] * len(record.sizes)
        try:
            for mb, g in enumerate(grads):
                last.conn.send(
                    protocol.BACKWARD,
                    {
                        "key": self.key,
                        "call": call,
                        "mb": mb,
                        "from": DRIVER,
                        "grad_out": g,
                        "grads": {},
                    },
                )
            done = gather(
                self.conns,
                lambda c, m: m.kind == protocol.DONE and c is first.conn and m.body.get("call") == call,
                len(record.sizes),
                call=call,
                what="backward",
            )
        except BaseException:
            self._abandon(call)
            raise
        if not record.x_grad:
            return None
        parts = sorted((m.body["mb"], m.body.get("grad_out")) for _, m in done)
        if any(p is None for _, p in parts):
            return None
        return parts[0][1] if len(parts) == 1 else torch.cat([p for _, p in parts], dim=0)

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
