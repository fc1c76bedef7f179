"""The wire format: round trips of every supported value, and refusal of everything malformed.

``decode`` faces bytes from the network, so every malformed input must end in a ProtocolError:
any other exception (or a crash) would take a worker down.
"""

from __future__ import annotations

import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.protocol import DTYPES, Limits, Message, decode, encode

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    """A tensor of ``dtype`` with varied values (extremes included for integers)."""
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    t = torch.randint(info.min, info.max, shape, dtype=dtype, generator=g)
    flat = t.view(-1)
    if flat.numel():
        flat[0], flat[-1] = info.min, info.max
    return t


def _roundtrip(body):
    return decode(encode("forward", 3, "sess", body))


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert isinstance(b, torch.Tensor)
    assert b.dtype == a.dtype
    assert b.shape == a.shape
    assert torch.equal(b, a.detach())


def _header(frames) -> list:
    return msgpack.unpackb(frames[0], raw=False, strict_map_key=False)


def _with_header(frames, header: list, tensors=None) -> list:
    return [msgpack.packb(header, use_bin_type=True), *(frames[1:] if tensors is None else tensors)]


def _raw(metas, body_bytes: bytes, frames=(), version=None, kind="forward", req_id=1, session="s") -> list:
    version = protocol.PROTOCOL_VERSION if version is None else version
    header = [version, kind, req_id, session, metas, msgpack.ExtType(0, body_bytes)]
    return [msgpack.packb(header, use_bin_type=True), *frames]


NONE = msgpack.packb(None)


def _tensor_ref(i: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, i.to_bytes(4, "little"))


# --- round trips ------------------------------------------------------------------------


def test_dtypes_cover_the_documented_set():
    assert set(DTYPES.values()) >= {torch.float32, torch.bfloat16, torch.bool, torch.complex128, torch.uint8}
    assert all(DTYPES[name] is d for name, d in DTYPES.items())


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(3, 4), (), (0,), (2, 0, 5), (1, 1, 1, 7)], ids=lambda s: f"shape{list(s)}")
def test_every_dtype_round_trips(name, shape):
    dtype = DTYPES[name]
    t = _sample(dtype, shape)
    frames = encode("forward", 3, "sess", {"x": t})
    assert len(frames) == 2
    assert len(memoryview(frames[1]).cast("B")) == t.numel() * t.element_size()
    msg = decode(frames)
    assert isinstance(msg, Message)
    assert (msg.kind, msg.id, msg.session) == ("forward", 3, "sess")
    _same(t, msg.body["x"])


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_non_contiguous_and_offset_views_round_trip(name):
    base = _sample(DTYPES[name], (6, 8))
    views = {
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "offset": base[3:, 5:],
        "expanded": base[0:1].expand(4, 8),
        "column": base[:, 2],
    }
    for what, v in views.items():
        assert what == "offset" or not v.is_contiguous() or v.dim() == 1
        _same(v, _roundtrip(v).body)


def test_conjugate_negative_and_grad_tensors_round_trip():
    z = torch.randn(3, dtype=torch.complex64)
    conj = z.conj()
    assert conj.is_conj()
    _same(conj.resolve_conj(), _roundtrip(conj).body)
    neg = torch._neg_view(torch.randn(4))
    assert neg.is_neg()
    _same(neg.resolve_neg(), _roundtrip(neg).body)
    p = torch.nn.Parameter(torch.randn(2, 2))
    got = _roundtrip({"p": p}).body["p"]
    _same(p, got)
    assert not got.requires_grad


def test_bfloat16_bits_survive_exactly():
    bits = torch.arange(0, 2**16, 37, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16)
    got = _roundtrip(t).body
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), bits)  # NaN payloads included: compare bits


