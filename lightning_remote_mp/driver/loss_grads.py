"""The loss's gradient of a call whose backward the stages ran on their own: one number, the input
of every stage's S action, sent with the driver's next message where it may wait.

Under 1F1B or zero-bubble, when the model returns its own loss, the last stage starts each
micro-batch's backward at that loss with its gradient taken as 1, and every stage keeps the weight
gradients this gives apart from ``.grad`` (`lightning_remote_mp.worker.runtime`). The driver's
``backward()`` then only has one number to tell each stage: the loss's real gradient (Lightning's
``1 / accumulate_grad_batches``, a loss scale; `DeferredLossGrads.value`, which refuses a step that
differentiated more than the loss). `DeferredLossGrads.post` posts it to every stage as a quiet
request (`lightning_remote_mp.wire.requests.LossGrad`) that goes with the next message, in front of
the optimizer's step, so a step costs the driver its forward and its losses, nothing else.

A stage applies it once its part of the call has run, and runs nothing the driver sent after it
before then (`lightning_remote_mp.worker.order.Order`). Each stage passes the later stages' requests on
only once it applied its own, and a stage that could not apply it refuses the step. The next forward's
results prove it applied everywhere (their fences name it); any other message confirms it first
(`confirm`). Two cases do not wait for the next message. Where the step sums gradients over
workers (replicas, a tied weight on several stages), a failure could leave the sum waiting for a
worker that refuses the step (`enabled` is false); and where the driver wants the gradient of the
model's input back. There the driver sends the gradients at once, up the pipeline from the last
stage, and stage 0, the last to apply its own, answers with each micro-batch's input gradients
(DONE), which the driver waits for as for a backward under GPipe
(`lightning_remote_mp.driver.pipeline.RemoteSpec.confirm`).

What deferring buys, measured (`benchmarks/README.md`, section 1h): without it (the gradient going
as a backward through the pipeline), the small model with its loss inside under 1F1B trains 19% slower at m=1 and
12% slower at m=4.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from lightning_remote_mp.errors import LrmpError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.collect import gather
from lightning_remote_mp.wire.requests import LossGrad
from lightning_remote_mp.wire.transport import Connection


def _late_read(key: str, what: str) -> str:
    return (
        f"{key}: the step's loss also depends on {what}, but with a schedule other than 'gpipe' the last stage "
        "runs the backward from the loss alone, as soon as each micro-batch's forward is done: use "
        "schedule='gpipe' for this model, or differentiate only the loss"
    )


class HeldStage(Protocol):
    """A stage of a `Pipeline`, as its loss gradients need it: the connection to its worker."""

    @property
    def conn(self) -> Connection: ...


class Pipeline(Protocol):
    """What deferring its calls' loss gradients needs of a pipeline front end
    (`lightning_remote_mp.driver.pipeline.RemoteSpec`): its stages, which of its outputs is the
    loss, and its own ways to carry requests to the stages, send them, give a call up, and have its
    confirmation run before the driver's next send."""

    key: str
    loss: int | None  # the output that is the model's loss (``None``: it returns none)
    loss_count: int | None  # the output the loss is divided by

    @property
    def replicas(self) -> Sequence[Sequence[HeldStage]]:
        """Each replica's stages, in order."""
        ...

    @property
    def conns(self) -> Sequence[Connection]:
        """Every worker's connection, once."""
        ...

    def grad_chunks(self, grad_y: tuple, flat: list[int]) -> list[tuple]:
        """The outputs' gradients ``grad_y`` split into the call's micro-batches (``flat``: their sizes)."""
        ...

    def carry_toward(self, replica: int, call: int, toward: int) -> list[tuple[str, Any]]:
        """The requests waiting for ``replica``'s later stages, to go with a message to its first."""
        ...

    def flush_linked(self) -> None:
        """Send what waits for a worker that got no message of the call."""
        ...

    def abandon(self, *calls: int) -> None:
        """Let the workers drop what they hold for ``calls``."""
        ...

    def confirm_before_sending(self, wanted: bool) -> None:
        """Have the pipeline's confirmation run before anything is sent to a worker, or no longer."""
        ...


