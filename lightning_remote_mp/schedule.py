"""Pipeline schedules as data: the actions a stage runs, each stage's list of them for a call, checked and printable.

Every kind of action a stage runs is a letter defined here (`Kind`), and printed as
torch.distributed.pipelining prints its actions: ``2F0`` is stage 2's forward of micro-batch 0,
``2S`` stage 2's loss scale of the call (a kind that runs once a call, or once a step, has no
micro-batch):

====  ==============================================================  ==========================================
kind  what the stage does                                             its input
====  ==============================================================  ==========================================
F     forward of a micro-batch                                        the previous stage's output (`Forward`)
B     backward of the input: the gradient the previous stage waits    the next stages' gradients (`Backward`),
      for (an early call's last stage starts it at the loss, as 1)    or the driver's
W     backward of the weights: a micro-batch's deferred linear-layer  none: the stage's own B
      weight gradients (`lightning_remote_mp.worker.deferred_grads`)
S     the loss's scale: an early call's weight gradients times the    the driver's gradient of the loss
      driver's gradient of the loss, added to ``.grad``               (`LossGrad`)
D     one decoding step of a generation: a micro-batch's new tokens   the previous stage's output
      through the stage's layers, with the stage's own key/value
      cache (generation runs a call of D's, as a forward runs F's)
====  ==============================================================  ==========================================

(`Forward`, `Backward`: `lightning_remote_mp.wire.messages`; `LossGrad`:
`lightning_remote_mp.wire.requests`.) A call under grad whose backward starts at the driver ("late",
GPipe) runs F, B and W of each micro-batch, its last stage's B once the driver's gradient came,
after every forward had returned; one whose backward the last stage starts at the model's loss
("early", `Forward.loss_output`) ends with S, whose input is the driver's gradient of the loss. A call
without grad runs F's alone. A list is one call's: ``zero_grad`` and the optimizer's step are no
actions of it (a step may follow several calls, as Lightning's loop decides) but the driver's
requests, run in the order the driver sent them (`lightning_remote_mp.worker.order.Order`).

The driver names a schedule; each worker builds its own stage's list from the name and the counts
(`actions`), and runs it in order, each action once what it waits for has arrived
(`lightning_remote_mp.worker.runtime`). The lists are data: `validate` checks them,
`simulate` plays them with costs, and `format_grid` draws them as a time x stage grid.

- ``"gpipe"``: fill and drain. Every forward, then every backward, then the weight gradients of the
  whole batch in one product. Every micro-batch's activations stay alive until its backward.
- ``"1f1b"``: after a warm-up of ``stages - 1 - index`` forwards, a stage alternates one forward
  and one backward (with its weight gradients). A stage holds at most ``stages - index``
  micro-batches' activations, however many micro-batches there are.
- ``"zero_bubble"``: 1F1B's order with stage ``index``'s weight gradients held back by ``index``
  backwards (after ZB-H1, Qi et al. 2023). A later stage sends each input gradient on without
  first computing its weight gradients, so the backward reaches stage 0 sooner, and it computes
  the held-back ones in the drain, where it would otherwise wait. The bubble shrinks where W is a
  real share of the backward: 4 stages, 8 micro-batches, unit costs: 11% against 1F1B's 20%
  (`simulate`). Memory as 1F1B, plus the inputs the held-back W's read.

>>> lists = build("1f1b", stages=2, microbatches=3)
>>> [" ".join(map(str, row)) for row in lists]
['0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2 0S', '1F0 1B0 1W0 1F1 1B1 1W1 1F2 1B2 1W2 1S']
>>> validate(lists)
>>> print(format_grid(lists))
step  stage 0  stage 1
   0      0F0
   1      0F1      1F0
   2               1B0
   3      0B0      1W0
   4      0W0      1F1
   5      0F2      1B1
   6      0B1      1W1
   7      0W1      1F2
   8               1B2
   9      0B2      1W2
  10      0W2       1S
  11       0S
>>> [peak_in_flight(row) for row in lists], round(simulate(lists).bubble, 3)
([2, 1], 0.182)

The lists are an early call's (`actions`' ``scale``): the last stage starts each backward at the
loss, and S comes last. A late call cannot run 1F1B: its last stage's first B waits for the
driver's gradient, which comes once every forward has returned:

>>> try:
...     validate(build("1f1b", stages=2, microbatches=2, scale=False))
... except ScheduleError as err:
...     print(str(err).splitlines()[0])
the schedule waits forever: 0B0 waits for 0F0 and 1B0, 1B0 waits for 1F0 and 1F1
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Literal

from lightning_remote_mp.errors import ConfigurationError
from lightning_remote_mp.flow import Word

Schedule = Literal["gpipe", "1f1b", "zero_bubble"]
#: The schedules `actions` builds.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "zero_bubble")


class Kind(Word):
    """Every kind of action a stage runs, by its letter (the module docstring's table says each one's
    input). A kind is a ``str``: it compares, hashes and prints as its letter."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHTS = "W"
    SCALE = "S"
    DECODE = "D"