def test_nested_body_with_tuples_dtypes_and_int_keys():
    a, b = torch.randn(2, 3), torch.arange(5)
    body = {
        "x": a,
        "kwargs": {"kernel_size": (3, 3), "padding": [1, 1], "dtype": torch.bfloat16, "bias": False},
        1: "one",
        -7: [None, 1.5, "é", (b, (a,), ())],
        "dtypes": [DTYPES[n] for n in sorted(DTYPES)],
        "same": [a, a],
        "deep": {0: {1: {2: ((1, 2), [3, (4,)])}}},
        "big": 2**63 - 1,
        "neg": -(2**63),
    }
    msg = _roundtrip(body)
    got = msg.body
    assert set(got) == set(body)
    assert got[1] == "one" and isinstance(next(k for k in got if k == 1), int)
    assert got["kwargs"] == {"kernel_size": (3, 3), "padding": [1, 1], "dtype": torch.bfloat16, "bias": False}
    assert type(got["kwargs"]["kernel_size"]) is tuple and type(got["kwargs"]["padding"]) is list
    assert got["dtypes"] == [DTYPES[n] for n in sorted(DTYPES)]
    _same(a, got["x"])
    none, f, s, tup = got[-7]
    assert (none, f, s) == (None, 1.5, "é")
    assert type(tup) is tuple and len(tup) == 3
    _same(b, tup[0])
    assert type(tup[1]) is tuple and len(tup[1]) == 1
    _same(a, tup[1][0])
    assert tup[2] == ()
    _same(a, got["same"][0])
    _same(a, got["same"][1])
    assert got["deep"] == {0: {1: {2: ((1, 2), [3, (4,)])}}}
    assert type(got["deep"][0][1][2][1][1]) is tuple
    assert got["big"] == 2**63 - 1 and got["neg"] == -(2**63)


def test_each_tensor_gets_its_own_frame_in_order():
    ts = [torch.full((i + 1,), float(i)) for i in range(5)]
    frames = encode("forward", 1, "s", {"ts": ts})
    assert len(frames) == 6
    assert [m[1] for m in _header(frames)[4]] == [[i + 1] for i in range(5)]
    got = decode(frames).body["ts"]
    for a, b in zip(ts, got):
        _same(a, b)


def test_decode_accepts_bytearray_and_memoryview_frames():
    t = torch.randn(4, 4)
    frames = encode("ok", 9, "", t)
    mixed = [bytearray(frames[0]), memoryview(bytes(frames[1]))]
    _same(t, decode(mixed).body)


def test_tuple_nesting_is_bounded_both_ways():
    limit = protocol.DEFAULT_LIMITS.max_tuple_depth
    nested: object = 1
    for _ in range(limit):
        nested = (nested,)
    assert _roundtrip(nested).body == nested
    with pytest.raises(ProtocolError, match="nested deeper"):
        encode("forward", 1, "s", (nested,))


def test_deeply_nested_tuples_from_the_wire_are_refused_not_a_crash():
    # Each tuple level is a nested msgpack unpack on the C stack: a few hundred levels, a couple
    # of kilobytes on the wire, used to overflow it and kill the process (segmentation fault).
    inner = NONE
    for _ in range(2000):
        inner = msgpack.packb(msgpack.ExtType(2, msgpack.packb([msgpack.ExtType(2, inner)])))
    frames = _raw([], inner)
    assert len(frames[0]) < 64 * 1024
    with pytest.raises(ProtocolError, match="nested deeper"):
        decode(frames)


# --- malformed input ---------------------------------------------------------------------


@pytest.fixture
def valid() -> list:
    return encode("forward", 5, "sess", {"x": torch.ones(2, 3), "i": torch.arange(4, dtype=torch.int16)})


def test_valid_fixture_decodes(valid):
    assert decode(valid).body["x"].shape == (2, 3)


def test_empty_frames():
    with pytest.raises(ProtocolError, match="empty"):
        decode([])


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"\xff\xfe\xfd",  # trailing data after a value
        b"\x96\x01",  # a 6-array cut short
        b"\x96\x01\xa7forward\x01\xa1s\x90\xc7\x05",  # ext header cut short
        b"\xdd\xff\xff\xff\xff",  # an array claiming 4 billion items
        b"\xa3\xff\xfe\xfd",  # a string that is not UTF-8
        b"hello world, this is not msgpack",
        msgpack.packb({"a": 1}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb([1, "k", 1, "s", [], msgpack.ExtType(0, NONE), "extra"]),
        msgpack.packb(None),
    ],
)
def test_garbage_header(header):
    with pytest.raises(ProtocolError):
        decode([header])


