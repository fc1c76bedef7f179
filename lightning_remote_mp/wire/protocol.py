"""The wire format: a msgpack header frame followed by one raw frame per tensor. No pickle.

A message is a list of ZeroMQ frames::

    [header, tensor_0, tensor_1, ...]

The header is the msgpack array ``[version, kind, id, session, metas, body]``. ``body`` is any
tree of msgpack values; tensors inside it are replaced by an extension value that points at
their entry in ``metas`` (``[dtype name, shape]``) and at their raw frame. Tuples and
``torch.dtype`` values also travel as extension values, so kwargs such as ``kernel_size=(3, 3)``
or ``dtype=torch.bfloat16`` arrive as they were sent. Decoding builds only tensors, tuples,
dtypes and plain msgpack values: nothing that arrives can name a class or run code.

One ZeroMQ message may also carry several messages, one after the other: a *bundle*
(`encode_all`, `decode_all`). Each header says how many tensor frames follow it. The driver sends a
call's micro-batches to a stage as one bundle, and a stage answers them in one, so that a call
costs a send and a wake-up per side rather than one per micro-batch.

The first three header fields (``version``, ``kind``, ``id``) keep their place and meaning in every
protocol version, so two sides of different versions can still tell which versions they speak and
answer the request that failed (`lightning_remote_mp.errors.ProtocolVersionError`).

>>> frames = encode("forward", 7, "s1", {"x": torch.ones(2, 3), "shape": (2, 3)})
>>> msg = decode(frames)
>>> msg.kind, msg.id, msg.body["shape"], msg.body["x"].shape
('forward', 7, (2, 3), torch.Size([2, 3]))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgpack
import torch

from lightning_remote_mp._version import __version__

# LimitExceeded lives with the other errors; ``protocol.LimitExceeded`` stays its name here too.
from lightning_remote_mp.errors import ConfigurationError, LimitExceeded, ProtocolError, ProtocolVersionError
from lightning_remote_mp.flow import Word
from lightning_remote_mp.wire.compression import compress, compressible, decompressed

PROTOCOL_VERSION = 18


class Kind(Word):
    """Every message kind on the wire. Requests go driver -> worker (peers send FORWARD/BACKWARD);
    replies are OK or ERROR and echo the request id. A kind is a ``str``: a received one (plain
    text) compares, hashes and prints as its value."""

    HELLO = "hello"
    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    RELEASE = "release"
    OPTIM_CREATE = "optim_create"
    OPTIM_STEP = "optim_step"
    ZERO_GRAD = "zero_grad"
    GET_STATE = "get_state"
    LOAD_STATE = "load_state"
    GET_OPTIM_STATE = "get_optim_state"
    LOAD_OPTIM_STATE = "load_optim_state"
    GRADS = "grads"
    PROFILE = "profile"
    TIMELINE = "timeline"
    GROUP = "group"
    SYNC = "sync"  # answered once every request sent before it has run (the quiet ones below included)
    FETCH = "fetch"  # the outputs the last stage kept for a call (read on the driver)
    LOSS = "loss"  # a loss over an output the last stage kept, computed there
    CARRY = "carry"  # quiet requests for the stages down (or up) the pipeline, passed stage to stage
    LOSS_GRAD = "loss_grad"  # the driver's gradient of a call's loss, whose backward the stages ran on their own
    SAVE = "save"  # write this worker's share of a sharded checkpoint (safetensors)
    SAVED = "saved"  # whether a sharded checkpoint's file written in the background is done
    READ_OPTIM = "read_optim"  # load an optimizer's state from a sharded checkpoint's files
    RESULT = "result"  # worker -> driver: the last stage's output of one micro-batch
    DONE = "done"  # worker -> driver: stage 0 finished one micro-batch's backward
    BYE = "bye"
    PING = "ping"
    OK = "ok"
    ERROR = "error"


# The short names the package uses.
HELLO, SETUP, FORWARD, BACKWARD = Kind.HELLO, Kind.SETUP, Kind.FORWARD, Kind.BACKWARD
RELEASE, OPTIM_CREATE, OPTIM_STEP, ZERO_GRAD = Kind.RELEASE, Kind.OPTIM_CREATE, Kind.OPTIM_STEP, Kind.ZERO_GRAD
GET_STATE, LOAD_STATE = Kind.GET_STATE, Kind.LOAD_STATE
GET_OPTIM_STATE, LOAD_OPTIM_STATE = Kind.GET_OPTIM_STATE, Kind.LOAD_OPTIM_STATE
GRADS, PROFILE, TIMELINE, GROUP, SYNC = Kind.GRADS, Kind.PROFILE, Kind.TIMELINE, Kind.GROUP, Kind.SYNC
FETCH, LOSS, CARRY, LOSS_GRAD = Kind.FETCH, Kind.LOSS, Kind.CARRY, Kind.LOSS_GRAD
SAVE, SAVED, READ_OPTIM = Kind.SAVE, Kind.SAVED, Kind.READ_OPTIM
RESULT, DONE, BYE, PING, OK, ERROR = Kind.RESULT, Kind.DONE, Kind.BYE, Kind.PING, Kind.OK, Kind.ERROR


def version_mismatch(other: str, other_version: Any, other_lrmp: Any, this: str) -> str:
    """What to tell the user when two sides speak different protocol versions (said once, for the
    driver's errors and the worker's replies alike).

    >>> version_mismatch("the driver", 9, "9.0.0", "this worker")  # doctest: +ELLIPSIS
    'the driver speaks lrmp wire protocol version 9 (lrmp 9.0.0); this worker speaks version ...'
    """
    other_lrmp = other_lrmp[:40] if isinstance(other_lrmp, str) else "?"  # sent by anyone: no str() of it
    return (
        f"{other} speaks lrmp wire protocol version {other_version!r:.20} (lrmp {other_lrmp}); "
        f"{this} speaks version {PROTOCOL_VERSION} (lrmp {__version__}): install the same lightning_remote_mp "
        "version on the driver and every worker"
    )


#: What a worker accepts; the others travel worker -> driver.
REQUEST_KINDS = frozenset(Kind) - {RESULT, DONE, OK, ERROR}

#: Requests a worker answers only when they fail: the driver sends them every step without
#: waiting (`lightning_remote_mp.wire.transport.Connection.carry`), and an OK per step and worker
#: would cost both sides a message for nothing. The ERROR of one says ``"posted": kind``; a SYNC
#: request is answered once they have all run.
QUIET_KINDS = frozenset({OPTIM_STEP, ZERO_GRAD, RELEASE, LOSS_GRAD})

#: Requests that may travel along the pipeline instead of straight to their worker
#: (`lightning_remote_mp.wire.carry.Carry`): the quiet ones, which the driver never waits for.
CARRIED_KINDS = QUIET_KINDS

_EXT_TENSOR = 1
_EXT_TUPLE = 2
_EXT_DTYPE = 3
_EXT_COMPRESSED = 4  # a floating tensor sent compressed (`wire.compression`): [mode, dtype, shape, frame indices]


DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_DTYPE_NAMES = {d: n for n, d in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds a receiver enforces before it allocates anything (the worker's ``--max-*`` flags).

    A worker reports its limits in its HELLO reply, and the driver checks what it sends against
    them, so a message over a limit fails on the driver with an error naming the flag to raise.
    """

    # Each limit a worker flag sets names it (and says how it reads) in its metadata: the worker's
    # command line and the driver's errors are made from these fields.

    #: Tensors (raw frames) in one message (``--max-tensors``).
    max_frames: int = dataclasses.field(
        default=4096, metadata={"flag": "--max-tensors", "help": "tensors in one message"}
    )
    #: Size of the msgpack header: every non-tensor value of a message (``--max-header-bytes``).
    max_header_bytes: int = dataclasses.field(
        default=64 * 1024**2,
        metadata={"flag": "--max-header-bytes", "help": "non-tensor part of one message", "bytes": True},
    )
    #: Dimensions of one tensor (``--max-tensor-dims``).
    max_tensor_dims: int = dataclasses.field(
        default=32, metadata={"flag": "--max-tensor-dims", "help": "dimensions of one tensor"}
    )
    #: Bytes of tensor data in one message (``--max-message-bytes``); also ZeroMQ's cap on one frame,
    #: so an oversized frame is refused while it arrives, before it is buffered whole.
    max_message_bytes: int = dataclasses.field(
        default=16 * 1024**3,
        metadata={
            "flag": "--max-message-bytes",
            "help": "tensor data in one message, and the largest frame",
            "bytes": True,
        },
    )
    #: Tuples nest through the decoder's C stack (each level is a nested msgpack unpack), so their
    #: depth is bounded: a few hundred levels would overflow it and crash the process.
    max_tuple_depth: int = 32
    #: Layers in one stage at SETUP (and in one PROFILE request) (``--max-layers``).
    max_layers: int = dataclasses.field(
        default=100_000, metadata={"flag": "--max-layers", "help": "layers in one stage"}
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ConfigurationError(f"limit {f.name} must be a positive integer, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Any) -> Limits:
        """The limits a peer reported; unknown or malformed entries keep their defaults."""
        if not isinstance(values, dict):
            return cls()
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names and type(v) is int and v > 0})

    @property
    def frame_cap(self) -> int:
        """The largest single frame a socket should accept (ZeroMQ's ``MAXMSGSIZE``)."""
        return max(self.max_message_bytes, self.max_header_bytes)


