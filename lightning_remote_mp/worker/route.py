"""Routing one stage's micro-batches: wait for every input, run, send every output where it goes.

A forward of micro-batch ``(call, mb)`` waits for one message from each source stage (the
previous stage, or the driver, brings the main input; producers of imported residual variables
bring those), runs the stage, then sends one message to each target stage (the next stage, or
the driver, gets the main output; consumers get the variables they import). Backward is the
mirror image: one gradient message from each target, then one to each source. Messages go
straight from worker to worker; only stage 0's input and the last stage's output pass through
the driver.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.spec import is_main
from lightning_remote_mp.worker.stage import StageExecutor
from lightning_remote_mp.worker.timeline import EventLog

DRIVER = -1

Outgoing = tuple[int, dict[str, Any]]  # (destination stage, or DRIVER; message body)


@dataclasses.dataclass
class _Parts:
    by_sender: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)


def _mapping(value: Any) -> Mapping[Any, Any]:
    """A field that should be a dict, or an empty one: what peers send is not trusted to be well formed."""
    return value if isinstance(value, dict) else {}


def _routes(value: Any, field: str) -> dict[int, tuple[str, ...]]:
    if not isinstance(value, list):
        raise ProtocolError(f"{field} must be a list")
    out = {}
    for item in value:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and isinstance(item[1], list)):
            raise ProtocolError(f"malformed {field} entry")
        out[item[0]] = tuple(str(n) for n in item[1])
    return out


def _main_flags(x: Any, flags: Any) -> bool | list[bool]:
    """The main input's requires-grad flags: one bool for a tensor, one per element of a tuple."""
    if isinstance(x, tuple):
        per = flags if isinstance(flags, list) and len(flags) == len(x) else [False] * len(x)
        return [f is True for f in per]
    return flags is True


def _wanted(grad_x: Any, flags: bool | list[bool]) -> Any:
    """The main input's gradient, where its sender asked for one."""
    if isinstance(flags, list):
        if not any(flags) or not isinstance(grad_x, tuple):
            return None
        return tuple(g if f else None for g, f in zip(grad_x, flags))
    return grad_x if flags else None


