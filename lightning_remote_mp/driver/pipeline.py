"""The driver's pipeline front end: an autograd Function whose forward and backward run a
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
import contextlib
import dataclasses
import itertools
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_remote_mp import schedule
from lightning_remote_mp.driver.loss_grads import DeferredLossGrads
from lightning_remote_mp.driver.losses import Losses
from lightning_remote_mp.driver.outputs import Kept, KeptOutputs
from lightning_remote_mp.errors import ConfigurationError, LrmpError, ProtocolError, RemoteInputError
from lightning_remote_mp.flow import DRIVER, Main, is_floating, is_main
from lightning_remote_mp.model.joins import Join, join_parts
from lightning_remote_mp.model.partition import Stage
from lightning_remote_mp.model.spec import Keep
from lightning_remote_mp.wire import protocol, request_order
from lightning_remote_mp.wire.collect import gather
from lightning_remote_mp.wire.messages import Backward, Forward, Generation
from lightning_remote_mp.wire.requests import Fetch, Release
from lightning_remote_mp.wire.transport import Connection, request_all

log = logging.getLogger(__name__)

#: Activation recomputation choices (torchgpipe's names).
CHECKPOINT_MODES = ("never", "except_last", "always")


def check_checkpoint_mode(checkpoint: str) -> str:
    """``checkpoint`` if it is one of `CHECKPOINT_MODES`, else `ConfigurationError`."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ConfigurationError(
            f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))}, got {checkpoint!r}"
        )
    return checkpoint


def confirm_outstanding(conns: Sequence[Connection]) -> None:
    """Confirm the backwards the session's driver sent without waiting (`RemoteSpec.confirm`), from
    the driver itself: before its next forward, its own layers' step, a clip, a checkpoint or a
    timeline read. If one failed, the requests posted since (the step on its gradients, zero_grad)
    are dropped unsent, and the failure is raised. `RequestOrder.before_send` holds the same
    confirmations for any send that comes first."""
    if conns:
        conns[0].order.confirm_first()


@dataclasses.dataclass
class RemoteStage:
    """One stage of one SpecSequential, held by the worker behind ``conn``."""

    key: str
    stage: Stage
    conn: Connection

    @property
    def address(self) -> str:
        return self.conn.address


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    if isinstance(value, Kept):
        return value  # made on ``device``; moving it would fetch it
    return value.to(device) if isinstance(value, torch.Tensor) else value


@dataclasses.dataclass
class _Call:
    sizes: list[list[int]]  # per replica, the micro-batch sizes along dim 0 (empty: no share)
    x_grad: bool | list[bool]
    early: bool = False  # its backward started at the model's loss on the last stage (a schedule's)
    graph: list[bool] = dataclasses.field(default_factory=list)  # early: which outputs have a graph there
    guessed: bool = False  # ``graph`` is the last stage's guess: every micro-batch was recomputed


def _autocast_state(device_type: str) -> dict[str, Any] | None:
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return {"enabled": True, "dtype": torch.get_autocast_dtype(device_type)}


def _any_of(grads: list[torch.Tensor | None] | None) -> list[torch.Tensor | None] | None:
    """``grads``, unless none of them is a tensor."""
    return grads if grads and any(g is not None for g in grads) else None


def _flags(flag: Any) -> list[bool]:
    """A result's `messages.Forward.requires_grad` of its output: one flag per element."""
    return [bool(f) for f in flag] if isinstance(flag, list) else [bool(flag)]


def _generation_steps(generation: tuple[int, int, torch.Tensor | None] | None, sizes: Sequence[int]) -> list[Any]:
    """Each micro-batch's `messages.Forward.generation`: beam search's reordering of the whole batch's
    rows, as each micro-batch's own rows (a reordering that moves a row to another micro-batch or
    replica would need its cache there: refused, naming what to change)."""
    if generation is None:
        return [None] * len(sizes)
    ident, capacity, rows = generation
    out, start = [], 0
    for size in sizes:
        local = None
        if rows is not None:
            local = (rows[start : start + size] - start).tolist()
            if any(not 0 <= r < size for r in local):
                raise ConfigurationError(
                    f"beam search reorders the rows of the batch across micro-batches or replicas (rows "
                    f"{start}-{start + size - 1} take rows from elsewhere), whose caches are on other stages' "
                    "micro-batches: use a number of micro-batches and replicas that divides the number of prompts"
                )
        out.append(Generation(ident, capacity, local))
        start += size
    return out


