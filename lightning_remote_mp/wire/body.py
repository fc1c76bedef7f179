"""A typed message body: a ``msgspec.Struct``, written as the dict `protocol` sends and read back
strictly.

Every typed message (`lightning_remote_mp.wire.messages`, `lightning_remote_mp.wire.requests`,
`lightning_remote_mp.wire.state`, `lightning_remote_mp.wire.grads`, `lightning_remote_mp.wire.carry`)
derives from `Body`: its fields' types say what a received value must be (constraints with
``Annotated[..., msgspec.Meta(...)]``, what fields must be together in ``__post_init__``), a field
that travels under another name says it with ``msgspec.field(name=...)``. `Body.from_body` reads a
body with ``msgspec.convert`` in strict mode, so a malformed body is refused in one way everywhere,
naming the kind and the field (`lightning_remote_mp.errors.ProtocolError`). Nothing here executes
what arrives: a body is plain values that `lightning_remote_mp.wire.protocol` decoded, and the only
objects besides (tensors, dtypes, tuples) are made by its extension types.

>>> class Ping(Body, frozen=True):
...     KIND: ClassVar[str] = "ping"
...     seq: Index
...     sender: int = msgspec.field(name="from", default=-1)
>>> Ping(3).body()
{'seq': 3, 'from': -1}
>>> Ping.from_body({"seq": 3})
Ping(seq=3, sender=-1)
>>> Ping.from_body({"seq": "3"})
Traceback (most recent call last):
...
lightning_remote_mp.errors.ProtocolError: ping message: field 'seq': expected an int, got a str
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec
import torch

from lightning_remote_mp.errors import ProtocolError

#: An int >= 0: a request id, a stage or micro-batch number, an output's position.
Index = Annotated[int, msgspec.Meta(ge=0)]
#: A positive count (``microbatches``, ``stages``).
Count = Annotated[int, msgspec.Meta(ge=1)]


def refuse(kind: str, text: str) -> ProtocolError:
    """The error for a malformed ``kind`` message: ``"<kind> message: <text>"``."""
    return ProtocolError(f"{kind} message: {text}")


def _dec_hook(kind: type, value: Any) -> Any:
    """A received value where a field wants a tensor or a dtype: what `protocol`'s extension types
    made, or a refusal."""
    if isinstance(kind, type) and isinstance(value, kind):
        return value
    raise ValueError(f"expected {'a tensor' if kind is torch.Tensor else kind.__name__}, got {type(value).__name__}")


_AT = re.compile(r"^(.*) - at `\$\.?([^`]*)`$", re.S)
_KEY = re.compile(r"^(.*) - at `key` in `\$\.?([^`]*)`$", re.S)
#: msgspec's names of received types (msgpack's), as a Python reader knows them.
_WORDS = {"array": "a list", "object": "a dict", "int": "an int", "str": "a str", "bool": "a bool"}
_WORDS |= {"float": "a float", "null": "None", "bytes": "bytes"}


def _words(text: str) -> str:
    def named(m: re.Match[str]) -> str:
        names = m[1].split(" | ")
        return " or ".join(_WORDS.get(n, f"`{n}`") for n in names) if all(n in _WORDS for n in names) else m[0]

    return re.sub(r"`([\w |]+)`", named, text)


def _said(err: msgspec.ValidationError) -> str:
    """msgspec's refusal in the words of the rest of lrmp's: which field, and what was wrong."""
    text = _words(str(err))
    text = text[:1].lower() + text[1:]
    missing = re.fullmatch(r"object missing required field `([^`]*)`", text)
    if missing:
        return f"field {missing[1]!r} is missing"
    unknown = re.fullmatch(r"object contains unknown field `([^`]*)`", text)
    if unknown:
        return f"unknown field {unknown[1]!r:.60}"
    key = _KEY.match(text)
    if key:
        return f"field {key[2]!r}: a key: {key[1]}"
    at = _AT.match(text)
    if at:
        return f"field {at[2]!r}: {at[1]}" if at[2] else at[1]
    return text


def plain(value: Any) -> Any:
    """A writer (`Body.WRITE`): a mapping as a ``dict``, another sequence as a ``list`` (a tuple
    would travel as a tuple)."""
    return dict(value) if isinstance(value, Mapping) else list(value)


def each(write: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A writer for a mapping's values, or a sequence's items: each ``write``-n."""
    return lambda v: {k: write(x) for k, x in v.items()} if isinstance(v, Mapping) else [write(x) for x in v]


_B = TypeVar("_B", bound="Body")


class Body(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A typed message (see the module docstring). ``KIND`` names the message kind in errors
    (`lightning_remote_mp.wire.protocol.Kind`); ``OMIT_NONE``: fields left out of a body where
    ``None``; ``WRITE``: how a field's value is written into a body where it is not as it is. A
    message without fields travels with no body (``None``)."""

    KIND: ClassVar[str]
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset()
    WRITE: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}

    @classmethod
    @functools.cache
    def _written(cls) -> tuple[tuple[str, str, bool, Callable[[Any], Any] | None], ...]:
        return tuple(
            (f.name, f.encode_name, f.name in cls.OMIT_NONE, cls.WRITE.get(f.name)) for f in msgspec.structs.fields(cls)
        )

    def body(self) -> dict[str, Any] | None:
        """The message body, as `lightning_remote_mp.wire.protocol.encode` sends it."""
        written = self._written()
        if not written:
            return None
        out: dict[str, Any] = {}
        for attr, wire, omit_none, write in written:
            value = getattr(self, attr)
            if value is None:
                if not omit_none:
                    out[wire] = None
            else:
                out[wire] = write(value) if write is not None else value
        return out

    @classmethod
    def from_body(cls: type[_B], body: Any) -> _B:
        """A received body, checked; raises `ProtocolError` naming the kind and the field if it is
        malformed. A field that arrives as ``None`` takes its default."""
        if body is None and not cls._written():
            return cls()
        if not isinstance(body, dict):
            raise refuse(cls.KIND, "the body must be a dict")
        try:
            return msgspec.convert({k: v for k, v in body.items() if v is not None}, cls, dec_hook=_dec_hook)
        except msgspec.ValidationError as err:
            raise refuse(cls.KIND, _said(err)) from None

    def replace(self: _B, **changes: Any) -> _B:
        """This message with ``changes``."""
        return msgspec.structs.replace(self, **changes)
