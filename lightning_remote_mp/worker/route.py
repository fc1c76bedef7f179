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
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from lightning_remote_mp import schedule
from lightning_remote_mp.errors import LrmpError, ProtocolError
from lightning_remote_mp.flow import DRIVER, Routes
from lightning_remote_mp.schedule import BACKWARD, FORWARD, WEIGHTS
from lightning_remote_mp.wire.messages import Backward, Forward
from lightning_remote_mp.worker.stage import StageExecutor
from lightning_remote_mp.worker.timeline import EventLog

log = logging.getLogger(__name__)

Outgoing = tuple[int, Forward | Backward]  # (destination stage, or DRIVER; the message)
_M = TypeVar("_M", Forward, Backward)


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


_LATE_READ = (
    "the step's loss also depends on {what}, but with a schedule other than 'gpipe' the last stage "
    "runs the backward from the loss alone, as soon as each micro-batch's forward is done: use "
    "schedule='gpipe' for this model, or differentiate only the loss"
)


def _times(grad: Any, scale: torch.Tensor) -> Any:
    if isinstance(grad, tuple):
        return tuple(_times(g, scale) for g in grad)
    return grad * scale.to(device=grad.device, dtype=grad.dtype) if isinstance(grad, torch.Tensor) else grad


@dataclasses.dataclass
class _Plan:
    """One call's actions on this stage (`lightning_remote_mp.schedule`), and what they wait for."""

    actions: collections.deque[schedule.Action]
    seed: int | None  # the model's output that is the loss, where the backward starts here; None: at the driver
    schedule: str
    microbatches: int
    fence: dict[int, int]  # the forward's (`messages._Pipelined.fence`), which its gradients carry on
    grad: bool  # a forward under grad: backward and weight actions follow
    ready: dict[tuple[str, int], dict[int, Any]] = dataclasses.field(default_factory=dict)  # inputs arrived
    outputs: dict[int, Any] = dataclasses.field(default_factory=dict)  # last stage: outputs, for the loss
    filings: dict[int, int] = dataclasses.field(default_factory=dict)  # per micro-batch, its backward's number
    to_driver: dict[int, Backward] = dataclasses.field(default_factory=dict)  # stage 0: input gradients, as 1
    differentiable: list[bool] = dataclasses.field(default_factory=list)  # last stage: which outputs have a graph

    @property
    def early(self) -> bool:
        """The backward starts at the loss on the last stage, before the driver's gradient comes."""
        return self.seed is not None


@dataclasses.dataclass
class _Meta:
    """What a micro-batch's backward needs to know of its forward."""

    saved: bool
    x_grad: bool | list[bool]
    var_grad: dict[str, Any]