DEFAULT_LIMITS = Limits()

#: Names of the worker flags that set each limit, for error messages.
LIMIT_FLAGS = {f.name: f.metadata["flag"] for f in dataclasses.fields(Limits) if "flag" in f.metadata}


@dataclasses.dataclass
class Message:
    kind: str
    id: int
    session: str
    body: Any


def _tensor_frame(t: torch.Tensor) -> tuple[list[Any], memoryview]:
    name = _DTYPE_NAMES.get(t.dtype)
    if t.layout != torch.strided:
        raise ProtocolError(f"cannot send a {t.layout} tensor; only dense (strided) tensors travel")
    if name is None:
        raise ProtocolError(f"cannot send a tensor of dtype {t.dtype}; supported: {sorted(DTYPES)}")
    # Each step only where it changes something: a decode step sends a few small tensors per message,
    # and each call here is a microsecond or more (several after a stage's weights flushed the caches).
    if t.requires_grad:
        t = t.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    # A zero-copy view of the bytes: numpy's, as bytes (bfloat16, which numpy lacks, and an empty
    # tensor, which a memoryview cannot cast, are viewed as bytes by torch first).
    if t.dtype is torch.bfloat16 or t.numel() == 0:
        return [name, list(t.shape)], memoryview(t.reshape(-1).view(torch.uint8).numpy())
    return [name, list(t.shape)], memoryview(t.numpy()).cast("B")


