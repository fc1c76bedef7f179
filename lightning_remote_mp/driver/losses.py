"""Losses on the last stage: a loss over an output the last stage kept is computed there, so that
the output never travels. The targets go there, and the loss comes back.

A language model's logits are batch x sequence x vocabulary: 262 MB a step for a 32k vocabulary
at batch 8 x 256, of which ``F.cross_entropy(logits.view(-1, V), targets.view(-1))`` needs one
number. When the logits are a `Kept` output (`lightning_remote_mp.driver.outputs`), that call, or
``nn.CrossEntropyLoss`` making it, lands here. What happens, in order:

1. The loss function and the steps recorded on the output (reshapes, slices, casts) are traced
   with ``torch.export`` into a loss program, like a traced model's pieces
   (`lightning_remote_mp.model.trace`), on the operator allowlist. A mean-reduced loss becomes its
   sum and its count (`lightning_remote_mp.model.joins`).
2. The program goes once to each replica's last stage (`lightning_remote_mp.wire.requests.Loss`),
   and after that only its number.
3. Each call sends the targets, split like the batch. The last stages answer with each
   micro-batch's loss. The driver adds up the sums and counts and divides: the whole batch's
   mean, exactly, however padding falls over the micro-batches.
4. Under grad, each last stage keeps the loss's graph. Backward sends each micro-batch's loss
   gradient with the pipeline's backward (`lightning_remote_mp.wire.messages.Backward.loss_grads`),
   and the output's gradient is made where the output is.

Where this cannot be done exactly, it is not done. The output is fetched and the loss computed
on the driver, as for any other read: the same answer, more bytes. `Losses.declined` says why,
and the reason is logged once. The cases:

- the target's dim 0 is not the batch's rows, or a whole multiple of them in batch order;
- a recorded step leaves dim 0 counting something else;
- the trace fixed a size a micro-batch does not have;
- a tensor argument needs a gradient (the target, say);
- the target of an element-wise loss broadcasts against the output;
- another tensor argument has the batch's rows (a per-sample weight);
- the loss would run in float16 or bfloat16 outside autocast (a sum over parts rounds otherwise);
- the output was fetched already (computing on the driver then costs nothing more).

>>> _target_rows(12, 4, [2, 2]), _target_rows(4, 4, [3, 1]), _target_rows(6, 4, [2, 2])
([6, 6], [3, 1], None)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remote_mp.driver.outputs import ELEMENTWISE, Kept, Step, replay
from lightning_remote_mp.errors import LrmpError
from lightning_remote_mp.model.joins import join_parts
from lightning_remote_mp.model.trace import trace_module
from lightning_remote_mp.model.traced import Interface
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.requests import Loss
from lightning_remote_mp.wire.transport import Connection, request_all

log = logging.getLogger(__name__)

#: Loss programs one model keeps (a new one for each function, each recorded steps and sizes).
MAX_PROGRAMS = 64


def _target_rows(rows: int, batch: int, parts: Sequence[int]) -> list[int] | None:
    """How a target of ``rows`` rows splits like a batch of ``batch`` rows cut into ``parts``: the
    same multiple of each part's rows (``None`` if ``rows`` is no whole multiple of ``batch``)."""
    if batch < 1 or rows % batch:
        return None
    k = rows // batch
    return [k * m for m in parts]


class _LossOf(nn.Module):
    """``func(output taken through steps, *arguments)``, the module that is traced into a loss program."""

    def __init__(
        self,
        func: Any,
        steps: Sequence[Step],
        leaves: list[Any],
        spec: Any,
        target: int,
        whole: list[int],
        upcast: bool = False,
    ) -> None:
        super().__init__()
        self.func, self.steps, self.leaves, self.spec = func, tuple(steps), leaves, spec
        self.target_at, self.whole_at, self.upcast = target, whole, upcast

    def forward(self, output: torch.Tensor, target: torch.Tensor, *whole: torch.Tensor) -> Any:
        flat = list(self.leaves)
        flat[self.target_at] = target
        for i, t in zip(self.whole_at, whole):
            flat[i] = t
        value = replay(output, self.steps)
        if self.upcast:  # what autocast does to a loss's arguments: float16 and bfloat16 become float32
            flat = [_float32(t) for t in flat]
            value = _float32(value)
        rest, kwargs = pytree.tree_unflatten(flat, self.spec)
        return self.func(value, *rest, **kwargs)


