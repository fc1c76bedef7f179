"""What runs when on a stage: its action list, fed by the messages that bring each action's input.

Every forward call, GPipe's included, and without grad too, runs its stage's list of actions from
`lightning_remote_mp.schedule`, where every kind of action is defined: F, B and W of each
micro-batch in the list's order (`StageRuntime`, one per stage). A message brings one input of an
action and says which (a `Forward` an F's, or a D's for a step of ``generate()``,
`Forward.generation`; a `Backward` a B's; the driver's `LossGrad` an S's); inputs are buffered by
(call, kind, micro-batch), and an action runs when it is next on its list and every input it waits
for is in (the previous stage's output and the residual variables of others, or the next stages'
gradients). `lightning_remote_mp.worker.route.RoutedStage` runs it. Under 1F1B and zero-bubble with
the loss inside the model, the last stage starts each micro-batch's backward at the loss, taken as
1 (an "early" call); the driver's real gradient of the loss follows (`LossGrad`), the input of the
call's last action (S, `schedule.SCALE`), which adds the weight gradients times it to ``.grad``, and
on stage 0, where the driver asks, sends it the input's gradients times it. A decoding step
runs D's alone, each inside the stage's key/value cache of its generation and micro-batch
(`lightning_remote_mp.worker.caches`). Releasing a call drops what waits for it.

When a message reaches its stage's runtime at all is `lightning_remote_mp.worker.order.Order`'s
to say: the driver's requests run in their order there.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lightning_remote_mp import schedule
from lightning_remote_mp.errors import LrmpError, ProtocolError, SpecError
from lightning_remote_mp.flow import DRIVER
from lightning_remote_mp.schedule import BACKWARD, DECODE, FORWARD, SCALE, WEIGHTS
from lightning_remote_mp.wire.messages import Backward, Forward
from lightning_remote_mp.wire.requests import LossGrad
from lightning_remote_mp.worker.route import Outgoing, RoutedStage

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

_M = TypeVar("_M", Forward, Backward)


@dataclasses.dataclass
class _Plan:
    """One call's actions on this stage (`lightning_remote_mp.schedule`), and what they wait for."""

    actions: collections.deque[schedule.Action]  # those left to run, the next first
    listing: tuple[schedule.Action, ...]  # all of them (an error quotes them)
    kinds: frozenset[str]  # the kinds of action in it: a message brings the input of one of them
    loss_output: int | None  # the model's output that is the loss, where the backward starts here; None: at the driver
    schedule: str
    microbatches: int
    fence: dict[int, int]  # the forward's (`messages._Pipelined.fence`), which its gradients carry on
    grad: bool  # a forward under grad: backward and weight actions follow
    ready: dict[tuple[str, int], dict[int, Any]] = dataclasses.field(default_factory=dict)  # inputs arrived
    outputs: dict[int, Any] = dataclasses.field(default_factory=dict)  # last stage: outputs, for the loss
    filings: dict[int, int] = dataclasses.field(default_factory=dict)  # per micro-batch, its backward's number
    to_driver: dict[int, Backward] = dataclasses.field(default_factory=dict)  # stage 0: input gradients, as 1
    loss_grad: LossGrad | None = None  # the driver's gradient of an early call's loss: its S action's input

    @property
    def early(self) -> bool:
        """The backward starts at the loss on the last stage, before the driver's gradient comes."""
        return self.loss_output is not None


def _times(grad: Any, scale: torch.Tensor) -> Any:
    if isinstance(grad, tuple):
        return tuple(_times(g, scale) for g in grad)
    return grad * scale.to(device=grad.device, dtype=grad.dtype) if isinstance(grad, torch.Tensor) else grad


