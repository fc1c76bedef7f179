"""The driver's requests to one worker, in their order: the driver's twin of the worker's `Order`.

A worker runs the driver's requests by rising id, whichever way each came
(`lightning_remote_mp.worker.order.Order`). This module is the driver's side of that order, one
`RequestOrder` per connection (`lightning_remote_mp.wire.transport.Connection.order`); the
connection itself only sends and receives. It keeps:

- **the ids**: `RequestOrder.last_id`, the last one given out; an id is used up only by a request
  that encoded, so the worker never sees a gap;
- **what is held**: quiet requests (`protocol.CARRIED_KINDS`: the optimizer's step, zero_grad,
  a release, a loss's gradient) posted to travel along the pipeline with the next call's
  micro-batches (`RequestOrder.hold`, `carry`), and those sent that way and not known to have run,
  which whatever goes straight to the worker sends again first (`RequestOrder.take_ahead`);
- **what is not known to have run**: posted requests whose reply was not read, and the quiet ones,
  which no reply names: a micro-batch's ``fence`` names the last of them (`fence`), and a worker
  holds the micro-batch back until it has run it;
- **what must be confirmed first**: the driver's backward it did not wait for, or a loss's
  gradient it posted, must be known done before anything else is sent (`RequestOrder.before_send`,
  `confirm_before_sending`).

>>> order = RequestOrder("tcp://127.0.0.1:5555")
>>> order.last_id = 1  # a zero_grad went without waiting for its reply
>>> order.awaits(1, "zero_grad"); order.unanswered_up_to
1
>>> order.ran_through(1); order.unanswered_up_to
0
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_remote_mp.flow import DRIVER
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.carry import Carried, Carry
from lightning_remote_mp.wire.requests import SEAL_KEY_BYTES


class RequestOrder:
    """The order of the driver's requests to one worker, as far as the driver knows it (see the module).

    Args:
        address: the worker's address, by which its heartbeat's answers say how far it ran (`heard`).
    """

    def __init__(self, address: str) -> None:
        self._address = address
        #: What the heartbeat heard (`lightning_remote_mp.wire.heartbeat.Heartbeat.ran`): by address,
        #: the id up to which each worker ran the driver's requests.
        self.heard: Mapping[str, int] = {}
        #: The id of the last request this side has given out (sent, or held by `hold`).
        self.last_id = 0
        #: Posted requests whose reply has not been read: id -> kind (in the order of their ids).
        self.unanswered: dict[int, str] = {}
        self._quiet_up_to = 0  # the id of the last request posted of `protocol.QUIET_KINDS`
        # Quiet requests that travel along the pipeline (`hold`): not sent yet; and sent that way,
        # not known to have run. Whatever is sent straight to the worker goes after both.
        self._carried: list[Carried] = []
        self._relayed: list[Carried] = []
        #: The connections whose held requests go when these go (`hold`): see `take_linked`.
        self.linked: list[Any] = []
        #: This worker's key for the session (HELLO brings it there): seals the requests `hold` keeps.
        self.seal_key = secrets.token_bytes(SEAL_KEY_BYTES)
        self._replied_up_to = 0  # the highest id an OK came for: everything before it has run
        self._answered_through = 0  # the highest id a pipelined answer proved run (`ran_through`)
        self._taken: tuple[list[Carried], list[Carried]] = ([], [])  # what `take_ahead` took, for `put_back`
        #: What runs before anything is sent to the worker or its replies are awaited: the driver
        #: registers a confirmation here only while a backward it sent without waiting is not known
        #: done (`confirm_before_sending`), so that nothing overtakes it; it removes it once done.
        #: Kept in order, as a dict's keys.
        self.before_send: dict[Callable[[], None], None] = {}

    def confirm_first(self) -> None:
        """Confirm now what the driver sent without waiting and must know done (`before_send`):
        before the driver acts on the assumption that it succeeded (steps its own layers, say)."""
        for confirm in list(self.before_send):
            confirm()

    def awaits(self, req_id: int, kind: str) -> None:
        """Request ``req_id`` (of ``kind``) went without waiting: its reply is read later, and a
        quiet one is answered only if it fails (`needs_sync`)."""
        self.unanswered[req_id] = kind
        if kind in protocol.QUIET_KINDS:
            self._quiet_up_to = req_id

    # --- what is held to travel along the pipeline ------------------------------------------------
    def hold(self, sealed: Carried, linked: Sequence[Any] = ()) -> None:
        """Keep ``sealed`` (encoded with the next id) to travel along the pipeline; ``linked``: the
        connections to the workers that run it together with this one (a step that sums gradients
        over them), whose held requests must leave when it does (`take_linked`)."""
        self.last_id = sealed.id
        self._carried.append(sealed)
        self.awaits(sealed.id, sealed.request.KIND)
        self.linked.extend(c for c in linked if c.order is not self and c not in self.linked)

    def take_ahead(self) -> tuple[list[Carried], list[Carried]]:
        """Before the next message sent straight to the worker: confirm what must be known done
        first (`confirm_first`), and take what goes before it (`put_back` returns it if the message
        is not sent), split where a lead (a `Carry` for the stages beyond) goes: after this worker's
        loss gradients (`LossGrad`), as it passes the lead on only once it applied them, so that the
        stages beyond never step on gradients this one could not add. Held requests, and those sent
        along the pipeline and not known to have run (the worker runs a request once, whichever way
        it came first)."""
        self.confirm_first()
        ran = self.known_ran()
        held = [*(c for c in self._relayed if c.id > ran), *self._carried]
        self._taken, self._carried, self._relayed = (self._carried, self._relayed), [], []
        cut = next((i + 1 for i in range(len(held) - 1, -1, -1) if held[i].request.KIND == protocol.LOSS_GRAD), 0)
        return held[:cut], held[cut:]

    def put_back(self, last_id: int) -> None:
        """The message `take_ahead` was for was not sent: what it took is held again, and the ids
        given out since ``last_id`` are not used up."""
        self._carried, self._relayed = self._taken
        self.last_id = last_id

    def take_carried(self) -> list[Carried]:
        """The held requests, for a `Carry`: from now on they travel along the pipeline (until
        known to have run, `take_ahead` sends them again)."""
        self.confirm_first()
        taken, self._carried = self._carried, []
        self._relayed.extend(taken)
        return taken

    @property
    def holds(self) -> bool:
        return bool(self._carried)

    def take_linked(self) -> list[Any]:
        """The connections linked to the requests that just left, which must send theirs now."""
        linked, self.linked = self.linked, []
        return linked

    def discard_carried(self, after: int, relayed: bool = False) -> None:
        """Forget the held requests, unsent, whose ids come after ``after`` (a `last_id`): those
        posted after a failure the driver learned of late (a backward it did not wait for), which
        must not run. They are the last ids given out, so the next request takes the first of
        them and the worker sees no gap. With ``relayed``, those sent along the pipeline after it
        are not sent straight either: the worker skips their ids (it runs requests by rising id)."""
        if relayed:
            self._relayed = [c for c in self._relayed if c.id <= after]
        dropped = [c for c in self._carried if c.id > after]
        if dropped:
            for c in dropped:
                self.unanswered.pop(c.id, None)
            self._carried = [c for c in self._carried if c.id <= after]
            self.last_id = dropped[0].id - 1
            self._quiet_up_to = min(self._quiet_up_to, self.last_id)

    # --- what the worker is known to have run -----------------------------------------------------
    def known_ran(self) -> int:
        """The id up to which the worker has run the driver's requests, as far as this side knows."""
        return max(self._replied_up_to, self._answered_through, self.heard.get(self._address, 0))

    def ran_through(self, req_id: int) -> None:
        """The worker has run the driver's requests up to ``req_id``: a call's answer came through
        the pipeline, and a micro-batch reaches a stage only once the requests its ``fence`` names
        have run there (`fence`). So the requests sent along the pipeline up to there are not sent
        again (`take_ahead`), and the quiet ones are no longer waited for."""
        if req_id > self._answered_through:
            self._answered_through = req_id
            self._ran_up_to(req_id + 1)

    def answered(self, msg: protocol.Message) -> str | None:
        """A message from the worker was read: the kind of the posted request it answers, if any
        (its reply is consumed, or raised if it failed), else ``None``."""
        posted = self.unanswered.pop(msg.id, None) if msg.id else None
        if msg.id and msg.kind == protocol.OK:  # an ERROR may be a refusal, answered before the queue ran
            self._replied_up_to = max(self._replied_up_to, msg.id)
            self._ran_up_to(msg.id)
        if msg.kind == protocol.ERROR and isinstance(msg.body, dict) and msg.body.get("posted") in protocol.QUIET_KINDS:
            posted = msg.body["posted"]  # a quiet request failed (maybe counted as run already, by the heartbeat)
        return posted

    @property
    def unanswered_up_to(self) -> int:
        """The id of the last posted request not known to have run, or 0: what a pipelined
        message's ``fence`` names for this worker (`lightning_remote_mp.wire.messages`)."""
        self._heartbeat_ran()
        return next(reversed(self.unanswered), 0)  # ids only grow, and dicts keep their order

    @property
    def needs_sync(self) -> bool:
        """Whether a quiet request was posted after the last reply: only a SYNC after it says it ran."""
        return self._quiet_up_to > self._replied_up_to

    def note(self) -> str:
        """`` (optim_step still unanswered)``: what this worker was asked and has not answered, or ``""``."""
        self._heartbeat_ran()
        if not self.unanswered:
            return ""
        return f" ({', '.join(dict.fromkeys(self.unanswered.values()))} still unanswered)"

    def _heartbeat_ran(self) -> None:
        if self.unanswered:
            self._ran_up_to(self.heard.get(self._address, 0) + 1)

    def _ran_up_to(self, req_id: int) -> None:
        """The worker has run every request before ``req_id`` (it runs them in order): forget the
        quiet ones among them, which no reply will name. A failure of one may still wait to be read
        (the heartbeat answers on another socket): it is raised whenever it comes, and a SYNC
        (`needs_sync`) comes after it."""
        while self.unanswered:
            first = next(iter(self.unanswered))
            if first >= req_id or self.unanswered[first] not in protocol.QUIET_KINDS:
                return
            del self.unanswered[first]