def encode(
    kind: str,
    req_id: int,
    session: str,
    body: Any = None,
    limits: Limits | None = None,
    compression: str | None = None,
) -> list[Any]:
    """Encode a message into ZeroMQ frames; tensors become zero-copy frames.

    With ``limits`` (the receiver's), a message the receiver would refuse raises `LimitExceeded`.
    With ``compression`` (`lightning_remote_mp.wire.compression.COMPRESSIONS`), floating tensors of at
    least `~lightning_remote_mp.wire.compression.COMPRESS_FROM` elements
    travel compressed, and `decode` gives them back in their dtype (with the compression's error);
    under ``"int8"``, one with an infinity or a NaN travels as it is.
    """
    metas: list[list[Any]] = []
    frames: list[Any] = []
    depth = 0

    def add(t: torch.Tensor) -> int:
        meta, data = _tensor_frame(t)
        metas.append(meta)
        frames.append(data)
        return len(metas) - 1

    def default(obj: Any) -> Any:
        nonlocal depth
        if isinstance(obj, torch.Tensor) and compression is not None and compressible(obj, compression):
            spec = [compression, _DTYPE_NAMES[obj.dtype], list(obj.shape), [add(p) for p in compress(obj, compression)]]
            return msgpack.ExtType(_EXT_COMPRESSED, msgpack.packb(spec))
        if isinstance(obj, torch.Tensor):
            return msgpack.ExtType(_EXT_TENSOR, add(obj).to_bytes(4, "little"))
        if isinstance(obj, tuple):
            if depth >= DEFAULT_LIMITS.max_tuple_depth:
                raise ProtocolError(f"tuples nested deeper than {DEFAULT_LIMITS.max_tuple_depth} levels cannot be sent")
            depth += 1
            try:
                return msgpack.ExtType(_EXT_TUPLE, _pack(list(obj)))
            finally:
                depth -= 1
        if isinstance(obj, torch.dtype):
            if obj not in _DTYPE_NAMES:
                raise ProtocolError(f"cannot send dtype {obj}")
            return msgpack.ExtType(_EXT_DTYPE, _DTYPE_NAMES[obj].encode())
        plain: Any
        for plain in (bool, int, float, str, dict, list):  # their subclasses, as msgpack packs them
            if isinstance(obj, plain):
                return plain(obj)
        raise ProtocolError(
            f"cannot send a value of type {type(obj).__qualname__} ({obj!r:.80}); only numbers, strings, "
            "bools, None, lists, tuples, dicts, torch dtypes and tensors travel"
        )

    def _pack(obj: Any) -> bytes:
        return msgpack.packb(obj, default=default, strict_types=True, use_bin_type=True)

    try:
        packed_body = _pack(body)
        header = msgpack.packb(
            [PROTOCOL_VERSION, kind, req_id, session, metas, msgpack.ExtType(0, packed_body)],
            use_bin_type=True,
        )
    except (TypeError, ValueError, OverflowError, RecursionError) as err:
        raise ProtocolError(f"cannot encode {kind!r} message: {err}") from err
    finally:
        # default and _pack refer to each other: break the cycle so that the frames (and the tensors
        # they view) are freed when the message is sent, not at the next garbage collection.
        default = _pack = None  # noqa: F841
    if limits is not None:
        _check_outgoing(kind, header, metas, frames, limits)
    return [header, *frames]


