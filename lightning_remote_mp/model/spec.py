"""The layer spec: entries, class resolution under an allowlist, and `SpecSequential` (the residual
variables they wire: `lightning_remote_mp.model.wiring`).

A spec is a list of entries ``(layer, kwargs, input_shape)``:

- ``layer``: an ``nn.Module`` subclass or its dotted import path (``"torch.nn.Linear"``);
- ``kwargs``: the constructor's keyword arguments (plain values, so they can travel to a worker);
- ``input_shape``: an example input shape, a tuple, or a list of tuples when the layer also takes
  residual inputs. It feeds validation and memory estimates; it never fixes the batch size.

Residual variables cross layers (and machines) by name. A layer instance whose attribute
``out_variables`` is a non-empty list returns ``(output, [(name, tensor), ...])``; a layer whose
attribute ``dependencies`` lists names receives those tensors as extra positional arguments
after its main input, in that order.

Dict entries can wire layers that know nothing of this convention (``torch.nn``, HuggingFace):

- ``"dependencies": ["mask"]`` passes those variables as extra positional arguments, and
  ``"dependencies": {"attention_mask": "mask"}`` as keyword arguments;
- ``"out_variables": ["skip"]`` publishes the layer's output under those names (and passes it on);
- ``"output": 0`` keeps one element of a layer that returns a tuple (or a key of a dict output);
- a kwarg value ``{"object": "torch.nn.BatchNorm2d", "kwargs": {...}}`` is built (an instance) and
  ``{"class": "torch.nn.BatchNorm2d"}`` is the class itself, both resolved through the worker's
  allowlist, so constructor arguments such as ``norm_layer=`` or a config object stay plain data
  (YAML; LightningCLI's own ``class_path`` spelling would be built by jsonargparse on the driver).

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
import hashlib
import importlib
import itertools
import keyword
import sys
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_remote_mp.errors import LrmpError, RefusedClassError, SpecError
from lightning_remote_mp.model.wiring import Wires, check_wiring, run_layers, variables_of

Shape = tuple[int, ...]
LayerRef = type[nn.Module] | str

#: Module prefixes every worker may build classes from.
#: ``lightning_remote_mp.graph`` is the name traced units travel under (`lightning_remote_mp.graph`);
#: ``lightning_remote_mp.model.graph`` where that class is defined, which the worker checks too.
DEFAULT_ALLOWED_PREFIXES: tuple[str, ...] = (
    "torch.nn",
    "lightning_remote_mp.layers",
    "lightning_remote_mp.graph",
    "lightning_remote_mp.model.graph",
)


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
        _check_dotted(layer, where)
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

    #: The tensors that are parts of a 4-bit frozen weight (a traced QLoRA base), by ``"<layer index>.<name>"``:
    #: the weight's ``state_dict`` key, the part (`lightning_remote_mp.model.four_bit.Format.parts`), its format.
    quantized: Mapping[str, tuple[str, str, Any]] = {}

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
        if init_seed is not None and (type(init_seed) is not int or not 0 <= init_seed < 2**62):
            raise SpecError(f"init_seed must be None or an integer in [0, 2**62), got {init_seed!r}")
        self.init_seed = init_seed
        if device is not None and torch.device(device).type == "meta" and init_seed is None:
            raise SpecError("a SpecSequential on the meta device needs init_seed, so that workers can initialise it")
        self._hold(
            self.entries, [build_layer(e, i, init_seed=init_seed, device=device) for i, e in enumerate(self.entries)]
        )
        _check_shapes(self.entries, self.layers)
        self._register_load_state_dict_pre_hook(_stash_state_for_meta, with_module=True)

    def _hold(self, entries: Sequence[LayerEntry], layers: Sequence[nn.Module]) -> None:
        """Take ``layers`` (built from ``entries``) as this module's, with checked wiring and no remote
        state yet. Subclasses that build their layers otherwise (a traced module's) start here."""
        self.entries = list(entries)
        self.layers = nn.ModuleList(layers)
        self.wiring = check_wiring(self.layers, [e.name for e in self.entries])
        self._remote: Any = None  # set by the strategy while the layers live on workers
        # Weights loaded into a meta module before it is placed wait here for the workers.
        self._pending_state: dict[str, torch.Tensor] = {}
        self._weights_left_on_workers = False  # a meta module whose trained weights only a run's workers had

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.layers)

    @property
    def is_remote(self) -> bool:
        return self._remote is not None

    # --- the remote life cycle (the driver session calls these) --------------------------------------
    @property
    def remote(self) -> Any:
        """What runs the layers while they live on workers (a `lightning_remote_mp.driver.pipeline.RemoteSpec`),
        else ``None``."""
        return self._remote

    @property
    def pending_state(self) -> dict[str, torch.Tensor]:
        """Weights loaded into this meta module (a checkpoint) that wait for its placement, by
        ``"<layer index>.<name>"``; empty when there are none."""
        return self._pending_state

    @property
    def weights_left_on_workers(self) -> bool:
        """A meta module whose trained weights only an earlier run's workers had."""
        return self._weights_left_on_workers

    def attach(self, remote: Any) -> None:
        """From now on ``forward`` runs on the workers through ``remote``; the weights waiting for
        placement have gone to them."""
        self._remote = remote
        self._pending_state = {}

    def detach(self) -> None:
        """Run locally again. A meta module keeps no weights here: its trained ones were only on the workers."""
        if self._remote is not None and self.is_meta:
            self._weights_left_on_workers = True
        self._remote = None

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

    @property
    def state_owner(self) -> nn.Module:
        """The module whose ``state_dict`` holds the layers' tensors (this one, for a spec)."""
        return self

    #: What errors and logs call it.
    kind = "SpecSequential"

    #: For a pipeline of tuples (a traced model): which input elements carry the batch, and how each
    #: output element joins across the parts of a batch (`lightning_remote_mp.model.joins.Join`).
    batched: tuple[list[bool], list[Any]] | None = None

    def kept_outputs(self) -> Any:
        """Which elements of the output the last stage keeps until they are read
        (`lightning_remote_mp.driver.outputs`, `lightning_remote_mp.model.traced.Keep`): a traced
        module's interface says; a spec's one output is kept in calls where it is large, its size
        learned from the first call."""
        interface = getattr(self, "interface", None)
        if interface is not None:
            return interface.kept()
        from lightning_remote_mp.model.traced import Keep

        return Keep([True], [0])

    def loss_output(self) -> int | None:
        """The position of the module's loss among its outputs, where it computes one (a traced
        module's, `lightning_remote_mp.model.traced.Interface.loss_output`); ``None`` for a layer spec."""
        interface = getattr(self, "interface", None)
        return interface.loss_output() if interface is not None else None

    def loss_count_output(self) -> int | None:
        """The position of the count that loss is divided by (`Interface.loss_count`), or ``None``."""
        interface = getattr(self, "interface", None)
        return interface.loss_count() if interface is not None else None

    def shared(self) -> list[list[str]]:
        """The tensors several layers hold, one list of their names (``"<layer index>.<name>"``) each:
        a traced model's tied weights. A stage holding several of the names keeps one tensor; stages
        that each hold one keep a copy each, and sum their gradients."""
        names: dict[int, list[str]] = {}
        for i, layer in enumerate(self.layers):
            for name, t in layer.state_dict(keep_vars=True).items():
                names.setdefault(id(t), []).append(f"{i}.{name}")
        return [group for group in names.values() if len(group) > 1]

    def state_keys(self) -> dict[str, list[str]]:
        """Each layer tensor (``"<layer index>.<name>"``): its keys in ``state_owner``'s ``state_dict``,
        the first one first (a tied weight has several; a spec's tensors have one each)."""
        return {
            f"{i}.{name}": [f"layers.{i}.{name}"]
            for i, layer in enumerate(self.layers)
            for name in layer.state_dict(keep_vars=True)
        }

    def layer_state(self, state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        """The entries of ``state_owner``'s ``state_dict`` (under ``prefix``) that belong to the layers,
        named ``"<layer index>.<name>"``."""
        head = prefix + "layers."
        return {k[len(head) :]: v for k, v in state_dict.items() if k.startswith(head)}

    def modes(self) -> Modes:
        """The train/eval flags of every layer and its submodules, as they are now.

        Remote stages follow these at each call: Lightning switches modes by ``.train()``/``.eval()``
        and also by setting ``.training`` directly (when it restores them after validation), so
        the flags are read, not intercepted.
        """
        per_layer = [layer_modes(layer) for layer in self.layers]
        first = per_layer[0]
        if isinstance(first, bool) and all(m is first for m in per_layer):
            return first
        return per_layer

    def extra_repr(self) -> str:
        return f"remote={self._remote!r}" if self._remote is not None else ""


#: Train/eval flags: one bool for every layer, or per layer a bool (for all its submodules) or a
#: list of bools (one per ``layer.modules()`` entry, in that order).
Modes = bool | list[bool | list[bool]]


def layer_modes(layer: nn.Module) -> bool | list[bool]:
    flags = [m.training for m in layer.modules()]
    return flags[0] if all(f is flags[0] for f in flags) else flags


def apply_modes(layers: Sequence[nn.Module], modes: Any, first_index: int) -> None:
    """Set the flags of ``layers`` (global indices from ``first_index``) from a `Modes` value; the
    flag counts are checked first, so that a malformed value changes nothing."""
    for i, layer in enumerate(layers):
        flags = modes if isinstance(modes, bool) else modes[first_index + i]
        if not isinstance(flags, bool) and len(flags) != sum(1 for _ in layer.modules()):
            raise SpecError(f"layer {first_index + i}: {len(flags)} mode flags for its modules")
    for i, layer in enumerate(layers):
        flags = modes if isinstance(modes, bool) else modes[first_index + i]
        if isinstance(flags, bool):
            for m in layer.modules():
                m.training = flags
            continue
        for m, f in zip(layer.modules(), flags):  # as many as the modules: checked above
            m.training = f


def _stash_state_for_meta(module: SpecSequential, state_dict: Any, prefix: str, *args: Any) -> None:
    # Loading into meta tensors keeps nothing; keep the tensors until the module is placed.
    if module.is_meta and not module.is_remote:
        head = prefix + "layers."
        module._pending_state = module.layer_state(state_dict, prefix)
        module._weights_left_on_workers = False
        # What is loaded here is then meta too: the same no-op, without torch's warning per parameter
        # ("copying from a non-meta parameter ... is a no-op"), which would alarm for nothing.
        for name in module._pending_state:
            value = state_dict[head + name]
            if isinstance(value, torch.Tensor):
                state_dict[head + name] = value.to("meta")