def test_truncated_header(valid):
    for cut in range(0, len(valid[0]), 3):
        with pytest.raises(ProtocolError):
            decode([valid[0][:cut], *valid[1:]])


@pytest.mark.parametrize("version", [0, 1, 99, "2", None, [2]])
def test_wrong_version(valid, version):
    header = _header(valid)
    header[0] = version
    with pytest.raises(ProtocolError, match="version"):
        decode(_with_header(valid, header))


@pytest.mark.parametrize("field,value", [(1, 7), (1, None), (2, "1"), (2, 1.0), (3, None), (3, 5)])
def test_header_fields_of_wrong_type(valid, field, value):
    header = _header(valid)
    header[field] = value
    with pytest.raises(ProtocolError, match="wrong types"):
        decode(_with_header(valid, header))


def test_frame_count_mismatch(valid):
    with pytest.raises(ProtocolError, match="2 tensors but 1 tensor frames"):
        decode(valid[:2])
    with pytest.raises(ProtocolError, match="2 tensors but 3 tensor frames"):
        decode([*valid, b"\x00" * 8])
    with pytest.raises(ProtocolError, match="but 0 tensor frames"):
        decode(valid[:1])
    header = _header(valid)
    header[4] = {"not": "a list"}
    with pytest.raises(ProtocolError, match="tensors"):
        decode(_with_header(valid, header))


@pytest.mark.parametrize("delta", [-1, 1, -4, -24, 100])
def test_frame_size_mismatch(valid, delta):
    x = bytes(valid[1])
    bad = x[:delta] if delta < 0 else x + b"\x00" * delta
    with pytest.raises(ProtocolError, match="needs 24 bytes"):
        decode([valid[0], bad, valid[2]])


@pytest.mark.parametrize("name", ["float8", "object", "torch.float32", "Float32", "", 5, None, b"float32"])
def test_unknown_dtype(name):
    frames = _raw([[name, [2]]], msgpack.packb(_tensor_ref(0)), [b"\x00" * 8])
    with pytest.raises(ProtocolError, match="unknown dtype"):
        decode(frames)


@pytest.mark.parametrize("meta", ["float32", ["float32"], ["float32", [2], 1], None, {"float32": [2]}])
def test_malformed_tensor_description(meta):
    with pytest.raises(ProtocolError, match="malformed description"):
        decode(_raw([meta], NONE, [b"\x00" * 8]))


def test_too_many_dims():
    ok = _raw([["float32", [1] * 32]], NONE, [b"\x00" * 4])
    decode(ok)
    with pytest.raises(ProtocolError, match="at most 32"):
        decode(_raw([["float32", [1] * 33]], NONE, [b"\x00" * 4]))
    with pytest.raises(ProtocolError, match="at most 2"):
        decode(encode("x", 1, "s", torch.ones(1, 1, 1)), Limits(max_tensor_dims=2))
    with pytest.raises(ProtocolError):
        decode(_raw([["float32", "abc"]], NONE, [b"\x00" * 4]))


@pytest.mark.parametrize(
    "shape,nbytes",
    [([-1], 0), ([-1, -4], 16), ([2, -2], 0), ([True, 2], 8), ([2.0], 8), (["2"], 8), ([2**62], 0), ([None], 0)],
)
def test_invalid_shape(shape, nbytes):
    with pytest.raises(ProtocolError, match="invalid shape"):
        decode(_raw([["float32", shape]], NONE, [b"\x00" * nbytes]))


@pytest.mark.parametrize("shape", [[0, 2**61, 2**61], [2**61, 2**61, 0], [0] + [2**40] * 31])
def test_empty_tensor_with_absurd_sizes(shape):
    # No elements, so the frame is empty, but torch overflows computing strides for such sizes:
    # that was a RuntimeError escaping decode (and killing the worker's I/O loop).
    with pytest.raises(ProtocolError, match="too large"):
        decode(_raw([["float32", shape]], NONE, [b""]))