def _check_outgoing(kind: str, header: bytes, metas: list[list[Any]], frames: list[Any], limits: Limits) -> None:
    what = f"the {kind!r} message"
    if len(frames) > limits.max_frames:
        raise LimitExceeded(f"{what} has {len(frames)} tensors; the receiver accepts {limits.max_frames}", "max_frames")
    if len(header) > limits.max_header_bytes:
        raise LimitExceeded(
            f"{what} has a header of {len(header)} bytes; the receiver accepts {limits.max_header_bytes}",
            "max_header_bytes",
        )
    dims = max((len(m[1]) for m in metas), default=0)
    if dims > limits.max_tensor_dims:
        raise LimitExceeded(
            f"{what} has a tensor of {dims} dimensions; the receiver accepts {limits.max_tensor_dims}",
            "max_tensor_dims",
        )
    total = sum(len(f) for f in frames)
    if total > limits.max_message_bytes:
        raise LimitExceeded(
            f"{what} carries {total} bytes of tensors; the receiver accepts {limits.max_message_bytes}",
            "max_message_bytes",
        )


def peek_id(frames: Sequence[Any]) -> int:
    """The request id of a message that may not decode (0 when even that is unreadable), so that
    the error reply reaches the request that caused it: read from the first fields of the header's
    array alone (its first 4 KiB)."""
    try:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, ext_hook=lambda c, d: None)
        unpacker.feed(bytes(_frame_buffer(frames[0])[:4096]))
        if unpacker.read_array_header() < 3:
            return 0
        unpacker.skip()
        unpacker.skip()
        req_id = unpacker.unpack()
    except Exception:
        return 0
    return req_id if type(req_id) is int and 0 <= req_id < 2**63 else 0


def _foreign_info(packed: Any) -> dict[str, Any]:
    """What a message of another protocol version says about its sender, read as plain values only."""
    if not (isinstance(packed, msgpack.ExtType) and packed.code == 0):
        return {}
    try:
        body = msgpack.unpackb(packed.data[:65536], raw=False, strict_map_key=False, ext_hook=lambda c, d: None)
    except Exception:
        return {}
    if not isinstance(body, dict):
        return {}
    return {
        k: v
        for k, v in body.items()
        if isinstance(k, str) and (isinstance(v, (int, float, bool)) or (isinstance(v, str) and len(v) <= 500))
    }


def _check_meta(meta: Any, frame_len: int, limits: Limits, index: int) -> tuple[torch.dtype, list[int]]:
    if not (isinstance(meta, list) and len(meta) == 2):
        raise ProtocolError(f"tensor {index}: malformed description {meta!r:.80}")
    name, shape = meta
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ProtocolError(f"tensor {index}: unknown dtype {name!r:.40}")
    if not isinstance(shape, list):
        raise ProtocolError(f"tensor {index}: shape must be a list of at most {limits.max_tensor_dims} sizes")
    if len(shape) > limits.max_tensor_dims:
        raise LimitExceeded(
            f"tensor {index}: shape must be a list of at most {limits.max_tensor_dims} sizes", "max_tensor_dims"
        )
    for s in shape:
        if type(s) is not int or not 0 <= s < 2**62:
            raise ProtocolError(f"tensor {index}: invalid shape {shape!r:.80}")
    itemsize = dtype.itemsize
    count = math.prod(shape)
    # Even with no elements (a zero in the shape), torch overflows computing such strides.
    if (count or math.prod(max(s, 1) for s in shape)) * itemsize >= 2**62:
        raise ProtocolError(f"tensor {index}: shape {shape!r:.80} is too large")
    if count * itemsize != frame_len:
        raise ProtocolError(
            f"tensor {index}: {name}{shape} needs {count * itemsize} bytes but its frame has {frame_len}"
        )
    return dtype, shape


