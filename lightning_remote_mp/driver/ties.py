"""Tied weights across stages: a tensor that several layers use (a language model's input and output
embeddings, T5's shared embedding) lives on every stage that uses it.

A stage that uses it in several layers holds one tensor (`lightning_remote_mp.wire.requests.Setup.shared`);
stages that each use it hold a copy each. The copies start equal, and stay equal the way DeepSpeed's
``TiedLayerSpec`` keeps them (``ReduceTiedGrads``): before every optimizer step (and before clipping)
the stages holding copies sum their gradients through a torch.distributed group, so each copy
takes the identical step. The optimizer mirror reports a tied weight's gradient norm and state
once, from its first copy. On the driver the module keeps its tie (``lm_head.weight is
transformer.wte.weight``), and its state dict holds it as the module's own does.

>>> from lightning_remote_mp.model.partition import Stage
>>> stages = [Stage(0, 0, 2, (), ()), Stage(1, 2, 4, (), ())]
>>> shared, ties = plan([["0.weight", "3.weight"], ["2.bias", "3.bias"]], stages, trains=lambda names: True)
>>> shared
{0: [], 1: [['2.bias', '3.bias']]}
>>> ties
[Tie(names={0: '0.weight', 1: '3.weight'})]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from lightning_remote_mp.model.partition import Stage
from lightning_remote_mp.model.spec import SpecSequential


@dataclasses.dataclass(frozen=True)
class Tie:
    """One tensor held by several stages: its name on each (``"<layer index>.<name>"``, the first of
    its names there), by stage number in order."""

    names: dict[int, str]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(self.names)


def plan(
    shared: Sequence[Sequence[str]], stages: Sequence[Stage], trains: Callable[[Sequence[str]], bool]
) -> tuple[dict[int, list[list[str]]], list[Tie]]:
    """For the tensors several layers hold (``shared``: `lightning_remote_mp.model.spec.SpecSequential.shared`)
    cut into ``stages``: per stage, the groups of its names that are one tensor there; and the
    tensors that several stages hold copies of and train (``trains(names)``), whose gradients those
    stages must sum. A tensor that takes no gradient (a frozen or constant one) needs no sum: its
    copies start equal and stay so."""
    stage_of = {i: s.index for s in stages for i in s.layer_indices}
    per_stage: dict[int, list[list[str]]] = {s.index: [] for s in stages}
    ties = []
    for names in shared:
        by_stage: dict[int, list[str]] = {}
        for name in names:
            by_stage.setdefault(stage_of[int(name.partition(".")[0])], []).append(name)
        for stage, here in by_stage.items():
            if len(here) > 1:
                per_stage[stage].append(here)
        if len(by_stage) > 1 and trains(names):
            ties.append(Tie({s: by_stage[s][0] for s in sorted(by_stage)}))
    return per_stage, ties


def groups(ties: Sequence[Tie]) -> list[tuple[tuple[int, ...], list[Tie]]]:
    """The ties, grouped by the stages that hold them: one gradient group each, in the order every
    member joins and runs them (sorted by stages, so that no two members wait on each other)."""
    by_stages: dict[tuple[int, ...], list[Tie]] = {}
    for tie in ties:
        by_stages.setdefault(tie.stages, []).append(tie)
    return sorted(by_stages.items())


def trainable(module: SpecSequential) -> Callable[[Sequence[str]], bool]:
    """`plan`'s ``trains`` for ``module``: whether the tensor a layer holds under ``names[0]``
    (``"<layer index>.<name>"``) takes a gradient."""

    def trains(names: Sequence[str]) -> bool:
        index, _, name = names[0].partition(".")
        try:
            return module.layers[int(index)].get_parameter(name).requires_grad
        except AttributeError:
            return False  # a buffer

    return trains
