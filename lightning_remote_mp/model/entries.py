"""A layer spec's entries, read and normalised: ``(layer, kwargs, input_shape)`` tuples or dicts
become `LayerEntry` values, checked for their shape before anything is built (what they build:
`lightning_remote_mp.model.build`; the spec format: `lightning_remote_mp.model.spec`).

>>> normalize_entry(("torch.nn.Linear", {"in_features": 4, "out_features": 8}, (32, 4)), 0).to_wire()
{'layer': 'torch.nn.Linear', 'kwargs': {'in_features': 4, 'out_features': 8}, 'input_shape': [32, 4]}
"""

from __future__ import annotations

import dataclasses
import keyword
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_remote_mp.errors import SpecError
from lightning_remote_mp.model.wiring import Wires

Shape = tuple[int, ...]
LayerRef = type[nn.Module] | str


@dataclasses.dataclass(frozen=True)
class LayerEntry:
    """One normalised spec entry."""

    layer: LayerRef
    kwargs: Mapping[str, Any]
    input_shape: Shape | tuple[Shape, ...]
    #: Variables passed as extra positional arguments, declared by the entry (not the layer).
    dependencies: tuple[str, ...] = ()
    #: Variables passed as keyword arguments: ``(keyword, variable)`` pairs.
    keyword_dependencies: tuple[tuple[str, str], ...] = ()
    #: Names under which the entry publishes the layer's (selected) output.
    out_variables: tuple[str, ...] = ()
    #: Which element (int) or key (str) of a tuple or dict output to keep.
    output: int | str | None = None
    #: The dtype of the example input (``"int64"`` for token ids); default float32, int64 for embeddings.
    input_dtype: str | None = None

    @property
    def path(self) -> str:
        """The dotted import path a worker resolves."""
        return self.layer if isinstance(self.layer, str) else layer_path(self.layer)

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def wires(self) -> Wires | None:
        """The wiring the entry declares for its layer (``None`` when the layer declares its own)."""
        if not (self.dependencies or self.keyword_dependencies or self.out_variables or self.output is not None):
            return None
        return Wires(self.dependencies, self.out_variables, self.output, self.keyword_dependencies)

    def to_wire(self) -> dict[str, Any]:
        """The entry as plain data (what travels to a worker, and a YAML-able dict entry)."""
        out: dict[str, Any] = {"layer": self.path, "kwargs": dict(self.kwargs), "input_shape": _shape_as_lists(self)}
        for name in _OPTIONAL_KEYS:
            value = getattr(self, name)
            if value not in (None, ()):
                out[name] = list(value) if isinstance(value, tuple) else value
        if self.keyword_dependencies:
            out["dependencies"] = dict(self.keyword_dependencies)
        return out

    @property
    def input_shapes(self) -> tuple[Shape, ...]:
        """The main input's shape first, then one per residual input."""
        if self.input_shape and isinstance(self.input_shape[0], tuple):
            return self.input_shape  # type: ignore[return-value]
        return (self.input_shape,)  # type: ignore[return-value]


_OPTIONAL_KEYS = ("dependencies", "out_variables", "output", "input_dtype")
_ENTRY_KEYS = {"layer", "kwargs", "input_shape", *_OPTIONAL_KEYS}


def _shape_as_lists(entry: LayerEntry) -> Any:
    shape = entry.input_shape
    return [list(s) for s in shape] if shape and isinstance(shape[0], tuple) else list(shape)


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
    extra: dict[str, Any] = {}
    if isinstance(entry, Mapping):
        unknown = set(entry) - _ENTRY_KEYS
        if unknown or "layer" not in entry:
            raise SpecError(
                f"{where}: a dict entry takes keys 'layer', 'kwargs', 'input_shape' and optionally "
                f"{', '.join(repr(k) for k in _OPTIONAL_KEYS)}; got {sorted(map(str, entry))}"
            )
        layer, kwargs, shape = entry["layer"], entry.get("kwargs") or {}, entry.get("input_shape", ())
        extra = _optional_fields(entry, where)
    elif isinstance(entry, (tuple, list)) and len(entry) == 3:
        layer, kwargs, shape = entry
        kwargs = kwargs or {}
    else:
        raise SpecError(f"{where}: expected (layer, kwargs, input_shape), got {entry!r:.80}")
    if isinstance(layer, str):
        check_dotted(layer, where)
    elif not (isinstance(layer, type) and issubclass(layer, nn.Module)):
        raise SpecError(f"{where}: layer must be an nn.Module subclass or a dotted path, got {layer!r:.80}")
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise SpecError(f"{where}: kwargs must be a dict with string keys, got {kwargs!r:.80}")
    if isinstance(shape, list) and shape and isinstance(shape[0], (tuple, list)):
        input_shape: Any = tuple(_as_shape(s, where) for s in shape)
    else:
        input_shape = _as_shape(shape, where)
    return LayerEntry(layer=layer, kwargs=dict(kwargs), input_shape=input_shape, **extra)


def _names(value: Any, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) and n for n in value):
        raise SpecError(f"{where}: {key!r} must be a list of non-empty variable names, got {value!r:.80}")
    return tuple(value)


def _optional_fields(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    deps = entry.get("dependencies")
    if isinstance(deps, Mapping):
        if not all(isinstance(k, str) and k.isidentifier() for k in deps):
            raise SpecError(f"{where}: 'dependencies' as a dict maps keyword arguments to variables, got {deps!r:.80}")
        out["keyword_dependencies"] = tuple(zip(deps, _names(list(deps.values()), "dependencies", where)))
    elif deps:
        out["dependencies"] = _names(deps, "dependencies", where)
    if entry.get("out_variables"):
        out["out_variables"] = _names(entry["out_variables"], "out_variables", where)
    output = entry.get("output")
    if output is not None:
        if isinstance(output, bool) or not isinstance(output, (int, str)):
            raise SpecError(f"{where}: 'output' must be an index (int) or a key (str), got {output!r:.80}")
        out["output"] = output
    dtype = entry.get("input_dtype")
    if dtype is not None:
        if not isinstance(dtype, str) or not isinstance(vars(torch).get(dtype), torch.dtype):
            raise SpecError(f"{where}: 'input_dtype' must name a torch dtype like 'int64', got {dtype!r:.40}")
        out["input_dtype"] = dtype
    return out


def normalize_spec(spec: Iterable[Any]) -> list[LayerEntry]:
    entries = [normalize_entry(e, i) for i, e in enumerate(spec)]
    if not entries:
        raise SpecError("the spec is empty; give at least one (layer, kwargs, input_shape) entry")
    return entries


def check_dotted(path: str, where: str) -> None:
    """Refuse ``path`` unless it is a dotted import path (``where`` names its use in the message)."""
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() and not keyword.iskeyword(p) for p in parts):
        raise SpecError(f"{where}: {path!r:.120} is not a dotted import path like 'torch.nn.Linear'")