# The short names the package uses.
FORWARD, BACKWARD, WEIGHTS, DECODE = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHTS, Kind.DECODE
SCALE = Kind.SCALE
#: What each kind of action does, by kind.
KINDS: dict[Kind, str] = {
    FORWARD: "forward",
    BACKWARD: "backward of the input",
    WEIGHTS: "backward of the weights",
    SCALE: "the loss's scale",
    DECODE: "decoding step",
}
#: The kinds that run once per micro-batch (``2F0``); the other runs once per call (``2S``).
PER_MICROBATCH: tuple[Kind, ...] = (FORWARD, BACKWARD, WEIGHTS, DECODE)


class ScheduleError(ConfigurationError):
    """A schedule that cannot run: an action twice or missing, out of order, or waiting forever."""


@dataclasses.dataclass(frozen=True)
class Action:
    """Stage ``stage`` does ``kind`` (one of `KINDS`) to micro-batch ``mb``; ``mb`` is ``None`` for
    a kind that runs once per call (`PER_MICROBATCH` says which)."""

    stage: int
    kind: Kind
    mb: int | None = None

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{'' if self.mb is None else self.mb}"


def check_schedule(schedule: str) -> str:
    """``schedule`` if it is one of `SCHEDULES`, else a `ConfigurationError` naming the choices."""
    if schedule not in SCHEDULES:
        raise ConfigurationError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    return schedule


def _check_counts(stages: int, stage: int, microbatches: int) -> None:
    if stages < 1 or not 0 <= stage < stages or microbatches < 1:
        raise ConfigurationError(
            f"a schedule needs stages >= 1, 0 <= stage < stages and microbatches >= 1; "
            f"got stages={stages}, stage={stage}, microbatches={microbatches}"
        )


def actions(
    schedule: str, stages: int, stage: int, microbatches: int, grad: bool = True, scale: bool = False
) -> list[Action]:
    """Stage ``stage``'s list of actions for one call of ``microbatches`` under ``schedule``;
    without ``grad`` (validation, prediction), its forwards alone, in order. ``scale``: an early
    call (its backward starts at the loss on the last stage), whose last action is the loss's
    scale (`SCALE`)."""
    check_schedule(schedule)
    _check_counts(stages, stage, microbatches)
    m = microbatches
    act = functools.partial(Action, stage)
    if not grad:
        return [act(FORWARD, mb) for mb in range(m)]
    if schedule == "gpipe":
        out = [act(kind, mb) for kind in (FORWARD, BACKWARD, WEIGHTS) for mb in range(m)]
    else:
        warmup = min(m, stages - 1 - stage)
        held = stage if schedule == "zero_bubble" else 0  # W's each stage holds back
        out = [act(FORWARD, mb) for mb in range(warmup)]
        forwards, backwards, weights = warmup, 0, 0
        while backwards < m:
            if forwards < m:
                out.append(act(FORWARD, forwards))
                forwards += 1
            out.append(act(BACKWARD, backwards))
            backwards += 1
            if backwards - weights > held:
                out.append(act(WEIGHTS, weights))
                weights += 1
        out += [act(WEIGHTS, mb) for mb in range(weights, m)]
    return [*out, act(SCALE)] if scale else out


def decoding(stages: int, stage: int, microbatches: int) -> list[Action]:
    """Stage ``stage``'s list for one decoding step of a generation: each micro-batch's `DECODE`, in order."""
    _check_counts(stages, stage, microbatches)
    return [Action(stage, DECODE, mb) for mb in range(microbatches)]


def build(schedule: str, stages: int, microbatches: int, *, scale: bool = True) -> list[list[Action]]:
    """Every stage's list of a call under grad (`actions`), stage 0 first: an early call's, but
    under GPipe, whose backward starts at the driver; ``scale`` says which where given."""
    early = scale and schedule != "gpipe"
    return [actions(schedule, stages, s, microbatches, scale=early) for s in range(stages)]


_PRINTED = re.compile(rf"(\d+)([{''.join(KINDS)}])(\d*)")


def parse(text: str) -> Action:
    """An action from its printed form (``"2F0"``, ``"2S"``)."""
    match = _PRINTED.fullmatch(text)
    if match is not None and (match[3] != "") == (match[2] in PER_MICROBATCH):
        return Action(int(match[1]), Kind(match[2]), int(match[3]) if match[3] else None)
    raise ScheduleError(
        f"{text!r} is no action (stage, kind, and for {'/'.join(PER_MICROBATCH)} the micro-batch: "
        f"'2F0', '2S'; kinds: {', '.join(KINDS)})"
    )


