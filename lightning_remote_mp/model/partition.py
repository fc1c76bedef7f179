"""Splitting a spec into stages: explicit balance, or automatic by estimated memory.

A stage is a contiguous run of layers held by one worker. Residual variables that cross a stage
boundary become the stage's ``imports`` (consumed here, produced earlier) and ``exports``
(produced here, consumed later).

>>> costs = [10, 0, 10, 0, 10, 0, 10, 0]
>>> split_contiguous(costs, [1.0, 1.0])
[4, 4]
>>> split_contiguous([10] * 8, [3.0, 1.0])  # the first worker has three times the memory
[6, 2]
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from torch import nn

from lightning_remote_mp.errors import SpecError
from lightning_remote_mp.flow import DRIVER
from lightning_remote_mp.model.entries import LayerEntry
from lightning_remote_mp.model.wiring import Wiring

#: Bytes kept per float32 parameter while training: the weight, its gradient and two optimizer moments.
TRAINING_BYTES_PER_PARAM_ELEMENT = 4 * 4


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of one SpecSequential: layers ``start:stop`` and the variables crossing its edges.

    ``sources`` and ``targets`` are the routes of a forward pass: ``(stage, variables)`` pairs, one
    message from each source (the previous stage, or `DRIVER` for stage 0, also brings the
    main input) and one to each target (the next stage, or the driver after the last stage, also
    gets the main output). Backward runs the same routes in reverse.
    """

    index: int
    start: int
    stop: int
    imports: tuple[str, ...]
    exports: tuple[str, ...]
    sources: tuple[tuple[int, tuple[str, ...]], ...] = ()
    targets: tuple[tuple[int, tuple[str, ...]], ...] = ()

    @property
    def layer_indices(self) -> range:
        return range(self.start, self.stop)


def plan_stages(balance: Sequence[int], wiring: Wiring) -> list[Stage]:
    """Turn layer counts per stage into `Stage` objects with their imports and exports."""
    bounds = [0, *itertools.accumulate(balance)]
    stage_of = {i: s for s in range(len(balance)) for i in range(bounds[s], bounds[s + 1])}
    stages = []
    for s in range(len(balance)):
        imports = sorted(
            name
            for name, users in wiring.consumed_at.items()
            if stage_of[wiring.produced_at[name]] < s and any(stage_of[u] == s for u in users)
        )
        exports = sorted(
            name
            for name, at in wiring.produced_at.items()
            if stage_of[at] == s and any(stage_of[u] > s for u in wiring.consumed_at.get(name, ()))
        )
        stages.append(Stage(s, bounds[s], bounds[s + 1], tuple(imports), tuple(exports)))
    return [_with_routes(stage, stages, wiring, stage_of) for stage in stages]


def _with_routes(stage: Stage, stages: Sequence[Stage], wiring: Wiring, stage_of: dict[int, int]) -> Stage:
    last = len(stages) - 1
    sources: dict[int, list[str]] = {stage.index - 1 if stage.index > 0 else DRIVER: []}
    for name in stage.imports:
        sources.setdefault(stage_of[wiring.produced_at[name]], []).append(name)
    targets: dict[int, list[str]] = {stage.index + 1 if stage.index < last else DRIVER: []}
    for other in stages[stage.index + 1 :]:
        shared = [n for n in other.imports if n in stage.exports]
        if shared:
            targets.setdefault(other.index, []).extend(shared)
    return dataclasses.replace(
        stage,
        sources=tuple((k, tuple(v)) for k, v in sources.items()),
        targets=tuple((k, tuple(v)) for k, v in targets.items()),
    )


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int, what: str) -> list[int]:
    balance = list(balance)
    if len(balance) != num_stages:
        raise SpecError(f"{what}: balance {balance} has {len(balance)} entries but there are {num_stages} workers")
    if any(type(n) is not int or n < 1 for n in balance):
        raise SpecError(f"{what}: every stage needs at least one layer; balance {balance} is invalid")
    if sum(balance) != num_layers:
        raise SpecError(f"{what}: balance {balance} covers {sum(balance)} layers but the spec has {num_layers}")
    return balance


def estimate_layer_bytes(entry: LayerEntry, layer: nn.Module, training: bool = True) -> int:
    """Memory a layer needs: its weights and buffers at their own dtypes and, when ``training``, a
    gradient and two optimizer moments (Adam's) per trainable parameter, plus the float32 activations
    it keeps for backward at its example input shape(s)."""
    weights = sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))
    trainable = sum(p.numel() * p.element_size() for p in layer.parameters() if p.requires_grad)
    activations = sum(math.prod(shape) for shape in entry.input_shapes if shape) * 4 if training else 0
    return weights + (3 * trainable if training else 0) + activations


