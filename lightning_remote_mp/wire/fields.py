"""Message fields, declared once: how each field travels and what a received value must be.

Every typed message (`lightning_remote_mp.wire.messages`, `lightning_remote_mp.wire.requests`) is a
frozen dataclass deriving from `Body`, whose fields are made by `field`: the check a received value
must pass, its name on the wire when that differs, and how it is written. `Body.body` writes a
message and `Body.from_body` reads one from those declarations alone, so that no message writes its
body or its parser by hand, and a malformed body is refused in one way everywhere, naming the kind
and the field (`lightning_remote_mp.errors.ProtocolError`). Nothing here executes what arrives: a
check only looks at plain values that `lightning_remote_mp.wire.protocol` decoded.

>>> @dataclasses.dataclass(frozen=True)
... class Ping(Body):
...     KIND: ClassVar[str] = "ping"
...     seq: int = field(INT)
...     sender: int = field(INT, wire="from", default=-1)
>>> Ping(3).body()
{'seq': 3, 'from': -1}
>>> Ping.from_body({"seq": 3})
Ping(seq=3, sender=-1)
>>> Ping.from_body({"seq": "3"})
Traceback (most recent call last):
...
lightning_remote_mp.errors.ProtocolError: ping message: field 'seq' must be an int, got str
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import torch

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.schedule import SCHEDULES

#: A field's check: ``(kind, field name, received value) -> the field's value``; raises `ProtocolError`.
Check = Callable[[str, str, Any], Any]

_MISSING = dataclasses.MISSING


def _a(name: str) -> str:
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def refuse(kind: str, text: str) -> ProtocolError:
    """The error for a malformed ``kind`` message: ``"<kind> message: <text>"``."""
    return ProtocolError(f"{kind} message: {text}")


def of(types: type | tuple[type, ...]) -> Check:
    """A value of these ``types`` (an ``int`` is never a ``bool``)."""
    expected = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)

    def check(kind: str, name: str, value: Any) -> Any:
        if not isinstance(value, types) or (types is int and isinstance(value, bool)):
            raise refuse(kind, f"field {name!r} must be {_a(expected)}, got {type(value).__name__}")
        return value

    return check


INT, STR, BOOL, DICT, LIST, TENSOR = of(int), of(str), of(bool), of(dict), of(list), of(torch.Tensor)


def number(kind: str, name: str, value: Any) -> float:
    """An int or a float (not a bool), as a float."""
    of((int, float))(kind, name, value)
    if isinstance(value, bool):
        raise refuse(kind, f"field {name!r} must be a number, got bool")
    return float(value)


def choice(values: Sequence[str]) -> Check:
    """One of the strings ``values``."""

    def check(kind: str, name: str, value: Any) -> Any:
        STR(kind, name, value)
        if value not in values:
            raise refuse(kind, f"field {name!r} must be one of {', '.join(map(repr, values))}, got {value!r:.40}")
        return value

    return check


def list_of(test: Callable[[Any], bool], means: str, read: Callable[[list], Any] | None = None) -> Check:
    """A list whose every item passes ``test`` (``means`` says what the items must be)."""

    def check(kind: str, name: str, value: Any) -> Any:
        LIST(kind, name, value)
        for i, item in enumerate(value):
            if not test(item):
                raise refuse(kind, f"field {name!r} must be a list of {means}; item {i} is not")
        return read(value) if read is not None else value

    return check


def map_of(key: Callable[[Any], bool], value: Callable[[Any], bool], means: str) -> Check:
    """A dict whose every entry passes ``key`` and ``value`` (``means``: "keys to values")."""

    def check(kind: str, name: str, got: Any) -> Any:
        DICT(kind, name, got)
        for k, v in got.items():
            if not (key(k) and value(v)):
                raise refuse(kind, f"field {name!r} must map {means}; entry {k!r:.40} does not")
        return got

    return check


def must(test: Callable[[Any], bool], text: str) -> Check:
    """A value that passes ``test``; otherwise the message says ``text`` (which names the field)."""

    def check(kind: str, name: str, value: Any) -> Any:
        if not test(value):
            raise refuse(kind, text)
        return value

    return check


def lenient(read: Callable[[Any], Any]) -> Check:
    """Never refused: ``read`` makes a value of whatever arrived (a flag that is only ``True`` when
    ``True`` arrived, say)."""

    def check(kind: str, name: str, value: Any) -> Any:
        return read(value)

    return check


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_str(value: Any) -> bool:
    return isinstance(value, str)


def is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def is_str_keyed(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


def anything(value: Any) -> bool:
    return True


# --- what the pipeline's values must be (declared here with the checks, so reading a message runs
# --- in this one module: `lightning_remote_mp.wire.messages`, `lightning_remote_mp.wire.requests`)


def is_bool(value: Any) -> bool:
    return type(value) is bool


def is_index(value: Any) -> bool:
    """A request id, an output's position: an int >= 0."""
    return type(value) is int and value >= 0


def is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(map(is_int, value))


def is_direction(value: Any) -> bool:
    """Down the pipeline (1) or up it (-1)."""
    return type(value) is int and value in (1, -1)


def is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(type(d) is int and d >= 0 for d in value)


def is_tensor_or_none(value: Any) -> bool:
    return value is None or isinstance(value, torch.Tensor)