def _depends(action: Action, stages: int, microbatches: int, early: bool) -> list[Action]:
    """What ``action`` waits for on any stage (its own stage's order aside); ``early``: the call's
    backward starts at the loss on the last stage."""
    s, mb, kind = action.stage, action.mb, action.kind
    if kind in (FORWARD, DECODE):
        return [Action(s - 1, kind, mb)] if s > 0 else []
    if kind == WEIGHTS:
        return [Action(s, BACKWARD, mb)]
    if kind == BACKWARD and s < stages - 1:
        return [Action(s, FORWARD, mb), Action(s + 1, BACKWARD, mb)]
    if kind == BACKWARD and early:
        return [Action(s, FORWARD, mb)]
    # S, and a late call's last B: the driver's gradient comes once the call's forward has returned.
    return [Action(stages - 1, FORWARD, i) for i in range(microbatches)]


@dataclasses.dataclass
class Simulation:
    """A schedule played with costs: when each action starts and ends, and how idle the stages are."""

    spans: dict[Action, tuple[float, float]]
    makespan: float
    busy: list[float]  # per stage

    @property
    def bubble(self) -> float:
        """The share of the stages' time spent idle between the call's first action and its last."""
        total = self.makespan * len(self.busy)
        return 1.0 - sum(self.busy) / total if total else 0.0


def _microbatches(lists: Sequence[Sequence[Action]]) -> int:
    return max((a.mb + 1 for row in lists for a in row if a.mb is not None), default=0)


def simulate(lists: Sequence[Sequence[Action]], costs: Mapping[str, float] | None = None) -> Simulation:
    """Play each stage's list in order, each action starting once its stage is free and what it waits
    for (`_depends`) has ended. ``costs``: seconds per kind (default 1 each, but 0 for S, a
    multiply-add of the gradients that F, B and W dwarf). Raises `ScheduleError`
    if the lists wait on each other forever."""
    cost: dict[str, float] = {**dict.fromkeys(KINDS, 1.0), SCALE: 0.0, **(costs or {})}
    stages, m = len(lists), _microbatches(lists)
    early = any(a.kind == SCALE for row in lists for a in row)
    spans: dict[Action, tuple[float, float]] = {}
    cursor = [0] * stages
    free = [0.0] * stages
    busy = [0.0] * stages
    remaining = sum(map(len, lists))
    while remaining:
        progressed = False
        for s, row in enumerate(lists):
            while cursor[s] < len(row):
                action = row[cursor[s]]
                deps = _depends(action, stages, m, early)
                if any(d not in spans for d in deps):
                    break
                start = max([free[s], *(spans[d][1] for d in deps)])
                end = start + cost[action.kind]
                spans[action] = (start, end)
                free[s] = end
                busy[s] += cost[action.kind]
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waiting = ", ".join(
                f"{row[cursor[s]]} waits for {' and '.join(str(d) for d in _depends(row[cursor[s]], stages, m, early))}"
                for s, row in enumerate(lists)
                if cursor[s] < len(row)
            )
            raise ScheduleError(f"the schedule waits forever: {waiting}\n{format_grid(lists, spans)}")
    return Simulation(spans, max((end for _, end in spans.values()), default=0.0), busy)


def validate(lists: Sequence[Sequence[Action]]) -> None:
    """Check the lists, and raise `ScheduleError` quoting the grid where they cannot run:

    - each action is one of `KINDS`, on its own stage's list, once;
    - every stage runs each micro-batch's actions, in order: a call under grad F, B and W; a call
      without grad F; a decoding step D, alone;
    - the loss's scale (S), once a call, after every B and W;
    - the lists run to the end together (no action waits for one that never comes, `simulate`)."""
    m = _microbatches(lists)
    for s, row in enumerate(lists):
        problem = _row_problem(s, row, m)
        if problem is not None:
            raise ScheduleError(f"{problem}\n{format_grid(lists)}")
    simulate(lists)


