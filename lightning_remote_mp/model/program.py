"""Traced programs as plain data, checked against an operator allowlist before anything runs.

A program is one piece of a model traced by ``torch.export`` (see `lightning_remote_mp.model.trace`): a
list of steps, each calling one operator on earlier values, with its weights named. It travels as
msgpack data inside an ordinary spec entry for `lightning_remote_mp.model.graph_layer.GraphLayer`,
the layer that runs it, so stages of traced models are placed, checkpointed, pipelined and mirrored
exactly like layers of a spec; the worker needs no user code. The checked steps become one Python
function (`lightning_remote_mp.model.program_code`).

What a worker accepts, checked before anything runs (`load_program`):

- ATen operators (``torch.ops.aten.*``) by namespace, name and overload, those of
  `lightning_remote_mp.model.operators.allowed_operator` (none reaches outside the process:
  ``from_file``, which reads files, is refused);
- a few Python operators on shapes and tuples (`PYTHON_OPERATORS`: ``getitem``, integer arithmetic);
- argument values that are numbers, strings, dtypes, lists and tuples of them, references to earlier
  steps, and a device/layout/memory-format marker. Nothing names a class, a module or a function
  outside those tables, so a received program cannot run code that came with it;
- per step, an optional context: grad mode on or off and autocast settings (what a
  ``torch.no_grad()`` or ``torch.autocast`` block inside the traced forward asked for).

>>> import torch
>>> program = {
...     "inputs": ["x"], "tensors": {"w": "weight"},
...     "steps": [["y", ["aten", "mm", "default"], [{"ref": "x"}, {"ref": "w"}], {}],
...               ["z", ["aten", "relu", "default"], [{"ref": "y"}], {}]],
...     "outputs": ["z"],
... }
>>> run(load_program(program, "unit 0"), (torch.tensor([[1.0, -1.0]]),), {"weight": torch.eye(2)}, torch.device("cpu"))
(tensor([[1., 0.]]),)
>>> load_program({**program, "steps": [["y", ["aten", "from_file", "default"], ["/etc/passwd"], {}]]}, "unit 0")
Traceback (most recent call last):
...
lightning_remote_mp.errors.RefusedOperatorError: unit 0, step 'y': operator aten.from_file.default is never run ...
"""  # noqa: E501

from __future__ import annotations

import collections
import dataclasses
import operator
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from lightning_remote_mp.errors import RefusedOperatorError, SpecError
from lightning_remote_mp.model.operators import ALLOWED_NAMESPACES, DROPPED_OPERATORS, allowed_operator, refused_why
from lightning_remote_mp.model.program_code import DEVICE, Ref, Step, compiled

#: Operators that leave memory uninitialised: allocators, and ``resize_`` where it grows a tensor.
#: They run zero-filled (`_zero_filled`), so a program never reads memory the worker freed (weights
#: of another session, keys).
_ZERO_FILLED = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_"})
#: The most a Python operator's integer operand or result may be, and a power's exponent: they
#: compute sizes, and unbounded Python integers would hold the interpreter lock for ever.
_MAX_INT = 2**63
_MAX_EXPONENT = 64