def test_tensor_ref_out_of_range():
    one = [["float32", [1]]]
    decode(_raw(one, msgpack.packb(_tensor_ref(0)), [b"\x00" * 4]))
    for index in (1, 5, 2**32 - 1):
        with pytest.raises(ProtocolError, match=f"reference to tensor {index}"):
            decode(_raw(one, msgpack.packb([1, {"a": _tensor_ref(index)}]), [b"\x00" * 4]))
    with pytest.raises(ProtocolError, match="only 0 arrived"):
        decode(_raw([], msgpack.packb(msgpack.ExtType(1, b"\x00\x00\x00\x00"))))
    with pytest.raises(ProtocolError, match="reference to tensor"):
        decode(_raw([], msgpack.packb(msgpack.ExtType(1, b""))))


@pytest.mark.parametrize(
    "body,match",
    [
        (msgpack.packb(msgpack.ExtType(9, b"")), "unknown extension type 9"),
        (msgpack.packb(msgpack.ExtType(127, b"x")), "unknown extension type 127"),
        (b"\xd4\xff\x78", "undecodable body"),  # a timestamp (ext -1) of a wrong size
        (msgpack.packb(msgpack.ExtType(3, b"float8")), "unknown dtype"),
        (msgpack.packb(msgpack.ExtType(3, b"\xff\xfe")), "unknown dtype"),
        (msgpack.packb(msgpack.ExtType(2, msgpack.packb(5))), "malformed tuple"),
        (msgpack.packb(msgpack.ExtType(2, b"\xc1")), "undecodable"),
        (msgpack.packb(msgpack.ExtType(2, b"\x92\x01")), "undecodable"),
        (b"\x92\x01", "undecodable body"),
        (b"\x81\x91\x01\x02", "undecodable body"),  # a map keyed by a list
        (b"\x01\x02", "undecodable body"),
        (b"", "undecodable body"),
    ],
)
def test_malformed_body(body, match):
    with pytest.raises(ProtocolError, match=match):
        decode(_raw([], body))


def test_body_must_be_the_body_extension(valid):
    for packed in (None, b"raw", msgpack.ExtType(1, NONE), 7):
        header = _header(valid)
        header[5] = packed
        with pytest.raises(ProtocolError, match="body is missing"):
            decode(_with_header(valid, header))


def test_limits_max_frames():
    frames = encode("x", 1, "s", [torch.ones(1)] * 3)
    decode(frames, Limits(max_frames=3))
    with pytest.raises(ProtocolError, match="3 tensor frames; the limit is 2"):
        decode(frames, Limits(max_frames=2))
    # The count is checked before anything else: even a garbage header is not looked at.
    with pytest.raises(ProtocolError, match="limit is 4"):
        decode([b"\xc1"] + [b""] * 5, Limits(max_frames=4))


def test_limits_max_header_bytes():
    frames = encode("x", 1, "s", {"text": "a" * 1000})
    n = len(frames[0])
    decode(frames, Limits(max_header_bytes=n))
    with pytest.raises(ProtocolError, match=f"header of {n} bytes exceeds the limit of {n - 1}"):
        decode(frames, Limits(max_header_bytes=n - 1))


def test_limits_max_message_bytes():
    frames = encode("x", 1, "s", [torch.ones(10), torch.ones(6, dtype=torch.float64)])
    decode(frames, Limits(max_message_bytes=88))
    with pytest.raises(ProtocolError, match="message of 88 bytes exceeds the limit of 87"):
        decode(frames, Limits(max_message_bytes=87))


# --- bundles: several messages in one ZeroMQ message ------------------------------------------


def test_a_bundle_decodes_into_its_messages_in_order():
    parts = [
        encode("forward", 1, "s", {"mb": 0, "x": torch.ones(2, 3)}),
        encode("forward", 2, "s", {"mb": 1}),  # no tensor: a header alone
        encode("backward", 3, "s", {"mb": 2, "g": (torch.zeros(1), torch.arange(4))}),
    ]
    [bundle] = protocol.encode_all(parts)
    assert len(bundle) == sum(map(len, parts))
    messages = protocol.decode_all(bundle)
    got = [(m.kind, m.id, m.body["mb"]) for m in messages]
    assert got == [("forward", 1, 0), ("forward", 2, 1), ("backward", 3, 2)]
    assert torch.equal(messages[0].body["x"], torch.ones(2, 3))
    assert torch.equal(messages[2].body["g"][1], torch.arange(4))
    # One message is a bundle of one; decode takes only that.
    assert [m.id for m in protocol.decode_all(parts[0])] == [1]
    with pytest.raises(ProtocolError, match="1 tensors but 5 tensor frames"):
        decode(bundle)