def _row_problem(s: int, row: Sequence[Action], m: int) -> str | None:
    """What is wrong with stage ``s``'s list (`validate`), or ``None``."""
    seen: dict[tuple[str, int | None], int] = {}
    for i, a in enumerate(row):
        if a.kind not in KINDS or (a.mb is None) == (a.kind in PER_MICROBATCH):
            return f"{a!r} is no action (kinds: {', '.join(KINDS)}; a micro-batch for {'/'.join(PER_MICROBATCH)})"
        if a.stage != s:
            return f"{a} is on stage {s}'s list"
        if (a.kind, a.mb) in seen:
            return f"{a} comes twice on stage {s}'s list"
        seen[(a.kind, a.mb)] = i
    kinds = {a.kind for a in row}
    each = (
        (DECODE,)
        if DECODE in kinds
        else (FORWARD, BACKWARD, WEIGHTS)
        if kinds & {BACKWARD, WEIGHTS, SCALE}
        else (FORWARD,)
    )
    stray = next((a for a in row if a.kind not in each and (a.kind in PER_MICROBATCH or DECODE in kinds)), None)
    if stray is not None:
        return f"stage {s} runs {stray} in a decoding step's list, which runs D's alone"
    for mb in range(m):
        missing = next((kind for kind in each if (kind, mb) not in seen), None)
        if missing is not None:
            return f"stage {s} never runs {Action(s, missing, mb)}"
        if len(each) > 1 and not seen[(FORWARD, mb)] < seen[(BACKWARD, mb)] < seen[(WEIGHTS, mb)]:
            return f"stage {s} runs micro-batch {mb} out of F, B, W order"
    gradients = [i for i, a in enumerate(row) if a.kind in (BACKWARD, WEIGHTS)]
    if (SCALE, None) in seen and gradients and gradients[-1] > seen[(SCALE, None)]:
        return f"stage {s} runs {s}S before {row[gradients[-1]]}: the loss's scale multiplies every weight gradient"
    return None


def peak_in_flight(row: Sequence[Action]) -> int:
    """The most micro-batches whose activations one stage holds at once (forward run, backward not yet)."""
    held = peak = 0
    for a in row:
        held += {FORWARD: 1, BACKWARD: -1}.get(a.kind, 0)
        peak = max(peak, held)
    return peak


def format_row(row: Sequence[Action], marked: Action, around: int = 8) -> str:
    """One stage's list with ``marked`` in brackets (an error names the action that failed), cut
    to ``around`` actions either side of it.

    >>> format_row(actions("gpipe", 2, 1, 2), Action(1, BACKWARD, 0))
    '1F0 1F1 [1B0] 1B1 1W0 1W1'
    >>> format_row(actions("1f1b", 2, 0, 2, scale=True), Action(0, SCALE), around=2)
    '... 0B1 0W1 [0S]'
    """
    at = list(row).index(marked) if marked in row else 0
    start, end = max(0, at - around), min(len(row), at + around + 1)
    cells = [f"[{a}]" if a == marked else str(a) for a in row[start:end]]
    return " ".join(["...", *cells][start == 0 :] + (["..."] if end < len(row) else []))


def format_grid(lists: Sequence[Sequence[Action]], spans: Mapping[Action, tuple[float, float]] | None = None) -> str:
    """The lists as a time-step x stage grid, each action in the step it starts in when every action
    costs one step (as torch's ``_format_pipeline_order`` draws them). ``spans``: the starts to use
    (a simulation stopped part-way draws what ran)."""
    if spans is None:
        try:
            spans = simulate(lists).spans
        except ScheduleError:
            spans = {a: (float(i), float(i + 1)) for row in lists for i, a in enumerate(row)}  # list order
    cells = {(int(start), a.stage): str(a) for a, (start, _) in spans.items()}
    steps = max((t for t, _ in cells), default=-1) + 1
    width = max([7, *(len(c) for c in cells.values())])
    head = "step  " + "  ".join(f"stage {s}".rjust(width) for s in range(len(lists)))
    rows = [
        f"{t:>4}  " + "  ".join(cells.get((t, s), "").rjust(width) for s in range(len(lists))).rstrip()
        for t in range(steps)
    ]
    return "\n".join([head, *rows])


def checked(schedule: str, stages: int, microbatches: int) -> str:
    """Build and `validate` ``schedule``'s lists of a call under grad, and describe them: what each
    stage holds at most, the bubble at equal costs, and the grid. Under GPipe the backward starts at
    the driver; under the others at the model's loss on the last stage, and the call ends with the
    loss's scale.

    >>> print(checked("1f1b", 2, 2).splitlines()[0])
    schedule '1f1b' over 2 stages, 2 micro-batches (a stage holds at most 2, 1 of them; bubble 25% at equal costs):
    """
    lists = build(schedule, stages, microbatches)
    validate(lists)
    peaks = ", ".join(str(peak_in_flight(row)) for row in lists)
    return (
        f"schedule {schedule!r} over {stages} stages, {microbatches} micro-batches (a stage holds at most {peaks} "
        f"of them; bubble {100 * simulate(lists).bubble:.0f}% at equal costs):\n{format_grid(lists)}"
    )
