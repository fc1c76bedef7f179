"""What the driver checks of a SpecSequential before any worker is contacted (and of a module
traced at its first call before it is placed), and what it learns.

Going remote makes mistakes fail late and far away: a kwarg that cannot travel used to be refused
by the encoder after the workers had started, a wrong ``input_shape`` surfaced as a dtype error in
the profiler, a layer returning a tuple broke the next layer on another machine. `preflight` runs
on the driver in milliseconds (nothing is allocated: the layers run on the meta device) and names
the layer, its class and the kwarg:

- every class can be imported by a worker (none from ``__main__``);
- every kwarg is plain data that travels (or an ``object``/``class`` value);
- no parameter is shared (tied weights would silently untie across workers);
- one forward at the declared input shapes: every layer accepts what the previous one produces,
  its output matches the next layer's declared ``input_shape``, and its FLOPs are counted, so that
  stages can be balanced by compute.

>>> from lightning_remote_mp.model.spec import SpecSequential
>>> net = SpecSequential([
...     ("torch.nn.Linear", {"in_features": 4, "out_features": 8}, (32, 4)),
...     ("torch.nn.Linear", {"in_features": 16, "out_features": 2}, (32, 16)),
... ])
>>> preflight(net)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
lightning_remote_mp.errors.SpecError: layer 1 (Linear) declares input_shape (32, 16), but ... produces (32, 8) ...
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_remote_mp.errors import SpecError, TraceError
from lightning_remote_mp.model.build import (
    DEFAULT_ALLOWED_PREFIXES,
    build_layer,
    is_allowed,
    nested_class_paths,
    refuse_main,
)
from lightning_remote_mp.model.entries import LayerEntry
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.model.traced import TracedSequential
from lightning_remote_mp.model.wiring import call_layer
from lightning_remote_mp.wire import protocol

log = logging.getLogger(__name__)

_TRAVEL_HINT = (
    "kwargs travel to workers as plain data (numbers, strings, lists, dicts, tuples, torch dtypes, tensors); "
    "spell an object as {'object': 'dotted.Path', 'kwargs': {...}} and a class as {'class': 'dotted.Path'}"
)


def preflight(module: SpecSequential) -> list[float]:
    """Check that ``module`` can go to workers (see the module docstring); raise `SpecError` naming the
    layer otherwise. Returns what the checks learnt: per layer, an estimate of its forward compute
    (FLOPs, plus one per output element so that layers without matrix products are not free)."""
    for i, entry in enumerate(module.entries):
        _check_importable(i, entry)
        _check_kwargs_travel(i, entry)
    _check_untied(module)
    return _dry_run(module.entries)


def _check_importable(index: int, entry: LayerEntry) -> None:
    for path in [entry.path, *nested_class_paths(entry.kwargs)]:
        refuse_main(path, f"layer {index} ({entry.name})")


def _check_kwargs_travel(index: int, entry: LayerEntry) -> None:
    for name, value in entry.kwargs.items():
        try:
            protocol.encode(protocol.SETUP, 0, "", value)
        except protocol.ProtocolError as err:
            raise SpecError(
                f"layer {index} ({entry.name}): kwarg {name!r} = {value!r:.80} cannot travel to a worker ({err}). "
                + _TRAVEL_HINT
            ) from None


def _check_untied(module: SpecSequential) -> None:
    owner: dict[int, str] = {}
    for i, layer in enumerate(module.layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            here = f"layer {i} ({module.entries[i].name}) {name!r}"
            if id(p) in owner:
                raise SpecError(
                    f"{owner[id(p)]} and {here} are the same parameter (tied weights, e.g. an embedding and an "
                    "LM head). lrmp cannot keep a parameter tied across workers or through a worker's state "
                    "loading; give each its own parameter (untie them), or keep the tied layers outside the "
                    "SpecSequential, on the driver."
                )
            owner[id(p)] = here


_LIMITATION_WORDS = ("meta", "device", "cuda", "nvidia", ".item()", "data-dependent", "not implemented")


def _meta_limitation(err: BaseException) -> bool:
    """Failures that say nothing about the spec: the meta device cannot run everything (data-dependent
    ops, layers that make tensors on a fixed device, CUDA-only layers on a driver without CUDA)."""
    text = str(err).lower()
    return isinstance(err, (NotImplementedError, AssertionError)) or any(w in text for w in _LIMITATION_WORDS)


def _shape_text(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(tuple(value.shape))
    return f"a {type(value).__name__}"


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    return None


@dataclasses.dataclass(frozen=True)
class _Ran:
    """What one layer did in the dry run: enough to replay an identical layer without running it."""

    compute: float
    out: tuple[tuple[int, ...], torch.dtype]
    published: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


def _meta_tensor(signature: tuple[tuple[int, ...], torch.dtype]) -> torch.Tensor:
    return torch.empty(signature[0], dtype=signature[1], device="meta")


def _dry_run(entries: Sequence[LayerEntry]) -> list[float]:
    compute = [0.0] * len(entries)
    checked = [False] * len(entries)
    variables: dict[str, torch.Tensor] = {}
    x: Any = None
    replays: dict[Any, _Ran] = {}  # identical entries on identical inputs (a stack of equal blocks) run once
    todo = list(entries)
    if todo and not todo[0].input_shapes[0]:
        log.debug("preflight skipped: layer 0 declares no input_shape")
        todo = []
    for i, entry in enumerate(todo):
        if i > 0:
            _check_declared_shape(entries, i, x)
        deps = [_signature(v) for v in variables.values()]
        key = (repr(entry.to_wire()), _signature(x), tuple(variables), tuple(deps)) if i > 0 else None
        if key is not None and key in replays:
            ran = replays[key]
            x = _meta_tensor(ran.out)
            variables.update((n, _meta_tensor((shape, dtype))) for n, shape, dtype in ran.published)
            compute[i], checked[i] = ran.compute, True
            continue
        try:
            x, compute[i] = _run_one(entries, i, x, variables)
        except _CannotTell as why:
            log.warning(
                "the setup check of layer %d (%s) and after stopped: %s. Those layers are checked when they run "
                "on the workers.",
                i,
                entry.name,
                why,
            )
            break
        checked[i] = True
        if (
            key is not None
            and isinstance(x, torch.Tensor)
            and all(isinstance(v, torch.Tensor) for v in variables.values())
        ):
            published = tuple((n, tuple(v.shape), v.dtype) for n, v in variables.items())
            replays[key] = _Ran(compute[i], _signature(x), published)
    else:
        if todo and not isinstance(x, torch.Tensor):
            last = len(entries) - 1
            raise SpecError(
                f"layer {last} ({entries[last].name}), the last, returns a {type(x).__name__}; a SpecSequential "
                "must end with a tensor: pick one element with 'output': 0 in its entry"
            )
    return [c if done else _fallback_compute(e) for c, done, e in zip(compute, checked, entries)]


class _CannotTell(Exception):
    """The meta device cannot run this layer: the check stops without a verdict."""


def _run_one(entries: Sequence[LayerEntry], i: int, x: Any, variables: dict[str, torch.Tensor]) -> tuple[Any, float]:
    """Build layer ``i`` on the meta device and run it on ``x``; its output and counted compute."""
    entry = entries[i]
    try:
        layer = build_layer(entry, i, device="meta")
    except SpecError as err:
        raise _CannotTell(f"it cannot be built on the meta device ({err})") from None
    inputs = [x] if i > 0 else _example_inputs(entry, type(layer))
    for n, candidate in enumerate(inputs):
        counter = FlopCounterMode(display=False)
        trial = dict(variables)
        try:
            with counter, torch.no_grad():
                y = call_layer(i, layer, candidate, trial)
        except SpecError:
            raise
        except Exception as err:
            if _meta_limitation(err):
                raise _CannotTell(f"{type(err).__name__}: {err}") from None
            if n + 1 < len(inputs):
                continue  # layer 0 may take integer ids that are not an Embedding's
            raise SpecError(_failure(entries, i, candidate, err)) from err
        variables.clear()
        variables.update(trial)
        return y, float(counter.get_total_flops()) + (float(y.numel()) if isinstance(y, torch.Tensor) else 0.0)
    raise AssertionError("unreachable")


def _example_inputs(entry: LayerEntry, layer_cls: type) -> list[torch.Tensor]:
    """Tensors of the entry's declared main input shape to try in turn: ``input_dtype``; int64 ids
    for embeddings; else float32, then int64 ids."""
    shape = entry.input_shapes[0]
    if entry.input_dtype is not None:
        return [torch.empty(shape, dtype=getattr(torch, entry.input_dtype), device="meta")]
    ids = torch.empty(shape, dtype=torch.int64, device="meta")
    if issubclass(layer_cls, (nn.Embedding, nn.EmbeddingBag)):
        return [ids]
    return [torch.empty(shape, dtype=torch.float32, device="meta"), ids]


def _failure(entries: Sequence[LayerEntry], i: int, x: Any, err: BaseException) -> str:
    entry = entries[i]
    came = "its declared input_shape" if i == 0 else f"what layer {i - 1} ({entries[i - 1].name}) returns"
    text = f"layer {i} ({entry.name}) fails on {_shape_text(x)}, {came}: {type(err).__name__}: {err}"
    if i > 0 and not isinstance(x, torch.Tensor):
        text += f". Layer {i - 1} returns a {type(x).__name__}: pick one element with 'output': 0 in its entry"
    elif i == 0:
        text += ". If it takes another dtype than float32 (or int64 ids), say so with 'input_dtype' in its entry"
    return text


def _check_declared_shape(entries: Sequence[LayerEntry], i: int, x: Any) -> None:
    declared = entries[i].input_shapes[0]
    if not isinstance(x, torch.Tensor) or not declared:
        return
    got = tuple(x.shape)
    # The batch dimension is free: input_shape never fixes the batch size.
    if len(got) != len(declared) or got[1:] != tuple(declared[1:]):
        raise SpecError(
            f"layer {i} ({entries[i].name}) declares input_shape {tuple(declared)}, but layer {i - 1} "
            f"({entries[i - 1].name}) produces {got} from the shapes declared before it; fix one of the two "
            "input_shapes."
        )


def _fallback_compute(entry: LayerEntry) -> float:
    """Without a dry run: two FLOPs per parameter per row of the input (what a linear layer costs)."""
    shape = entry.input_shapes[0]
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    try:
        layer = build_layer(entry, 0, device="meta")
    except Exception:
        return float(rows)
    return 2.0 * rows * sum(p.numel() for p in layer.parameters()) + rows


def checked_for_workers(module: SpecSequential, what: str, stages: int | None = None) -> list[float]:
    """`preflight` with errors that name the SpecSequential too; with ``stages`` (one per worker of
    a pipeline), first that each can have a layer."""
    if stages is not None and len(module.layers) < stages:
        raise SpecError(
            f"{what} has {len(module.layers)} layers but there are {stages} stages (one per worker "
            "of a pipeline); each stage needs at least one layer: use fewer workers"
        )
    try:
        return preflight(module)
    except SpecError as err:
        raise SpecError(f"{what}, {err}") from err.__cause__


def checked_traced(key: str, module: TracedSequential, balance: Any, stages: int, split: bool) -> Any:
    """The ``balance`` of ``module``, traced at its first call, for ``stages`` stages (the names of
    submodules where stages 1, 2, ... start become unit counts), once it is known to have a unit
    for each stage and, where its batch is ``split`` (micro-batches, replicas), to split exactly."""
    if len(module.layers) < stages:
        raise TraceError(
            f"module {key!r} was cut into {len(module.layers)} units ({', '.join(e.name for e in module.entries)}), "
            f"fewer than the {stages} stages: use fewer workers, split a larger module, or mark where "
            "plain code may be cut with torch.distributed.pipelining.pipe_split() (a module whose running "
            "statistics are used in several places keeps every unit between its uses in one)"
        )
    if isinstance(balance, list) and all(isinstance(b, str) for b in balance):
        balance = module.counts_at(balance, stages)
    if split:
        module.check_batch_split(module.example)
    return balance


def allow_modules_for(
    modules: Mapping[str, SpecSequential], optimizers: Sequence[torch.optim.Optimizer] = ()
) -> list[str]:
    """Module prefixes local workers need beyond their defaults to build these layers and optimizers."""
    prefixes = []
    for module in modules.values():
        for entry in module.entries:
            for path in [entry.path, *nested_class_paths(entry.kwargs)]:
                mod = path.rsplit(".", 1)[0]
                if not is_allowed(path, DEFAULT_ALLOWED_PREFIXES) and mod != "__main__":
                    prefixes.append(mod)
    for opt in optimizers:
        mod = type(opt).__module__
        if not is_allowed(mod, ("torch.optim",)) and mod != "__main__":
            prefixes.append(mod)
    return list(dict.fromkeys(prefixes))