class RoutedStage:
    """A `StageExecutor` plus its routes and the partly arrived micro-batches."""

    def __init__(self, stage: StageExecutor, sources: Any, targets: Any, microbatch_limit: int = 4096) -> None:
        self.stage = stage
        self.sources = _routes(sources, "sources")
        self.targets = _routes(targets, "targets")
        self.x_from = stage.index - 1 if stage.index > 0 else DRIVER
        self.x_to = next((t for t in self.targets if t == stage.index + 1), DRIVER)
        if self.x_from not in self.sources or self.x_to not in self.targets:
            raise ProtocolError(f"stage {stage.index}: routes must include the main input's source and output's target")
        self.limit = microbatch_limit
        self._forward: dict[tuple[int, int], _Parts] = {}
        self._backward: dict[tuple[int, int], _Parts] = {}
        self._meta: dict[tuple[int, int], dict[str, Any]] = {}  # per micro-batch: grad flags seen going forward
        self.events: EventLog | None = None  # set while the driver records a timeline
        self._released: collections.deque[int] = collections.deque(maxlen=1024)

    @property
    def index(self) -> int:
        return self.stage.index

    def _collect(
        self, table: dict[tuple[int, int], _Parts], expected: Iterable[int], body: Mapping[str, Any]
    ) -> dict[int, dict[str, Any]] | None:
        call, mb, sender = body.get("call"), body.get("mb"), body.get("from")
        if not all(isinstance(v, int) for v in (call, mb, sender)):
            raise ProtocolError("call, mb and from must be integers")
        expected = set(expected)
        if sender not in expected:
            raise ProtocolError(f"stage {self.index} expects no message from stage {sender}")
        if call in self._released:
            return None  # a late message of a call the driver gave up on
        key = (call, mb)
        parts = table.get(key)
        if parts is None:
            if len(table) >= self.limit:
                raise ProtocolError(f"stage {self.index}: more than {self.limit} micro-batches in flight")
            parts = table[key] = _Parts()
        if sender in parts.by_sender:
            raise ProtocolError(f"stage {self.index}: micro-batch {key} from stage {sender} arrived twice")
        parts.by_sender[sender] = dict(body)
        if self.events is not None and isinstance(body.get("sent_at"), float):
            self.events.transfer(self.stage.key, sender, self.index, call, mb, body["sent_at"], time.time())
        if set(parts.by_sender) != expected:
            return None
        del table[key]
        return parts.by_sender

    def forward(self, body: Mapping[str, Any]) -> list[Outgoing]:
        parts = self._collect(self._forward, self.sources, body)
        if parts is None:
            return []
        first = parts[self.x_from]
        x = first.get("x")
        if not is_main(x):
            raise ProtocolError(f"stage {self.index}: the main input is missing")
        imports: dict[str, torch.Tensor] = {}
        needs: dict[str, Any] = {"x": _main_flags(x, _mapping(first.get("requires_grad")).get("x"))}
        for sender, msg in parts.items():
            variables = _mapping(msg.get("vars"))
            flags = _mapping(msg.get("requires_grad"))
            for name in self.sources[sender]:
                if not isinstance(variables.get(name), torch.Tensor):
                    raise ProtocolError(f"stage {self.index}: variable {name!r} from stage {sender} is missing")
                imports[name] = variables[name]
                needs[name] = flags.get(name) is True
        call, mb = int(first["call"]), int(first["mb"])
        grad = first.get("grad") is True
        autocast = first.get("autocast")
        modes = first.get("modes")
        started = time.time()
        out = self.stage.forward(
            (call, mb),
            x,
            imports,
            grad=grad,
            needs_grad=needs,
            autocast=autocast if isinstance(autocast, dict) else None,
            modes=modes if isinstance(modes, (bool, list)) else None,
            recompute=first.get("checkpoint") is True,
        )
        if self.events is not None:
            self.events.span("forward", self.stage.key, self.index, call, mb, started, time.time())
        if grad:
            self._meta[(call, mb)] = {"saved": out["saved"], "x_grad": needs["x"], "var_grad": needs}
        outgoing = []
        for target, names in self.targets.items():
            msg: dict[str, Any] = {
                "key": self.stage.key,
                "call": call,
                "mb": mb,
                "from": self.index,
                "grad": grad,
                "autocast": autocast,
                "modes": modes,
                "checkpoint": first.get("checkpoint") is True,
            }
            flags: dict[str, bool] = {}
            if target == self.x_to:
                msg["x"] = out["y"]
                flags["x"] = out["requires_grad"]["y"]
            msg["vars"] = {n: out["exports"][n] for n in names}
            flags.update({n: out["requires_grad"][n] for n in names})
            msg["requires_grad"] = flags
            outgoing.append((target, msg))
        return outgoing

    def backward(self, body: Mapping[str, Any]) -> list[Outgoing]:
        parts = self._collect(self._backward, self.targets, body)
        if parts is None:
            return []
        first = parts[self.x_to]
        call, mb = int(first["call"]), int(first["mb"])
        meta = self._meta.pop((call, mb), None)
        if meta is None:
            raise ProtocolError(
                f"stage {self.index}: backward of micro-batch {(call, mb)} without a forward under grad"
            )
        grad_y = first.get("grad_out")
        grad_exports: dict[str, torch.Tensor] = {}
        for sender, msg in parts.items():
            grads = _mapping(msg.get("grads"))
            for name in self.targets[sender]:
                g = grads.get(name)
                if isinstance(g, torch.Tensor):
                    grad_exports[name] = grad_exports[name] + g if name in grad_exports else g
        grad_x, grad_imports = None, {}
        started = time.time()
        if meta["saved"]:
            grad_x, grad_imports = self.stage.backward(
                (call, mb), grad_y if isinstance(grad_y, (torch.Tensor, tuple)) else None, grad_exports
            )
        if self.events is not None:
            self.events.span("backward", self.stage.key, self.index, call, mb, started, time.time())
        outgoing = []
        for source, names in self.sources.items():
            msg: dict[str, Any] = {"key": self.stage.key, "call": call, "mb": mb, "from": self.index}
            if source == self.x_from:
                msg["grad_out"] = _wanted(grad_x, meta["x_grad"])
            msg["grads"] = {n: grad_imports.get(n) for n in names if meta["var_grad"].get(n)}
            outgoing.append((source, msg))
        return outgoing

    def finish_backward(self, body: Mapping[str, Any]) -> None:
        """After a backward's gradients left: once the call's last micro-batch is through this
        stage, compute its deferred weight gradients (while the other stages work on theirs)."""
        call = body.get("call")
        started = time.time()
        if isinstance(call, int) and self.stage.flush_weight_grads(call) and self.events is not None:
            self.events.span("weights", self.stage.key, self.index, call, -1, started, time.time())

    def release(self, calls: Iterable[int]) -> None:
        drop = set(calls)
        self._released.extend(drop)
        self.stage.release(list(drop))
        for table in (self._forward, self._backward, self._meta):
            for key in [k for k in table if k[0] in drop]:
                del table[key]