def is_flag(value: Any) -> bool:
    """A ``requires_grad`` entry: a bool per variable, and for the main value a bool or one per element."""
    return isinstance(value, bool) or (isinstance(value, list) and all(type(f) is bool for f in value))


def is_autocast(value: Any) -> bool:
    """``{"enabled": bool, "dtype": a torch dtype or None}``."""
    return (
        isinstance(value, dict)
        and type(value.get("enabled")) is bool
        and (value.get("dtype") is None or isinstance(value["dtype"], torch.dtype))
    )


def is_grad_out(value: Any) -> bool:
    return isinstance(value, torch.Tensor) or (
        isinstance(value, tuple) and all(g is None or isinstance(g, torch.Tensor) for g in value)
    )


def is_schedule(value: Any) -> bool:
    return value in SCHEDULES


def is_scalar(value: Any) -> bool:
    """A floating tensor of one value (a loss's gradient)."""
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def count(kind: str, name: str, value: Any) -> int:
    """A positive count (``microbatches``: 1 where a sender leaves it out)."""
    if INT(kind, name, value) < 1:
        raise refuse(kind, f"field {name!r} must be at least 1, got {value}")
    return value


def true_only(value: Any) -> bool:
    return value is True


def float_or_none(value: Any) -> float | None:
    return value if isinstance(value, float) else None


def bool_or_list_or_none(value: Any) -> Any:
    return value if isinstance(value, (bool, list)) else None


# --- writers: how a field's value goes into a body (plain lists and dicts, as msgpack sends them) --


def each(plain: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A writer for a mapping's values, or a sequence's items: each made ``plain`` (``dict``, ``list``)."""
    return lambda v: {k: plain(x) for k, x in v.items()} if isinstance(v, Mapping) else [plain(x) for x in v]


def field(
    check: Check,
    *,
    wire: str | None = None,
    default: Any = _MISSING,
    default_factory: Any = _MISSING,
    write: Callable[[Any], Any] | None = None,
    omit_none: bool = False,
    init: bool = True,
    repr: bool = True,
) -> Any:
    """A message field: ``check`` what arrives; travel as ``wire`` (default: the attribute's name);
    ``write`` the value into a body (default: as it is); ``omit_none`` leaves a ``None`` out of the
    body. A field with a default may be missing (or ``None``) in a received body."""
    metadata = {"check": check, "wire": wire, "write": write, "omit_none": omit_none}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, init=init, repr=repr, metadata=metadata)
    return dataclasses.field(default=default, init=init, repr=repr, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class _Field:
    attr: str
    wire: str
    check: Check
    write: Callable[[Any], Any] | None
    omit_none: bool
    default: Any  # _MISSING when the field is required

    def read(self, kind: str, body: Mapping[str, Any]) -> Any:
        value = body.get(self.wire)
        if value is None:
            if self.default is _MISSING:
                raise refuse(kind, f"field {self.wire!r} is missing")
            return self.default() if callable(self.default) else self.default
        return self.check(kind, self.wire, value)


_B = TypeVar("_B", bound="Body")


class Body:
    """A typed message: a frozen dataclass of `field`s (see the module docstring). ``KIND`` names
    the message kind in errors (`lightning_remote_mp.wire.protocol.Kind`). A message without fields
    travels with no body (``None``)."""

    KIND: ClassVar[str]

    @classmethod
    @functools.cache
    def _fields(cls) -> tuple[_Field, ...]:
        out = []
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            meta = f.metadata
            if "check" not in meta:
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with wire.fields.field")
            # A default that is itself callable (a class, say) would be called by `_Field.read`.
            assert not callable(f.default), f"{cls.__name__}.{f.name}: give a callable default as default_factory"
            default = f.default_factory if f.default is _MISSING else f.default  # each _MISSING where not given
            out.append(_Field(f.name, meta["wire"] or f.name, meta["check"], meta["write"], meta["omit_none"], default))
        return tuple(out)

    def body(self) -> dict[str, Any] | None:
        """The message body, as `lightning_remote_mp.wire.protocol.encode` sends it."""
        fields = self._fields()
        if not fields:
            return None
        out = {}
        for f in fields:
            value = getattr(self, f.attr)
            if value is None and f.omit_none:
                continue
            out[f.wire] = f.write(value) if f.write is not None and value is not None else value
        return out

    @classmethod
    def from_body(cls: type[_B], body: Any) -> _B:
        """A received body, checked; raises `ProtocolError` naming the kind and the field if it is malformed."""
        values = cls._read(body)
        init = cls._init_names()
        return cls(**{k: v for k, v in values.items() if k in init})

    @classmethod
    @functools.cache
    def _init_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in dataclasses.fields(cls) if f.init)  # type: ignore[arg-type]

    @classmethod
    def _read(cls, body: Any) -> dict[str, Any]:
        """Every field's value from a received body, checked, by attribute name."""
        fields = cls._fields()
        if body is None and not fields:
            return {}
        if not isinstance(body, dict):
            raise refuse(cls.KIND, "the body must be a dict")
        values = {f.attr: f.read(cls.KIND, body) for f in fields}
        cls._check(values)
        return values

    @classmethod
    def _check(cls, values: dict[str, Any]) -> None:
        """What the fields must be together (each alone is checked by its own `field`): raise
        `refuse` if they do not fit."""