def _split(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.tensor_split`` of ``n`` rows into ``parts`` (some may be 0): the first
    ``n % parts`` parts get one row more. Arithmetic, not a tensor: this runs at every forward.

    >>> _split(10, 4), _split(2, 3)
    ([3, 3, 2, 2], [1, 1, 0])
    """
    base, extra = divmod(n, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


class RemoteSpec:
    """Runs a SpecSequential's stages on workers; the module's ``forward`` delegates here.

    Args:
        key: the SpecSequential's name in the LightningModule (how workers tell stages apart).
        replicas: for each replica (data parallel), its stages in order; usually one replica.
        microbatches: how many micro-batches each replica's share of a batch is split into.
        modes: returns the driver-side layers' train/eval flags (`lightning_remote_mp.model.spec.Modes`);
            they travel with every forward, so the workers follow whatever Lightning set.
        checkpoint: activation recomputation, as torchgpipe names it: ``"never"``; ``"always"``
            (every stage keeps only each micro-batch's inputs and recomputes its forward at
            backward); ``"except_last"`` (all micro-batches but the last, whose backward comes first).
        batched: for a pipeline whose input and output are tuples of tensors (a traced model),
            which input elements have the batch along dim 0 (split into micro-batches; the others go
            whole to every micro-batch), and how each output element joins back
            (`lightning_remote_mp.model.joins.Join`: concatenated, or added up).
    """

    def __init__(
        self,
        key: str,
        replicas: Sequence[Sequence[RemoteStage]],
        microbatches: int = 1,
        modes: Callable[[], Any] = lambda: None,
        checkpoint: str = "never",
        batched: tuple[Sequence[bool], Sequence[Join]] | None = None,
        keep: Keep | None = None,
        compression: str | None = None,
        schedule: str = "gpipe",
        loss: tuple[int | None, int | None] = (None, None),
    ) -> None:
        if microbatches < 1:
            raise ConfigurationError(f"microbatches must be at least 1, got {microbatches}")
        self.checkpoint, self.schedule = checkpoint, schedule  # checked by `DriverSession.place`
        #: The output that is the model's loss (`lightning_remote_mp.model.traced.Interface.loss_output`):
        #: under a schedule other than GPipe, each micro-batch's backward starts there on the last
        #: stage as soon as its forward is done. A model without one runs every call as GPipe. And the
        #: output it is divided by (a mean's count: no gradient flows through it).
        self.loss, self.loss_count = loss
        self.key = key
        self.replicas = [list(row) for row in replicas]
        self.stages = self.replicas[0]
        self.microbatches = microbatches
        self.modes = modes
        self.batched_in, self.joins_out = (list(batched[0]), list(batched[1])) if batched else (None, None)
        self.conns = list({id(rs.conn): rs.conn for row in self.replicas for rs in row}.values())
        self.backwards = 0
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        #: Backwards sent and not yet known done (`confirm`; at most one, as every send confirms them):
        #: call -> its micro-batch sizes per replica, each connection's `RequestOrder.last_id` then, and
        #: the fences its messages carried (per replica).
        self._unconfirmed: dict[
            int, tuple[list[list[int]], list[tuple[Connection, int]], dict[int, dict[int, int]]]
        ] = {}
        #: The loss gradients of early calls, posted to go with the driver's next message.
        self.loss_grads = DeferredLossGrads(self)
        self._forwarding = False
        self._to_release: collections.deque[int] = collections.deque()
        #: Which elements of the output the last stage keeps until they are read (`driver.outputs`).
        self.keep = keep
        self.compression = compression  # how floating inputs and output gradients travel to the stages
        self._kept: weakref.WeakSet[KeptOutputs] = weakref.WeakSet()  # to fetch before the session ends
        self._outputs_to_release: collections.deque[int] = collections.deque()
        self.fetched_bytes = 0  # bytes of kept outputs the driver read
        # Losses over kept outputs, computed on the last stages.
        self.losses = Losses(key, [row[-1].conn for row in self.replicas], self.awaits_backward)
        self.result_bytes = 0  # bytes of the outputs the last stages sent with their results
        # A leaf that requires grad, so the Function's output joins the graph even when the input
        # does not require grad: the remote parameters are invisible to the driver's autograd.
        self._anchor = torch.zeros((), requires_grad=True)
        self._planned: set[int] = set()  # micro-batch counts whose plans were checked

    def __repr__(self) -> str:
        return " | ".join(
            "[" + ", ".join(f"stage {rs.stage.index} @ {rs.address}" for rs in row) + "]" for row in self.replicas
        )

    def __call__(self, x: Main) -> Main:
        if isinstance(x, tuple) and is_main(x):
            autocast = _autocast_state(x[0].device.type)
            if torch.is_grad_enabled():
                return _RemoteTupleFunction.apply(self, autocast, self._anchor, *x)
            return self.forward(x, grad=False, x_needs_grad=False, autocast=autocast)[0]
        if not isinstance(x, torch.Tensor):
            raise RemoteInputError(
                f"SpecSequential {self.key!r}: a remote SpecSequential takes one tensor, got {type(x).__name__}"
            )
        if torch.is_grad_enabled():
            return _RemoteSpecFunction.apply(self, _autocast_state(x.device.type), x, self._anchor)
        return self.forward(x, grad=False, x_needs_grad=False, autocast=_autocast_state(x.device.type))[0]

    # --- forward / backward -------------------------------------------------------------
    def _flush_releases(self) -> None:
        calls = []
        while self._to_release:
            call = self._to_release.popleft()
            if self._calls.pop(call, None) is not None:
                calls.append(call)
        self.losses.forget(calls)
        outputs = []
        while self._outputs_to_release:
            outputs.append(self._outputs_to_release.popleft())
        if calls or outputs:  # carried with the forward that follows (`Connection.carry`)
            last = list({id(row[-1].conn): row[-1].conn for row in self.replicas}.values()) if not calls else self.conns
            for conn in last:
                conn.carry(Release({self.key: calls} if calls else {}, {self.key: outputs}))

    def _keeping(self, call: int, sizes: list[list[int]], results: dict[tuple[int, int], Any], device: torch.device):
        """The `Kept` tensors of the outputs the last stages kept of ``call``, by position."""
        order = [(r, mb) for r, row in enumerate(sizes) for mb in range(len(row))]
        first = results[order[0]]
        shapes = {}
        for i in first.shapes or {}:
            rows = sum(results[k].shapes[i][0] for k in order)
            shapes[i] = [rows, *first.shapes[i][1:]]
        # Each kept output's rows per part, as the last stages reported them (dim 0 of a spec's
        # output need not be its input's rows).
        rows = {
            i: [[results[(r, mb)].shapes[i][0] for mb in range(len(row))] for r, row in enumerate(sizes)]
            for i in shapes
        }
        dtypes = {i: (first.x if isinstance(first.x, torch.Tensor) else first.x[i]).dtype for i in shapes}
        source = KeptOutputs(
            lambda: self._fetch(call, sizes, order),
            device,
            lambda: self._outputs_to_release.append(call),
            lambda kept, func, rest, kwargs: self.losses.compute(call, rows[kept.position], kept, func, rest, kwargs),
        )
        self._kept.add(source)
        return source.tensors(shapes, dtypes)

    def _fetch(self, call: int, sizes: list[list[int]], order: list[tuple[int, int]]) -> dict[int, torch.Tensor]:
        """The outputs the last stage of each replica kept of ``call``, joined over the batch."""
        requests = [
            (row[-1].conn, protocol.FETCH, Fetch(self.key, call).body())
            for r, row in enumerate(self.replicas)
            if sizes[r]
        ]
        replies = iter(request_all(requests, what="reading the model's kept outputs", bounded=False))
        parts: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
        for r, row in enumerate(sizes):
            if row:
                for mb, outputs in next(replies)["outputs"].items():
                    parts[(r, mb)] = dict(outputs)
        joined = {i: torch.cat([parts[k][i] for k in order], dim=0) for i in parts[order[0]]}
        self.fetched_bytes += sum(t.nbytes for t in joined.values())
        return joined

    def awaits_backward(self, call: int) -> bool:
        """Whether ``call`` ran under grad and its backward has not run."""
        return call in self._calls

    def materialize(self) -> None:
        """Fetch every kept output still referenced: before the session ends, so none goes missing."""
        for source in list(self._kept):
            if not source.fetched:
                source.fetch_now()

    def abandon(self, *calls: int) -> None:
        """After a failure mid-call, let the workers drop what they hold for ``calls`` (best effort)."""
        for call in calls:
            self._calls.pop(call, None)
        self.losses.forget(list(calls))
        self.loss_grads.forget(calls)
        for conn in self.conns:
            if conn.lost_reason is None and not conn.closed:
                conn.send(protocol.RELEASE, Release({self.key: list(calls)}).body())

    def _collect(
        self,
        kind: str,
        end: int,
        call: int,
        sizes: list[list[int]],
        what: str,
        fences: dict[int, dict[int, int]],
        late: Sequence[int] = (),
    ) -> dict[tuple[int, int], Any]:
        """Gather the messages of ``kind`` (RESULT: `Forward`; DONE: `Backward`) for ``call`` from each
        replica's stage ``end`` (0 or -1), one per micro-batch of ``sizes`` (per replica),
        keyed by (replica, micro-batch). Once all came, every stage of each replica has run the
        driver's requests its ``fences`` (per replica, what the call's messages carried) named. An
        error of one of the ``late`` calls (`DeferredLossGrads`) is raised too."""
        count = sum(map(len, sizes))
        replica_of = {id(row[end].conn): r for r, row in enumerate(self.replicas)}
        got = gather(
            self.conns,
            count,
            call=call,
            what=what,
            kind=kind,
            sources=[row[end].conn for row in self.replicas],
            patience=max(map(len, sizes), default=1),  # a stage answers a call's micro-batches together
            late={c: self.loss_grads.what(c) for c in late},
        )
        parse = Forward.from_body if kind == protocol.RESULT else Backward.from_body
        out: dict[tuple[int, int], Any] = {}
        for c, m in got:
            try:
                msg = parse(m.body)
                r = replica_of[id(c)]
                if (r, msg.mb) in out or not 0 <= msg.mb < len(sizes[r]):
                    raise ProtocolError(f"micro-batch {msg.mb} of call {call} is unexpected or came twice")
                if kind == protocol.RESULT and msg.x is None:
                    raise ProtocolError(f"the result of micro-batch {msg.mb} carries no output")
            except ProtocolError as err:
                raise ProtocolError(f"{c.where()}: {err}") from None
            out[(r, msg.mb)] = msg
            if kind == protocol.RESULT:
                self.result_bytes += sum(t.nbytes for t in pytree.tree_leaves(msg.x) if isinstance(t, torch.Tensor))
        for r, fence in fences.items():
            for rs in self.replicas[r]:
                if rs.stage.index in fence:
                    rs.conn.order.ran_through(fence[rs.stage.index])
        return out

    def _fence(self, replica: int) -> dict[int, int]:
        """What a micro-batch of ``replica`` must not overtake (`request_order.fence`)."""
        return request_order.fence([(rs.stage.index, rs.conn.order) for rs in self.replicas[replica]])

    def carry_toward(self, replica: int, call: int, toward: int) -> list[tuple[str, Any]]:
        """The quiet requests that wait for the stages of ``replica`` beyond its first ``toward``
        (``1``: down the pipeline; ``-1``: up it), as a `Carry` to bundle with the call's
        micro-batches (`request_order.carry`)."""
        row = self.replicas[replica] if toward == 1 else self.replicas[replica][::-1]
        return request_order.carry(self.key, call, toward, [(rs.stage.index, rs.conn.order) for rs in row])

    def flush_linked(self) -> None:
        """After every replica's message of a call went: a step that sums gradients over workers
        some of which got none (a replica with no share of the batch) goes to those straight, or
        the others would wait for them in the sum (`Connection.flush_linked`)."""
        for conn in self.conns:
            conn.flush_linked()

    def _from_driver(self, call: int, mb: int, microbatches: int, fence: dict[int, int]) -> dict[str, Any]:
        """The header fields of micro-batch ``mb`` of ``call`` as the driver sends it (`messages._Pipelined`)."""
        return {"key": self.key, "call": call, "mb": mb, "sender": DRIVER, "microbatches": microbatches, "fence": fence}

    def generation_step(self, x: Main, generation: tuple[int, int, torch.Tensor | None]) -> Main:
        """One step of ``generate()`` (`messages.Forward.generation`): ``x`` through the stages without
        grad, each stage writing its keys and values to its cache of the generation; ``generation``
        is its id, its capacity in tokens, and beam search's reordering of the batch's rows."""
        autocast = _autocast_state((x[0] if isinstance(x, tuple) else x).device.type)
        with torch.no_grad():
            return self.forward(x, grad=False, x_needs_grad=False, autocast=autocast, generation=generation)[0]

    def release_generation(self, generation: int) -> None:
        """Free the caches of ``generation`` on every stage (``generate()`` returned or failed)."""
        for conn in self.conns:
            with contextlib.suppress(LrmpError):  # a lost worker's cache went with it
                conn.send(protocol.RELEASE, Release({}, {}, {self.key: [generation]}).body())

    def forward(
        self,
        x: Main,
        *,
        grad: bool,
        x_needs_grad: bool | list[bool],
        autocast: dict[str, Any] | None,
        generation: tuple[int, int, torch.Tensor | None] | None = None,
    ) -> tuple[Main, int]:
        self._forwarding = True  # the loss gradients posted since the last forward go with this one
        try:
            return self._forward(x, grad=grad, x_needs_grad=x_needs_grad, autocast=autocast, generation=generation)
        finally:
            self._forwarding = False
            if self.loss_grads.calls:  # the forward failed before its results confirmed them
                self.confirm_before_sending(True)

    def _forward(
        self,
        x: Main,
        *,
        grad: bool,
        x_needs_grad: bool | list[bool],
        autocast: dict[str, Any] | None,
        generation: tuple[int, int, torch.Tensor | None] | None = None,
    ) -> tuple[Main, int]:
        confirm_outstanding(self.conns)  # the last backward, before anything is posted for this call
        self._flush_releases()
        call = next(self._ids)
        modes = self.modes()
        n = self._batch_size(x)
        sizes = [
            [m for m in _split(share, min(self.microbatches, share)) if m > 0] if share > 0 else []
            for share in _split(n, len(self.replicas))
        ]
        flat = [m for row in sizes for m in row]
        chunks = iter(self._chunks(x, flat))
        steps = iter(_generation_steps(generation, flat))
        keep = self.keep.at(n) if self.keep is not None else None
        early = grad and self.loss is not None and self.schedule != "gpipe"
        if grad and self.schedule != "gpipe" and self.loss is None:
            raise ConfigurationError(
                f"{self.key}: schedule={self.schedule!r} starts each micro-batch's backward on the last stage as "
                "soon as its forward is done, at the model's loss, so that a stage holds at most (stages - its "
                "index) micro-batches' activations; this model returns no loss (it is computed in training_step "
                "from the model's output), so no backward can start before the whole forward has returned, as "
                "under GPipe. Use schedule='gpipe', or let the model compute its loss (a HuggingFace model called "
                "with labels=, a traced module whose forward returns the loss)"
            )
        if early:
            for row in sizes:
                self._check_plan(len(row))
        fences: dict[int, dict[int, int]] = {}
        sent = False
        try:
            for r, row in enumerate(sizes):
                carry = self.carry_toward(r, call, 1) if row else []
                fence = fences[r] = self._fence(r) if row else {}
                forwards = [
                    Forward(
                        **self._from_driver(call, mb, len(row), fence),
                        x=next(chunks),
                        requires_grad={"x": x_needs_grad},
                        grad=grad,
                        autocast=autocast,
                        modes=modes,
                        checkpoint=grad and self._recomputed(mb, len(row)),
                        keep=keep,
                        schedule=self.schedule if early else None,
                        loss_output=self.loss if early else None,
                        generation=next(steps),
                    ).body()
                    for mb in range(len(row))
                ]
                if forwards:  # one message to stage 0 for the whole call (`Connection.send_all`)
                    self.replicas[r][0].conn.send_all(
                        protocol.FORWARD, forwards, self.compression, lead=carry, link=False
                    )
                    sent = True  # what was held is on its way
            self.flush_linked()
            results = self._collect(protocol.RESULT, -1, call, sizes, "forward", fences, list(self.loss_grads.calls))
        except BaseException:
            # Once sent, the loss gradients and the step on them may have failed on a stage: none goes
            # again. A forward that could not even be encoded sent nothing: they stay held.
            self.abandon(call, *(self.loss_grads.drop() if sent else ()))
            raise
        self.loss_grads.calls = {}  # the fences of this call's micro-batches named their loss gradients: they ran
        outputs = [results[(r, mb)].x for r, row in enumerate(sizes) for mb in range(len(row))]
        device = (x[0] if isinstance(x, tuple) else x).device
        y = join_parts(outputs, self.joins_out, "output", self.key)
        if keep is not None:  # the outputs left on the last stages, until read
            kept = self._keeping(call, sizes, results, device)
            y = tuple(kept.get(i, t) for i, t in enumerate(y)) if isinstance(y, tuple) else kept[0]
        elif self.keep is not None and n > 0:
            self.keep = self.keep.learned(outputs, n)
        if early:
            # A recomputed micro-batch's flags are a guess (`Stage.forward`): the others', where there are any.
            exact = [m for (r, mb), m in results.items() if not self._recomputed(mb, len(sizes[r]))]
            flags = [_flags(m.requires_grad.get("x")) for m in exact or results.values()]
            self._calls[call] = _Call(sizes, x_needs_grad, early, [any(f) for f in zip(*flags)], guessed=not exact)
        elif grad:
            self._calls[call] = _Call(sizes, x_needs_grad)
        return _to(y, device), call

    def _check_plan(self, microbatches: int) -> None:
        """Validate the schedule's lists for this many micro-batches once (the workers build the same
        lists from the schedule's name), and log them as a grid."""
        if microbatches >= 1 and microbatches not in self._planned:
            self._planned.add(microbatches)
            log.info("%s: %s", self.key, schedule.checked(self.schedule, len(self.stages), microbatches))

    def _batch_size(self, x: Main) -> int:
        if not isinstance(x, tuple):
            return x.shape[0] if x.dim() > 0 else 1
        flags = self.batched_in or [True] * len(x)
        first = next((t for t, f in zip(x, flags) if f and t.dim() > 0), None)
        return first.shape[0] if first is not None else 1

    def _chunks(self, x: Main, flat: list[int]) -> list[Main]:
        """``x`` split into micro-batches along dim 0 (for a tuple, its batched elements; the
        others go whole to each)."""
        if not isinstance(x, tuple):
            return list(x.split(flat, dim=0)) if x.dim() > 0 and len(flat) > 1 else [x]
        flags = self.batched_in or [True] * len(x)
        per = [
            t.split(flat, dim=0) if f and t.dim() > 0 and len(flat) > 1 else [t] * len(flat) for t, f in zip(x, flags)
        ]
        return [tuple(parts) for parts in zip(*per)] if flat else [x]

    def _recomputed(self, mb: int, count: int) -> bool:
        return self.checkpoint == "always" or (self.checkpoint == "except_last" and mb < count - 1)

    def backward(self, call: int, grad_y: Main | None) -> Main | None:
        record = self._calls.pop(call)
        self.backwards += 1
        flat = [m for row in record.sizes for m in row]
        loss_grads = self.losses.grads_for(call)
        x_grad = any(record.x_grad) if isinstance(record.x_grad, list) else record.x_grad
        if record.early:
            # The stages ran the backward from the loss: what is left is one number for them all, which
            # goes with the next message (deferred), or now up the pipeline, stage 0 answering the driver.
            try:
                grad = self.loss_grads.value(call, grad_y, flat, record.graph, loss_grads, guessed=record.guessed)
                if self.loss_grads.post(call, record.sizes, grad, defer=not x_grad):
                    return None
            except BaseException:
                self.abandon(call)
                raise
            grads: Iterator[Any] = iter(())  # no backward messages: the loss gradients are the stages' (`post`)
        elif isinstance(grad_y, tuple):
            grads = iter(self.grad_chunks(grad_y, flat))
        else:
            grads = iter(grad_y.split(flat, dim=0) if grad_y is not None else [None] * len(flat))
        fences: dict[int, dict[int, int]] = {}
        try:
            for r, row in enumerate(record.sizes):
                carry = self.carry_toward(r, call, -1) if row else []
                fence = fences[r] = self._fence(r) if row else {}
                backwards = [
                    Backward(
                        **self._from_driver(call, mb, len(row), fence),
                        grad_out=next(grads),
                        loss_grads=_any_of(loss_grads.get((r, mb))),
                    ).body()
                    for mb in range(0 if record.early else len(row))
                ]
                if row:  # an early call's: its loss gradients alone, carried up from the last stage
                    self.replicas[r][-1].conn.send_all(
                        protocol.BACKWARD, backwards, self.compression, lead=carry, link=False
                    )
            self.flush_linked()
            if not x_grad:
                # Nothing to return: the driver goes on (Lightning's step, the next batch) while the
                # workers run the backward, and confirms it before its next message (`confirm`). What
                # is posted later may be dropped.
                marks = [(c, c.order.last_id) for c in self.conns[0].session_conns]
                self._unconfirmed[call] = (record.sizes, marks, fences)
                self.confirm_before_sending(True)
                return None
            done = self._collect(protocol.DONE, 0, call, record.sizes, "backward", fences)
        except BaseException:
            self.abandon(call)
            raise
        parts = [done[(r, mb)].grad_out for r, row in enumerate(record.sizes) for mb in range(len(row))]
        if any(p is None for p in parts):
            return None
        flags = self.batched_in or [True] * len(parts[0])
        return join_parts(parts, ["batch" if b else "sum" for b in flags], "input", self.key)

    def confirm(self) -> None:
        """Wait for stage 0 to report done every micro-batch of the backwards that returned at once
        (no input needed a gradient): before the driver's next message to any worker, which must
        not overtake them (`confirm_before_sending`). A failure
        among them is raised here, once; the requests the driver posted since it sent that backward
        (the optimizer's step on its gradients, zero_grad) are dropped unsent first. What not waiting
        buys (`benchmarks/README.md`, 1k): 30% at m=1 and 9-12% at m=4 on the small model."""
        while self._unconfirmed:
            call = next(iter(self._unconfirmed))
            sizes, marks, fences = self._unconfirmed.pop(call)
            try:
                self._collect(protocol.DONE, 0, call, sizes, f"backward of call {call}", fences)
            except BaseException:
                for conn, mark in marks:
                    conn.order.discard_carried(mark)
                self.abandon(call)
                raise
        if self.loss_grads.calls and not self._forwarding:
            self.loss_grads.confirm()
        if not self.loss_grads.calls or self._forwarding:  # this forward's results confirm those
            self.confirm_before_sending(False)

    def confirm_before_sending(self, wanted: bool) -> None:
        """Have `confirm` run before anything is sent to a worker of the session, or no longer
        (`request_order.confirm_before_sending`)."""
        request_order.confirm_before_sending([c.order for c in self.conns[0].session_conns], self.confirm, wanted)

    def grad_chunks(self, grad_y: tuple, flat: list[int]) -> list[tuple]:
        joins = self.joins_out or ["batch"] * len(grad_y)
        per = [
            [None] * len(flat)
            if g is None
            else (g.split(flat, dim=0) if join == "batch" and len(flat) > 1 else [g] * len(flat))
            for g, join in zip(grad_y, joins)
        ]
        return [tuple(parts) for parts in zip(*per)]


