"""Timing layers on the worker that would hold them, for ``balance="time"``.

Each layer is built alone (so profiling needs the memory of one layer, not of the model), fed
random inputs of its example shape(s), and timed forward plus backward; the median of a few runs
is its cost.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from lightning_remote_mp.model.build import build_layer
from lightning_remote_mp.model.entries import LayerEntry, normalize_entry
from lightning_remote_mp.model.wiring import call_layer, variables_of


def _inputs(entry: LayerEntry, deps: list[str], device: torch.device, floating: bool) -> tuple[Any, dict]:
    shapes = list(entry.input_shapes)
    while len(shapes) < 1 + len(deps):  # one shape given for a layer with residual inputs: same shape
        shapes.append(shapes[0])

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        if floating:
            return torch.randn(shape, device=device, requires_grad=True)
        return torch.zeros(shape, dtype=torch.long, device=device)

    return make(shapes[0]), {name: make(shape) for name, shape in zip(deps, shapes[1:])}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layer(layer: torch.nn.Module, entry: LayerEntry, index: int, device: torch.device, repeats: int) -> float:
    """Median seconds of one forward plus backward of ``layer`` on inputs of its example shape."""
    deps, outs = variables_of(layer)
    if hasattr(layer, "example_inputs"):  # a traced unit knows what it takes
        return _median_seconds(layer, layer.example_inputs(device), {}, index, outs, device, repeats)
    kinds = (True, False)  # integer inputs (an Embedding's indices) when floats are refused
    if entry.input_dtype is not None:
        kinds = (getattr(torch, entry.input_dtype).is_floating_point,)
    for floating in kinds:
        try:
            x, variables = _inputs(entry, deps, device, floating)
            return _median_seconds(layer, x, variables, index, outs, device, repeats)
        except (RuntimeError, TypeError):
            if floating is kinds[-1]:
                raise
    raise AssertionError("unreachable")


def _median_seconds(
    layer: torch.nn.Module,
    x: Any,
    variables: dict[str, torch.Tensor],
    index: int,
    outs: list[str],
    device: torch.device,
    repeats: int,
) -> float:
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        _sync(device)
        start = time.perf_counter()
        produced = dict(variables)
        out = call_layer(index, layer, x, produced)
        tensors = [*(out if isinstance(out, tuple) else (out,)), *(produced[n] for n in outs)]
        loss = sum(t.float().sum() for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
        _sync(device)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs[1:])


def profile_layers(
    entries: Sequence[Any], device: torch.device, allowed_prefixes: Sequence[str], repeats: int = 3
) -> list[float]:
    seconds = []
    for i, raw in enumerate(entries):
        entry = normalize_entry(raw, i)
        layer = build_layer(entry, i, allowed_prefixes).to(device)
        if i == 0:
            time_layer(layer, entry, i, device, repeats)  # the process's first kernels pay one-off costs
        seconds.append(time_layer(layer, entry, i, device, repeats))
        del layer
    return seconds