def _frame_buffer(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    return frame.buffer  # zmq.Frame: zero-copy view of the received message


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode the frames of one message into a `Message`; raises `ProtocolError` on anything malformed."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) - 1 > limits.max_frames:
        raise LimitExceeded(
            f"message has {len(frames) - 1} tensor frames; the limit is {limits.max_frames}", "max_frames"
        )
    buffers = [_frame_buffer(f) for f in frames]
    _check_bytes(sum(len(b) for b in buffers[1:]), limits)
    header = _header(buffers[0], limits)
    if len(header[4]) != len(buffers) - 1:
        raise ProtocolError(f"header describes {len(header[4])} tensors but {len(buffers) - 1} tensor frames arrived")
    return _message(header, buffers[1:], limits)


def _check_bytes(total: int, limits: Limits) -> None:
    if total > limits.max_message_bytes:
        raise LimitExceeded(
            f"message of {total} bytes exceeds the limit of {limits.max_message_bytes}", "max_message_bytes"
        )


def encode_all(messages: Iterable[list[Any]], limits: Limits = DEFAULT_LIMITS) -> list[list[Any]]:
    """Several encoded messages (`encode`'s frames) as few ZeroMQ messages, *bundles*: a bundle
    costs one send and one wake-up of the receiver instead of one per message. Each bundle stays
    within the receiver's ``limits`` (`decode_all`, which splits it); a message that is within
    them alone makes a bundle of its own.

    >>> bundles = encode_all([encode("forward", 1, "s", {"mb": 0}), encode("forward", 2, "s", {"mb": 1})])
    >>> [[m.body["mb"] for m in decode_all(bundle)] for bundle in bundles]
    [[0, 1]]
    """
    bundles: list[list[Any]] = []
    bundle: list[Any] = []
    count = tensors = size = 0
    for frames in messages:
        more, more_bytes = len(frames) - 1, sum(len(f) for f in frames[1:])
        if bundle and (
            count >= limits.max_frames
            or tensors + more > limits.max_frames
            or size + more_bytes > limits.max_message_bytes
        ):
            bundles.append(bundle)
            bundle, count, tensors, size = [], 0, 0, 0
        bundle.extend(frames)
        count, tensors, size = count + 1, tensors + more, size + more_bytes
    if bundle:
        bundles.append(bundle)
    return bundles


def decode_all(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> list[Message]:
    """Decode one message, or a bundle of them (`encode_all`), in order. A bundle is taken whole or
    not at all: anything malformed in it raises `ProtocolError`, and none of it is returned.

    Each header says how many tensor frames follow it. ``limits`` bound the bundle as a whole (its
    tensors and their bytes, and its messages: at most ``max_frames`` of each) and each header."""
    if not frames:
        raise ProtocolError("empty message")
    if len(frames) > 2 * limits.max_frames:  # at most max_frames headers and max_frames tensors
        raise LimitExceeded(
            f"message has {len(frames)} frames; a bundle holds at most {limits.max_frames} messages and "
            f"{limits.max_frames} tensors",
            "max_frames",
        )
    buffers = [_frame_buffer(f) for f in frames]
    parts: list[tuple[list[Any], list[memoryview]]] = []  # every header checked before any body is decoded
    tensor_count = tensor_bytes = at = 0
    while at < len(buffers):
        if len(parts) == limits.max_frames:
            raise LimitExceeded(
                f"a bundle of over {limits.max_frames} messages; the limit is {limits.max_frames}", "max_frames"
            )
        header = _header(buffers[at], limits)
        metas = header[4]
        tensors = buffers[at + 1 : at + 1 + len(metas)]
        if len(tensors) != len(metas):
            raise ProtocolError(f"header describes {len(metas)} tensors but {len(tensors)} tensor frames arrived")
        tensor_count += len(tensors)
        if tensor_count > limits.max_frames:
            raise LimitExceeded(
                f"message has at least {tensor_count} tensor frames; the limit is {limits.max_frames}", "max_frames"
            )
        tensor_bytes += sum(len(b) for b in tensors)
        _check_bytes(tensor_bytes, limits)
        parts.append((header, tensors))
        at += 1 + len(tensors)
    return [_message(header, tensors, limits) for header, tensors in parts]


def _header(buffer: memoryview, limits: Limits) -> list[Any]:
    """A message's header, checked: ``[version, kind, id, session, metas, body]``."""
    if len(buffer) > limits.max_header_bytes:
        raise LimitExceeded(
            f"header of {len(buffer)} bytes exceeds the limit of {limits.max_header_bytes}", "max_header_bytes"
        )
    try:
        header = msgpack.unpackb(buffer, raw=False, strict_map_key=False, use_list=True)
    except Exception as err:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(f"undecodable header: {err}") from None
    if not isinstance(header, list) or not header:
        raise ProtocolError("header is not an array")
    version = header[0]
    if type(version) is not int or version != PROTOCOL_VERSION:
        remote = version if type(version) is int else None
        raise ProtocolVersionError(
            f"protocol version {version!r:.20} received; this side speaks {PROTOCOL_VERSION}",
            remote_version=remote,
            info=_foreign_info(header[5]) if remote is not None and len(header) == 6 else None,
        )
    if len(header) != 6:
        raise ProtocolError("header is not a 6-element array")
    _, kind, req_id, session, metas, packed = header
    if not isinstance(kind, str) or not isinstance(req_id, int) or not isinstance(session, str):
        raise ProtocolError("header fields kind/id/session have the wrong types")
    if not isinstance(metas, list):
        raise ProtocolError("header describes no tensors (its tensor list is missing)")
    if not (isinstance(packed, msgpack.ExtType) and packed.code == 0):
        raise ProtocolError("header body is missing")
    return header


def _message(header: list[Any], buffers: Sequence[memoryview], limits: Limits) -> Message:
    """One message from its checked header and its tensor frames."""
    _, kind, req_id, session, metas, packed = header
    tensors: list[torch.Tensor] = []
    depth = 0
    for i, (meta, buf) in enumerate(zip(metas, buffers)):
        dtype, shape = _check_meta(meta, len(buf), limits, i)
        if len(buf) == 0:
            tensors.append(torch.empty(shape, dtype=dtype))
        else:
            # A frame kept as bytes (a request carried along the pipeline, `carry.Carried`) is
            # read-only: torch would warn, and a tensor over it must not be written. It is small: copied.
            view = memoryview(bytearray(buf)) if buf.readonly else buf
            tensors.append(torch.frombuffer(view, dtype=dtype).reshape(shape))

    def ext_hook(code: int, data: bytes) -> Any:
        nonlocal depth
        if code == _EXT_TENSOR:
            index = int.from_bytes(data, "little")
            if index >= len(tensors):
                raise ProtocolError(f"reference to tensor {index}, but only {len(tensors)} arrived")
            return tensors[index]
        if code == _EXT_COMPRESSED:
            try:
                spec = msgpack.unpackb(data, raw=False, strict_map_key=False)
            except Exception:
                raise ProtocolError("malformed compressed tensor") from None
            return decompressed(spec, tensors, DTYPES, limits.max_tensor_dims)
        if code == _EXT_TUPLE:
            if depth >= limits.max_tuple_depth:
                raise ProtocolError(f"tuples nested deeper than {limits.max_tuple_depth} levels")
            depth += 1
            try:
                inner = _unpack(data)
            finally:
                depth -= 1
            if not isinstance(inner, list):
                raise ProtocolError("malformed tuple")
            return tuple(inner)
        if code == _EXT_DTYPE:
            dtype = DTYPES.get(data.decode("utf-8", "replace"))
            if dtype is None:
                raise ProtocolError(f"unknown dtype {data[:40]!r}")
            return dtype
        raise ProtocolError(f"unknown extension type {code}")

    def _unpack(data: bytes) -> Any:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True, ext_hook=ext_hook)

    try:
        body = _unpack(packed.data)
    except ProtocolError:
        raise
    except Exception as err:
        raise ProtocolError(f"undecodable body: {err}") from None
    finally:
        # As in encode: no reference cycle may keep the received buffers alive until a collection.
        ext_hook = _unpack = None  # noqa: F841
    return Message(kind=kind, id=req_id, session=session, body=body)
