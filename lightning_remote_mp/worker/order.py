"""The order in which a worker runs the driver's requests, and what waits for what.

The driver's requests run in the order it sent them (their ids), whichever way they came: straight
from the driver, or along the pipeline (`lightning_remote_mp.wire.requests.Carry`). Three things wait:

- a peer's micro-batch, for the driver's requests its ``fence`` names (`hold_back`);
- a request that came along the pipeline, for the one the driver sent before it (`next_carried`);
- every request the driver sent after a loss's gradient (`requests.LossGrad`), until the stage has
  run its part of that call's backward and applied it (`wait`, `park`): the optimizer's step on
  those gradients, and the next call's forward, come right behind it.

>>> order = Order(lambda key, call: False)
>>> order.ran(3), order.driver_ran, order.already_ran(2)
([], 3, True)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.wire.requests import Carried, LossGrad, Release

log = logging.getLogger(__name__)

#: The most of the driver's requests a worker keeps while they wait for one that never came
#: (each is a small request; more means the pipeline that brings them lost one on the way).
MAX_WAITING = 4096


class Order:
    """The driver's requests on one worker, in their order, and the tasks waiting for them.

    Args:
        loss_grad_waits: whether the loss gradient of a call (by stage key and call) still waits for
            the call's actions on this worker (`lightning_remote_mp.worker.route.RoutedStage.loss_grad_waits`);
            it raises if they failed or the call was released.
    """

    def __init__(self, loss_grad_waits: Callable[[str, int], bool]) -> None:
        self.driver_ran = 0  # the id of the driver's last request run here (they run in order)
        self._held_back: list[tuple[int, str, Any]] = []  # peers' micro-batches waiting for a driver request
        self._carried: list[Carried] = []  # the driver's requests that came along the pipeline, not run yet
        self._loss_grad_waits = loss_grad_waits
        self._waiting: tuple[int, str, int] | None = None  # a loss gradient's (request id, stage key, call)
        self._parked: list[Any] = []  # the driver's requests after it, in the order they came
        #: Why the optimizer must not step: a loss's gradient that could not be applied (None: it may).
        self.no_step: str | None = None

    # --- peers' micro-batches ------------------------------------------------------------------
    def hold_back(self, key: str, wanted: int | None, limit: int, task: Any) -> bool:
        """Keep ``task`` (a peer's micro-batch of stage ``key``) until the driver's request ``wanted``
        has run here; returns whether it was kept. `ran` gives it back."""
        if wanted is None or wanted <= self.driver_ran:
            return False
        if sum(1 for _, held_key, _ in self._held_back if held_key == key) >= limit:
            raise ProtocolError(f"more than {limit} micro-batches wait for driver requests that never came")
        self._held_back.append((wanted, key, task))
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

    def already_ran(self, req_id: int) -> bool:
        """Whether the driver's request ``req_id`` ran already: it came along the pipeline first, and
        this is the copy the driver sent straight here; or it waited behind a loss gradient whose
        call the driver released, with a later id (`park`)."""
        return req_id <= self.driver_ran

    # --- requests behind a loss's gradient -----------------------------------------------------
    def wait(self, req_id: int, msg: LossGrad) -> None:
        """The driver's request ``req_id``, ``msg``, waits for its call's actions here: it has not
        run yet, and neither may any request the driver sent after it (`park`)."""
        self._waiting = (req_id, msg.key, msg.call)

    def park(self, request: Any) -> bool:
        """Keep the driver's ``request`` (a `lightning_remote_mp.worker.dispatch.Request`) while a
        loss gradient sent before it waits; returns whether it was kept. A release of that call
        goes at once: the driver gave up on it. The requests parked behind the gradient then run in
        their order, but for the quiet ones (the step on it), which the release's later id shows as
        run already: they are skipped (`already_ran`)."""
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
            if self._loss_grad_waits(key, call):
                return []
            self.no_step = None
        except Exception as err:  # its actions failed (the driver hears of it from them) or it was released
            log.warning("the loss's gradient of call %d of %r was not applied: %s", call, key, err)
            self.no_step = f"the loss's gradient of call {call} of {key!r} was not applied here: {err}"
        self._waiting = None
        self.driver_ran = max(self.driver_ran, req_id)
        parked, self._parked = self._parked, []
        return parked
