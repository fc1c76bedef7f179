"""The layer spec: entries, class resolution, residual-variable wiring, and `SpecSequential`.

A spec is a list of entries ``(layer, kwargs, input_shape)``:

- ``layer``: an ``nn.Module`` subclass or its dotted import path (``"torch.nn.Linear"``);
- ``kwargs``: the constructor's keyword arguments (plain values, so they can travel to a worker);
- ``input_shape``: an example input shape, a tuple, or a list of tuples when the layer also takes
  residual inputs. It feeds validation and memory estimates; it never fixes the batch size.

Residual variables cross layers (and machines) by name. A layer instance whose attribute
``out_variables`` is a non-empty list returns ``(output, [(name, tensor), ...])``; a layer whose
attribute ``dependencies`` lists names receives those tensors as extra positional arguments
after its main input, in that order.

This module imports no Lightning: the worker builds its stages with it.

>>> import torch
>>> from lightning_remote_mp.layers import WrappedLinear
>>> net = SpecSequential([
...     ("torch.nn.Linear", {"in_features": 4, "out_features": 8}, (32, 4)),
...     (WrappedLinear, {"in_features": 8, "out_features": 8, "out_variables": ["skip"]}, (32, 8)),
...     (WrappedLinear, {"in_features": 8, "out_features": 8, "dependencies": ["skip"]}, [(32, 8), (32, 8)]),
... ])
>>> net(torch.ones(5, 4)).shape
torch.Size([5, 8])
>>> SpecSequential([(WrappedLinear, {"in_features": 8, "out_features": 8, "dependencies": ["nope"]}, (32, 8))])
Traceback (most recent call last):
...
lightning_remote_mp.errors.SpecError: layer 0 (WrappedLinear) depends on 'nope', which no earlier layer produces.
>>   0 WrappedLinear  needs ['nope']
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import keyword
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_remote_mp.errors import RefusedClassError, SpecError

Shape = tuple[int, ...]
LayerRef = type[nn.Module] | str

#: Module prefixes every worker may build classes from.
DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = ("torch.nn", "lightning_remote_mp.layers")


@dataclasses.dataclass(frozen=True)
class LayerEntry:
    """One normalised spec entry."""

    layer: LayerRef
    kwargs: Mapping[str, Any]
    input_shape: Shape | tuple[Shape, ...]

    @property
    def path(self) -> str:
        """The dotted import path a worker resolves."""
        return self.layer if isinstance(self.layer, str) else layer_path(self.layer)

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def input_shapes(self) -> tuple[Shape, ...]:
        """The main input's shape first, then one per residual input."""
        if self.input_shape and isinstance(self.input_shape[0], tuple):
            return self.input_shape  # type: ignore[return-value]
        return (self.input_shape,)  # type: ignore[return-value]


def layer_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _as_shape(value: Any, where: str) -> Shape:
    if isinstance(value, (tuple, list)) and all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        if any(s < 0 for s in value):
            raise SpecError(f"{where}: input_shape {tuple(value)} has a negative size")
        return tuple(value)
    raise SpecError(f"{where}: input_shape must be a tuple of ints or a list of such tuples, got {value!r:.80}")


def normalize_entry(entry: Any, index: int) -> LayerEntry:
    """Turn a tuple/list ``(layer, kwargs, input_shape)`` or a dict with those keys into a LayerEntry."""
    where = f"spec entry {index}"
    if isinstance(entry, LayerEntry):
        return entry
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"layer", "kwargs", "input_shape"}
        if unknown or "layer" not in entry:
            raise SpecError(f"{where}: a dict entry needs keys 'layer', 'kwargs', 'input_shape'; got {sorted(entry)}")
        layer, kwargs, shape = entry["layer"], entry.get("kwargs") or {}, entry.get("input_shape", ())
    elif isinstance(entry, (tuple, list)) and len(entry) == 3:
        layer, kwargs, shape = entry
        kwargs = kwargs or {}
    else:
        raise SpecError(f"{where}: expected (layer, kwargs, input_shape), got {entry!r:.80}")
    if isinstance(layer, str):
        _check_dotted(layer, where)
    elif not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        raise SpecError(f"{where}: layer must be an nn.Module subclass or a dotted path, got {layer!r:.80}")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise SpecError(f"{where}: kwargs must be a dict with string keys, got {kwargs!r:.80}")
    if isinstance(shape, list) and shape and isinstance(shape[0], (tuple, list)):
        input_shape: Any = tuple(_as_shape(s, where) for s in shape)
    else:
        input_shape = _as_shape(shape, where)
    return LayerEntry(layer=layer, kwargs=dict(kwargs), input_shape=input_shape)