def _number_operator(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` on plain numbers only, within `_MAX_INT` (sizes, not strings or lists)."""

    def checked(*args: Any) -> Any:
        for a in args:
            if not isinstance(a, (bool, int, float)) or (isinstance(a, int) and abs(a) > _MAX_INT):
                raise SpecError(f"Python operator {name!r} takes numbers within 2**63, got {a!r:.60}")
        if name == "pow" and (not isinstance(args[1], (int, float)) or abs(args[1]) > _MAX_EXPONENT):
            raise SpecError(f"Python operator 'pow' takes an exponent of at most {_MAX_EXPONENT}")
        out = fn(*args)
        if isinstance(out, int) and abs(out) > _MAX_INT:
            raise SpecError(f"Python operator {name!r} gave a number beyond 2**63")
        return out

    return checked


def _getitem(container: Any, index: Any) -> Any:
    """``container[index]`` for a multi-output operator's tuple and an integer index only."""
    if not isinstance(container, (tuple, list)) or not isinstance(index, int) or isinstance(index, bool):
        raise SpecError("Python operator 'getitem' takes a tuple of results and an integer index")
    return container[index]


_ARITHMETIC = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "floordiv": operator.floordiv,
    "truediv": operator.truediv,
    "mod": operator.mod,
    "neg": operator.neg,
    "pow": operator.pow,
    "eq": operator.eq,
    "ne": operator.ne,
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "sym_max": torch.sym_max,
    "sym_min": torch.sym_min,
    "sym_not": torch.sym_not,
    "sym_int": torch.sym_int,
    "sym_float": torch.sym_float,
}
#: Python callables a traced program may use, by the name they travel under: arithmetic and
#: comparisons on sizes, and taking one result of a multi-output operator.
PYTHON_OPERATORS: dict[str, Callable[..., Any]] = {
    "getitem": _getitem,
    **{name: _number_operator(fn, name) for name, fn in _ARITHMETIC.items()},
}
#: What the tracer's graphs call, by the name it travels under (driver side).
TRACED_PYTHON_NAMES: dict[Any, str] = {operator.getitem: "getitem", **{fn: n for n, fn in _ARITHMETIC.items()}}


def _batch_norm(
    input: Any,
    weight: Any,
    bias: Any,
    running_mean: Any,
    running_var: Any,
    training: Any,
    momentum: Any,
    eps: Any,
    _: Any,
) -> Any:
    """``aten.batch_norm`` through ``F.batch_norm`` (the same operator; cuDNN as the worker's torch sets it)."""
    return torch.nn.functional.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


#: Operators that run through their Python entry point, where a worker's TorchFunctionModes see them:
#: split backward defers traced linear layers' weight gradients (``F.linear``, worker.deferred_grads),
#: and deferred batch norm the statistics of traced batch norms (``F.batch_norm``, worker.deferred_bn).
_PYTHON_ENTRY: dict[Any, Callable[..., Any]] = {
    torch.ops.aten.linear.default: torch.nn.functional.linear,
    torch.ops.aten.batch_norm.default: _batch_norm,
}
#: The layouts and memory formats a program may name, by the names they travel under.
MARKERS: dict[str, dict[str, Any]] = {
    "layout": {"strided": torch.strided},
    "memory_format": {
        "contiguous_format": torch.contiguous_format,
        "channels_last": torch.channels_last,
        "channels_last_3d": torch.channels_last_3d,
        "preserve_format": torch.preserve_format,
    },
}
#: Values a step's arguments may hold besides references and markers.
_PLAIN = (bool, int, float, str, type(None), torch.dtype)
_MAX_DEPTH = 8


def resolve_operator(target: Any, where: str) -> Callable[..., Any] | None:
    """The callable a step names (``[namespace, name, overload]`` or ``["python", name]``), or
    ``None`` for a step to drop; `RefusedOperatorError` for anything outside the allowlist."""
    if not (isinstance(target, list) and all(isinstance(t, str) for t in target) and len(target) in (2, 3)):
        raise SpecError(f"{where}: malformed operator {target!r:.120}")
    if target[0] == "python" and len(target) == 2:
        fn = PYTHON_OPERATORS.get(target[1])
        if fn is None:
            raise RefusedOperatorError(f"{where}: Python operator {target[1]!r} is not allowed on a worker")
        return fn
    if len(target) != 3:
        raise SpecError(f"{where}: malformed operator {target!r:.120}")
    namespace, name, overload = target
    shown = ".".join(target)
    if namespace not in ALLOWED_NAMESPACES:
        raise RefusedOperatorError(
            f"{where}: operator {shown} is not allowed on a worker; only {', '.join(ALLOWED_NAMESPACES)} operators "
            "are (lrmp's own and ATen's: custom operators and other namespaces are refused)"
        )
    if not (name.isidentifier() and overload.isidentifier()):
        raise RefusedOperatorError(f"{where}: {shown!r} is not an operator name")
    if name in DROPPED_OPERATORS:
        return None
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        raise SpecError(f"{where}: this worker's torch {torch.__version__} has no operator {shown}") from None
    # Only attribute lookups happened so far; what they found must be an operator (``__class__``
    # and friends are attributes too), and its overload too.
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise RefusedOperatorError(f"{where}: {shown} is not an operator")
    if overload not in packet.overloads():
        raise SpecError(f"{where}: this worker's torch {torch.__version__} has no operator {shown}")
    op = getattr(packet, overload)
    if not isinstance(op, torch._ops.OpOverload):
        raise RefusedOperatorError(f"{where}: {shown} is not an operator")
    if not allowed_operator(op):
        why = refused_why(name)
        raise RefusedOperatorError(
            f"{where}: operator {shown} is never run from the wire: it {why}"
            if why is not None
            else f"{where}: operator {shown} is not on this worker's operator allowlist "
            "(lightning_remote_mp.model.operators); its owner can allow it with lrmp-worker --allow-op "
            f"aten::{name}"
        )
    if name in _ZERO_FILLED:
        return _zero_filled(op)
    return _PYTHON_ENTRY.get(op, op)


def _zero_filled(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """``op`` without uninitialised memory: a fresh tensor's whole memory zeroed, the gaps between a
    strided tensor's elements too (``as_strided`` reaches them); a tensor it writes into (``out=``,
    ``resize_``'s own) zeroed where its memory grew, and an allocator's ``out`` where it is written."""
    resize = op._schema.name == "aten::resize_"

    def zeroed(*args: Any, **kwargs: Any) -> torch.Tensor:
        into = args[0] if resize and args else kwargs.get("out")
        if not isinstance(into, torch.Tensor):
            out = op(*args, **kwargs)
            _memory(out).zero_()
            return out
        before = into.untyped_storage().nbytes()
        out = op(*args, **kwargs)
        _memory(out)[before:].zero_()
        return out if resize else out.zero_()

    zeroed.__wrapped_op__ = op  # type: ignore[attr-defined]  # whose schema the arguments are checked against
    return zeroed


def _memory(t: torch.Tensor) -> torch.Tensor:
    """The whole memory under ``t``, as bytes."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _check_devices(op: Any, args: Sequence[Any], kwargs: Mapping[str, Any], where: str) -> None:
    """Arguments the operator's schema types as a device must be the layer's own (the marker): a
    program does not pick the worker's GPU, nor the meta device."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return
    named = dict(zip((a.name for a in schema.arguments), args))
    named.update(kwargs)
    for arg in schema.arguments:
        if "Device" in str(arg.type) and named.get(arg.name) not in (None, DEVICE):
            raise RefusedOperatorError(f"{where}: argument {arg.name!r} must be the layer's device marker")


def _nothing(*args: Any, **kwargs: Any) -> None:
    """What a dropped step (an assertion) computes."""


def _decode_value(value: Any, known: set[str], where: str, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise SpecError(f"{where}: arguments nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        items = [_decode_value(v, known, where, depth + 1) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict) and len(value) == 1:
        ((tag, item),) = value.items()
        if tag == "ref":
            if item not in known:
                raise SpecError(f"{where}: refers to {item!r}, which no earlier step or input defines")
            return Ref(item)
        if tag == "device":
            return DEVICE
        if tag in MARKERS and item in MARKERS[tag]:
            return MARKERS[tag][item]
    raise SpecError(f"{where}: argument {value!r:.120} is not a value a program may hold")


def _context(value: Any, where: str) -> tuple[bool | None, tuple[bool, torch.dtype | None] | None]:
    """A step's optional context: ``{"grad": bool, "autocast": {"enabled": bool, "dtype": dtype}}``."""
    if not isinstance(value, dict) or not set(value) <= {"grad", "autocast"}:
        raise SpecError(f"{where}: malformed step context {value!r:.120}")
    grad = value.get("grad")
    if grad is not None and not isinstance(grad, bool):
        raise SpecError(f"{where}: grad must be a bool")
    cast = value.get("autocast")
    if cast is None:
        return grad, None
    if not (
        isinstance(cast, dict)
        and isinstance(cast.get("enabled"), bool)
        and (cast.get("dtype") is None or isinstance(cast.get("dtype"), torch.dtype))
    ):
        raise SpecError(f"{where}: autocast must be {{'enabled': bool, 'dtype': dtype or None}}")
    return grad, (cast["enabled"], cast.get("dtype"))


@dataclasses.dataclass(frozen=True)
class Program:
    """A checked program: run it with `run`."""

    inputs: tuple[str, ...]
    scalar_inputs: frozenset[str]
    tensors: dict[str, str]  # value name -> the layer's attribute holding it
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]
    scalar_outputs: frozenset[str]
    #: The steps as one Python function, made by `compiled` (see there): ``fn(inputs, tensors, device)``.
    fn: Callable[..., tuple] = dataclasses.field(repr=False, compare=False)

    def bound(self, data: dict[str, Any]) -> Program:
        """This program for ``data``, a program with the same steps but for its value names and the
        attributes that hold its weights: its names, the same checked steps and compiled code, and a
        function that reads its own attributes."""
        tensors = dict(data.get("tensors", {}))
        positions = tuple(kv_cache_positions(data))
        defaults = (tuple(tensors.values()), positions, *self.fn.__defaults__[2:])  # type: ignore[index]
        fn = types.FunctionType(self.fn.__code__, self.fn.__globals__, "program", defaults)
        fn.source = self.fn.source  # type: ignore[attr-defined]
        return Program(
            tuple(data["inputs"]),
            frozenset(data.get("scalar_inputs", ())),
            tensors,
            self.steps,
            tuple(data["outputs"]),
            frozenset(data.get("scalar_outputs", ())),
            fn,
        )


#: Programs checked in this process, by their content with names left out (`program_key`): a deep
#: model's decoder layers are one program, checked and compiled once (issue #60). Bounded: the least
#: recently used goes first.
_CHECKED: collections.OrderedDict[str, Program] = collections.OrderedDict()
_CHECKED_MOST = 1024


class _Malformed(Exception):
    pass


def kv_cache_position(step: Any) -> int | None:
    """The layer position a step of lrmp's key/value cache operator names (its third argument, a
    number), as a program's data holds it; ``None`` for any other step."""
    if (
        isinstance(step, list)
        and len(step) > 2
        and step[1] == ["lrmp", "kv_cache", "default"]
        and isinstance(step[2], list)
        and len(step[2]) > 2
        and type(step[2][2]) is int
    ):
        return step[2][2]
    return None


def kv_cache_positions(program: Mapping[str, Any]) -> list[int]:
    """The layer positions a program's key/value cache steps name, in order (`kv_cache_position`)."""
    return [p for step in program["steps"] if (p := kv_cache_position(step)) is not None]


def with_kv_cache_position(step: list[Any], position: Any) -> list[Any]:
    """A key/value cache step (`kv_cache_position`) naming ``position`` instead of its own."""
    return [*step[:2], [*step[2][:2], position, *step[2][3:]], *step[3:]]


def program_key(data: Any) -> str:
    """``data``'s content with its value names numbered in order of definition and its attributes
    left out: two programs with one key run the same operators on the same arguments. `_Malformed`
    for anything else than a program's plain data (`load_program` then says what is wrong)."""
    names: dict[str, int] = {}

    def define(name: Any) -> None:
        if not isinstance(name, str) or name in names:
            raise _Malformed
        names[name] = len(names)

    def walk(value: Any) -> Any:
        if isinstance(value, _PLAIN):
            return value
        if isinstance(value, dict):
            if len(value) == 1 and "ref" in value:
                return ("ref", names[value["ref"]])
            return ("dict", tuple((walk(k), walk(v)) for k, v in value.items()))
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(walk(v) for v in value))
        raise _Malformed

    try:
        inputs, tensors, steps = data["inputs"], data.get("tensors", {}), data["steps"]
        for name in (*inputs, *tensors):
            define(name)
        if not all(isinstance(a, str) for a in tensors.values()):
            raise _Malformed
        shape = []
        for step in steps:
            if kv_cache_position(step) is not None:  # the layer's position: `Program.bound` gives each its own
                step = with_kv_cache_position(step, "<layer>")
            shape.append(tuple(walk(part) for part in step[1:]))
            define(step[0])
        key = (
            [names[n] for n in inputs],
            sorted(names[n] for n in data.get("scalar_inputs", [])),
            [names[n] for n in tensors],
            shape,
            [names[n] for n in data["outputs"]],
            sorted(names[n] for n in data.get("scalar_outputs", [])),
        )
    except (KeyError, TypeError, IndexError, AttributeError, _Malformed):
        raise _Malformed from None
    return repr(key)


def _names(value: Any, field: str, where: str) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise SpecError(f"{where}: {field} must be a list of names")
    return value


def load_program(data: Any, where: str) -> Program:
    """Check a program that arrived (see the module docstring) and resolve its operators; a program
    checked before in this process but for its names (the next decoder layer's) is not checked again."""
    try:
        key = program_key(data)
    except _Malformed:
        return _check_program(data, where)  # says what is wrong
    checked = _CHECKED.get(key)
    if checked is None:
        checked = _CHECKED[key] = _check_program(data, where)
        if len(_CHECKED) > _CHECKED_MOST:
            _CHECKED.popitem(last=False)
        return checked
    _CHECKED.move_to_end(key)
    return checked.bound(data)


def _check_program(data: Any, where: str) -> Program:
    if not isinstance(data, dict):
        raise SpecError(f"{where}: a program is a dict, got {type(data).__name__}")
    inputs = _names(data.get("inputs"), "inputs", where)
    tensors = data.get("tensors", {})
    if not (isinstance(tensors, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in tensors.items())):
        raise SpecError(f"{where}: tensors must map value names to attribute names")
    known = set(inputs) | set(tensors)
    if len(known) != len(inputs) + len(tensors):
        raise SpecError(f"{where}: input and tensor names must be unique")
    raw_steps = data.get("steps")
    if not isinstance(raw_steps, list):
        raise SpecError(f"{where}: steps must be a list")
    resolved = []
    for raw in raw_steps:
        if not (isinstance(raw, list) and len(raw) in (4, 5) and isinstance(raw[0], str) and isinstance(raw[3], dict)):
            raise SpecError(f"{where}: malformed step {raw!r:.120}")
        name, target, args, kwargs = raw[:4]
        at = f"{where}, step {name!r}"
        context = _context(raw[4], at) if len(raw) == 5 else (None, None)
        if name in known:
            raise SpecError(f"{at}: the name is defined twice")
        fn = resolve_operator(target, at)
        if not isinstance(args, (list, tuple)) or not all(isinstance(k, str) for k in kwargs):
            raise SpecError(f"{at}: malformed arguments")
        decoded_args = tuple(_decode_value(a, known, at) for a in args)
        decoded_kwargs = {k: _decode_value(v, known, at) for k, v in kwargs.items()}
        if fn is not None:
            _check_devices(getattr(fn, "__wrapped_op__", fn), decoded_args, decoded_kwargs, at)
        known.add(name)
        resolved.append((name, fn or _nothing, decoded_args, decoded_kwargs, context))
    outputs = _names(data.get("outputs"), "outputs", where)
    for name in outputs:
        if name not in known:
            raise SpecError(f"{where}: output {name!r} is not defined")
    scalar_inputs = set(_names(data.get("scalar_inputs", []), "scalar_inputs", where))
    scalar_outputs = set(_names(data.get("scalar_outputs", []), "scalar_outputs", where))
    if not scalar_inputs <= set(inputs) or not scalar_outputs <= set(outputs):
        raise SpecError(f"{where}: scalar inputs and outputs must be inputs and outputs")
    steps = _with_drops(resolved, outputs)
    fn = compiled(
        tuple(inputs), frozenset(scalar_inputs), dict(tensors), steps, tuple(outputs), frozenset(scalar_outputs)
    )
    return Program(
        tuple(inputs), frozenset(scalar_inputs), dict(tensors), steps, tuple(outputs), frozenset(scalar_outputs), fn
    )


def _with_drops(steps: Sequence[tuple[Any, ...]], outputs: Sequence[str]) -> tuple[Step, ...]:
    """The steps to run, each with the values to forget after it; a dropped step (an assertion)
    whose value nothing reads does not run at all."""
    used = {r.name for _, _, args, kwargs, _ in steps for r in pytree.tree_leaves((args, kwargs)) if isinstance(r, Ref)}
    steps = [s for s in steps if s[1] is not _nothing or s[0] in used or s[0] in outputs]
    last_use: dict[str, int] = {}
    for i, (_, _, args, kwargs, _) in enumerate(steps):
        for ref in pytree.tree_leaves((args, kwargs)):
            if isinstance(ref, Ref):
                last_use[ref.name] = i
    keep = set(outputs)
    drops: dict[int, list[str]] = {}
    for name, i in last_use.items():
        if name not in keep:
            drops.setdefault(i, []).append(name)
    return tuple(
        Step(n, fn, a, k, tuple(drops.get(i, ())), grad, cast) for i, (n, fn, a, k, (grad, cast)) in enumerate(steps)
    )


def run(program: Program, inputs: Sequence[Any], tensors: Mapping[str, torch.Tensor], device: torch.device) -> tuple:
    """Run ``program`` on ``inputs`` with its weights from ``tensors`` (by attribute name)."""
    if len(inputs) != len(program.inputs):
        raise SpecError(f"the program takes {len(program.inputs)} inputs, got {len(inputs)}")
    return program.fn(inputs, tensors, device)
