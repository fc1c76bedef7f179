"""Routing one stage's micro-batches: run a forward or backward from its inputs, send every output where it goes.

A forward of micro-batch ``(call, mb)`` reads one message from each source stage (the previous
stage, or the driver, brings the main input; producers of imported residual variables bring
those), runs the stage, then addresses one message to each target stage (the next stage, or the
driver, gets the main output; consumers get the variables they import). Backward is the mirror
image: one gradient message from each target, then one to each source. Messages go straight from
worker to worker; only stage 0's input and the last stage's output pass through the driver. When
each runs, once all its messages are in, is `lightning_remote_mp.worker.runtime`'s to decide.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.flow import DRIVER, Routes
from lightning_remote_mp.model.head_loss import Head
from lightning_remote_mp.wire.messages import Backward, Forward
from lightning_remote_mp.worker.stage import StageExecutor
from lightning_remote_mp.worker.timeline import EventLog

Outgoing = tuple[int, Forward | Backward]  # (destination stage, or DRIVER; the message)


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
    """A `StageExecutor` plus its routes: runs one micro-batch's forward or backward from the
    messages that brought its inputs, and addresses the messages that take its outputs on. When it
    runs is `lightning_remote_mp.worker.runtime.StageRuntime`'s to decide."""

    def __init__(self, stage: StageExecutor, sources: Routes, targets: Routes) -> None:
        self.stage = stage
        self.index = stage.index
        self.sources = dict(sources)  # sender stage -> the variables it brings (checked by `requests.Setup`)
        self.targets = dict(targets)
        self.x_from = stage.index - 1 if stage.index > 0 else DRIVER
        self.x_to = next((t for t in self.targets if t == stage.index + 1), DRIVER)
        if self.x_from not in self.sources or self.x_to not in self.targets:
            raise ProtocolError(f"stage {stage.index}: routes must include the main input's source and output's target")
        self._needs: dict[tuple[int, int], dict[str, Any]] = {}  # per micro-batch under grad: the inputs wanting grads
        self._kept: dict[tuple[int, int], dict[int, Any]] = {}  # the model's outputs the driver reads when it needs
        # Losses computed here under grad over kept outputs, per micro-batch in order: (position,
        # the output as the loss read it, the loss's value the backward's gradient is for).
        self._losses: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self.events: EventLog | None = None  # set while the driver records a timeline
        # Logits kept as their head's input (`lightning_remote_mp.model.head_loss`), per micro-batch
        # and output position: the head, its input, whether that needs a gradient; and, once read,
        # the input as the logits were computed from it and the logits.
        self._heads: dict[tuple[int, int], dict[int, tuple[Head, torch.Tensor, bool]]] = {}
        self._read: dict[tuple[int, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        if self.x_to == DRIVER:
            stage.defer_heads()

    def run_forward(self, parts: dict[int, Forward]) -> tuple[list[Outgoing], Any]:
        """Run a micro-batch's forward (an F action): the messages that take its outputs on, and
        the model's output (the last stage's runtime keeps it for a backward that starts at its loss)."""
        first = parts[self.x_from]
        if first.x is None:
            raise ProtocolError(f"stage {self.index}: the main input is missing")
        imports: dict[str, torch.Tensor] = {}
        needs: dict[str, Any] = {"x": _main_flags(first.x, first.requires_grad.get("x"))}
        for sender, part in parts.items():
            for name in self.sources[sender]:
                value = part.vars.get(name)
                if not isinstance(value, torch.Tensor):
                    raise ProtocolError(f"stage {self.index}: variable {name!r} from stage {sender} is missing")
                imports[name] = value
                needs[name] = part.requires_grad.get(name) is True
        call, mb = first.call, first.mb
        started = time.time()
        out = self.stage.forward(
            (call, mb),
            first.x,
            imports,
            grad=first.grad,
            needs_grad=needs,
            autocast=first.autocast,
            modes=first.modes,
            recompute=first.checkpoint,
            microbatches=first.microbatches,
        )
        if self.events is not None:
            self.events.span("forward", self.stage.key, self.index, call, mb, started, time.time())
        if first.grad:
            self._needs[(call, mb)] = needs
        heads = self.stage.take_heads()
        if heads:
            flags = out["requires_grad"]["y"]
            self._heads[(call, mb)] = {p: (h, out["y"][p], first.grad and flags[p]) for p, h in heads.items()}
            keep = first.keep or []
            out["y"] = tuple(
                self._logits(call, mb, p).detach() if p in heads and not (p < len(keep) and keep[p]) else t
                for p, t in enumerate(out["y"])
            )
        outgoing: list[Outgoing] = []
        for target, names in self.targets.items():
            main = target == self.x_to
            flags = {n: out["requires_grad"][n] for n in names}
            if main:
                flags["x"] = out["requires_grad"]["y"]
            y, shapes = out["y"] if main else None, None
            if main and target == DRIVER and first.keep is not None:
                y, shapes = self._keep(call, mb, y, first.keep)
            outgoing.append(
                (
                    target,
                    first.replace(
                        sender=self.index,
                        x=y,
                        vars={n: out["exports"][n] for n in names},
                        requires_grad=flags,
                        sent_at=None,
                        shapes=shapes,
                    ),
                )
            )
        return outgoing, out["y"]

    def _keep(self, call: int, mb: int, y: Any, keep: list[bool]) -> tuple[Any, dict[int, list[int]]]:
        """The model's output with the elements ``keep`` marks left here (`fetch` sends them, when
        the driver reads them): in their place an empty tensor of their dtype, and their shapes."""
        if isinstance(y, torch.Tensor) and keep == [True]:  # a spec's one output
            self._kept[(call, mb)] = {0: y}
            return y.new_empty(0), {0: list(y.shape)}
        if not isinstance(y, tuple) or len(keep) != len(y):
            raise ProtocolError(f"stage {self.index}: 'keep' names {len(keep)} outputs of a model with other outputs")
        self._kept[(call, mb)] = {i: t for i, (t, k) in enumerate(zip(y, keep)) if k}
        heads = self._heads.get((call, mb), {})
        sent = tuple(
            t.new_empty(0, dtype=heads[i][0].dtype if i in heads else t.dtype) if k else t
            for i, (t, k) in enumerate(zip(y, keep))
        )
        return sent, {i: heads[i][0].shape(y[i]) if i in heads else list(y[i].shape) for i in self._kept[(call, mb)]}

    def _logits(self, call: int, mb: int, position: int) -> torch.Tensor:
        """The deferred logits at ``position`` of micro-batch ``(call, mb)``, computed at their first
        read from the head's input, with a graph to it when a backward is still to come."""
        read = self._read.setdefault((call, mb), {})
        if position not in read:
            head, x, grad = self._heads[(call, mb)][position]
            with torch.set_grad_enabled((call, mb) in self._needs):
                leaf = x.detach().requires_grad_(grad)
                read[position] = (leaf, head.materialize(leaf))
        return read[position][1]

    def _kept_outputs(self, call: int, mb: int) -> dict[int, Any]:
        """Micro-batch ``(call, mb)``'s kept outputs, deferred logits computed."""
        kept = self._kept[(call, mb)]
        for position in self._heads.get((call, mb), {}):
            if position in kept and position not in self._read.get((call, mb), {}):
                kept[position] = self._logits(call, mb, position).detach()
        return kept

    def fetch(self, call: int) -> dict[int, dict[int, Any]]:
        """The outputs kept of ``call``, by micro-batch and position."""
        return {mb: self._kept_outputs(c, mb) for (c, mb) in list(self._kept) if c == call}

    def loss(
        self, call: int, position: int, run: Callable[[torch.Tensor, int], tuple], grad: bool, differentiate: int
    ) -> dict[int, list[torch.Tensor]]:
        """Run ``run(output, mb)`` (a loss program, `requests.Loss`) over the kept output at
        ``position`` of each micro-batch of ``call``; under ``grad``, keep its graph from the output
        to its value ``differentiate`` for the backward. Returns each micro-batch's values."""
        kept = self.fetch(call)
        if not kept:
            raise ProtocolError(f"stage {self.index} keeps no outputs of call {call} (released?)")
        out, graphs = {}, {}
        for mb, outputs in sorted(kept.items()):
            if position not in outputs:
                raise ProtocolError(f"stage {self.index} keeps no output {position} of call {call}")
            y = outputs[position]
            # A graph only for a backward still to come (a loss after it, a perplexity, keeps none).
            keep = grad and (call, mb) in self._needs
            leaf = y.detach().requires_grad_(keep and y.is_floating_point())
            with torch.set_grad_enabled(keep):
                values = run(leaf, mb)
            if not 0 <= differentiate < len(values):
                raise ProtocolError(f"the loss program has no output {differentiate}")
            if keep:
                graphs[(call, mb)] = (position, leaf, values[differentiate])
            out[mb] = [v.detach() for v in values]
        for key, graph in graphs.items():  # every micro-batch's, or (after a failure) none
            self._losses.setdefault(key, []).append(graph)
        return out

    def _with_loss_grads(self, call: int, mb: int, grad_out: Any, loss_grads: list[Any] | None) -> Any:
        """The output's gradient from the driver plus, for each loss computed here over the output,
        its gradient through the loss (`messages.Backward.loss_grads`)."""
        losses = self._losses.pop((call, mb), [])
        if not loss_grads:
            return grad_out
        if len(loss_grads) != len(losses):
            raise ProtocolError(
                f"stage {self.index}: backward of micro-batch {(call, mb)} brings {len(loss_grads)} loss gradients "
                f"for {len(losses)} losses"
            )
        extra: dict[int, torch.Tensor] = {}
        for (position, leaf, value), g in zip(losses, loss_grads):
            if g is None or not value.requires_grad:
                continue
            (through,) = torch.autograd.grad(value, leaf, g.to(device=value.device, dtype=value.dtype))
            extra[position] = extra[position] + through if position in extra else through
        if not extra:
            return grad_out
        # The driver sends a tuple output's gradient as a tuple, ``None`` where it has none; a layer
        # spec's one output's as a tensor or ``None``.
        if not isinstance(grad_out, tuple):
            return extra[0] if grad_out is None else extra[0] + grad_out.to(extra[0].device)
        grads = list(grad_out)
        for position, g in extra.items():
            old = grads[position]
            grads[position] = g if old is None else g + old.to(g.device)
        return tuple(grads)

    def before_step(self) -> None:
        """Before the optimizer changes the weights: deferred logits still kept and not read keep the
        head's weight and bias as their forward used them (one copy a step, gone with the outputs),
        so that logits read after the step are the forward's, as locally."""
        copies: dict[int, torch.Tensor] = {}

        def as_now(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or not t.requires_grad:
                return t
            return copies.setdefault(id(t), t.detach().clone())

        for key, heads in self._heads.items():
            unread = [p for p in heads if p in self._kept.get(key, {}) and p not in self._read.get(key, {})]
            for p in unread:
                head, x, grad = heads[p]
                heads[p] = (dataclasses.replace(head, weight=as_now(head.weight), bias=as_now(head.bias)), x, grad)

    def _through_heads(self, call: int, mb: int, grad_out: Any) -> Any:
        """The output's gradient with each deferred logits' gradient taken back through its head:
        the gradient of the head's input in its place, the head's weight's accumulated."""
        heads = self._heads.get((call, mb))
        if not heads or not isinstance(grad_out, tuple):
            return grad_out
        grads = list(grad_out)
        for position in heads:
            g = grads[position]
            if g is None:
                continue
            logits = self._logits(call, mb, position)
            leaf = self._read[(call, mb)][position][0]
            if logits.requires_grad:
                torch.autograd.backward(logits, g.to(device=logits.device, dtype=logits.dtype))
            grads[position] = leaf.grad
        return tuple(grads)

    def release_outputs(self, calls: Iterable[int]) -> None:
        """Forget the outputs kept of these calls (the driver will not read them)."""
        drop = set(calls)
        for table in (self._kept, self._read):
            for key in [k for k in table if k[0] in drop]:
                del table[key]  # type: ignore[attr-defined]

    def late_backward(self, call: int, mb: int, parts: dict[int, Backward]) -> list[Outgoing]:
        """A B action with the driver's gradient (the loss was computed there, or over the output)."""
        first = parts[self.x_to]
        grad_out = first.grad_out
        if self.x_to == DRIVER:
            grad_out = self._through_heads(call, mb, self._with_loss_grads(call, mb, grad_out, first.loss_grads))
        grad_x, grad_imports, needs = self.run_backward(call, mb, grad_out, parts, early=False)
        return self.gradients(first, grad_x, grad_imports, needs)

    def run_backward(
        self, call: int, mb: int, grad_out: Any, parts: dict[int, Backward], early: bool
    ) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
        needs = self._needs.pop((call, mb), None)
        if needs is None:
            raise ProtocolError(
                f"stage {self.index}: backward of micro-batch {(call, mb)} without a forward under grad"
            )
        grad_exports: dict[str, torch.Tensor] = {}
        for sender, part in parts.items():
            for name in self.targets[sender]:
                g = part.grads.get(name)
                if isinstance(g, torch.Tensor):
                    grad_exports[name] = grad_exports[name] + g if name in grad_exports else g
        started = time.time()
        grad_x, grad_imports = self.stage.backward((call, mb), grad_out, grad_exports, early=early)
        if self.events is not None:
            self.events.span("backward", self.stage.key, self.index, call, mb, started, time.time())
        return grad_x, grad_imports, needs

    def gradients(
        self, first: Forward | Backward, grad_x: Any, grad_imports: dict[str, Any], needs: dict[str, Any]
    ) -> list[Outgoing]:
        """A micro-batch's gradients, to each of its sources: the inputs of their B actions."""
        return [
            (
                source,
                Backward(
                    key=self.stage.key,
                    call=first.call,
                    mb=first.mb,
                    sender=self.index,
                    grad_out=_wanted(grad_x, needs["x"]) if source == self.x_from else None,
                    grads={n: grad_imports.get(n) for n in names if needs.get(n)},
                    fence=first.fence,
                    microbatches=first.microbatches,
                ),
            )
            for source, names in self.sources.items()
        ]

    def release(self, calls: Iterable[int]) -> None:
        """Forget what the stage keeps of these calls: saved forwards, outputs, losses' graphs."""
        drop = set(calls)
        self.stage.release(list(drop))
        for table in (self._needs, self._kept, self._losses, self._heads, self._read):
            for key in [k for k in table if k[0] in drop]:
                del table[key]  # type: ignore[attr-defined]