class StageRuntime:
    """One stage's action lists, one per call in flight, and the inputs that wait for their action.

    Args:
        route: runs the stage's actions and addresses their outputs.
        send: sends messages at once (the worker's session's): a list runs several actions per
            message received, and the next stage waits for the first action's output, not the last's.
        stages: how many stages the pipeline has (`requests.Setup.stages`; a schedule's list
            depends on it).
        limit: the most micro-batches (and calls) that may wait here at once.
    """

    def __init__(self, route: RoutedStage, send: Callable[[list[Outgoing]], None], *, stages: int, limit: int = 4096):
        self.route = route
        self.send = send
        self.index = route.index
        self.where = f"stage {route.index}"  # what its errors begin with (torch's pipelining: log_prefix)
        self.stages = stages
        self.limit = limit
        self._inputs: dict[tuple[int, str, int], dict[int, Any]] = {}  # (call, kind, mb) -> parts arrived so far
        self._plans: dict[int, _Plan] = {}  # by call, while actions are left
        # Calls whose action failed, and whether they were early (the driver heard of it from the failure).
        self._failed: collections.OrderedDict[int, tuple[Exception, bool]] = collections.OrderedDict()
        self._released: collections.deque[int] = collections.deque(maxlen=1024)
        #: A W action of a call whose backward the driver ran failed: raised when ``.grad`` is next read.
        self.weights_failed: Exception | None = None

    def _collect(self, kind: str, expected: Iterable[int], msg: _M) -> dict[int, _M] | None:
        """File ``msg``, an input of a ``kind`` action (`FORWARD`, `BACKWARD`, `DECODE`) of its micro-batch,
        with the other parts of it; all of them, once every expected sender's part is in."""
        expected = set(expected)
        if msg.sender not in expected:
            raise ProtocolError(f"{self.where} expects no message from stage {msg.sender}")
        key = (msg.call, kind, msg.mb)
        parts = self._inputs.get(key)
        if parts is None:
            if len(self._inputs) >= self.limit:
                raise ProtocolError(f"{self.where}: more than {self.limit} micro-batches in flight")
            parts = self._inputs[key] = {}
        if msg.sender in parts:
            raise ProtocolError(f"{self.where}: micro-batch {key} from stage {msg.sender} arrived twice")
        parts[msg.sender] = msg
        events = self.route.events
        if events is not None and msg.sent_at is not None:
            events.transfer(self.route.stage.key, msg.sender, self.index, msg.call, msg.mb, msg.sent_at, time.time())
        if set(parts) != expected:
            return None
        del self._inputs[key]
        return parts  # type: ignore[return-value]

    def forward(self, msg: Forward) -> None:
        """File a forward's input (from the driver or a peer) and run what of its call's list may run now."""
        if msg.call in self._released:
            return  # a call the driver gave up on, whose forward waited here behind a loss gradient
        kind = FORWARD if msg.generation is None else DECODE  # a step of generate() decodes
        parts = self._collect(kind, self.route.sources, msg)
        if parts is None:
            return
        first = parts[self.route.x_from]
        if first.call in self._failed:
            return  # an earlier action of the call failed: the driver heard of it
        plan = self._plan_of(first)
        self._check_mb(first, plan)
        plan.ready[(kind, first.mb)] = parts
        self._advance(first.call)

    def backward(self, msg: Backward) -> None:
        """File a B action's input (the gradients of what this stage sent on) and run what may run now."""
        if msg.call in self._released:
            return  # a late message of a call the driver gave up on
        plan = self._plans.get(msg.call)
        if plan is None or BACKWARD not in plan.kinds:
            self._unplanned(msg)
            return
        self._check_mb(msg, plan)
        parts = self._collect(BACKWARD, self.route.targets, msg)
        if parts is not None:
            plan.ready[(BACKWARD, msg.mb)] = parts
            self._advance(msg.call)

    def _unplanned(self, msg: Backward) -> None:
        """A backward's input for a call that runs no B here (now): dropped where the call is an
        early one that failed (the driver heard of the failure from it), else an error."""
        failed = self._failed.get(msg.call)
        if failed is not None and failed[1]:
            return
        self._check_applicable(msg.call)
        raise ProtocolError(f"{self.where}: backward of micro-batch {(msg.call, msg.mb)} without a forward under grad")

    def _plan_of(self, first: Forward) -> _Plan:
        """``first``'s call's plan: its stage's actions under the call's schedule (GPipe where the
        backward starts at the driver), the forwards alone for a call without grad, or a decoding
        step's D's for a step of ``generate()``."""
        plan = self._plans.get(first.call)
        if plan is None:
            early = first.schedule is not None  # with its loss_output, under grad (`Forward`'s check)
            name = first.schedule or "gpipe"
            if len(self._plans) >= self.limit:
                raise ProtocolError(f"{self.where}: more than {self.limit} calls run a schedule at once")
            m = first.microbatches
            if first.generation is not None:
                name, actions = "decoding", schedule.decoding(self.stages, self.index, m)
            else:
                actions = schedule.actions(name, self.stages, self.index, m, grad=first.grad, scale=early)
            plan = self._plans[first.call] = _Plan(
                collections.deque(actions),
                tuple(actions),
                frozenset(a.kind for a in actions),
                first.loss_output,
                name,
                first.microbatches,
                dict(first.fence),
                first.grad,
            )
        return plan

    def _check_mb(self, msg: Forward | Backward, plan: _Plan) -> None:
        """A micro-batch of the call's plan, or a `ProtocolError` (it would wait in the plan forever)."""
        if not 0 <= msg.mb < plan.microbatches:
            raise ProtocolError(
                f"{self.where}: micro-batch {msg.mb} of call {msg.call}, whose schedule has "
                f"{plan.microbatches} micro-batches"
            )

    def _advance(self, call: int) -> None:
        """Run ``call``'s actions in the plan's order for as long as the next one has what it waits for.
        A failure is kept for the call: its actions may run after the driver's forward has returned,
        so the driver's backward learns of it (`loss_grad`) rather than waiting for a gradient that never comes."""
        try:
            self._run_actions(call)
        except Exception as err:
            plan = self._plans.pop(call, None)
            self._failed[call] = (err, plan is not None and plan.early)
            while len(self._failed) > self.limit:
                self._failed.popitem(last=False)
            if plan is not None and plan.actions:  # the error reply quotes the list, the failing action marked
                listing = schedule.format_row(plan.listing, plan.actions[0])
                with contextlib.suppress(AttributeError):  # an exception type that takes no attributes
                    err.lrmp_actions = f"{self.where}'s actions for call {call} ({plan.schedule}): {listing}"  # type: ignore[attr-defined]
            raise

    def _run_actions(self, call: int) -> None:
        """Run the call's next actions while each has its input; each action's messages leave
        before the next action runs."""
        plan = self._plans[call]
        while plan.actions:
            out: list[Outgoing] = []
            action = plan.actions[0]
            if action.kind == WEIGHTS:
                self._weights(call, action.mb, plan)
            elif action.kind == SCALE:
                if plan.loss_grad is None:
                    break
                out = self._scaled(call, plan, plan.loss_grad)
            else:
                parts = plan.ready.pop((action.kind, action.mb), None)
                if parts is None:
                    break
                if action.kind == DECODE:  # the stage's layers write its cache of this generation
                    generation = parts[self.route.x_from].generation  # type: ignore[union-attr]
                    with self.route.stage.caches.step(generation, action.mb):
                        out, _ = self.route.run_forward(parts)  # type: ignore[arg-type]
                elif action.kind == FORWARD:
                    out, y = self.route.run_forward(parts)  # type: ignore[arg-type]
                    if plan.early and self.route.x_to == DRIVER:
                        plan.outputs[action.mb] = y
                        # the loss's gradient, taken as 1, is here already
                        plan.ready[(BACKWARD, action.mb)] = {}
                elif plan.early:
                    out = self._early_backward(call, action.mb, parts, plan)  # type: ignore[arg-type]
                else:
                    out = self.route.late_backward(call, action.mb, parts)  # type: ignore[arg-type]
            plan.actions.popleft()
            if out:
                self.send(out)
        if not plan.actions:
            del self._plans[call]

    def _weights(self, call: int, mb: int, plan: _Plan) -> None:
        """A W action: the deferred weight gradients of micro-batch ``mb``'s backward (of the whole
        call's, at its first W, where the backward started at the driver: one product, into ``.grad``)."""
        started = time.time()
        if plan.early:
            self.route.stage.flush_early(call, plan.filings.pop(mb, 0))
        else:
            try:
                if not self.route.stage.flush_weight_grads(call):
                    return
            except Exception as err:
                # The micro-batches are reported done already and the driver may have moved on: the
                # failure belongs to the next request that needs these gradients (step, clipping, zero_grad).
                log.warning("%s: computing the deferred weight gradients failed: %s", self.where, err)
                self.weights_failed = err
                return
        if self.route.events is not None:
            mb = mb if plan.early else -1
            self.route.events.span("weights", self.route.stage.key, self.index, call, mb, started, time.time())

    def loss_grad(self, msg: LossGrad) -> bool:
        """The driver's gradient of ``msg.call``'s loss (`LossGrad`): the input of the call's S
        action, which runs once the call's other actions have. Returns whether it waits for them."""
        call = msg.call
        plan = self._plans.get(call)
        if plan is None or not plan.early:
            self._check_applicable(call)
            raise ProtocolError(f"{self.where}: a loss gradient for call {call}, which ran no schedule here")
        if plan.loss_grad is not None:
            raise ProtocolError(f"{self.where}: the loss gradient of call {call} came twice")
        if msg.answer and self.route.x_from != DRIVER:
            raise ProtocolError(
                f"{self.where}: the loss gradient of call {call} asks for the input gradients of a stage "
                "the driver does not feed"
            )
        plan.loss_grad = msg
        self._advance(call)
        return call in self._plans

    def loss_grad_waits(self, call: int) -> bool:
        """Whether the driver's gradient of ``call``'s loss still waits for the call's actions here;
        an action of it that failed meanwhile, or a release of the call, raises."""
        self._check_applicable(call)
        return call in self._plans

    def _check_applicable(self, call: int) -> None:
        failed = self._failed.get(call)
        if failed is not None:
            err = failed[0]
            raise LrmpError(
                f"{self.where}: an action of call {call}'s schedule failed before its backward: "
                f"{type(err).__name__}: {err}"
            ) from err
        if call in self._released:
            raise LrmpError(f"{self.where}: call {call} was released before its loss's gradient was applied")

    def _apply(self, call: int, grad: torch.Tensor | None) -> None:
        if grad is None:  # the step did not differentiate the loss: no gradient, as with GPipe
            self.route.stage.release_early(call)
        else:
            self.route.stage.apply_early(call, grad)

    def _early_backward(self, call: int, mb: int, parts: dict[int, Backward], plan: _Plan) -> list[Outgoing]:
        if self.route.x_to == DRIVER:
            y, at = plan.outputs.pop(mb), plan.loss_output
            if not isinstance(y, tuple) or not 0 <= at < len(y):
                raise ProtocolError(f"{self.where}: the model has no output {at} to start the backward at")
            loss = y[at]
            grad_out: Any = tuple(torch.ones_like(t) if i == at else None for i, t in enumerate(y))
            if loss.numel() != 1 or not loss.is_floating_point():
                raise LrmpError(
                    f"{self.where}: the model's output {at}, where schedule={plan.schedule!r} starts the "
                    "backward, is no loss (one floating value per micro-batch): use schedule='gpipe' for this model"
                )
            key, m = self.route.stage.key, plan.microbatches
            first: Forward | Backward = Backward(
                key=key, call=call, mb=mb, sender=DRIVER, microbatches=m, fence=plan.fence
            )
        else:
            first = parts[self.route.x_to]
            grad_out = first.grad_out
        grad_x, grad_imports, needs = self.route.run_backward(call, mb, grad_out, parts, early=True)
        plan.filings[mb] = self.route.stage.filing
        outgoing = self.route.gradients(first, grad_x, grad_imports, needs)
        if self.route.x_from == DRIVER:  # stage 0: the input's gradient waits for the driver's scale
            plan.to_driver[mb] = next(m for target, m in outgoing if target == DRIVER and isinstance(m, Backward))
            outgoing = [(t, m) for t, m in outgoing if t != DRIVER]
        return outgoing

    def _scaled(self, call: int, plan: _Plan, msg: LossGrad) -> list[Outgoing]:
        """The S action: add the weight gradients times the driver's gradient of the loss to
        ``.grad``; where the driver asks (`LossGrad.answer`, stage 0), send it each micro-batch's
        input gradients, times that gradient too."""
        self._apply(call, msg.grad)
        if not msg.answer:
            return []
        scale = msg.grad
        return [
            (DRIVER, done.replace(grad_out=_times(done.grad_out, scale) if scale is not None else None))
            for _, done in sorted(plan.to_driver.items())
        ]

    def release(self, calls: Iterable[int]) -> None:
        """Drop everything of these calls: the driver gave up on them, or is done with them."""
        drop = set(calls)
        self._released.extend(drop)
        self.route.release(drop)
        for key in [k for k in self._inputs if k[0] in drop]:
            del self._inputs[key]
        for table in (self._plans, self._failed):
            for call in drop:
                table.pop(call, None)  # type: ignore[attr-defined]


class StageRuntimes(dict[str, StageRuntime]):
    """A worker's stage runtimes, by stage key: looking up a stage it does not hold is an error that
    names the key (``get`` and ``in`` ask without one)."""

    def __missing__(self, key: str) -> StageRuntime:
        raise SpecError(f"no stage {key!r:.80} on this worker; send setup first")
