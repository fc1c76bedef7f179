"""What runs when on a worker: each stage's action list, and the driver's requests in their order.

This module is the one place that decides when a worker runs something. Two things enter it:

- **micro-batches** (`StageRuntime`, one per stage). Every forward call, GPipe's included, and
  without grad too, runs its stage's list of actions from `lightning_remote_mp.schedule`, where
  every kind of action is defined: F, B and W of each micro-batch in the list's order. A message
  brings one input of an action and says which (a `Forward` an F's, or a D's for a step of
  ``generate()``, `Forward.generation`; a `Backward` a B's or an S's, `Backward.action`); inputs are
  buffered by (call, kind, micro-batch), and an action runs when it is next on its list and every
  input it waits for is in (the previous stage's output and the residual variables of others, or the
  next stages' gradients). `lightning_remote_mp.worker.route.RoutedStage` runs it. Under 1F1B and
  zero-bubble with the loss inside the model, the last stage starts each micro-batch's backward at
  the loss, taken as 1 (an "early" call); the driver's real gradient of the loss follows, the input
  of the call's last action (S, `schedule.SCALE`), which adds the weight gradients times it to
  ``.grad``. A decoding step runs D's alone, each inside the stage's key/value cache of its
  generation and micro-batch (`lightning_remote_mp.worker.caches`). Releasing a call drops what
  waits for it.
- **the driver's requests** (`Order`, one per worker). They run in the order the driver sent them
  (their ids), whichever way they came: straight from the driver, or along the pipeline
  (`lightning_remote_mp.wire.carry.Carry`). Three things wait: a peer's micro-batch, for the
  driver's requests its ``fence`` names (`Order.hold_back`); a request that came along the
  pipeline, for the one the driver sent before it (`Order.next_carried`); every request the driver
  sent after a loss's gradient (`requests.LossGrad`), until the stage has run its part of that
  call's backward and applied it (`Order.park`): the optimizer's step on those gradients, and the
  next call's forward, come right behind it. `Order.run` runs each request in its turn.
  ``zero_grad`` (Z) and the optimizer's step (O) are actions of the schedule's vocabulary too, but
  of no call's list (a step may follow several calls); `schedule.training_step` draws where they fall.

What the message-saving parts buy, measured (`benchmarks/README.md`, sections 1h and 1j): carrying
the driver's requests along the pipeline, the unwaited backward and `LossGrad` together 10-15% of a
step (small model, 1F1B, loss inside the model); `LossGrad` alone 12-19%; carrying alone 5-7% at
m=4 with the loss in ``training_step``, nothing at m=1.

>>> order = Order({}, handle=lambda message: None)
>>> order.ran(3), order.driver_ran
([], 3)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lightning_remote_mp import schedule
from lightning_remote_mp.errors import LrmpError, ProtocolError, SpecError
from lightning_remote_mp.flow import DRIVER
from lightning_remote_mp.schedule import BACKWARD, DECODE, FORWARD, SCALE, WEIGHTS
from lightning_remote_mp.wire.carry import Carried, Carry
from lightning_remote_mp.wire.messages import Backward, Forward
from lightning_remote_mp.wire.protocol import CARRIED_KINDS, CARRY
from lightning_remote_mp.wire.requests import LossGrad, Release
from lightning_remote_mp.worker.route import Outgoing, RoutedStage

if TYPE_CHECKING:
    from lightning_remote_mp.worker.outbox import Outbox

log = logging.getLogger(__name__)

_M = TypeVar("_M", Forward, Backward)
#: What a request's handler returns where nothing is sent back: its answer travels on its own (a
#: micro-batch's results go on along the pipeline), or it runs later (`Order.run`).
NO_REPLY = object()


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
    differentiable: list[bool] = dataclasses.field(default_factory=list)  # last stage: which outputs have a graph
    # The driver's gradient of an early call's loss, for its S action: one value for the call (a
    # `requests.LossGrad`), or per micro-batch the messages that bring it from each stage this one feeds.
    loss_grad: tuple[torch.Tensor | None, ...] = ()
    scales: dict[int, dict[int, Backward]] = dataclasses.field(default_factory=dict)

    @property
    def early(self) -> bool:
        """The backward starts at the loss on the last stage, before the driver's gradient comes."""
        return self.loss_output is not None


