"""Pipeline schedules as data: for one call, each stage's list of actions, checked and printable.

An action is a stage doing one thing to one micro-batch: ``F`` (forward), ``B`` (backward of the
input: the gradient the previous stage waits for) or ``W`` (backward of the weights: deferred
linear-layer weight gradients, `lightning_remote_mp.worker.deferred_grads`). It prints as
torch.distributed.pipelining prints its actions: ``2F0`` is stage 2's forward of micro-batch 0.
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
['0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2', '1F0 1B0 1W0 1F1 1B1 1W1 1F2 1B2 1W2']
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
  10      0W2
>>> [peak_in_flight(row) for row in lists], round(simulate(lists).bubble, 3)
([2, 1], 0.182)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Literal

from lightning_remote_mp.errors import ConfigurationError

Schedule = Literal["gpipe", "1f1b", "zero_bubble"]
#: The schedules `actions` builds.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "zero_bubble")

FORWARD, BACKWARD, WEIGHTS = "F", "B", "W"


class ScheduleError(ConfigurationError):
    """A schedule that cannot run: an action twice or missing, out of order, or waiting forever."""


@dataclasses.dataclass(frozen=True)
class Action:
    """Stage ``stage`` does ``kind`` (`FORWARD`, `BACKWARD`, `WEIGHTS`) to micro-batch ``mb``."""

    stage: int
    kind: str
    mb: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def check_schedule(schedule: str) -> str:
    """``schedule`` if it is one of `SCHEDULES`, else a `ConfigurationError` naming the choices."""
    if schedule not in SCHEDULES:
        raise ConfigurationError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    return schedule


def actions(schedule: str, stages: int, stage: int, microbatches: int, grad: bool = True) -> list[Action]:
    """Stage ``stage``'s list of actions for one call of ``microbatches`` under ``schedule``;
    without ``grad`` (validation, prediction), its forwards alone, in order."""
    check_schedule(schedule)
    if stages < 1 or not 0 <= stage < stages or microbatches < 1:
        raise ConfigurationError(
            f"a schedule needs stages >= 1, 0 <= stage < stages and microbatches >= 1; "
            f"got stages={stages}, stage={stage}, microbatches={microbatches}"
        )
    m = microbatches
    act = functools.partial(Action, stage)
    if not grad:
        return [act(FORWARD, mb) for mb in range(m)]
    if schedule == "gpipe":
        return [act(kind, mb) for kind in (FORWARD, BACKWARD, WEIGHTS) for mb in range(m)]
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
    return out


def build(schedule: str, stages: int, microbatches: int) -> list[list[Action]]:
    """Every stage's list (`actions`), stage 0 first."""
    return [actions(schedule, stages, s, microbatches) for s in range(stages)]


def parse(text: str) -> Action:
    """An action from its printed form (``"2F0"``)."""
    for kind in (FORWARD, BACKWARD, WEIGHTS):
        stage, sep, mb = text.partition(kind)
        if sep and stage.isdigit() and mb.isdigit():
            return Action(int(stage), kind, int(mb))
    raise ScheduleError(f"{text!r} is no action (stage, F/B/W, micro-batch: '2F0')")


def _depends(action: Action, stages: int) -> list[Action]:
    """What ``action`` waits for on any stage (its own stage's order aside)."""
    s, mb = action.stage, action.mb
    if action.kind == FORWARD:
        return [Action(s - 1, FORWARD, mb)] if s > 0 else []
    if action.kind == BACKWARD:
        later = [Action(s + 1, BACKWARD, mb)] if s < stages - 1 else []
        return [Action(s, FORWARD, mb), *later]
    return [Action(s, BACKWARD, mb)]


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


def simulate(lists: Sequence[Sequence[Action]], costs: Mapping[str, float] | None = None) -> Simulation:
    """Play each stage's list in order, each action starting once its stage is free and what it waits
    for (`_depends`) has ended. ``costs``: seconds per kind (default 1 each). Raises `ScheduleError`
    if the lists wait on each other forever."""
    cost = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHTS: 1.0, **(costs or {})}
    stages = len(lists)
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
                deps = _depends(action, stages)
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
                f"{row[cursor[s]]} waits for {' and '.join(str(d) for d in _depends(row[cursor[s]], stages))}"
                for s, row in enumerate(lists)
                if cursor[s] < len(row)
            )
            raise ScheduleError(f"the schedule waits forever: {waiting}\n{format_grid(lists, spans)}")
    return Simulation(spans, max((end for _, end in spans.values()), default=0.0), busy)


def validate(lists: Sequence[Sequence[Action]]) -> None:
    """Check that every stage does F, B and W of every micro-batch exactly once, in that order, that
    each action is on its own stage's list, and that the lists run to the end together (no action
    waits for one that never comes). Raises `ScheduleError` quoting the grid."""
    mbs = {a.mb for row in lists for a in row}
    m = max(mbs) + 1 if mbs else 0
    for s, row in enumerate(lists):
        seen: dict[tuple[str, int], int] = {}
        for i, a in enumerate(row):
            if a.stage != s:
                raise ScheduleError(f"{a} is on stage {s}'s list\n{format_grid(lists)}")
            if (a.kind, a.mb) in seen:
                raise ScheduleError(f"{a} comes twice on stage {s}'s list\n{format_grid(lists)}")
            seen[(a.kind, a.mb)] = i
        for mb in range(m):
            for kind in (FORWARD, BACKWARD, WEIGHTS):
                if (kind, mb) not in seen:
                    raise ScheduleError(f"stage {s} never runs {Action(s, kind, mb)}\n{format_grid(lists)}")
            if not seen[(FORWARD, mb)] < seen[(BACKWARD, mb)] < seen[(WEIGHTS, mb)]:
                raise ScheduleError(f"stage {s} runs micro-batch {mb} out of F, B, W order\n{format_grid(lists)}")
    simulate(lists)


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
    """Build and `validate` ``schedule``'s lists, and describe them: what each stage holds at most,
    the bubble at equal costs, and the grid.

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