def split_contiguous(costs: Sequence[float], capacities: Sequence[float]) -> list[int]:
    """Cut ``costs`` into ``len(capacities)`` non-empty contiguous runs minimising the largest
    ``run_cost / capacity``; ties prefer the most even layer counts."""
    if any(c <= 0 for c in capacities):
        raise SpecError(f"worker capacities must be positive, got {list(capacities)}")
    return split_min_max([costs] * len(capacities), capacities)


def split_min_max(
    stage_costs: Sequence[Sequence[float]],
    capacities: Sequence[float] | None = None,
    memory: tuple[Sequence[float], Sequence[float]] | None = None,
) -> list[int]:
    """Cut layers into one non-empty contiguous run per stage, minimising the slowest stage.

    ``stage_costs[s][i]`` is what layer ``i`` costs on stage ``s``'s worker (time measured there,
    or memory); a stage's load is its layers' total cost divided by its worker's capacity (default 1).
    With ``memory = (layer_bytes, stage_budgets)`` only splits whose stages fit their budget count
    (`SpecError` if none does). Ties prefer the most even layer counts.

    >>> split_min_max([[1, 1, 1, 1], [2, 2, 2, 2]])  # the second worker is twice as slow
    [3, 1]
    >>> split_min_max([[1, 1, 1, 1]] * 2, memory=([1, 1, 1, 1], [1, 3]))  # only one layer fits on stage 0
    [1, 3]
    """
    k = len(stage_costs)
    n = len(stage_costs[0]) if k else 0
    if n < k:
        raise SpecError(f"cannot split {n} layers into {k} stages: every stage needs at least one layer")
    prefix = [[0.0, *itertools.accumulate(map(float, costs))] for costs in stage_costs]
    caps = [float(c) for c in capacities] if capacities is not None else [1.0] * k
    mem_prefix = [0.0, *itertools.accumulate(map(float, memory[0] if memory is not None else []))]

    def load(s: int, j: int, i: int) -> float:  # layers j:i on stage s (1-based)
        if memory is not None and mem_prefix[i] - mem_prefix[j] > memory[1][s - 1]:
            return math.inf
        return (prefix[s - 1][i] - prefix[s - 1][j]) / caps[s - 1]

    # Two exact min-max passes: a single pass on (load, spread) pairs can keep, for a prefix, a
    # split whose spread is worse than an equally loaded alternative, missing the most even one.
    # worst[s][i]: the smallest worst load placing the first i layers on the first s stages.
    worst = [[math.inf] * (n + 1) for _ in range(k + 1)]
    worst[0][0] = 0.0
    for s in range(1, k + 1):
        for i in range(s, n - (k - s) + 1):
            for j in range(s - 1, i):
                worst[s][i] = min(worst[s][i], max(worst[s - 1][j], load(s, j, i)))
    limit = worst[k][n]
    if limit == math.inf:
        raise SpecError(f"no split of {n} layers into {k} stages fits every stage into its worker's memory")
    # spread[s][i]: the smallest layer-count spread among such placements within ``limit``.
    spread = [[math.inf] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    spread[0][0] = 0.0
    ideal = n / k
    for s in range(1, k + 1):
        for i in range(s, n - (k - s) + 1):
            for j in range(s - 1, i):
                if spread[s - 1][j] == math.inf or load(s, j, i) > limit:
                    continue
                cand = max(spread[s - 1][j], abs((i - j) - ideal))
                if cand < spread[s][i]:
                    spread[s][i] = cand
                    cut[s][i] = j
    counts = []
    i = n
    for s in range(k, 0, -1):
        j = cut[s][i]
        counts.append(i - j)
        i = j
    return counts[::-1]


def stage_loads(counts: Sequence[int], stage_costs: Sequence[Sequence[float]]) -> list[float]:
    """Each stage's total cost for a split: the predicted stage times when costs are times."""
    bounds = [0, *itertools.accumulate(counts)]
    return [float(sum(stage_costs[s][bounds[s] : bounds[s + 1]])) for s in range(len(counts))]


def describe(
    stages: Sequence[Stage], entries: Sequence[LayerEntry], layers: Sequence[nn.Module], hosts: Sequence[str]
) -> str:
    """A human-readable table of which layers went where, for the log."""
    lines = []
    for stage, host in zip(stages, hosts):
        idx = stage.layer_indices
        params = sum(p.numel() for i in idx for p in layers[i].parameters())
        names = ", ".join(entries[i].name for i in idx)
        io = ""
        if stage.imports:
            io += f" imports {list(stage.imports)}"
        if stage.exports:
            io += f" exports {list(stage.exports)}"
        lines.append(
            f"stage {stage.index} @ {host}: layers {stage.start}-{stage.stop - 1} ({names}), {params:,} parameters{io}"
        )
    return "\n".join(lines)