class _CallGuard:
    """Queues a release of the workers' saved state if the graph dies without a backward."""

    def __init__(self, spec: RemoteSpec, call: int) -> None:
        self._finalizer = weakref.finalize(self, spec._to_release.append, call)

    def done(self) -> None:
        self._finalizer.detach()


class _RemoteSpecFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, spec: RemoteSpec, autocast: dict[str, Any] | None, x: torch.Tensor, anchor: torch.Tensor):
        ctx.set_materialize_grads(False)  # an output the loss did not use has no gradient to send
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


class _RemoteTupleFunction(torch.autograd.Function):
    """`_RemoteSpecFunction` for a tuple of inputs and outputs (a traced model's values)."""

    @staticmethod
    def forward(ctx: Any, spec: RemoteSpec, autocast: dict[str, Any] | None, anchor: torch.Tensor, *xs: torch.Tensor):
        ctx.set_materialize_grads(False)
        needs = [bool(ctx.needs_input_grad[3 + i]) and is_floating(t) for i, t in enumerate(xs)]
        y, call = spec.forward(tuple(xs), grad=True, x_needs_grad=needs, autocast=autocast)
        ctx.spec, ctx.call = spec, call
        ctx.guard = _CallGuard(spec, call)
        ctx.inputs = [(t.dtype, t.device) for t in xs]
        ctx.mark_non_differentiable(*[t for t in y if not is_floating(t)])
        return tuple(y)

    @staticmethod
    def backward(ctx: Any, *grad_ys: torch.Tensor):
        ctx.guard.done()
        grads = ctx.spec.backward(ctx.call, tuple(grad_ys))
        out: list[Any] = [None] * len(ctx.inputs)
        if isinstance(grads, tuple):
            for i, (g, (dtype, device)) in enumerate(zip(grads, ctx.inputs)):
                if g is not None and ctx.needs_input_grad[3 + i]:
                    out[i] = g.to(device=device, dtype=dtype)
        return (None, None, None, *out)