def test_a_bundle_is_taken_whole_or_refused_whole():
    good = encode("forward", 1, "s", {"x": torch.ones(2)})
    bad = [b"\xc1"]  # an undecodable header after a good message
    with pytest.raises(ProtocolError, match="undecodable header"):
        protocol.decode_all([*good, *bad])
    short = encode("forward", 2, "s", {"x": torch.ones(2), "y": torch.ones(3)})[:-1]  # its last tensor is missing
    with pytest.raises(ProtocolError, match="2 tensors but 1 tensor frames"):
        protocol.decode_all([*good, *short])
    with pytest.raises(protocol.ProtocolVersionError):
        old = msgpack.packb([protocol.PROTOCOL_VERSION - 1, "forward", 3, "s", [], msgpack.ExtType(0, b"\xc0")])
        protocol.decode_all([*good, old])


def test_encode_all_keeps_each_bundle_within_the_receivers_limits():
    parts = [encode("forward", i, "s", {"x": torch.ones(4)}) for i in range(5)]  # 16 bytes of tensor each
    sizes = [len(protocol.decode_all(b)) for b in protocol.encode_all(parts, Limits(max_message_bytes=40))]
    assert sizes == [2, 2, 1]
    sizes = [len(protocol.decode_all(b)) for b in protocol.encode_all(parts, Limits(max_frames=3))]
    assert sizes == [3, 2]
    # A message that is alone over a limit makes a bundle of its own (encode's limits refuse it).
    assert [len(b) for b in protocol.encode_all(parts[:2], Limits(max_message_bytes=8))] == [2, 2]
    assert protocol.encode_all([]) == []


def test_a_bundle_over_the_limits_is_refused():
    parts = [encode("forward", i, "s", {"x": torch.ones(4)}) for i in range(3)]
    [bundle] = protocol.encode_all(parts)
    protocol.decode_all(bundle, Limits(max_frames=3, max_message_bytes=48))
    with pytest.raises(protocol.LimitExceeded, match="6 frames; a bundle holds at most 2 messages and 2 tensors"):
        protocol.decode_all(bundle, Limits(max_frames=2))
    with pytest.raises(protocol.LimitExceeded, match="3 tensor frames; the limit is 2"):
        protocol.decode_all(encode("forward", 1, "s", [torch.ones(1)] * 3), Limits(max_frames=2))
    with pytest.raises(protocol.LimitExceeded, match="message of 48 bytes exceeds the limit of 47"):
        protocol.decode_all(bundle, Limits(max_message_bytes=47))
    headers_only = [f for i in range(3) for f in encode("ok", i, "s", None)]
    protocol.decode_all(headers_only, Limits(max_frames=3))
    with pytest.raises(protocol.LimitExceeded, match="bundle of over 2 messages; the limit is 2"):
        protocol.decode_all(headers_only, Limits(max_frames=2))