def _float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float16, torch.bfloat16):
        return value.float()
    return value


@dataclasses.dataclass
class _Program:
    """A loss program: its number, its entries and tensors as they travel, and how it is called."""

    number: int
    entries: list[Any]
    state: list[dict[str, torch.Tensor]]
    interface: Interface
    differentiate: int  # the output the loss's gradient is for (the sum, or the loss itself)


@dataclasses.dataclass
class LossRecord:
    """One loss computed under grad over a call's kept output: the gradient backward brought for
    each (replica, micro-batch) part of it (``None`` until backward)."""

    order: list[tuple[int, int]]
    grads: dict[tuple[int, int], torch.Tensor | None] | None = None


class _OnLastStage(torch.autograd.Function):
    """The parts of a loss the last stages computed, in the driver's graph after the model's output:
    backward files each part's gradient for the pipeline's backward to carry, and gives the output
    none here (its gradient is made on the last stage)."""

    @staticmethod
    def forward(ctx: Any, record: LossRecord, output: torch.Tensor, parts: list[torch.Tensor]) -> Any:
        ctx.record = record
        ctx.set_materialize_grads(False)
        return tuple(p.clone() for p in parts)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None, None]:
        ctx.record.grads = dict(zip(ctx.record.order, grads))
        return None, None, None


