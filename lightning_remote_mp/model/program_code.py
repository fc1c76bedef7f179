"""A checked program's steps as one Python function: the code generator of
`lightning_remote_mp.model.program` (which checks a program, then hands its steps here).

What a step is once checked (`Step`: its operator, its arguments with references to earlier values
(`Ref`) and the layer's device (`DEVICE`), the values to forget after it), and `compiled`, which
writes a program's steps as straight-line Python whose tables hold everything the program brought.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_remote_mp.errors import SpecError


@dataclasses.dataclass(frozen=True)
class Ref:
    name: str


class _Device:
    """Stands for the device the layer runs on (a program traced on the driver's CPU runs on a GPU)."""


DEVICE = _Device()


_aten = torch.ops.aten
#: The ATen operators a traced transformer calls most (a Llama's decode step: ~550 calls), and the
#: Python bindings of torch that run the same overload on the same arguments, with the most positional
#: arguments each binding takes alike (``Tensor.to`` takes ``memory_format`` by keyword only). A
#: binding parses its arguments in generated C++, where an operator's own entry point handles them
#: generically: ``torch.mul(a, b)`` takes 1-2 microseconds less per call on this project's machines.
_BINDINGS: dict[Any, tuple[Callable[..., Any], int]] = {
    _aten.add.Tensor: (torch.add, 2),
    _aten.mul.Tensor: (torch.mul, 2),
    _aten.neg.default: (torch.neg, 1),
    _aten.rsqrt.default: (torch.rsqrt, 1),
    _aten.pow.Tensor_Scalar: (torch.pow, 2),
    _aten.mean.dim: (torch.mean, 3),
    _aten.linear.default: (torch._C._nn.linear, 3),
    _aten.silu.default: (torch._C._nn.silu, 1),
    _aten.scaled_dot_product_attention.default: (torch._C._nn.scaled_dot_product_attention, 6),
    _aten.embedding.default: (torch.embedding, 5),
    _aten.cat.default: (torch.cat, 2),
    _aten.view.default: (torch.Tensor.view, 2),
    _aten.reshape.default: (torch.reshape, 2),
    _aten.transpose.int: (torch.transpose, 3),
    _aten.unsqueeze.default: (torch.unsqueeze, 2),
    _aten.expand.default: (torch.Tensor.expand, 2),
    _aten.to.dtype: (torch.Tensor.to, 4),
}


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    drop: tuple[str, ...]  # values no later step or output needs
    grad: bool | None = None  # run with autograd on or off (a torch.no_grad block), None: as called
    autocast: tuple[bool, torch.dtype | None] | None = None  # (enabled, dtype) of an autocast block

    @property
    def call(self) -> Callable[..., Any]:
        """What runs the step: ``fn``'s Python binding (`_BINDINGS`) where it takes this many
        positional arguments, else its C++ callable (an ATen operator) or ``fn`` itself."""
        binding, most = _BINDINGS.get(self.fn, (None, 0))
        if binding is not None and len(self.args) <= most:
            return binding
        return getattr(self.fn, "_op", self.fn) if isinstance(self.fn, torch._ops.OpOverload) else self.fn  # private

    @property
    def plain(self) -> bool:
        """No context (grad mode, autocast) to enter."""
        return self.grad is None and self.autocast is None


def filled(value: Any) -> bool:
    """Whether ``value`` holds a reference or the device marker, which a run resolves (`compiled`)."""
    if isinstance(value, (list, tuple)):
        return any(filled(v) for v in value)
    return isinstance(value, Ref) or value is DEVICE


# --- a program as one Python function -----------------------------------------------------------
#: The only names the generated source may hold besides its values ``v0, v1, ...``: its own
#: parameters and the tables that hold everything taken from the program (see `compiled`).
_SOURCE_NAMES = frozenset(
    {"def", "program", "inputs", "tensors", "device", "return", "del", "dict", "zip"}
    | {"functions", "constants", "keywords", "keyword_names", "in_context", "attributes", "positions"}
    | {"_in_context", "_scalar", "_tensor"}
)
_VALUE_NAME = re.compile(r"v[0-9]+")
#: Any character but those of names, indices, calls, lists and assignments (a quote, say).
_SOURCE_OTHER = re.compile(r"[^A-Za-z0-9_\[\](){},=*:. \n]")


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value


def _tensor(value: Any, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, device=device)


#: lrmp's key/value cache operator (`lightning_remote_mp.model.kv_cache`), by its schema's name.
KV_CACHE = "lrmp::kv_cache"


def is_kv_cache(step: Step) -> bool:
    """A step of lrmp's key/value cache operator with its layer's position (its third argument) given."""
    schema = getattr(step.fn, "_schema", None)
    return schema is not None and schema.name == KV_CACHE and len(step.args) > 2 and type(step.args[2]) is int


#: The tables a compiled program reads (see `compiled`), in the order of its defaults.
_TABLES = ("attributes", "positions", "functions", "constants", "keywords", "keyword_names", "in_context")


def compiled(
    inputs: tuple[str, ...],
    scalar_inputs: frozenset[str],
    tensors: dict[str, str],
    steps: tuple[Step, ...],
    outputs: tuple[str, ...],
    scalar_outputs: frozenset[str],
) -> Callable[..., tuple]:
    """The program's steps as straight-line Python: each value a local variable (``v7 =
    functions[3](v2, constants[5])``), dropped where the program drops it, so the interpreter runs
    the operator calls and nothing between them. A Llama's decode step (568 steps) took 2.1 ms less
    than stepping through the program one step at a time (19.9 against 17.8 ms, paired, in one
    process).

    Nothing the program brings enters the source: its operators, constants, keyword names and the
    attribute names of its weights sit in tables (``functions``, ``constants``, ``keywords`` and
    ``keyword_names``, ``attributes``, ``in_context`` for the steps run under a grad or autocast
    mode, ``positions`` for a layer's key/value-cache position) that the source indexes by number,
    and its value names become ``v0, v1, ...``. The source is checked to hold only those names
    (`_SOURCE_NAMES`) before it is compiled, so what runs is a function of the program's shape
    alone: the same operator calls a step-by-step interpreter would make."""
    slots: dict[str, str] = {}
    tables: dict[str, list[Any]] = {name: [] for name in _TABLES}

    def put(table: str, value: Any) -> str:
        tables[table].append(value)
        return f"{table}[{len(tables[table]) - 1}]"

    def define(name: str) -> str:
        slots[name] = f"v{len(slots)}"
        return slots[name]

    def expr(value: Any) -> str:
        if isinstance(value, Ref):
            return slots[value.name]
        if value is DEVICE:
            return "device"
        if isinstance(value, (list, tuple)) and filled(value):
            items = ", ".join(expr(v) for v in value)
            return f"[{items}]" if isinstance(value, list) else f"({items}{',' * (len(value) == 1)})"
        return put("constants", value)

    def keywords(kwargs: Mapping[str, Any]) -> str:
        if not any(filled(v) for v in kwargs.values()):
            return put("keywords", dict(kwargs))  # unpacked into a fresh dict at each call: the table's stays as it is
        values = ", ".join(expr(v) for v in kwargs.values())
        return f"dict(zip({put('keyword_names', tuple(kwargs))}, ({values},)))"

    # The tables are the function's defaults: local variables inside it, the fastest to read.
    # ``attributes`` and ``positions`` first: `Program.bound` gives another layer's.
    tables_as_defaults = ", ".join(f"{name}={name}" for name in _TABLES)
    head = f"def program(inputs, tensors, device, {tables_as_defaults}, _in_context=_in_context, "
    lines = [head + "_scalar=_scalar, _tensor=_tensor):"]
    for i, name in enumerate(inputs):
        value = f"_scalar(inputs[{i}])" if name in scalar_inputs else f"inputs[{i}]"
        lines.append(f" {define(name)} = {value}")
    for name, attr in tensors.items():
        lines.append(f" {define(name)} = tensors[{put('attributes', attr)}]")
    for step in steps:
        args = [expr(a) for a in step.args]
        if is_kv_cache(step):  # its layer's position: the one constant of a layer's program another's lacks
            args[2] = put("positions", step.args[2])
        if step.plain:
            if step.kwargs:
                args.append(f"**{keywords(step.kwargs)}")
            call = f"{put('functions', step.call)}({', '.join(args)})"
        else:
            kwargs = keywords(step.kwargs) if step.kwargs else "{}"
            call = f"_in_context({put('in_context', step)}, device, [{', '.join(args)}], {kwargs})"
        lines.append(f" {define(step.name)} = {call}")
        lines.extend(f" del {slots[name]}" for name in step.drop)
    returned = [f"_tensor({slots[n]}, device)" if n in scalar_outputs else slots[n] for n in outputs]
    lines.append(f" return ({', '.join(returned)}{',' * (len(returned) == 1)})")
    source = "\n".join(lines)
    names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", source)) - _SOURCE_NAMES
    strange = {w for w in names if not _VALUE_NAME.fullmatch(w)} | set(_SOURCE_OTHER.findall(source))
    if strange:  # never: a bug of the generator's
        raise SpecError(f"a program's generated source holds unexpected names or characters {sorted(strange)[:5]}")
    namespace: dict[str, Any] = {k: tuple(v) for k, v in tables.items()}
    # The usual builtins: an operator that imports from C (``PyImport_Import``) reads them from this frame.
    namespace.update(_in_context=_in_context, _scalar=_scalar, _tensor=_tensor)
    exec(compile(source, "<lrmp program>", "exec"), namespace)  # noqa: S102 (the source is checked above)
    fn = namespace["program"]
    fn.source = source  # for a reader (and the tests): what runs
    return fn  # type: ignore[no-any-return]


def _in_context(step: Step, device: torch.device, args: Any, kwargs: Any) -> Any:
    grad: Any = torch.set_grad_enabled(step.grad) if step.grad is not None else contextlib.nullcontext()
    cast: Any = contextlib.nullcontext()
    if step.autocast is not None:
        enabled, dtype = step.autocast
        cast = torch.autocast(device.type, dtype=dtype, enabled=enabled)
    with grad, cast:
        return step.call(*args, **kwargs)