@FUZZ
@given(st.data())
def test_mutated_bundles_decode_or_raise_protocol_error(data):
    parts = data.draw(st.lists(st.sampled_from(_SEED_MESSAGES), min_size=2, max_size=3))
    frames = [bytearray(f) for part in parts for f in part]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(frames) - 1))
        op = data.draw(st.sampled_from(["flip", "drop_frame", "dup_frame", "swap"]))
        if op == "flip" and frames[i]:
            pos = data.draw(st.integers(0, len(frames[i]) - 1))
            frames[i][pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "drop_frame" and len(frames) > 1:
            del frames[i]
        elif op == "dup_frame":
            frames.insert(i, bytearray(frames[i]))
        elif op == "swap":
            j = data.draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
    _decode_or_protocol_error(frames)


def test_decoding_never_names_a_class():
    # A body cannot smuggle an object in: msgpack has no object type, and extensions are closed.
    frames = _raw([], msgpack.packb({"__class__": "os.system", "args": ["echo hi"]}))
    assert decode(frames).body == {"__class__": "os.system", "args": ["echo hi"]}


# --- encode refuses what cannot travel -----------------------------------------------------


class _Thing:
    pass


@pytest.mark.parametrize(
    "value,type_name",
    [
        (object(), "object"),
        (_Thing(), "_Thing"),
        (lambda x: x, "function"),
        (print, "builtin_function_or_method"),
        ({1, 2}, "set"),
        (1 + 2j, "complex"),
        (torch.nn.Linear(2, 2), "Linear"),
        (torch.device("cpu"), "device"),
        (Ellipsis, "ellipsis"),
        ({"nested": [1, (2, _Thing())]}, "_Thing"),
    ],
)
def test_encode_refuses_unsupported_values(value, type_name):
    with pytest.raises(ProtocolError, match=f"type {type_name}\\b"):
        encode("setup", 1, "s", value)


def test_encode_refuses_unsupported_tensors_and_dtypes():
    with pytest.raises(ProtocolError, match="sparse|strided"):
        encode("x", 1, "s", torch.eye(3).to_sparse())
    unsupported = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "uint16", None)) if d]
    assert unsupported
    for d in unsupported:
        with pytest.raises(ProtocolError, match="dtype"):
            encode("x", 1, "s", torch.zeros(2, dtype=d))
        with pytest.raises(ProtocolError, match="dtype"):
            encode("x", 1, "s", {"dtype": d})


def test_encode_refuses_out_of_range_ints():
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode("x", 1, "s", 2**64)
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode("x", 1, "s", [-(2**63) - 1])


def test_encode_accepts_int_and_str_subclasses_as_plain_values():
    import enum

    class Mode(enum.IntEnum):
        A = 3

    got = _roundtrip({"mode": Mode.A, "flag": True}).body
    assert got == {"mode": 3, "flag": True}
    assert type(got["mode"]) is int and type(got["flag"]) is bool


# --- property tests ------------------------------------------------------------------------


def _decode_or_protocol_error(frames):
    """``decode``, and ``decode_all`` (what the worker and the driver call), of frames from anyone:
    messages, or a `ProtocolError`; never another exception."""
    try:
        messages = protocol.decode_all(frames)
    except ProtocolError:
        messages = []
    for msg in messages:
        assert isinstance(msg, Message)
        assert isinstance(msg.kind, str) and isinstance(msg.id, int) and isinstance(msg.session, str)
    try:
        msg = decode(frames)
    except ProtocolError:
        return None
    assert len(messages) == 1 and messages[0].id == msg.id, "decode and decode_all disagree"
    return msg


@FUZZ
@given(st.lists(st.binary(max_size=80), max_size=4))
def test_arbitrary_bytes_decode_or_raise_protocol_error(frames):
    _decode_or_protocol_error(frames)


_SEED_MESSAGES = [
    encode("forward", 5, "sess", {"x": torch.randn(2, 3), "t": (1, (2.5, "a")), "d": torch.bfloat16}),
    encode("setup", 1, "s", {"entries": [["torch.nn.Linear", {"in_features": 2}, [[1, 2], [3]]]], 4: None}),
    encode("backward", 2**40, "", [torch.zeros((), dtype=torch.bool), torch.ones(3, dtype=torch.complex64)]),
    encode("ok", 0, "x", torch.empty(0, 4, dtype=torch.int8)),
]