class Losses:
    """The losses one model's last stages compute over its kept outputs (see the module docstring).

    Args:
        key: the placed model's key (`lightning_remote_mp.driver.pipeline.RemoteSpec.key`).
        last_stages: the connection to each replica's last stage, in replica order.
        awaits_backward: whether a call ran under grad and its backward is still to come.
    """

    def __init__(self, key: str, last_stages: Sequence[Connection], awaits_backward: Callable[[int], bool]) -> None:
        self.key = key
        self.last_stages = list(last_stages)
        self.awaits_backward = awaits_backward
        self._programs: dict[Any, _Program | str] = {}  # by what they compute; a str: why none can
        self._numbers = itertools.count(1)
        self._sent: set[tuple[int, int]] = set()  # (id of a connection, program number)
        self._records: dict[int, list[LossRecord]] = {}  # by call, in the order they were computed
        self.computed = 0  # losses computed on the last stage
        self.reply_bytes = 0  # bytes of the values they sent back
        self.declined: list[str] = []  # why a loss was computed on the driver instead

    # --- forward ---------------------------------------------------------------------------
    def compute(
        self, call: int, sizes: list[list[int]], kept: Kept, func: Any, rest: tuple, kwargs: dict
    ) -> torch.Tensor | None:
        """``func(kept, *rest, **kwargs)``, computed on the last stages; ``None`` where it cannot be
        exactly (the caller then fetches the output and computes it here)."""
        plan = self._plan(sizes, kept, func, rest, kwargs)
        if isinstance(plan, str):
            self._decline(func, plan)
            return None
        program, target_parts, whole = plan
        order = [(r, mb) for r, row in enumerate(sizes) for mb in range(len(row))]
        parts = dict(zip(order, target_parts))
        # A gradient only while the call's backward is to come (not for a loss computed after it).
        grad = torch.is_grad_enabled() and kept.root.requires_grad and self.awaits_backward(call)
        requests, conns = [], []
        for r, conn in enumerate(self.last_stages):
            if not sizes[r]:
                continue
            first = (id(conn), program.number) not in self._sent
            body = Loss(
                key=self.key,
                call=call,
                position=kept.position,
                program=program.number,
                inputs=program.interface.input_leaves,
                targets={mb: parts[(r, mb)] for mb in range(len(sizes[r]))},
                whole=whole,
                entries=program.entries if first else None,
                state=program.state if first else None,
                grad=grad,
                differentiate=program.differentiate,
            ).body()
            requests.append((conn, protocol.LOSS, body))
            conns.append(conn)
        replies = request_all(requests, what="computing the loss on the last stage", bounded=False)
        self._sent.update((id(c), program.number) for c in conns)
        raw: dict[tuple[int, int], list[torch.Tensor]] = {}
        for r, reply in zip([r for r, row in enumerate(sizes) if row], replies):
            for mb, values in reply["values"].items():
                raw[(r, mb)] = [v.to(kept.device) for v in values]
                self.reply_bytes += sum(v.nbytes for v in values)
        d = program.differentiate
        diff = [raw[k][d] for k in order]
        if grad:
            record = LossRecord(order)
            self._records.setdefault(call, []).append(record)
            diff = list(_OnLastStage.apply(record, kept.root, diff))
        per_part = [tuple(diff[i] if j == d else raw[k][j] for j in range(len(raw[k]))) for i, k in enumerate(order)]
        joined = join_parts(per_part, program.interface.joins_out, "loss output", self.key)
        self.computed += 1
        return program.interface.outputs(joined if isinstance(joined, tuple) else (joined,))

    def _plan(
        self, sizes: list[list[int]], kept: Kept, func: Any, rest: tuple, kwargs: dict
    ) -> tuple[_Program, list[torch.Tensor], list[torch.Tensor]] | str:
        """The program and the target's parts, or why the loss cannot be computed on the last stage."""
        leaves, spec = pytree.tree_flatten((rest, kwargs))
        tensors = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        if any(isinstance(leaves[i], Kept) for i in tensors):
            return "another of its arguments is a model output as well"
        if any(leaves[i].requires_grad for i in tensors):
            return "an argument other than the model's output needs a gradient"
        target_at = 0 if rest else next((i for i, v in enumerate(leaves) if v is kwargs.get("target")), -1)
        if target_at not in tensors or leaves[target_at].dim() == 0:
            return "it has no target tensor with rows"
        target = leaves[target_at]
        whole_at = [i for i in tensors if i != target_at]
        whole = [leaves[i] for i in whole_at]
        root = kept.root
        flat = [m for row in sizes for m in row]
        rows = _target_rows(target.shape[0], root.shape[0], flat)
        if rows is None:
            return f"its target has {target.shape[0]} rows, no whole multiple of the output's {root.shape[0]}"
        for m, n in set(zip(flat, rows)):
            try:
                shape = replay(torch.empty((m, *root.shape[1:]), dtype=root.dtype, device="meta"), kept.steps).shape
            except Exception:
                return "a step on the output fixes a size a micro-batch does not have (write -1 for the batch's)"
            if shape[0] != n:
                return "a step on the output leaves dim 0 counting something other than the batch's rows"
        value = replay(torch.empty(root.shape, dtype=root.dtype, device="meta"), kept.steps)
        upcast = torch.is_autocast_enabled(kept.device.type)  # torch.nn.functional's losses run in float32 there
        if value.dtype in (torch.float16, torch.bfloat16) and not upcast and len(flat) > 1:
            return f"in {value.dtype} a sum over micro-batches rounds otherwise than one mean does"
        if func in ELEMENTWISE and tuple(target.shape) != tuple(value.shape):
            return f"its target's shape {tuple(target.shape)} is not the output's {tuple(value.shape)} (a broadcast)"
        batchlike = {root.shape[0], target.shape[0]}
        if len(flat) > 1 and any(w.dim() > 0 and w.shape[0] in batchlike for w in whole):
            return "another tensor argument has as many rows as the batch: it is split with it, or not at all"
        constants = [None if i in tensors else v for i, v in enumerate(leaves)]
        key = (
            upcast,
            func,
            tuple((f, repr(r), repr(k)) for f, r, k in kept.steps),
            repr(spec),
            repr(constants),
            target_at,
            (root.dim(), root.dtype),
            (target.dim(), target.dtype),
            tuple((tuple(t.shape), t.dtype) for t in whole),
        )
        module = _LossOf(func, kept.steps, constants, spec, target_at, whole_at, upcast)
        k = rows[0] // flat[0]
        why = ""
        # One program for every size the trace left dynamic; one for these sizes where it fixed some.
        for name in (key, (*key, tuple(root.shape[1:]), tuple(target.shape[1:]))):
            program = self._programs.get(name)
            if program is None:
                if len(self._programs) >= MAX_PROGRAMS:
                    return f"{MAX_PROGRAMS} loss programs are made already (one per function, steps and fixed sizes)"
                program = self._programs[name] = self._trace(module, kept, target, whole, k)
            if isinstance(program, str):
                return program
            why = self._misfit(program, root, target, whole, flat, rows)
            if not why:
                break
        if why:
            return why
        if any(j == "whole" for j in program.interface.joins_out) and len(flat) > 1:
            return "its value cannot be joined exactly over micro-batches or replicas"
        return program, list(target.split(rows, dim=0)), whole

    @staticmethod
    def _misfit(
        program: _Program,
        root: torch.Tensor,
        target: torch.Tensor,
        whole: list[torch.Tensor],
        flat: list[int],
        rows: list[int],
    ) -> str:
        """Why a micro-batch does not fit the program's trace ("" when every one does)."""
        for m, n in set(zip(flat, rows)):
            output = torch.empty((m, *root.shape[1:]), dtype=root.dtype, device="meta")
            part = torch.empty((n, *target.shape[1:]), dtype=target.dtype, device="meta")
            try:
                program.interface.inputs((output, part, *whole), {})
            except LrmpError as err:
                return f"a micro-batch of {m} rows does not fit its trace: {err}"
        return ""

    def _trace(
        self, module: _LossOf, kept: Kept, target: torch.Tensor, whole: list[torch.Tensor], k: int
    ) -> _Program | str:
        """Trace the loss into a program (or say why it cannot be)."""
        root = kept.root
        # Two rows, so that the trace sees the batch's dimension as one (1 would be fixed). On the
        # meta device: a long context's logits would be gigabytes, and the trace needs only shapes.
        rows = 2
        output = torch.empty((rows, *root.shape[1:]), dtype=root.dtype, device="meta")
        example = torch.empty((k * rows, *target.shape[1:]), dtype=target.dtype, device="meta")
        arguments = (output, example, *[w.to("meta") for w in whole])
        name = f"loss {getattr(module.func, '__name__', module.func)!s}"
        try:
            with torch.autocast(kept.device.type, enabled=False):  # the program casts as autocast would
                traced = trace_module(module, arguments, {}, name)
        except LrmpError as err:
            return f"it cannot be traced: {err}"
        interface: Interface = traced.interface  # type: ignore[attr-defined]
        if len(interface.out_leaves) != 1 or interface.out_leaves[0][0] not in ("value", "ratio"):
            return "it does not return one tensor"
        return _Program(
            number=next(self._numbers),
            entries=[e.to_wire() for e in traced.entries],
            state=[{n: t.detach() for n, t in layer.state_dict().items()} for layer in traced.layers],
            interface=interface,
            differentiate=interface.out_leaves[0][1],
        )

    def _decline(self, func: Any, why: str) -> None:
        if why not in self.declined:
            log.info(
                "%s: %s over the model's output is computed on the driver, which fetches the output: %s",
                self.key,
                getattr(func, "__name__", func),
                why,
            )
        self.declined.append(why)

    # --- backward --------------------------------------------------------------------------
    def grads_for(self, call: int) -> dict[tuple[int, int], list[torch.Tensor | None]]:
        """For each (replica, micro-batch) of ``call``, the gradient of each loss computed under grad
        over it, in order (what `messages.Backward.loss_grads` carries); forgets them."""
        records = self._records.pop(call, [])
        out: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        for record in records:
            for k in record.order:
                g = record.grads.get(k) if record.grads is not None else None
                out.setdefault(k, []).append(g)
        return out

    def forget(self, calls: Sequence[int]) -> None:
        for call in calls:
            self._records.pop(call, None)
