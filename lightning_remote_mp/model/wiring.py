"""Residual variables: which layer produces and which consume each one, and running layers under
that convention.

A layer publishes variables (its attribute ``out_variables``, or a spec entry's ``"out_variables"``)
and receives them (``dependencies``: extra positional arguments, or keywords from a dict entry).
`check_wiring` checks the names before anything runs and draws the offending layer otherwise;
`run_layers` runs a stage's layers, keeping the variables as they are made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_remote_mp.errors import SpecError


@dataclasses.dataclass(frozen=True)
class Wires:
    """Residual wiring a spec entry declares for a layer that does not speak the convention itself."""

    dependencies: tuple[str, ...] = ()
    out_variables: tuple[str, ...] = ()
    output: int | str | None = None
    #: ``(keyword argument, variable)`` pairs: variables passed by name (``attention_mask=``).
    keyword_dependencies: tuple[tuple[str, str], ...] = ()

    @property
    def names_in(self) -> list[str]:
        return [*self.dependencies, *(name for _, name in self.keyword_dependencies)]


def _declared(layer: nn.Module, name: str) -> Any:
    """``getattr(layer, name, None)``, without going through ``nn.Module.__getattr__`` for a name
    the layer does not have: that raises (and formats) an AttributeError each time, which cost a
    stage ~15 us per layer per micro-batch. Set on the instance, by its class (a property too), or
    by a ``__getattr__`` of its own."""
    value = layer.__dict__.get(name)
    if value is None and (hasattr(type(layer), name) or type(layer).__getattr__ is not nn.Module.__getattr__):
        value = getattr(layer, name, None)  # a class attribute, or a wrapper that delegates (torch.compile's)
    return value


def variables_of(layer: nn.Module) -> tuple[list[str], list[str]]:
    """The ``(dependencies, out_variables)`` lists a layer (or its spec entry) declares."""
    wires = _declared(layer, "_lrmp_wires")
    if wires is not None:
        return wires.names_in, list(wires.out_variables)
    return list(_declared(layer, "dependencies") or []), list(_declared(layer, "out_variables") or [])


@dataclasses.dataclass(frozen=True)
class Wiring:
    """Where each residual variable is produced and consumed (global layer indices)."""

    produced_at: dict[str, int]
    consumed_at: dict[str, list[int]]


def check_wiring(layers: Sequence[nn.Module], names: Sequence[str] | None = None) -> Wiring:
    """Validate residual variables: unique names, every dependency produced by an earlier layer."""
    names = names or [type(m).__name__ for m in layers]
    produced: dict[str, int] = {}
    consumed: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        deps, outs = variables_of(layer)
        for name in deps + outs:
            if not isinstance(name, str) or not name:
                raise SpecError(f"layer {i} ({names[i]}): variable names must be non-empty strings, got {name!r}")
        for name in deps:
            if name not in produced:
                raise SpecError(
                    f"layer {i} ({names[i]}) depends on {name!r}, which no earlier layer produces.\n"
                    + _diagram(layers, names, highlight=i)
                )
            consumed.setdefault(name, []).append(i)
        for name in outs:
            if name in produced:
                j = produced[name]
                raise SpecError(
                    f"layer {i} ({names[i]}) produces {name!r}, already produced by layer {j} ({names[j]}); "
                    "variable names must be unique.\n" + _diagram(layers, names, highlight=i)
                )
            if outs.count(name) > 1:
                raise SpecError(f"layer {i} ({names[i]}) lists {name!r} twice in out_variables")
            produced[name] = i
    return Wiring(produced_at=produced, consumed_at=consumed)


def _diagram(layers: Sequence[nn.Module], names: Sequence[str], highlight: int) -> str:
    lines = []
    for i, layer in enumerate(layers):
        deps, outs = variables_of(layer)
        note = "".join([f"  needs {deps}" if deps else "", f"  makes {outs}" if outs else ""])
        mark = ">>" if i == highlight else "  "
        lines.append(f"{mark} {i:3d} {names[i]}{note}")
    return "\n".join(lines)


def call_layer(index: int, layer: nn.Module, x: Any, variables: dict[str, torch.Tensor]) -> Any:
    """Run one layer under the residual convention, updating ``variables`` with what it produces."""
    wires = _declared(layer, "_lrmp_wires")
    if wires is not None:
        out = layer(
            x,
            *[variables[d] for d in wires.dependencies],
            **{k: variables[v] for k, v in wires.keyword_dependencies},
        )
        if wires.output is not None:
            out = _select(index, layer, out, wires.output)
        variables.update((name, out) for name in wires.out_variables)
        return out
    deps, outs = variables_of(layer)
    out = layer(x, *[variables[d] for d in deps])
    if outs:
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], (list, tuple))):
            raise SpecError(
                f"layer {index} ({type(layer).__name__}) has out_variables {outs} and must return "
                f"(output, [(name, tensor), ...]); it returned {type(out).__name__}"
            )
        out, pairs = out
        got = {}
        for pair in pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and isinstance(pair[0], str)):
                raise SpecError(f"layer {index} ({type(layer).__name__}) returned a malformed variable {pair!r:.80}")
            got[pair[0]] = pair[1]
        if set(got) != set(outs):
            raise SpecError(
                f"layer {index} ({type(layer).__name__}) declares out_variables {outs} but returned {sorted(got)}"
            )
        variables.update(got)
    return out


def _select(index: int, layer: nn.Module, out: Any, which: int | str) -> Any:
    try:
        return out[which]
    except (IndexError, KeyError, TypeError) as err:
        raise SpecError(
            f"layer {index} ({type(layer).__name__}): 'output': {which!r} cannot be taken from its "
            f"{type(out).__name__} output ({err})"
        ) from None


def run_layers(layers: Iterable[tuple[int, nn.Module]], x: Any, variables: dict[str, torch.Tensor]) -> Any:
    """Run ``(global index, layer)`` pairs in order. A failure is tagged with ``lrmp_layer``."""
    for index, layer in layers:
        try:
            x = call_layer(index, layer, x, variables)
        except Exception as err:
            if getattr(err, "lrmp_layer", None) is None:
                try:
                    err.lrmp_layer = index  # type: ignore[attr-defined]
                except AttributeError:
                    pass
            raise
    return x
