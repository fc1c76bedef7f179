"""Classes resolved from dotted paths and layers built from spec entries, under a worker's allowlist.

A worker builds only classes whose dotted path, and whose defining module, fall under its
allowlist (`DEFAULT_ALLOWED_PREFIXES` and its ``--allow-module`` prefixes): `resolve_class` checks
the path before anything is imported. `build_layer` builds one entry's layer, its nested
``{"object": ...}`` and ``{"class": ...}`` kwargs too (`construct_values`); the driver builds the
same layers with no allowlist. `source_digest` and `user_code_modules` name the user's code a class
comes from, whose versions no version check covers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_remote_mp.errors import LrmpError, RefusedClassError, SpecError
from lightning_remote_mp.model.entries import LayerEntry, LayerRef, check_dotted
from lightning_remote_mp.model.wiring import variables_of

#: Module prefixes every worker may build classes from.
#: ``lightning_remote_mp.graph`` is the name traced units travel under (`lightning_remote_mp.graph`);
#: ``lightning_remote_mp.model.graph_layer`` where that class is defined, which the worker checks too.
DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = (
    "torch.nn",
    "lightning_remote_mp.layers",
    "lightning_remote_mp.graph",
    "lightning_remote_mp.model.graph_layer",
)


def is_allowed(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def resolve_class(path: str, base: type, allowed_prefixes: Sequence[str] | None = None) -> type:
    """Import the class a dotted path names and check it subclasses ``base``.

    With ``allowed_prefixes`` (the worker's case), the path is checked against the allowlist
    before anything is imported, and a refused path raises `RefusedClassError`.
    """
    check_dotted(path, "class path")
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
        raise SpecError(
            f"{path!r}: no module of this path can be imported; install it where this runs (on a worker, for its "
            "stage), or put it on that process's PYTHONPATH"
        )
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise SpecError(f"{path!r} is not a {base.__module__}.{base.__qualname__} subclass")
    if allowed_prefixes is not None:  # a worker
        home = f"{obj.__module__}.{obj.__qualname__}"
        if not is_allowed(home, allowed_prefixes):
            # Allowed modules import classes from elsewhere (subprocess.Popen, itertools.repeat...):
            # what counts is where the class is defined.
            raise RefusedClassError(
                f"class {path!r} is {home}, defined outside this worker's allowlist {list(allowed_prefixes)}; "
                f"start the worker with --allow-module {obj.__module__} to permit it"
            )
        source_digest(obj.__module__, as_loaded=True)  # remember the code it imported (see source_digest)
    return obj


#: Digests of modules' source files as this process first saw them: what it runs, even when the
#: file has changed on disk since (a long-lived worker keeps the version it imported first).
_LOADED_DIGESTS: dict[str, str | None] = {}


def source_digest(module_name: str, *, as_loaded: bool = False) -> str | None:
    """SHA-256 of the source file of an imported module (``None`` without one). ``as_loaded``
    remembers the first answer, so that it describes the code this process imported."""
    if as_loaded and module_name in _LOADED_DIGESTS:
        return _LOADED_DIGESTS[module_name]
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    digest = None
    if isinstance(path, str) and path.endswith(".py"):
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            digest = None
    if as_loaded and module is not None:
        _LOADED_DIGESTS[module_name] = digest
    return digest


def user_code_modules(entries: Iterable[LayerEntry]) -> list[str]:
    """Modules that define the entries' classes (nested ones too) outside torch and lrmp, whose
    versions no version check covers."""
    names = []
    for entry in entries:
        for path in [entry.path, *nested_class_paths(entry.kwargs)]:
            try:
                cls = resolve_class(path, object) if isinstance(path, str) else path
            except (SpecError, ImportError):
                continue
            module = getattr(cls, "__module__", "")
            if module.split(".")[0] not in ("torch", "lightning_remote_mp", "builtins"):
                names.append(module)
    return list(dict.fromkeys(names))


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
    where = f"layer {index} ({entry.name})"
    try:
        if init_seed is None or (device is not None and torch.device(device).type == "meta"):
            with torch.device(device) if device is not None else contextlib.nullcontext():
                layer = cls(**construct_values(entry.kwargs, allowed_prefixes, where))
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(init_seed + index)
                layer = cls(**construct_values(entry.kwargs, allowed_prefixes, where))
    except (SpecError, RefusedClassError):
        raise
    except Exception as err:
        raise SpecError(f"{where}: constructing it with {dict(entry.kwargs)} failed: {err}") from err
    if entry.wires is not None:
        if any(variables_of(layer)):
            raise SpecError(
                f"{where} declares its own dependencies/out_variables; the spec entry may not declare them too"
            )
        layer._lrmp_wires = entry.wires  # type: ignore[assignment]
    return layer


#: Nested objects one entry may build: a bound on what a spec can make a worker construct.
MAX_NESTED_OBJECTS = 1024


def construct_values(value: Any, allowed_prefixes: Sequence[str] | None, where: str) -> Any:
    """Build the ``{"object": ..., "kwargs": {...}}`` (instance) and ``{"class": ...}`` (class)
    values in ``value``, recursively; everything else is returned as it is.

    >>> construct_values({"norm": {"class": "torch.nn.LayerNorm"}, "n": 3}, ["torch.nn"], "layer 0")
    {'norm': <class 'torch.nn.modules.normalization.LayerNorm'>, 'n': 3}
    """
    budget = [MAX_NESTED_OBJECTS]
    return _construct_tree(value, allowed_prefixes, where, budget)


def _construct_tree(value: Any, allowed: Sequence[str] | None, where: str, budget: list[int]) -> Any:
    if isinstance(value, Mapping):
        if _is_nested_object(value):
            budget[0] -= 1
            if budget[0] < 0:
                raise SpecError(f"{where}: more than {MAX_NESTED_OBJECTS} nested objects in its kwargs")
            return _construct(value, allowed, where, budget)
        return {k: _construct_tree(v, allowed, where, budget) for k, v in value.items()}
    if isinstance(value, list):
        return [_construct_tree(v, allowed, where, budget) for v in value]
    if isinstance(value, tuple):
        return tuple(_construct_tree(v, allowed, where, budget) for v in value)
    return value


def _is_nested_object(value: Mapping[str, Any]) -> bool:
    return ("object" in value and set(value) <= {"object", "kwargs"}) or ("class" in value and set(value) == {"class"})


def _construct(value: Mapping[str, Any], allowed: Sequence[str] | None, where: str, budget: list[int]) -> Any:
    if "class" in value:
        if not isinstance(value["class"], str):
            raise SpecError(f"{where}: a class is {{'class': 'dotted.Path'}}, got {value!r:.120}")
        return resolve_class(value["class"], object, allowed)
    path, kwargs = value["object"], value.get("kwargs") or {}
    if not isinstance(path, str) or not isinstance(kwargs, Mapping):
        raise SpecError(
            f"{where}: a nested object is {{'object': 'dotted.Path', 'kwargs': {{...}}}}, got {value!r:.120}"
        )
    cls = resolve_class(path, object, allowed)
    try:
        return cls(**_construct_tree(kwargs, allowed, where, budget))
    except SpecError:
        raise
    except Exception as err:
        raise SpecError(f"{where}: building {path} with {dict(kwargs)} failed: {err}") from err


def refuse_main(path: str, what: str, error: type[LrmpError] = SpecError) -> None:
    """Refuse the class at ``path`` if it is defined in ``__main__`` (the user's script): no worker
    can import it. ``what`` names the user of the class in the message.

    >>> refuse_main("__main__.Block", "layer 3 (Block)")
    Traceback (most recent call last):
    ...
    lightning_remote_mp.errors.SpecError: layer 3 (Block) uses Block, defined in __main__, which a worker ...
    """
    if path.startswith("__main__."):
        raise error(
            f"{what} uses {path.removeprefix('__main__.')}, defined in __main__, which a worker cannot import; "
            "move it into a module next to your script and, on remote workers, allow that module with --allow-module"
        )


def nested_class_paths(value: Any) -> list[str]:
    """Every dotted path a kwarg value names through ``object`` / ``class``."""
    if isinstance(value, Mapping):
        own = []
        if _is_nested_object(value):
            own = [v for k, v in value.items() if k in ("object", "class") and isinstance(v, str)]
        return own + [p for v in value.values() for p in nested_class_paths(v)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in nested_class_paths(v)]
    return []