# --- a pipeline's stages, together ------------------------------------------------------------------


def fence(stages: Sequence[tuple[int, RequestOrder]]) -> dict[int, int]:
    """What a micro-batch sent to these ``(stage index, order)`` must not overtake: for each stage,
    the last request posted to it without waiting for the reply (the optimizer's step,
    zero_grad). Each worker runs the driver's requests in order, but a micro-batch reaches a later
    stage from another worker, and could arrive before a step the driver posted to that stage
    earlier; the stage holds it back until it has run the step (`Order.hold_back`)."""
    return {index: posted for index, order in stages if (posted := order.unanswered_up_to)}


def carry(key: str, call: int, toward: int, row: Sequence[tuple[int, RequestOrder]]) -> list[tuple[str, Any]]:
    """The held requests of the stages of ``row`` beyond its first (in the order ``toward`` goes:
    ``1`` down the pipeline, from stage 0; ``-1`` up it, from the last stage), as a `Carry` to
    bundle with the call's micro-batches to the first: each stage passes the rest on to the next,
    so a step costs the driver no message of its own. The first stage's own go in the same bundle
    (`lightning_remote_mp.wire.transport.Connection.send_all`)."""
    requests = {}
    for index, order in row[1:]:
        if order is not row[0][1] and (taken := order.take_carried()):
            requests[index] = taken
    if not requests:
        return []
    return [(protocol.CARRY, Carry(key, call, DRIVER, toward, requests).body())]


def confirm_before_sending(orders: Sequence[RequestOrder], confirm: Callable[[], None], wanted: bool) -> None:
    """Have ``confirm`` run before anything is sent to these workers (`RequestOrder.before_send`), or
    no longer: only while a backward or a loss gradient the driver sent is not known done."""
    for order in orders:
        if wanted:
            order.before_send[confirm] = None
        else:
            order.before_send.pop(confirm, None)