_LATE_READ = (
    "the step's loss also depends on {what}, but with a schedule other than 'gpipe' the last stage "
    "runs the backward from the loss alone, as soon as each micro-batch's forward is done: use "
    "schedule='gpipe' for this model, or differentiate only the loss"
)


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
        """File ``msg``, an input of a ``kind`` action (`FORWARD`, `BACKWARD`, `SCALE`) of its micro-batch,
        with the other parts of it; all of them, once every expected sender's part is in."""
        expected = set(expected)
        if msg.sender not in expected:
            raise ProtocolError(f"stage {self.index} expects no message from stage {msg.sender}")
        key = (msg.call, kind, msg.mb)
        parts = self._inputs.get(key)
        if parts is None:
            if len(self._inputs) >= self.limit:
                raise ProtocolError(f"stage {self.index}: more than {self.limit} micro-batches in flight")
            parts = self._inputs[key] = {}
        if msg.sender in parts:
            raise ProtocolError(f"stage {self.index}: micro-batch {key} from stage {msg.sender} arrived twice")
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
        """File a backward's input, for the action it names (`Backward.action`: a B's gradients, or
        an early call's S), and run what may run now."""
        if msg.call in self._released:
            return  # a late message of a call the driver gave up on
        plan = self._plans.get(msg.call)
        if plan is None or msg.action not in plan.kinds:
            self._unplanned(msg)
            return
        self._check_mb(msg, plan)
        if msg.action == SCALE:
            self._scale(msg, plan)
            return
        parts = self._collect(BACKWARD, self.route.targets, msg)
        if parts is not None:
            plan.ready[(BACKWARD, msg.mb)] = parts
            self._advance(msg.call)

    def _unplanned(self, msg: Backward) -> None:
        """A backward's input for an action the call does not run here (now): dropped where it is a
        B's of an early call that failed (the driver heard of the failure from it), else an error."""
        failed = self._failed.get(msg.call)
        if failed is not None and failed[1] and msg.action == BACKWARD:
            return
        self._check_applicable(msg.call)
        if msg.action == SCALE:
            raise ProtocolError(f"stage {self.index}: a loss scale (S) for call {msg.call}, which runs no S here")
        raise ProtocolError(
            f"stage {self.index}: backward of micro-batch {(msg.call, msg.mb)} without a forward under grad"
        )

    def _plan_of(self, first: Forward) -> _Plan:
        """``first``'s call's plan: its stage's actions under the call's schedule (GPipe where the
        backward starts at the driver), the forwards alone for a call without grad, or a decoding
        step's D's for a step of ``generate()``."""
        plan = self._plans.get(first.call)
        if plan is None:
            early = first.loss_output is not None and first.schedule is not None and first.grad
            name = first.schedule if early and first.schedule is not None else "gpipe"
            if len(self._plans) >= self.limit:
                raise ProtocolError(f"stage {self.index}: more than {self.limit} calls run a schedule at once")
            m = first.microbatches
            if first.generation is not None:
                name, actions = "decoding", schedule.decoding(self.stages, self.index, m)
            else:
                actions = schedule.actions(name, self.stages, self.index, m, grad=first.grad, scale=early)
            loss_output = first.loss_output if early else None
            plan = self._plans[first.call] = _Plan(
                collections.deque(actions),
                tuple(actions),
                frozenset(a.kind for a in actions),
                loss_output,
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
                f"stage {self.index}: micro-batch {msg.mb} of call {msg.call}, whose schedule has "
                f"{plan.microbatches} micro-batches"
            )

    def _advance(self, call: int) -> None:
        """Run ``call``'s actions in the plan's order for as long as the next one has what it waits for.
        A failure is kept for the call: its actions may run after the driver's forward has returned,
        so the driver's backward learns of it (`_scale`) rather than waiting for a gradient that never comes."""
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
                    err.lrmp_actions = f"stage {self.index}'s actions for call {call} ({plan.schedule}): {listing}"  # type: ignore[attr-defined]
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
                if plan.loss_grad:  # the driver's `LossGrad`: nothing to pass on
                    self._apply(call, plan.loss_grad[0])
                elif len(plan.scales) == plan.microbatches:
                    out = self._scaled(call, plan)
                else:
                    break
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
                log.warning("stage %d: computing the deferred weight gradients failed: %s", self.index, err)
                self.weights_failed = err
                return
        if self.route.events is not None:
            mb = mb if plan.early else -1
            self.route.events.span("weights", self.route.stage.key, self.index, call, mb, started, time.time())

    def loss_grad(self, call: int, grad: torch.Tensor | None) -> bool:
        """The driver's gradient of ``call``'s loss, straight from the driver (`requests.LossGrad`):
        the input of the call's S action, which runs once the call's other actions have. Returns
        whether it waits for them."""
        plan = self._plans.get(call)
        if plan is None or not plan.early:
            self._check_applicable(call)
            raise ProtocolError(f"stage {self.index}: a loss gradient for call {call}, which ran no schedule here")
        plan.loss_grad = (grad,)
        self._advance(call)  # applying it sends nothing
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
                f"stage {self.index}: an action of call {call}'s schedule failed before its backward: "
                f"{type(err).__name__}: {err}"
            ) from err
        if call in self._released:
            raise LrmpError(f"stage {self.index}: call {call} was released before its loss's gradient was applied")

    def _apply(self, call: int, grad: torch.Tensor | None) -> None:
        if grad is None:  # the step did not differentiate the loss: no gradient, as with GPipe
            self.route.stage.release_early(call)
        else:
            self.route.stage.apply_early(call, grad)

    def _early_backward(self, call: int, mb: int, parts: dict[int, Backward], plan: _Plan) -> list[Outgoing]:
        if self.route.x_to == DRIVER:
            y, at = plan.outputs.pop(mb), plan.loss_output
            if not isinstance(y, tuple) or not 0 <= at < len(y):
                raise ProtocolError(f"stage {self.index}: the model has no output {at} to start the backward at")
            loss = y[at]
            grad_out: Any = tuple(torch.ones_like(t) if i == at else None for i, t in enumerate(y))
            if loss.numel() != 1 or not loss.is_floating_point():
                raise LrmpError(
                    f"stage {self.index}: the model's output {at}, where schedule={plan.schedule!r} starts the "
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
        if self.route.x_to == DRIVER:
            plan.differentiable = list(self.route.stage.differentiable)
        outgoing = self.route.gradients(first, grad_x, grad_imports, needs)
        if self.route.x_from == DRIVER:  # stage 0: the input's gradient waits for the driver's scale
            plan.to_driver[mb] = next(m for target, m in outgoing if target == DRIVER and isinstance(m, Backward))
            outgoing = [(t, m) for t, m in outgoing if t != DRIVER]
        return outgoing

    def _scale(self, msg: Backward, plan: _Plan) -> None:
        """File the driver's gradient of an early call's loss (from the driver, or passed on by the
        next stage) for the call's S action."""
        if msg.mb in plan.scales:
            raise ProtocolError(f"stage {self.index}: the gradient of micro-batch {(msg.call, msg.mb)} came twice")
        parts = self._collect(SCALE, self.route.targets, msg)
        if parts is not None:
            plan.scales[msg.mb] = parts
            self._advance(msg.call)

    def _scaled(self, call: int, plan: _Plan) -> list[Outgoing]:
        """The S action of an early call whose driver's gradient came per micro-batch (from each
        stage this one feeds): add the weight gradients times it to ``.grad``, and pass it on
        (stage 0: the input's gradients, times it, to the driver)."""
        waiting = plan.scales
        grads = [self._scale_of(parts[self.route.x_to], plan) for _, parts in sorted(waiting.items())]
        scale = grads[0]
        for mb, g in enumerate(grads):
            if (g is None) != (scale is None) or (g is not None and scale is not None and not torch.equal(g, scale)):
                raise LrmpError(
                    f"stage {self.index}: the loss's micro-batches got different gradients ({scale} and "
                    f"{g} for micro-batch {mb} of call {call}); a schedule other than 'gpipe' needs one "
                    "for all of them (a loss that adds its micro-batches' sums): use schedule='gpipe'"
                )
        self._apply(call, scale)
        out: list[Outgoing] = []
        for mb, parts in sorted(waiting.items()):
            first = parts[self.route.x_to]
            if self.route.x_from == DRIVER:
                done = plan.to_driver.get(mb)
                if done is not None:
                    grad = _times(done.grad_out, scale) if scale is not None else None
                    out.append((DRIVER, dataclasses.replace(done, grad_out=grad)))
                continue
            for source in self.route.sources:
                out.append(
                    (
                        source,
                        Backward(
                            key=self.route.stage.key,
                            call=call,
                            mb=mb,
                            sender=self.index,
                            action=SCALE,
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
        loss_output = plan.loss_output
        grads = msg.grad_out if isinstance(msg.grad_out, tuple) else (msg.grad_out,)
        graph = plan.differentiable
        # A gradient for an output without a graph here (a count of tokens) goes nowhere, as in `stage.backward`.
        others = [i for i, g in enumerate(grads) if g is not None and i != loss_output and i < len(graph) and graph[i]]
        if others:
            raise LrmpError(_LATE_READ.format(what=f"its output {others[0]}"))
        g = grads[loss_output] if loss_output < len(grads) else None
        return g.detach().reshape(()).float() if g is not None else None

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


#: The most of the driver's requests a worker keeps while they wait for one that never came
#: (each is a small request; more means the pipeline that brings them lost one on the way).
MAX_WAITING = 4096


class Order:
    """The driver's requests on one worker, in their order, and the tasks waiting for them.

    Args:
        runtimes: the worker's stages, by key (the session's): a peer's micro-batch waits by its
            stage's fence, and a loss gradient for its stage's actions (`StageRuntime.loss_grad_waits`).
        handle: runs a request's message (`lightning_remote_mp.worker.session.WorkerSession.handle`),
            but a micro-batch's (its stage's runtime runs it), a `Carry` and a `LossGrad`, which
            this runs itself.
        peers, outbox: the session's peers' addresses, by stage key, and where a `Carry` goes on.
        seal_key, session: what the driver's requests that come along the pipeline are sealed with.
    """

    def __init__(
        self,
        runtimes: Mapping[str, StageRuntime],
        handle: Callable[[Any], Any],
        peers: Mapping[str, Mapping[int, str]] | None = None,
        outbox: Outbox | None = None,
        seal_key: bytes | None = None,
        session: str = "",
    ) -> None:
        self._handle = handle
        self._peers = peers if peers is not None else {}
        self._outbox, self._seal_key, self._session = outbox, seal_key, session
        #: What may run now, once `run` returned: the driver's request that came along the pipeline
        #: and runs first (`next_carried`), and the tasks that waited (`ran`). The server queues
        #: them before anything else.
        self.next: tuple[list[Carried], list[Any]] = ([], [])
        self.driver_ran = 0  # the id of the driver's last request run here (they run in order)
        self._held_back: list[tuple[int, str, Any]] = []  # peers' micro-batches waiting for a driver request
        self._carried: list[Carried] = []  # the driver's requests that came along the pipeline, not run yet
        self._runtimes = runtimes
        self._waiting: tuple[int, str, int] | None = None  # a loss gradient's (request id, stage key, call)
        self._parked: list[Any] = []  # the driver's requests after it, in the order they came
        #: Why the optimizer must not step: a loss's gradient that could not be applied (None: it may).
        self.no_step: str | None = None

    def run(self, request: Any) -> Any:
        """Run ``request`` (a `lightning_remote_mp.worker.request.Request` of this session) in its
        turn, and return its answer, or `NO_REPLY` where none goes back: a micro-batch (its stage's
        runtime runs it, and its messages go on by themselves), or a request that does not run now:
        a peer's micro-batch waits for the driver's requests its fence names (`hold_back`); a
        driver's request waits behind a loss's gradient (`park`), runs once (one whose id is not
        above `driver_ran` ran already), or is a loss gradient that waits for its call's actions
        (`_loss_grad`). A request that could not be read raises its refusal, in its turn. Either
        way `next` then says what may run now."""
        message = request.message
        try:
            if request.refused is not None:
                raise request.refused
            if request.from_peer:
                if isinstance(message, (Forward, Backward)) and self.hold_back(message, request):
                    return NO_REPLY
            elif self.park(request) or (request.kind in CARRIED_KINDS and request.id <= self.driver_ran):
                return NO_REPLY
            if isinstance(message, Forward):
                self._runtimes[message.key].forward(message)
                return NO_REPLY
            if isinstance(message, Backward):
                self._runtimes[message.key].backward(message)
                return NO_REPLY
            if isinstance(message, Carry):
                return self._carry(message)
            if isinstance(message, LossGrad):
                return self._loss_grad(request.id, message)
            return self._handle(message)
        finally:
            ready = self.ran(0 if request.from_peer else request.id)
            carried = self.next_carried()
            self.next = ([carried] if carried is not None else [], ready)

    # --- peers' micro-batches ------------------------------------------------------------------
    def hold_back(self, message: Forward | Backward, task: Any) -> bool:
        """Keep ``task`` (a peer's pipelined ``message``) if the driver sent it after a request to
        this worker that has not run here yet (the request its `messages._Pipelined.fence` names for
        this stage); returns whether it was kept. `ran` gives it back once that request has run."""
        runtime = self._runtimes.get(message.key)
        if runtime is None:
            return False  # nothing to wait for; a stage this worker does not hold is refused when it runs
        wanted = message.fence.get(runtime.index)
        if wanted is None or wanted <= self.driver_ran:
            return False
        if sum(1 for _, held_key, _ in self._held_back if held_key == message.key) >= runtime.limit:
            raise ProtocolError(
                f"stage {runtime.index}: more than {runtime.limit} micro-batches wait for requests that never came"
            )
        self._held_back.append((wanted, message.key, task))
        return True

    def held_back(self) -> dict[str, int]:
        """``{"held_back": n, "waits_for": request id}`` while micro-batches wait for a driver request
        (the heartbeat's answer carries it), else ``{}``."""
        held = list(self._held_back)  # read by the thread answering heartbeats
        if not held:
            return {}
        return {"held_back": len(held), "waits_for": min(wanted for wanted, _, _ in held)}

    def ran(self, req_id: int) -> list[Any]:
        """The driver's request ``req_id`` has run here (0: a peer's message has): the tasks that
        may run now, in the order they came: the driver's requests that waited behind a loss's
        gradient, once it is applied, then peers' micro-batches."""
        # The loss gradient that waits, and what was parked behind it, have not run.
        waiting = self._waiting
        kept = waiting is not None and (req_id == waiting[0] or any(r.id == req_id for r in self._parked))
        ready = self._settle() if waiting is not None else []
        if not kept:
            self.driver_ran = max(self.driver_ran, req_id)
        if self._held_back:
            ready += [task for wanted, _, task in self._held_back if wanted <= self.driver_ran]
            self._held_back = [held for held in self._held_back if held[0] > self.driver_ran]
        return ready

    # --- the driver's requests that came along the pipeline ------------------------------------
    def keep_carried(self, mine: list[Carried], where: str) -> None:
        """Keep the driver's requests a `Carry` brought for this worker, to run in their turn."""
        mine = [c for c in mine if c.id > self.driver_ran]
        if len(self._carried) + len(mine) > MAX_WAITING:
            raise ProtocolError(
                f"{where}: more than {MAX_WAITING} of the driver's requests wait for ones that never came"
            )
        known = {c.id for c in self._carried}
        self._carried = sorted([*self._carried, *(c for c in mine if c.id not in known)], key=lambda c: c.id)

    def next_carried(self) -> Carried | None:
        """The driver's request that came along the pipeline and runs next: the first, once the
        request before it has run; ``None`` while none may run. One that came the short way too,
        and ran, is dropped: each of the driver's requests runs once."""
        if not self._carried:
            return None  # asked after every request: nothing to build while none came this way
        self._carried = [c for c in self._carried if c.id > self.driver_ran]
        if self._carried and self._carried[0].after <= self.driver_ran:
            return self._carried.pop(0)
        return None

    def _carry(self, msg: Carry) -> Any:
        """Pass the driver's requests for the stages further ``msg.toward`` on to the next stage that
        way, then keep this stage's own to run in their turn (`next_carried`). They go on first, so
        that every stage gets its own at once: a step whose stages sum tied gradients together
        (`lightning_remote_mp.worker.collective.GradGroup`) would otherwise wait on itself."""
        here = self._runtimes[msg.key].index
        if self.no_step is not None:  # the stages beyond must not step on gradients this one lacks
            log.warning(
                "stage %d: the driver's requests for stages %s are not passed on: %s",
                here,
                sorted(msg.requests),
                self.no_step,
            )
            return NO_REPLY
        for c in msg.requests.get(here, ()):
            if not c.sealed_by(self._seal_key, self._session):
                came = "from the driver" if msg.sender == DRIVER else f"from stage {msg.sender}"
                raise PermissionError(
                    f"stage {here}: the driver's request {c.id} ({c.request.KIND}), which came along the pipeline "
                    f"{came}, does not bear the driver's seal for this worker: forged or altered on the way. "
                    "Nothing it brought runs; check the workers of this pipeline"
                )
        rest = {stage: carried for stage, carried in msg.requests.items() if stage != here}
        if any((stage - here) * msg.toward <= 0 for stage in rest):
            raise ProtocolError(
                f"stage {here}: a carry toward {msg.toward:+d} brings requests for stages {sorted(rest)}, "
                "which are not further that way"
            )
        if rest:
            onward = self._peers.get(msg.key, {}).get(here + msg.toward)
            if onward is None:
                raise ProtocolError(
                    f"stage {here} has no stage {here + msg.toward} to pass the driver's requests on to"
                )
            assert self._outbox is not None
            self._outbox.to_peer(onward, CARRY, Carry(msg.key, msg.call, here, msg.toward, rest).body())
        self.keep_carried(list(msg.requests.get(here, ())), f"stage {here}")
        return NO_REPLY

    # --- requests behind a loss's gradient -----------------------------------------------------
    def _loss_grad(self, req_id: int, msg: LossGrad) -> Any:
        """Apply the driver's gradient of a call's loss (`StageRuntime.loss_grad`), or wait for the
        call's actions here first: then no later request of the driver's runs before it (`park`)."""
        try:
            waits = self._runtimes[msg.key].loss_grad(msg.call, msg.grad)
        except Exception as err:
            self.no_step = f"the loss's gradient of call {msg.call} of {msg.key!r} was not applied here: {err}"
            raise
        self.no_step = None
        if waits:
            self._waiting = (req_id, msg.key, msg.call)
        return None

    def park(self, request: Any) -> bool:
        """Keep the driver's ``request`` (a `lightning_remote_mp.worker.request.Request`) while a
        loss gradient sent before it waits; returns whether it was kept. A release of that call
        goes at once: the driver gave up on it. The requests parked behind the gradient then run in
        their order, but for the quiet ones (the step on it), which the release's later id shows as
        run already: they are skipped (`run`)."""
        if self._waiting is None or 0 < request.id <= self._waiting[0]:  # 0: a `Carry` the driver sent after it
            return False
        _, key, call = self._waiting
        if isinstance(request.message, Release) and call in request.message.calls.get(key, ()):
            return False
        if len(self._parked) >= MAX_WAITING:
            raise ProtocolError(f"more than {MAX_WAITING} of the driver's requests wait behind call {call}'s backward")
        self._parked.append(request)
        return True

    def _settle(self) -> list[Any]:
        """The parked requests, once the waiting loss gradient is applied, failed or released."""
        assert self._waiting is not None
        req_id, key, call = self._waiting
        try:
            runtime = self._runtimes.get(key)
            if runtime is not None and runtime.loss_grad_waits(call):
                return []
            self.no_step = None
        except Exception as err:  # its actions failed (the driver hears of it from them) or it was released
            log.warning("the loss's gradient of call %d of %r was not applied: %s", call, key, err)
            self.no_step = f"the loss's gradient of call {call} of {key!r} was not applied here: {err}"
        self._waiting = None
        self.driver_ran = max(self.driver_ran, req_id)
        parked, self._parked = self._parked, []
        return parked