class DeferredLossGrads:
    """The loss gradients posted by one `Pipeline`'s backwards and not yet known applied."""

    def __init__(self, spec: Pipeline) -> None:
        self.spec = spec
        #: call -> each connection with its `RequestOrder.last_id` before the gradient was posted (`drop`),
        #: as the pipeline keeps them for a backward it did not wait for.
        self.calls: dict[int, list[tuple[Connection, int]]] = {}
        #: Whether gradients may be deferred: one replica, no tied weights over stages, and the only
        #: module placed on its workers (the driver session clears it otherwise).
        self.enabled = len(spec.replicas) == 1

    def value(
        self,
        call: int,
        grad_y: Any,
        flat: list[int],
        graph: Sequence[bool],
        loss_grads: Mapping[Any, Sequence[torch.Tensor | None]],
        *,
        guessed: bool = False,
    ) -> torch.Tensor | None:
        """The one number the backward of ``call`` (an early call: the stages ran it from the loss,
        taken as 1) brings its stages: the gradient of the model's loss (``grad_y``: the outputs'
        gradients, ``flat``: the micro-batches' sizes), the same for every micro-batch; ``None``
        where the step did not differentiate the loss. A step that differentiated more (an output
        with a graph on the last stage, ``graph``, or a loss the last stage computed, ``loss_grads``)
        is refused: the backward that ran there did not include it. ``guessed``: every micro-batch
        was recomputed, so ``graph`` is the last stage's guess (any floating output, where it trains)."""
        spec, seed = self.spec, self.spec.loss
        assert seed is not None
        if any(g is not None for grads in loss_grads.values() for g in grads):
            raise LrmpError(_late_read(spec.key, "a loss computed over one of its other outputs"))
        value: torch.Tensor | None = None
        for mb, chunk in enumerate(spec.grad_chunks(grad_y if isinstance(grad_y, tuple) else (grad_y,), flat)):
            # An output without a graph there (a count of tokens) passes no gradient on, as locally.
            others = [i for i, g in enumerate(chunk) if g is not None and i not in (seed, spec.loss_count)]
            others = [i for i in others if i < len(graph) and graph[i]]
            if others:
                what = f"its output {others[0]}" + (
                    " (which has a graph there, or may: with checkpoint='always' the last stage cannot tell before "
                    "its backward, and takes any floating output of a stage that trains to have one)"
                    if guessed
                    else ""
                )
                raise LrmpError(_late_read(spec.key, what))
            g = chunk[seed] if seed < len(chunk) else None
            if g is not None and (g.numel() != 1 or not g.is_floating_point()):
                raise LrmpError(
                    f"{spec.key}: the gradient of the model's loss (output {seed}) of micro-batch {mb} of call {call} "
                    f"is not one floating value (shape {tuple(g.shape)}, {g.dtype}): a schedule other than 'gpipe' "
                    "starts the backward at a loss of one value per micro-batch: use schedule='gpipe'"
                )
            if mb == 0:
                value = g
            elif (g is None) != (value is None) or (g is not None and value is not None and not torch.equal(g, value)):
                raise LrmpError(
                    f"{spec.key}: the loss's micro-batches got different gradients ({value} and {g} for micro-batch "
                    f"{mb} of call {call}); a schedule other than 'gpipe' needs one for all of them (a loss that adds "
                    "its micro-batches' sums): use schedule='gpipe'"
                )
        return value.detach().reshape(()).float().cpu() if value is not None else None

    def post(self, call: int, sizes: list[list[int]], grad: torch.Tensor | None, *, defer: bool) -> bool:
        """Post ``grad``, the loss's gradient of ``call`` (`value`), to every stage that had a share
        of the call. Deferred where it may be (`enabled`) and ``defer`` (no input gradient is
        wanted back): it goes with the next message down the pipeline, and returns true. Else the
        driver sends it now, up the pipeline from the last stage (each stage passes the rest on once
        it applied its own), and stage 0 answers with each micro-batch's input gradients (DONE),
        once all of them applied it: returns false."""
        spec = self.spec
        defer = defer and self.enabled
        if not defer and self.calls:  # their SYNC would take this call's gradients along, and its answers
            self.confirm()
        marks = [(c, c.order.last_id) for c in spec.conns]
        for r, row in enumerate(spec.replicas):
            for rs in (row if defer else row[::-1]) if sizes[r] else ():
                rs.conn.carry(LossGrad(spec.key, call, grad, answer=not defer and rs is row[0]))
        if defer:
            self.calls[call] = marks
            spec.confirm_before_sending(True)
        return defer

    @staticmethod
    def what(call: int) -> str:
        """What a failure of ``call``'s deferred backward is raised as having happened during."""
        return (
            f"backward (of call {call}, which the stages ran from the model's loss on their own; its loss's gradient "
            "went with the driver's next message)"
        )

    def forget(self, calls: Sequence[int]) -> None:
        for call in calls:
            self.calls.pop(call, None)

    def confirm(self) -> None:
        """Before a message other than the next forward: every stage applied the gradients posted,
        and ran the requests before this message. Stage 0 first, bringing the other stages theirs,
        which it passes on once it applied its own; then the others. A failure drops what was
        posted since (`drop`) and is raised."""
        spec, posted = self.spec, self.calls
        self.calls = {}
        calls = list(posted)
        late = {c: self.what(c) for c in calls}
        try:
            first: dict[int, tuple[Connection, int]] = {}
            for r, row in enumerate(spec.replicas):
                carry = spec.carry_toward(r, calls[-1], 1)
                conn = row[0].conn
                first[id(conn)] = (conn, conn.send_all(protocol.SYNC, [None], lead=carry, link=False)[0])
            spec.flush_linked()
            self._synced(first, calls[-1], late)
            self._synced({id(c): (c, c.send(protocol.SYNC)) for c in spec.conns if id(c) not in first}, calls[-1], late)
        except BaseException:
            self.calls = posted
            spec.abandon(*self.drop())
            raise

    def drop(self) -> list[int]:
        """After a failure: the requests posted since the first gradient (it, the step on it) are
        dropped, sent or not, and never sent straight; a stage that could not apply its gradient
        passed none of them on (`lightning_remote_mp.worker.order.Order`). Returns
        the calls, forgotten."""
        posted, self.calls = self.calls, {}
        for conn, mark in next(iter(posted.values()), []):
            conn.order.discard_carried(mark, relayed=True)
        return list(posted)

    def _synced(self, syncs: dict[int, tuple[Connection, int]], call: int, late: dict[int, str]) -> None:
        """Wait for the replies to ``syncs`` (a SYNC request per connection), raising any failure."""
        got = gather(self.spec.conns, len(syncs), replies=dict(syncs.values()), call=call, what=late[call], late=late)
        for c, m in got:
            if m.kind == protocol.ERROR:
                raise c.remote_failure(m.body if isinstance(m.body, dict) else {}, late[call])