def normalize_spec(spec: Iterable[Any]) -> list[LayerEntry]:
    entries = [normalize_entry(e, i) for i, e in enumerate(spec)]
    if not entries:
        raise SpecError("the spec is empty; give at least one (layer, kwargs, input_shape) entry")
    return entries


def _check_dotted(path: str, where: str) -> None:
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise SpecError(f"{where}: {path!r:.120} is not a dotted import path like 'torch.nn.Linear'")


def is_allowed(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def resolve_class(path: str, base: type, allowed_prefixes: Sequence[str] | None = None) -> type:
    """Import the class a dotted path names and check it subclasses ``base``.

    With ``allowed_prefixes`` (the worker's case), the path is checked against the allowlist
    before anything is imported, and a refused path raises `RefusedClassError`.
    """
    _check_dotted(path, "class path")
    if allowed_prefixes is not None and not is_allowed(path, allowed_prefixes):
        module = path.rsplit(".", 1)[0]
        raise RefusedClassError(
            f"class {path!r} is not in this worker's allowlist {list(allowed_prefixes)}; "
            f"start the worker with --allow-module {module} to permit it"
        )
    parts = path.split(".")
    # Import the longest importable module prefix, then walk attributes (nested classes).
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and module_name.startswith(err.name):
                continue
            raise
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
                if allowed_prefixes is not None and isinstance(obj, types.ModuleType):
                    # A module imported by an allowed one (``torch.nn.modules.module.torch...``)
                    # would reach classes from anywhere: only nested classes are walked.
                    raise RefusedClassError(
                        f"class {path!r} is reached through module {obj.__name__!r}, which {module_name!r} "
                        "imports; name the class by its own module path and start the worker with "
                        "--allow-module for that module to permit it"
                    )
        except AttributeError:
            raise SpecError(f"{path!r}: module {module_name!r} has no attribute {'.'.join(parts[cut:])!r}") from None
        break
    else:
        raise SpecError(f"{path!r}: no module of this path can be imported")
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise SpecError(f"{path!r} is not a {base.__module__}.{base.__qualname__} subclass")
    return obj


def resolve_layer(layer: LayerRef, allowed_prefixes: Sequence[str] | None = None) -> type[nn.Module]:
    """Return the ``nn.Module`` class a spec entry names (see `resolve_class`)."""
    if not isinstance(layer, str):
        return layer
    return resolve_class(layer, nn.Module, allowed_prefixes)


def build_layer(
    entry: LayerEntry,
    index: int,
    allowed_prefixes: Sequence[str] | None = None,
    init_seed: int | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Construct one layer. With ``init_seed``, its initial weights depend only on the seed and the
    layer's index (the CPU generator is seeded with ``init_seed + index`` around construction), so a
    worker that builds only this layer gets the same weights as a driver that builds them all."""
    cls = resolve_layer(entry.layer, allowed_prefixes)
    try:
        if init_seed is None:
            with torch.device(device) if device is not None else contextlib.nullcontext():
                return cls(**entry.kwargs)
        if device is not None and torch.device(device).type == "meta":
            with torch.device("meta"):
                return cls(**entry.kwargs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed + index)
            return cls(**entry.kwargs)
    except Exception as err:
        raise SpecError(
            f"layer {index} ({entry.name}): constructing it with {dict(entry.kwargs)} failed: {err}"
        ) from err


def variables_of(layer: nn.Module) -> tuple[list[str], list[str]]:
    """The ``(dependencies, out_variables)`` lists a layer declares."""
    deps = list(getattr(layer, "dependencies", None) or [])
    outs = list(getattr(layer, "out_variables", None) or [])
    return deps, outs


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


def _check_shapes(entries: Sequence[LayerEntry], layers: Sequence[nn.Module]) -> None:
    for i, (entry, layer) in enumerate(zip(entries, layers)):
        deps, _ = variables_of(layer)
        shapes = entry.input_shapes
        if isinstance(entry.input_shape[0] if entry.input_shape else None, tuple) and len(shapes) != 1 + len(deps):
            raise SpecError(
                f"layer {i} ({entry.name}) takes 1 input plus dependencies {deps}, "
                f"but its input_shape lists {len(shapes)} shapes"
            )


class SpecSequential(nn.Module):
    """An ``nn.Module`` built from a layer spec; trains locally as-is.

    Under `RemoteModelParallelStrategy` its layers run on workers;
    its parameters here are then a copy that the strategy refreshes from the workers whenever
    ``state_dict()`` is taken, and restores when the run ends.

    >>> import torch
    >>> net = SpecSequential([
    ...     ("torch.nn.Linear", {"in_features": 3, "out_features": 5}, (8, 3)),
    ...     (torch.nn.ReLU, {}, (8, 5)),
    ... ])
    >>> net(torch.zeros(2, 3)).shape
    torch.Size([2, 5])
    """

    def __init__(
        self, spec: Iterable[Any], *, init_seed: int | None = None, device: torch.device | str | None = None
    ) -> None:
        """
        Args:
            spec: the layer spec.
            init_seed: initialise layer ``i`` from seed ``init_seed + i``, independently of the others.
                Needed with ``device="meta"``: the workers then initialise their own layers from it.
            device: where to build the layers; ``"meta"`` builds no weights at all on this process,
                for models larger than the driver (they only ever exist on the workers).
        """
        super().__init__()
        self.entries = normalize_spec(spec)
        self.init_seed = init_seed
        if device is not None and torch.device(device).type == "meta" and init_seed is None:
            raise SpecError("a SpecSequential on the meta device needs init_seed, so that workers can initialise it")
        self.layers = nn.ModuleList(
            build_layer(e, i, init_seed=init_seed, device=device) for i, e in enumerate(self.entries)
        )
        self.wiring = check_wiring(self.layers, [e.name for e in self.entries])
        _check_shapes(self.entries, self.layers)
        self._remote: Any = None  # set by the strategy while the layers live on workers
        # Weights loaded into a meta module before it is placed wait here for the workers.
        self._pending_state: dict[str, torch.Tensor] = {}
        self._weights_left_on_workers = False  # a meta module whose trained weights only a run's workers had
        self._register_load_state_dict_pre_hook(_stash_state_for_meta, with_module=True)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.layers)

    @property
    def is_remote(self) -> bool:
        return self._remote is not None

    @property
    def is_meta(self) -> bool:
        """Whether the layers have no weights here (built on the meta device)."""
        return any(t.is_meta for t in itertools.chain(self.layers.parameters(), self.layers.buffers()))

    def _apply(self, fn: Any, recurse: bool = True) -> SpecSequential:
        # Moving or casting weights that do not exist here (meta) is a no-op, not an error:
        # Lightning moves the whole LightningModule to its device.
        if self.is_meta:
            return self
        return super()._apply(fn, recurse)

    def forward(self, x: Any) -> Any:
        if self._remote is not None:
            return self._remote(x)
        return run_layers(enumerate(self.layers), x, {})

    def train(self, mode: bool = True) -> SpecSequential:
        super().train(mode)
        if self._remote is not None:
            self._remote.set_mode(mode)
        return self

    def extra_repr(self) -> str:
        return f"remote={self._remote!r}" if self._remote is not None else ""


def _stash_state_for_meta(module: SpecSequential, state_dict: Any, prefix: str, *args: Any) -> None:
    # Loading into meta tensors keeps nothing; keep the tensors until the module is placed.
    if module.is_meta and not module.is_remote:
        head = prefix + "layers."
        module._pending_state = {k[len(head) :]: v for k, v in state_dict.items() if k.startswith(head)}
        module._weights_left_on_workers = False