@FUZZ
@given(st.data())
def test_mutated_valid_frames_decode_or_raise_protocol_error(data):
    frames = [bytearray(f) for f in data.draw(st.sampled_from(_SEED_MESSAGES))]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frames) - 1))
        f = frames[i]
        op = data.draw(st.sampled_from(["flip", "set", "cut", "insert", "drop_frame", "dup_frame"]))
        if op == "flip" and f:
            pos = data.draw(st.integers(0, len(f) - 1))
            f[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set" and f:
            pos = data.draw(st.integers(0, len(f) - 1))
            f[pos] = data.draw(st.sampled_from([0x00, 0x7F, 0x80, 0x90, 0xC1, 0xD4, 0xDD, 0xFF]))
        elif op == "cut":
            del f[data.draw(st.integers(0, len(f))) :]
        elif op == "insert":
            pos = data.draw(st.integers(0, len(f)))
            f[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif op == "drop_frame" and len(frames) > 1:
            del frames[i]
        elif op == "dup_frame":
            frames.insert(i, bytearray(f))
    _decode_or_protocol_error([bytes(f) for f in frames])


def _ext(children):
    return st.builds(
        msgpack.ExtType,
        st.sampled_from([0, 1, 2, 3, 4, 127]),
        st.one_of(
            st.binary(max_size=8),
            children.map(lambda v: msgpack.packb(v, use_bin_type=True)),
        ),
    )


_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=True),
        st.text(max_size=8),
        st.binary(max_size=8),
        st.sampled_from(["float32", "bool", "bfloat16", "nope"]),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.integers(-5, 5), st.text(max_size=4)), children, max_size=3),
        _ext(children),
    ),
    max_leaves=12,
)


@FUZZ
@given(
    version=st.sampled_from([protocol.PROTOCOL_VERSION] * 3 + [protocol.PROTOCOL_VERSION + 1]),
    kind=st.one_of(st.sampled_from(["forward", "ok"]), _values),
    req_id=st.one_of(st.integers(0, 10), _values),
    metas=st.one_of(
        st.lists(st.lists(st.one_of(st.sampled_from(sorted(DTYPES)), _values), max_size=3), max_size=2),
        st.lists(
            st.tuples(st.sampled_from(sorted(DTYPES)), st.lists(st.integers(-1, 3), max_size=3)).map(list),
            max_size=2,
        ),
        _values,
    ),
    body=_values,
    frames=st.lists(st.binary(max_size=16), max_size=2),
)
def test_structured_headers_decode_or_raise_protocol_error(version, kind, req_id, metas, body, frames):
    header = [version, kind, req_id, "s", metas, msgpack.ExtType(0, msgpack.packb(body, use_bin_type=True))]
    msg = _decode_or_protocol_error([msgpack.packb(header, use_bin_type=True), *frames])
    if msg is not None:
        assert version == protocol.PROTOCOL_VERSION
        if isinstance(metas, list):
            assert len(metas) == len(frames)


@FUZZ
@given(
    st.recursive(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-(2**63), 2**63 - 1),
            st.floats(allow_nan=False),
            st.text(max_size=6),
            st.sampled_from(list(DTYPES.values())),
            st.builds(
                _sample,
                st.sampled_from(list(DTYPES.values())),
                st.lists(st.integers(0, 3), max_size=3).map(tuple),
            ),
        ),
        lambda c: st.one_of(
            st.lists(c, max_size=3),
            st.lists(c, max_size=3).map(tuple),
            st.dictionaries(st.one_of(st.integers(-3, 3), st.text(max_size=3)), c, max_size=3),
        ),
        max_leaves=10,
    )
)
def test_encoded_values_round_trip(value):
    def check(a, b):
        if isinstance(a, torch.Tensor):
            _same(a, b)
        elif isinstance(a, (list, tuple)):
            assert type(b) is type(a) and len(a) == len(b)
            for x, y in zip(a, b):
                check(x, y)
        elif isinstance(a, dict):
            assert type(b) is dict and set(a) == set(b)
            for k in a:
                check(a[k], b[k])
        elif isinstance(a, float):
            assert type(b) is float and (a == b or (math.isnan(a) and math.isnan(b)))
        else:
            assert type(b) is type(a) and b == a

    check(value, _roundtrip(value).body)


def test_decoded_and_encoded_buffers_are_freed_without_the_garbage_collector():
    import gc
    import weakref

    gc.disable()
    try:
        t = torch.ones(1024)
        frames = encode("forward", 1, "s", {"x": t, "nested": (t, [t])})
        ref_out = weakref.ref(t)
        msg = decode(frames)
        ref_in = weakref.ref(msg.body["x"])
        del t, frames, msg
        assert ref_out() is None and ref_in() is None
    finally:
        gc.enable()
