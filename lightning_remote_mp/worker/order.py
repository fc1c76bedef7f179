"""The driver's requests on a worker, in their order: what waits for what before it runs.

Requests run in the order the driver sent them (their ids), whichever way they came: straight from
the driver, or along the pipeline (`lightning_remote_mp.wire.carry.Carry`). Three things wait: a
peer's micro-batch, for the driver's requests its ``fence`` names (`Order.hold_back`); a request
that came along the pipeline, for the one the driver sent before it (`Order.next_carried`); every
request the driver sent after a loss's gradient (`requests.LossGrad`), until the stage has run its
part of that call's backward and applied it (`Order.park`): the optimizer's step on those
gradients, and the next call's forward, come right behind it. `Order.run` runs each request in its
turn: a micro-batch through its stage's `lightning_remote_mp.worker.runtime.StageRuntime`, which
decides when each action runs. ``zero_grad`` and the optimizer's step are requests, not actions of
a call's list (`lightning_remote_mp.schedule`): a step may follow several calls, as Lightning's loop
decides, so they run in their turn here. The driver's side of this order is
`lightning_remote_mp.wire.request_order.RequestOrder`.

What the message-saving parts buy, measured (`benchmarks/README.md`, sections 1h and 1j): carrying
the driver's requests along the pipeline, the unwaited backward and `LossGrad` together 10-15% of a
step (small model, 1F1B, loss inside the model); `LossGrad` alone 12-19%; carrying alone 5-7% at
m=4 with the loss in ``training_step``, nothing at m=1.

>>> order = Order({}, handle=lambda message: None)
>>> order.ran(3), order.driver_ran
([], 3)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.flow import DRIVER
from lightning_remote_mp.wire.carry import Carried, Carry
from lightning_remote_mp.wire.messages import Backward, Forward
from lightning_remote_mp.wire.protocol import CARRIED_KINDS, CARRY
from lightning_remote_mp.wire.requests import LossGrad, Release
from lightning_remote_mp.worker.runtime import StageRuntime

if TYPE_CHECKING:
    from lightning_remote_mp.worker.outbox import Outbox

log = logging.getLogger(__name__)

#: What a request's handler returns where nothing is sent back: its answer travels on its own (a
#: micro-batch's results go on along the pipeline), or it runs later (`Order.run`).
NO_REPLY = object()

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
        # Carries held until this stage's loss gradient has run: (its request id, the next stage, the carry).
        self._onward: list[tuple[int, str, Carry]] = []
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
        if self._onward:
            self._pass_on()
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
        way, and keep this stage's own to run in their turn (`next_carried`). Where they bring this
        stage a loss gradient (`LossGrad`), the rest go on once it is applied (`_pass_on`), and not
        at all if it could not be: no stage beyond then steps on gradients this one lacks, and where
        stage 0 answers the driver once it applied its own (`LossGrad.answer`), its answer proves
        that every stage before it in the carry's way applied theirs. Else they go on at once, so
        that every stage gets its own at once: a step whose stages sum tied gradients together
        (`lightning_remote_mp.worker.collective.GradGroup`) would otherwise wait on itself."""
        here = self._runtimes[msg.key].index
        mine = list(msg.requests.get(here, ()))
        gate = next((c.id for c in mine if isinstance(c.request, LossGrad) and c.id > self.driver_ran), None)
        if self.no_step is not None and gate is None:  # the stages beyond must not step on gradients this one lacks
            log.warning(
                "stage %d: the driver's requests for stages %s are not passed on: %s",
                here,
                sorted(msg.requests),
                self.no_step,
            )
            return NO_REPLY
        for c in mine:
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
            if len(self._onward) >= MAX_WAITING:
                raise ProtocolError(f"stage {here}: more than {MAX_WAITING} carries wait for loss gradients here")
            self._onward.append((gate or 0, onward, Carry(msg.key, msg.call, here, msg.toward, rest)))
        self.keep_carried(mine, f"stage {here}")
        self._pass_on()
        return NO_REPLY

    def _pass_on(self) -> None:
        """Send on the carries whose loss gradient has run here, or that wait for none (`_carry`):
        dropped, with what they bring the stages beyond, where it could not be applied."""
        due = [held for held in self._onward if held[0] <= self.driver_ran]
        self._onward = [held for held in self._onward if held[0] > self.driver_ran]
        for _, onward, carry in due:
            if self.no_step is not None:
                log.warning(
                    "stage %d: the driver's requests for stages %s are not passed on: %s",
                    carry.sender,
                    sorted(carry.requests),
                    self.no_step,
                )
                continue
            assert self._outbox is not None
            self._outbox.to_peer(onward, CARRY, carry.body())

    # --- requests behind a loss's gradient -----------------------------------------------------
    def _loss_grad(self, req_id: int, msg: LossGrad) -> Any:
        """Apply the driver's gradient of a call's loss (`StageRuntime.loss_grad`), or wait for the
        call's actions here first: then no later request of the driver's runs before it (`park`)."""
        try:
            waits = self._runtimes[msg.key].loss_grad(msg)
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