class RoutedStage:
    """A `StageExecutor` plus its routes and the partly arrived micro-batches."""

    def __init__(
        self,
        stage: StageExecutor,
        sources: Routes,
        targets: Routes,
        microbatch_limit: int = 4096,
        stages: int | None = None,
    ) -> None:
        self.stage = stage
        self.sources = dict(sources)  # sender stage -> the variables it brings (checked by `requests.Setup`)
        self.targets = dict(targets)
        self.x_from = stage.index - 1 if stage.index > 0 else DRIVER
        self.x_to = next((t for t in self.targets if t == stage.index + 1), DRIVER)
        if self.x_from not in self.sources or self.x_to not in self.targets:
            raise ProtocolError(f"stage {stage.index}: routes must include the main input's source and output's target")
        self.limit = microbatch_limit
        self._forward: dict[tuple[int, int], dict[int, Forward]] = {}
        self._backward: dict[tuple[int, int], dict[int, Backward]] = {}
        self._meta: dict[tuple[int, int], _Meta] = {}  # per micro-batch under grad, from its forward
        self._kept: dict[tuple[int, int], dict[int, Any]] = {}  # the model's outputs the driver reads when it needs
        # Losses computed here under grad over kept outputs, per micro-batch in order: (position,
        # the output as the loss read it, the loss's value the backward's gradient is for).
        self._losses: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self.events: EventLog | None = None  # set while the driver records a timeline
        self.stages = stages
        # Calls whose backward starts on the last stage: their plans while actions are left, then
        # until the driver's gradient (its scale) has come for every micro-batch.
        self._plans: dict[int, _Plan] = {}
        self._done: dict[int, _Plan] = {}
        self._scale_parts: dict[tuple[int, int], dict[int, Backward]] = {}  # scales partly arrived (`_collect`)
        self._scales: dict[int, dict[int, dict[int, Backward]]] = {}  # and all arrived, by call and micro-batch
        self._failed: collections.OrderedDict[int, Exception] = collections.OrderedDict()  # calls whose action failed
        self._loss_grads: dict[int, torch.Tensor | None] = {}  # the driver's (`loss_grad`), until the plan has run
        #: Sends messages at once (the worker's session sets it): a schedule runs several actions per
        #: message received, and the next stage waits for the first action's output, not the last's.
        self.send_now: Callable[[list[Outgoing]], None] | None = None
        self._released: collections.deque[int] = collections.deque(maxlen=1024)
        #: A W action of a call whose backward the driver ran failed: raised when ``.grad`` is next read.
        self.weights_failed: Exception | None = None

    @property
    def index(self) -> int:
        return self.stage.index

    def _collect(
        self, table: dict[tuple[int, int], dict[int, _M]], expected: Iterable[int], msg: _M
    ) -> dict[int, _M] | None:
        """File ``msg`` with the other parts of its micro-batch; all of them, once every expected
        sender's part is in."""
        expected = set(expected)
        if msg.sender not in expected:
            raise ProtocolError(f"stage {self.index} expects no message from stage {msg.sender}")
        if msg.call in self._released:
            return None  # a late message of a call the driver gave up on
        key = (msg.call, msg.mb)
        parts = table.get(key)
        if parts is None:
            if len(table) >= self.limit:
                raise ProtocolError(f"stage {self.index}: more than {self.limit} micro-batches in flight")
            parts = table[key] = {}
        if msg.sender in parts:
            raise ProtocolError(f"stage {self.index}: micro-batch {key} from stage {msg.sender} arrived twice")
        parts[msg.sender] = msg
        if self.events is not None and msg.sent_at is not None:
            self.events.transfer(self.stage.key, msg.sender, self.index, msg.call, msg.mb, msg.sent_at, time.time())
        if set(parts) != expected:
            return None
        del table[key]
        return parts

    def forward(self, msg: Forward) -> list[Outgoing]:
        if msg.call in self._released:
            return []  # a call the driver gave up on, whose forward waited here behind a loss gradient
        parts = self._collect(self._forward, self.sources, msg)
        if parts is None:
            return []
        first = parts[self.x_from]
        if first.call in self._failed:
            return []  # an earlier action of the call failed: the driver heard of it
        plan = self._plan_of(first)
        self._check_mb(first, plan)
        plan.ready[(FORWARD, first.mb)] = parts
        return self._advance(first.call)

    def _run_forward(self, parts: dict[int, Forward], plan: _Plan | None = None) -> list[Outgoing]:
        """Run a micro-batch's forward; on the last stage, under a ``plan``, keep its output there
        for the backward that starts at its loss."""
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
            self._meta[(call, mb)] = _Meta(saved=out["saved"], x_grad=needs["x"], var_grad=needs)
        if plan is not None and self.x_to == DRIVER:
            plan.outputs[mb] = out["y"]
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
                    dataclasses.replace(
                        first,
                        sender=self.index,
                        x=y,
                        vars={n: out["exports"][n] for n in names},
                        requires_grad=flags,
                        sent_at=None,
                        shapes=shapes,
                    ),
                )
            )
        return outgoing

    def _keep(self, call: int, mb: int, y: Any, keep: list[bool]) -> tuple[Any, dict[int, list[int]]]:
        """The model's output with the elements ``keep`` marks left here (`fetch` sends them, when
        the driver reads them): in their place an empty tensor of their dtype, and their shapes."""
        if isinstance(y, torch.Tensor) and keep == [True]:  # a spec's one output
            self._kept[(call, mb)] = {0: y}
            return y.new_empty(0), {0: list(y.shape)}
        if not isinstance(y, tuple) or len(keep) != len(y):
            raise ProtocolError(f"stage {self.index}: 'keep' names {len(keep)} outputs of a model with other outputs")
        self._kept[(call, mb)] = {i: t for i, (t, k) in enumerate(zip(y, keep)) if k}
        sent = tuple(t.new_empty(0) if k else t for t, k in zip(y, keep))
        return sent, {i: list(y[i].shape) for i in self._kept[(call, mb)]}

    def fetch(self, call: int) -> dict[int, dict[int, Any]]:
        """The outputs kept of ``call``, by micro-batch and position."""
        return {mb: kept for (c, mb), kept in self._kept.items() if c == call}

    def loss(
        self, call: int, position: int, run: Callable[[torch.Tensor, int], tuple], grad: bool, differentiate: int
    ) -> dict[int, list[torch.Tensor]]:
        """Run ``run(output, mb)`` (a loss program, `requests.Loss`) over the kept output at
        ``position`` of each micro-batch of ``call``; under ``grad``, keep its graph from the output
        to its value ``differentiate`` for the backward. Returns each micro-batch's values."""
        kept = {mb: outputs for (c, mb), outputs in self._kept.items() if c == call}
        if not kept:
            raise ProtocolError(f"stage {self.index} keeps no outputs of call {call} (released?)")
        out, graphs = {}, {}
        for mb, outputs in sorted(kept.items()):
            if position not in outputs:
                raise ProtocolError(f"stage {self.index} keeps no output {position} of call {call}")
            y = outputs[position]
            # A graph only for a backward still to come (a loss after it, a perplexity, keeps none).
            keep = grad and (call, mb) in self._meta
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

    def release_outputs(self, calls: Iterable[int]) -> None:
        """Forget the outputs kept of these calls (the driver will not read them)."""
        drop = set(calls)
        for key in [k for k in self._kept if k[0] in drop]:
            del self._kept[key]

    def backward(self, msg: Backward) -> list[Outgoing]:
        if msg.call in self._released:
            return []  # a late message of a call the driver gave up on
        if msg.early and msg.call in self._failed:
            return []
        plan = self._plans.get(msg.call)
        if plan is not None and plan.grad and (msg.early or not plan.early):  # a B action's input
            self._check_mb(msg, plan)
            parts = self._collect(self._backward, self.targets, msg)
            if parts is None:
                return []
            plan.ready[(BACKWARD, msg.mb)] = parts
            return self._advance(msg.call)
        if plan is not None and plan.early or msg.call in self._done or msg.call in self._scales:
            return self._scale(msg)  # the driver's gradient of a loss whose backward ran here already
        if msg.call in self._failed:
            self._check_applicable(msg.call)
        if msg.early:
            raise ProtocolError(f"stage {self.index}: an early gradient for call {msg.call}, which runs no schedule")
        raise ProtocolError(
            f"stage {self.index}: backward of micro-batch {(msg.call, msg.mb)} without a forward under grad"
        )

    def _late_backward(self, call: int, mb: int, parts: dict[int, Backward]) -> list[Outgoing]:
        """A B action with the driver's gradient (the loss was computed there, or over the output)."""
        first = parts[self.x_to]
        grad_out = first.grad_out
        if self.x_to == DRIVER:
            grad_out = self._with_loss_grads(call, mb, grad_out, first.loss_grads)
        grad_x, grad_imports, meta = self._run_backward(call, mb, grad_out, parts, early=False)
        return self._gradients(first, grad_x, grad_imports, meta, early=False)

    def _run_backward(
        self, call: int, mb: int, grad_out: Any, parts: dict[int, Backward], early: bool
    ) -> tuple[Any, dict[str, torch.Tensor], _Meta]:
        meta = self._meta.pop((call, mb), None)
        if meta is None:
            raise ProtocolError(
                f"stage {self.index}: backward of micro-batch {(call, mb)} without a forward under grad"
            )
        grad_exports: dict[str, torch.Tensor] = {}
        for sender, part in parts.items():
            for name in self.targets[sender]:
                g = part.grads.get(name)
                if isinstance(g, torch.Tensor):
                    grad_exports[name] = grad_exports[name] + g if name in grad_exports else g
        grad_x: Any = None
        grad_imports: dict[str, torch.Tensor] = {}
        started = time.time()
        if meta.saved:
            grad_x, grad_imports = self.stage.backward((call, mb), grad_out, grad_exports, early=early)
        if self.events is not None:
            self.events.span("backward", self.stage.key, self.index, call, mb, started, time.time())
        return grad_x, grad_imports, meta

    def _gradients(
        self, first: Forward | Backward, grad_x: Any, grad_imports: dict[str, Any], meta: _Meta, early: bool
    ) -> list[Outgoing]:
        """A micro-batch's gradients, to each of its sources."""
        return [
            (
                source,
                Backward(
                    key=self.stage.key,
                    call=first.call,
                    mb=first.mb,
                    sender=self.index,
                    grad_out=_wanted(grad_x, meta.x_grad) if source == self.x_from else None,
                    grads={n: grad_imports.get(n) for n in names if meta.var_grad.get(n)},
                    fence=first.fence,
                    microbatches=first.microbatches,
                    early=True if early and source != DRIVER else None,
                ),
            )
            for source, names in self.sources.items()
        ]

    # --- calls whose backward starts on the last stage, as the schedule orders ---------------
    def _plan_of(self, first: Forward) -> _Plan:
        """``first``'s call's plan: its stage's actions under the call's schedule (GPipe where the
        backward starts at the driver), or the forwards alone for a call without grad."""
        plan = self._plans.get(first.call)
        if plan is None:
            early = first.seed is not None and first.schedule is not None and first.grad
            name = first.schedule if early and first.schedule is not None else "gpipe"
            stages = self.stages if self.stages is not None else (None if early else self.index + 1)
            if stages is None or not self.index < stages:
                raise ProtocolError(f"stage {self.index}: a schedule, but setup did not say how many stages there are")
            if len(self._plans) >= self.limit:
                raise ProtocolError(f"stage {self.index}: more than {self.limit} calls run a schedule at once")
            actions = schedule.actions(name, stages, self.index, first.microbatches, grad=first.grad)
            seed = first.seed if early else None
            plan = self._plans[first.call] = _Plan(
                collections.deque(actions), seed, name, first.microbatches, dict(first.fence), first.grad
            )
        return plan

    def _check_mb(self, msg: Forward | Backward, plan: _Plan) -> None:
        """A micro-batch of the call's plan, or a `ProtocolError` (it would wait in the plan forever)."""
        if not 0 <= msg.mb < plan.microbatches:
            raise ProtocolError(
                f"stage {self.index}: micro-batch {msg.mb} of call {msg.call}, whose schedule has "
                f"{plan.microbatches} micro-batches"
            )

    def _advance(self, call: int) -> list[Outgoing]:
        """Run ``call``'s actions in the plan's order for as long as the next one has what it waits for.
        A failure is kept for the call: its actions may run after the driver's forward has returned,
        so the driver's backward learns of it (`_scale`) rather than waiting for a gradient that never comes."""
        try:
            return self._run_actions(call)
        except Exception as err:
            self._failed[call] = err
            while len(self._failed) > self.limit:
                self._failed.popitem(last=False)
            self._plans.pop(call, None)
            raise

    def _run_actions(self, call: int) -> list[Outgoing]:
        plan = self._plans[call]
        out: list[Outgoing] = []
        while plan.actions:
            action = plan.actions[0]
            if action.kind == WEIGHTS:
                self._weights(call, action.mb, plan)
            else:
                parts = plan.ready.pop((action.kind, action.mb), None)
                if parts is None:
                    break
                if action.kind == FORWARD:
                    out += self._run_forward(parts, plan)  # type: ignore[arg-type]
                    if plan.early and self.x_to == DRIVER:  # the loss's gradient, taken as 1, is here already
                        plan.ready[(BACKWARD, action.mb)] = {}
                elif plan.early:
                    out += self._early_backward(call, action.mb, parts, plan)  # type: ignore[arg-type]
                else:
                    out += self._late_backward(call, action.mb, parts)  # type: ignore[arg-type]
            plan.actions.popleft()
            if self.send_now is not None and out:  # each action's messages leave before the next action runs
                self.send_now(out)
                out = []
        if not plan.actions:
            del self._plans[call]
            if plan.early:
                self._done[call] = plan
                if call in self._loss_grads:
                    self._apply(call, self._loss_grads.pop(call))
                out += self._scale_ready(call)
        return out

    def _weights(self, call: int, mb: int, plan: _Plan) -> None:
        """A W action: the deferred weight gradients of micro-batch ``mb``'s backward (of the whole
        call's, at its first W, where the backward started at the driver: one product, into ``.grad``)."""
        started = time.time()
        if plan.early:
            self.stage.flush_early(call, plan.filings.pop(mb, 0))
        else:
            try:
                if not self.stage.flush_weight_grads(call):
                    return
            except Exception as err:
                # The micro-batches are reported done already and the driver may have moved on: the
                # failure belongs to the next request that needs these gradients (step, clipping, zero_grad).
                log.warning("stage %d: computing the deferred weight gradients failed: %s", self.index, err)
                self.weights_failed = err
                return
        if self.events is not None:
            mb = mb if plan.early else -1
            self.events.span("weights", self.stage.key, self.index, call, mb, started, time.time())

    def loss_grad(self, call: int, grad: torch.Tensor | None) -> bool:
        """The driver's gradient of ``call``'s loss, straight from the driver (`requests.LossGrad`):
        applied once the call's plan has run here. Returns whether it waits for that."""
        if call in self._plans:
            self._loss_grads[call] = grad
            return True
        self._check_applicable(call)
        self._apply(call, grad)
        return False

    def loss_grad_waits(self, call: int) -> bool:
        """Whether the driver's gradient of ``call``'s loss still waits for the call's plan here; an
        action of it that failed meanwhile, or a release of the call, raises."""
        if call in self._failed:
            self._loss_grads.pop(call, None)
        self._check_applicable(call)
        return call in self._loss_grads

    def _check_applicable(self, call: int) -> None:
        failed = self._failed.get(call)
        if failed is not None:
            raise LrmpError(
                f"stage {self.index}: an action of call {call}'s schedule failed before its backward: "
                f"{type(failed).__name__}: {failed}"
            ) from failed
        if call in self._released:
            raise LrmpError(f"stage {self.index}: call {call} was released before its loss's gradient was applied")

    def _apply(self, call: int, grad: torch.Tensor | None) -> None:
        if self._done.pop(call, None) is None:
            raise ProtocolError(f"stage {self.index}: a loss gradient for call {call}, which ran no schedule here")
        if grad is None:  # the step did not differentiate the loss: no gradient, as with GPipe
            self.stage.release_early(call)
        else:
            self.stage.apply_early(call, grad)

    def _early_backward(self, call: int, mb: int, parts: dict[int, Backward], plan: _Plan) -> list[Outgoing]:
        if self.x_to == DRIVER:
            y = plan.outputs.pop(mb)
            if not isinstance(y, tuple) or not 0 <= plan.seed < len(y):
                raise ProtocolError(f"stage {self.index}: the model has no output {plan.seed} to start the backward at")
            loss = y[plan.seed]
            grad_out: Any = tuple(torch.ones_like(t) if i == plan.seed else None for i, t in enumerate(y))
            if loss.numel() != 1 or not loss.is_floating_point():
                raise LrmpError(
                    f"stage {self.index}: the model's output {plan.seed}, where schedule={plan.schedule!r} starts the "
                    "backward, is no loss (one floating value per micro-batch): use schedule='gpipe' for this model"
                )
            first: Forward | Backward = Backward(
                key=self.stage.key, call=call, mb=mb, sender=DRIVER, microbatches=plan.microbatches, fence=plan.fence
            )
        else:
            first = parts[self.x_to]
            grad_out = first.grad_out
        grad_x, grad_imports, meta = self._run_backward(call, mb, grad_out, parts, early=True)
        plan.filings[mb] = self.stage.filing
        if self.x_to == DRIVER:
            plan.differentiable = list(self.stage.differentiable)
        outgoing = self._gradients(first, grad_x, grad_imports, meta, early=True)
        if self.x_from == DRIVER:  # stage 0: the input's gradient waits for the driver's scale
            plan.to_driver[mb] = next(m for target, m in outgoing if target == DRIVER and isinstance(m, Backward))
            outgoing = [(t, m) for t, m in outgoing if t != DRIVER]
        return outgoing

    def _scale(self, msg: Backward) -> list[Outgoing]:
        """File the driver's gradient of an early call's loss (from the driver, or passed on by the
        next stage); once the call's actions have all run, apply it."""
        self._check_applicable(msg.call)
        plan = self._plans.get(msg.call) or self._done.get(msg.call)
        if plan is not None:
            self._check_mb(msg, plan)
        if msg.mb in self._scales.get(msg.call, {}):
            raise ProtocolError(f"stage {self.index}: the gradient of micro-batch {(msg.call, msg.mb)} came twice")
        parts = self._collect(self._scale_parts, self.targets, msg)
        if parts is None:
            return []
        self._scales.setdefault(msg.call, {})[msg.mb] = parts
        return self._scale_ready(msg.call)

    def _scale_ready(self, call: int) -> list[Outgoing]:
        """Once the plan of an early call has run and the driver's gradient of every micro-batch is
        in (from each stage this one feeds), add the weight gradients times it to ``.grad``, and pass
        it on (stage 0: the input's gradients, times it, to the driver)."""
        plan = self._done.get(call)
        waiting = self._scales.get(call, {})  # micro-batches whose scale came from every stage this one feeds
        if plan is None or len(waiting) < plan.microbatches:
            return []
        del self._done[call], self._scales[call]
        grads = [self._scale_of(parts[self.x_to], plan) for _, parts in sorted(waiting.items())]
        scale = grads[0]
        for mb, g in enumerate(grads):
            if (g is None) != (scale is None) or (g is not None and scale is not None and not torch.equal(g, scale)):
                raise LrmpError(
                    f"stage {self.index}: the loss's micro-batches got different gradients ({scale} and "
                    f"{g} for micro-batch {mb} of call {call}); a schedule other than 'gpipe' needs one "
                    "for all of them (a loss that adds its micro-batches' sums): use schedule='gpipe'"
                )
        if scale is None:  # the step did not differentiate the loss: no gradient, as with GPipe
            self.stage.release_early(call)
        else:
            self.stage.apply_early(call, scale)
        out: list[Outgoing] = []
        for mb, parts in sorted(waiting.items()):
            first = parts[self.x_to]
            if self.x_from == DRIVER:
                done = plan.to_driver.get(mb)
                if done is not None:
                    grad = _times(done.grad_out, scale) if scale is not None else None
                    out.append((DRIVER, dataclasses.replace(done, grad_out=grad)))
                continue
            for source in self.sources:
                out.append(
                    (
                        source,
                        Backward(
                            key=self.stage.key,
                            call=call,
                            mb=mb,
                            sender=self.index,
                            scale=scale,
                            fence=first.fence,
                            microbatches=first.microbatches,
                        ),
                    )
                )
        return out

    def _scale_of(self, msg: Backward, plan: _Plan) -> torch.Tensor | None:
        """The loss's gradient a scale message brings: from the next stage, ``scale``; from the
        driver, the output's gradient at the loss's position, and nothing at the others."""
        if msg.sender != DRIVER:
            return msg.scale  # None: the step did not differentiate the loss
        if msg.loss_grads and any(g is not None for g in msg.loss_grads):
            raise LrmpError(_LATE_READ.format(what="a loss computed over one of its other outputs"))
        seed = plan.seed
        grads = msg.grad_out if isinstance(msg.grad_out, tuple) else (msg.grad_out,)
        graph = plan.differentiable
        # A gradient for an output without a graph here (a count of tokens) goes nowhere, as in `stage.backward`.
        others = [i for i, g in enumerate(grads) if g is not None and i != seed and i < len(graph) and graph[i]]
        if others:
            raise LrmpError(_LATE_READ.format(what=f"its output {others[0]}"))
        g = grads[seed] if seed < len(grads) else None
        return g.detach().reshape(()).float() if g is not None else None

    def release(self, calls: Iterable[int]) -> None:
        drop = set(calls)
        self._released.extend(drop)
        self.stage.release(list(drop))
        for table in (self._forward, self._backward, self._scale_parts, self._meta, self._kept, self._losses):
            for key in [k for k in table if k[0] in drop]:
                del table[key]  # type: ignore[attr-defined]
        for calls_table in (self._plans, self._done, self._scales, self._failed, self._loss_grads):
            for call in drop:
                calls_table.pop(call, None)  # type: ignore[attr-defined]
