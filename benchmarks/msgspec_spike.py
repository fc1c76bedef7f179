"""Spike (#49 item 3): msgspec Structs for the pipelined message bodies, against today's `fields.Body`.

Today a `Forward` or `Backward` (``lightning_remote_mp/wire/messages.py``) is a frozen dataclass whose
fields `lightning_remote_mp.wire.fields` declares with hand-written checks: ``.body()`` writes it as a
dict, `protocol.encode` packs that dict with msgpack (tensors become extension values pointing at
raw frames), and a worker reads it back with `protocol.decode_all` and `worker.request.parse`
(``Forward.from_body``), which checks each field. This script times that round trip for the
messages of a training step against the same metadata declared as msgspec ``Struct`` s (tagged,
``forbid_unknown_fields=True``, typed fields with the constraints fields.py checks), encoded with
``msgspec.msgpack`` and decoded strictly into ``ForwardS | BackwardS``. Tensors travel the same way
on both sides: one raw zero-copy frame each (`protocol._tensor_frame` on the way out, a checked
``torch.frombuffer`` on the way in); a msgspec body refers to them by frame index, resolved after
decoding. It also checks that both sides read the messages back equal and shows which malformed
bodies each refuses (they differ where fields.py is lenient). Each phase is timed with the garbage
collector on, as a worker runs.

msgspec is not a dependency of lightning_remote_mp: ``pip install msgspec`` to run this.

    python benchmarks/msgspec_spike.py            # full run (about half a minute)
    python benchmarks/msgspec_spike.py --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import os
import statistics
import sys
import timeit
from collections.abc import Callable
from typing import Annotated, Any, Literal

try:
    import msgspec
    from msgspec import Meta, Struct
except ImportError:
    sys.exit("benchmarks/msgspec_spike.py needs msgspec, which lrmp does not depend on: pip install msgspec")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

from lightning_remote_mp.errors import LimitExceeded, ProtocolError  # noqa: E402
from lightning_remote_mp.flow import DRIVER  # noqa: E402
from lightning_remote_mp.schedule import BACKWARD, SCALE, SCHEDULES  # noqa: E402
from lightning_remote_mp.wire import fields, messages, protocol  # noqa: E402
from lightning_remote_mp.wire.messages import Backward, Forward  # noqa: E402
from lightning_remote_mp.worker.request import Request, parse  # noqa: E402

# --- the msgspec declarations: the metadata of a Forward and a Backward, as fields.py checks it -----

#: An int >= 0: a request id, an output's position, a frame index (`fields.is_index`).
Index = Annotated[int, Meta(ge=0)]
#: A tensor: the index of its raw frame (`protocol`'s tensor extension value carries the same).
Ref = Index
DtypeName = Literal[tuple(protocol.DTYPES)]  # type: ignore[valid-type]
ScheduleName = Literal[SCHEDULES]  # type: ignore[valid-type]


class TensorMeta(Struct, array_like=True, frozen=True):
    """A tensor frame's description (`protocol._check_meta`): ``[dtype name, shape]``."""

    dtype: DtypeName
    shape: Annotated[
        list[Annotated[int, Meta(ge=0, lt=2**62)]], Meta(max_length=protocol.DEFAULT_LIMITS.max_tensor_dims)
    ]


class AutocastS(Struct, forbid_unknown_fields=True, frozen=True):
    """`fields.is_autocast`."""

    enabled: bool
    dtype: DtypeName | None = None


class PipelinedS(Struct, tag_field="kind", forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """`messages._Pipelined`."""

    key: str
    call: int
    mb: int
    sender: int = msgspec.field(name="from")
    sent_at: float | None = None  # fields.py: lenient, anything not a float reads as None
    fence: dict[int, Index] = {}
    microbatches: Annotated[int, Meta(ge=1)] = 1


class ForwardS(PipelinedS, tag=protocol.FORWARD.value):
    """`messages.Forward`; a tuple ``x`` is a non-empty list of frame indices."""

    x: Ref | Annotated[list[Ref], Meta(min_length=1)] | None = None
    vars: dict[str, Ref | None] = {}
    requires_grad: dict[str, bool | list[bool]] = {}
    grad: bool = False  # fields.py: lenient, anything but True reads as False
    autocast: AutocastS | None = None
    modes: bool | list[bool | list[bool]] | None = None  # fields.py: lenient
    checkpoint: bool = False  # fields.py: lenient
    keep: list[bool] | None = None
    shapes: dict[int, list[Index]] | None = None
    schedule: ScheduleName | None = None
    seed: Index | None = None
    generation: tuple[Index, int, list[Index] | None] | None = None


class BackwardS(PipelinedS, tag=protocol.BACKWARD.value):
    """`messages.Backward`; a tuple ``grad_out`` is a list of frame indices (or None)."""

    action: Literal[BACKWARD, SCALE] = BACKWARD  # type: ignore[valid-type]
    grad_out: Ref | list[Ref | None] | None = None
    grads: dict[str, Ref | None] = {}
    loss_grads: list[Ref | None] | None = None
    scale: Ref | None = None  # checked once resolved: a floating tensor of one value


class Envelope(Struct, array_like=True, frozen=True):
    """The header frame, ``[version, id, session, metas, body]``: the body's tag is its kind. The
    version comes first, so a peer of another version is refused at ``$[0]`` before its body is read."""

    version: Literal[protocol.PROTOCOL_VERSION]  # type: ignore[valid-type]
    id: Index
    session: str
    metas: Annotated[list[TensorMeta], Meta(max_length=protocol.DEFAULT_LIMITS.max_frames)]
    body: ForwardS | BackwardS


ENCODER = msgspec.msgpack.Encoder()
DECODER = msgspec.msgpack.Decoder(Envelope)
KIND_OF = {ForwardS: protocol.FORWARD, BackwardS: protocol.BACKWARD}


class Outgoing:
    """The tensor frames of a message being built: `ref` gives a tensor's frame index."""

    __slots__ = ("metas", "frames")

    def __init__(self) -> None:
        self.metas: list[TensorMeta] = []
        self.frames: list[Any] = []

    def ref(self, t: torch.Tensor) -> int:
        meta, data = protocol._tensor_frame(t)  # as protocol.encode frames it
        self.metas.append(TensorMeta(meta[0], meta[1]))
        self.frames.append(data)
        return len(self.frames) - 1

    def encode(self, req_id: int, session: str, body: PipelinedS) -> list[Any]:
        header = ENCODER.encode(Envelope(protocol.PROTOCOL_VERSION, req_id, session, self.metas, body))
        return [header, *self.frames]


def ms_decode(frames: list[Any], limits: protocol.Limits = protocol.DEFAULT_LIMITS) -> tuple[Envelope, list[Any]]:
    """One message's frames: its checked header (typed, strict) and its tensors (as `protocol.decode`)."""
    if len(frames) - 1 > limits.max_frames:
        raise LimitExceeded(f"message has {len(frames) - 1} tensor frames", "max_frames")
    if len(frames[0]) > limits.max_header_bytes:
        raise LimitExceeded(f"header of {len(frames[0])} bytes", "max_header_bytes")
    try:
        env = DECODER.decode(frames[0])
    except msgspec.DecodeError as err:  # ValidationError included
        raise ProtocolError(f"malformed message: {err}") from None
    buffers = [memoryview(f) for f in frames[1:]]
    if len(env.metas) != len(buffers):
        raise ProtocolError(f"header describes {len(env.metas)} tensors but {len(buffers)} tensor frames arrived")
    if sum(len(b) for b in buffers) > limits.max_message_bytes:
        raise LimitExceeded("message too large", "max_message_bytes")
    tensors = []
    for i, (meta, buf) in enumerate(zip(env.metas, buffers)):
        dtype, shape = protocol.DTYPES[meta.dtype], meta.shape
        if math.prod(max(s, 1) for s in shape) * dtype.itemsize >= 2**62:
            raise ProtocolError(f"tensor {i}: shape {shape!r:.80} is too large")
        if math.prod(shape) * dtype.itemsize != len(buf):
            raise ProtocolError(f"tensor {i}: {meta.dtype}{shape} does not fit its frame of {len(buf)} bytes")
        if not buf:
            tensors.append(torch.empty(shape, dtype=dtype))
        else:
            view = memoryview(bytearray(buf)) if buf.readonly else buf
            tensors.append(torch.frombuffer(view, dtype=torch.uint8).view(dtype).reshape(shape))
    return env, tensors


def _take(tensors: list[Any], i: int | None) -> Any:
    if i is None:
        return None
    if i >= len(tensors):
        raise ProtocolError(f"reference to tensor {i}, but only {len(tensors)} arrived")
    return tensors[i]


def _main(tensors: list[Any], x: Any) -> Any:
    return tuple(_take(tensors, i) for i in x) if isinstance(x, list) else _take(tensors, x)


def ms_resolve(peer: bytes, env: Envelope, tensors: list[Any]) -> Request:
    """The decoded body with its tensors in place of their frame indices, as a worker's `Request`."""
    b = env.body
    if isinstance(b, ForwardS):
        body: Any = msgspec.structs.replace(
            b, x=_main(tensors, b.x), vars={k: _take(tensors, i) for k, i in b.vars.items()}
        )
    else:
        scale = _take(tensors, b.scale)
        if scale is not None and not fields.is_scalar(scale):
            raise ProtocolError("backward message: 'scale' must be a floating tensor of one value")
        body = msgspec.structs.replace(
            b,
            grad_out=_main(tensors, b.grad_out),
            grads={k: _take(tensors, i) for k, i in b.grads.items()},
            loss_grads=None if b.loss_grads is None else [_take(tensors, i) for i in b.loss_grads],
            scale=scale,
        )
    return Request(peer, KIND_OF[type(b)], env.id, env.session, body, from_peer=body.sender != DRIVER)


# --- the messages of a training step ---------------------------------------------------------------

SESSION, REQ_ID, PEER = "9f1c2b7e4d6a48f0b3a5c8e1d2f4a6b7", 70_123, b"\x00k\x8b\x45\x67"
KEY, CALL, MB, MICROBATCHES, FENCE = "net", 1_234, 2, 4, {0: 5_678, 1: 5_671}


def step_tensors(rows: int, width: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "inputs": (torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)),
        "grad": torch.randn(rows, width, generator=g),
    }


def today_forward(t: dict[str, Any]) -> Forward:
    """A 1F1B call's micro-batch from the driver to stage 0 (the model's inputs and targets; the loss
    is the output's position 0 on the last stage), as `driver.pipeline` builds it."""
    return Forward(
        key=KEY,
        call=CALL,
        mb=MB,
        sender=DRIVER,
        fence=FENCE,
        microbatches=MICROBATCHES,
        x=t["inputs"],
        requires_grad={"x": [False, False]},
        grad=True,
        modes=True,
        schedule="1f1b",
        seed=0,
    )


def today_backward(t: dict[str, Any]) -> Backward:
    """A micro-batch's gradient from stage 1 to stage 0 (a B action's input), as `worker.route` builds it."""
    return Backward(
        key=KEY, call=CALL, mb=MB, sender=1, grad_out=t["grad"], grads={}, fence=FENCE, microbatches=MICROBATCHES
    )


def ms_forward(t: dict[str, Any], out: Outgoing) -> ForwardS:
    return ForwardS(
        key=KEY,
        call=CALL,
        mb=MB,
        sender=DRIVER,
        fence=FENCE,
        microbatches=MICROBATCHES,
        x=[out.ref(x) for x in t["inputs"]],
        requires_grad={"x": [False, False]},
        grad=True,
        modes=True,
        schedule="1f1b",
        seed=0,
    )


def ms_backward(t: dict[str, Any], out: Outgoing) -> BackwardS:
    return BackwardS(
        key=KEY, call=CALL, mb=MB, sender=1, grad_out=out.ref(t["grad"]), fence=FENCE, microbatches=MICROBATCHES
    )


# --- the two paths, whole and phase by phase -------------------------------------------------------


def today_path(build: Callable[[], Any]) -> dict[str, Callable[[], Any]]:
    """Today's send (build, ``.body()``, `protocol.encode`) and receive (`protocol.decode_all`, then
    `worker.request.parse`, i.e. ``from_body``), whole and each phase on its own prepared input."""
    msg = build()
    body = msg.body()
    frames = protocol.encode(msg.KIND, REQ_ID, SESSION, body)
    decoded = protocol.decode_all(frames)

    def whole() -> Any:
        m = build()
        sent = protocol.encode(m.KIND, REQ_ID, SESSION, m.body())
        return [parse(PEER, d) for d in protocol.decode_all(sent)]

    return {
        "whole": whole,
        "build": build,
        "body()": msg.body,
        "encode": lambda: protocol.encode(msg.KIND, REQ_ID, SESSION, body),
        "decode": lambda: protocol.decode_all(frames),
        "check": lambda: [parse(PEER, d) for d in decoded],
    }


def ms_path(t: dict[str, Any], build: Callable[[dict[str, Any], Outgoing], PipelinedS]) -> dict[str, Callable[[], Any]]:
    """msgspec's send (frames and Struct, ``msgspec.msgpack`` encode) and receive (strict typed decode
    into ``ForwardS | BackwardS`` with the tensor frames, then the frame indices resolved)."""
    out = Outgoing()
    body = build(t, out)
    frames = out.encode(REQ_ID, SESSION, body)
    env, tensors = ms_decode(frames)

    def built() -> tuple[Outgoing, PipelinedS]:
        o = Outgoing()
        return o, build(t, o)

    def whole() -> Any:
        o = Outgoing()
        e, ts = ms_decode(o.encode(REQ_ID, SESSION, build(t, o)))
        return ms_resolve(PEER, e, ts)

    return {
        "whole": whole,
        "build": built,
        "encode": lambda: out.encode(REQ_ID, SESSION, body),
        "decode": lambda: ms_decode(frames),
        "check": lambda: ms_resolve(PEER, env, tensors),
    }


#: Tensors each message carries (the Forward: the model's inputs and targets; the Backward: one gradient).
TENSORS = {"Forward": 2, "Backward": 1}


def framing(t: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """One tensor's framing, the same in both paths: out (`protocol._tensor_frame`), and in as
    `protocol.decode` does it (`protocol._check_meta`, ``torch.frombuffer``)."""
    meta, buf = protocol._tensor_frame(t["grad"])

    def frame_in() -> torch.Tensor:
        dtype, shape = protocol._check_meta(meta, len(buf), protocol.DEFAULT_LIMITS, 0)
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape)

    return {"out": lambda: protocol._tensor_frame(t["grad"]), "in": frame_in}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def check_round_trips(t: dict[str, Any]) -> None:
    """Both paths must give back every field of the message sent (tensors by value)."""
    for original, today, ms in (
        (today_forward(t), today_path(lambda: today_forward(t)), ms_path(t, ms_forward)),
        (today_backward(t), today_path(lambda: today_backward(t)), ms_path(t, ms_backward)),
    ):
        for path, received, names in (
            ("today", today["whole"]()[0].message, [f.name for f in dataclasses.fields(original)]),
            ("msgspec", ms["whole"]().message, [f.name for f in msgspec.structs.fields(ms["whole"]().message)]),
        ):
            for name in names:
                want, got = getattr(original, name), getattr(received, name)
                if not same(want, got):
                    raise AssertionError(f"{original.KIND}.{name}: {path} read back {got!r:.80}, sent {want!r:.80}")


#: Malformed Forward bodies: (what, the change to the body: (field, value), or (field, DELETE)).
DELETE = object()
MALFORMED = [
    ("call is a str", "call", "3"),
    ("call is a bool", "call", True),
    ("fence names a negative id", "fence", {0: -1}),
    ("microbatches is 0", "microbatches", 0),
    ("schedule is unknown", "schedule", "bogus"),
    ("key is missing", "key", DELETE),
    ("microbatches is None", "microbatches", None),
    ("sent_at is a str", "sent_at", "soon"),
    ("grad is 1", "grad", 1),
    ("an unknown field", "extra", 1),
]


def refusals(t: dict[str, Any]) -> list[list[str]]:
    """Which malformed bodies each side refuses (today: ``Forward.from_body``; msgspec: the typed decode)."""
    today_body = today_forward(t).body()
    out = Outgoing()
    ms_body = msgspec.to_builtins(ms_forward(t, out))
    metas = msgspec.to_builtins(out.metas)
    rows = []
    for what, name, value in MALFORMED:
        verdicts = []
        for body, read in (
            (today_body, Forward.from_body),
            (ms_body, lambda b: DECODER.decode(msgspec.msgpack.encode([protocol.PROTOCOL_VERSION, 1, "s", metas, b]))),
        ):
            body = dict(body)
            if value is DELETE:
                del body[name]
            else:
                body[name] = value
            try:
                read(body)
                verdicts.append("accepted")
            except (ProtocolError, msgspec.ValidationError) as err:
                verdicts.append(f"refused ({str(err).removeprefix('forward message: ')})")
        rows.append([what, *verdicts])
    return rows


# --- context: the hand-written machinery's size -----------------------------------------------------


def lines_of(obj: Any) -> int:
    return len(inspect.getsourcelines(obj)[0])


def loc_rows() -> list[list[Any]]:
    with open(fields.__file__) as f:
        fields_lines = sum(1 for _ in f)
    header = lines_of(protocol._header) + lines_of(protocol._check_meta)
    declared = lines_of(messages._Pipelined) + lines_of(Forward) + lines_of(Backward)
    spike = sum(lines_of(c) for c in (TensorMeta, AutocastS, PipelinedS, ForwardS, BackwardS, Envelope))
    spike_read = sum(lines_of(f) for f in (Outgoing, ms_decode, _take, _main, ms_resolve))
    return [
        ["lightning_remote_mp/wire/fields.py (wc -l: the checks, Body.body / from_body)", fields_lines],
        ["protocol.py `_header` + `_check_meta` (the header's hand-written checks)", header],
        ["messages.py `_Pipelined` + `Forward` + `Backward` (declarations, with docstrings)", declared],
        ["this spike: the Structs replacing those declarations and checks", spike],
        ["this spike: tensor frames and references (`Outgoing`, `ms_decode`, `ms_resolve`)", spike_read],
    ]


# --- timing ----------------------------------------------------------------------------------------


def measure(jobs: dict[tuple[str, str, str], Callable[[], Any]], repeats: int, number: int) -> dict[Any, float]:
    """Microseconds per call of each job: the median of ``repeats`` rounds of ``number`` calls
    (timeit, with the garbage collector on), the jobs interleaved round by round."""
    timers = {k: timeit.Timer(fn, setup=gc.enable) for k, fn in jobs.items()}
    for timer in timers.values():
        timer.timeit(max(1, number // 10))  # warm-up
    times: dict[Any, list[float]] = {k: [] for k in jobs}
    for _ in range(repeats):
        for k, timer in timers.items():
            times[k].append(timer.timeit(number) / number * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: few iterations (seconds)")
    p.add_argument("--repeats", type=int, default=7, help="rounds; the median is reported")
    p.add_argument("--number", type=int, default=5000, help="calls per round and phase")
    p.add_argument("--rows", type=int, default=64, help="rows of a micro-batch's tensors (256 samples, m=4)")
    p.add_argument("--width", type=int, default=1024, help="columns of a micro-batch's tensors")
    p.add_argument("--step-ms", type=float, default=40.0, help="a training step's time (the small model's)")
    p.add_argument("--messages", type=int, default=16, help="Forward/Backward messages per training step")
    p.add_argument("--out", default=_common.RESULTS, help="folder for msgspec_spike.json")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.number = 3, 200
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    import msgpack

    print(f"# msgspec Structs vs fields.Body: Forward / Backward round trip ({'quick' if args.quick else 'full'} run)")
    print(_common.environment())
    print(f"msgspec {msgspec.__version__}, msgpack {'.'.join(map(str, msgpack.version))}", flush=True)

    t = step_tensors(args.rows, args.width)
    check_round_trips(t)
    paths = {
        ("Forward", "today"): today_path(lambda: today_forward(t)),
        ("Forward", "msgspec"): ms_path(t, ms_forward),
        ("Backward", "today"): today_path(lambda: today_backward(t)),
        ("Backward", "msgspec"): ms_path(t, ms_backward),
    }
    jobs = {(m, p, phase): fn for (m, p), phases in paths.items() for phase, fn in phases.items()}
    jobs.update({("tensor", "framing", side): fn for side, fn in framing(t).items()})
    us = measure(jobs, args.repeats, args.number)
    sizes = {(m, p): _header_bytes(m, p, t) for (m, p) in paths}
    framing_us = {side: us[("tensor", "framing", side)] for side in ("out", "in")}
    results: dict[str, Any] = {
        "environment": _common.environment(),
        "msgspec": msgspec.__version__,
        "repeats": args.repeats,
        "number": args.number,
        "tensor": [args.rows, args.width],
        "us": {" ".join(k): v for k, v in us.items()},
        "header_bytes": {" ".join(k): v for k, v in sizes.items()},
        "metadata_only_us": {},
    }

    print()
    print(
        f"Per message, µs (median of {args.repeats} rounds of {args.number}), send and receive side together, "
        f"tensors {args.rows}x{args.width} float32 framed the same way in both (zero-copy frame out, checked "
        "torch.frombuffer in). today: build the dataclass, .body(), protocol.encode, protocol.decode_all, "
        "worker.request.parse (from_body's checks). msgspec: build the Struct (tensors registered as frames), "
        "msgspec.msgpack encode, strict typed decode into ForwardS | BackwardS (the checks), tensor frames, "
        "frame indices resolved into a Request. ratio: today / msgspec. The rows 'metadata only' subtract "
        "the tensors' framing (timed alone: out "
        f"{framing_us['out']:,.1f} µs + in {framing_us['in']:,.1f} µs per tensor, protocol's own code) from "
        "both columns."
    )
    print()
    rows = []
    for m in ("Forward", "Backward"):
        a, b = us[(m, "today", "whole")], us[(m, "msgspec", "whole")]
        rows.append([m, f"{a:,.1f}", f"{b:,.1f}", f"{a / b:.2f}x"])
    for m in ("Forward", "Backward"):
        frames_us = TENSORS[m] * (framing_us["out"] + framing_us["in"])
        a, b = us[(m, "today", "whole")] - frames_us, us[(m, "msgspec", "whole")] - frames_us
        their = f"{TENSORS[m]} tensors'" if TENSORS[m] > 1 else "its tensor's"
        rows.append(
            [
                f"{m}, metadata only ({their} framing subtracted)",
                f"{a:,.1f}",
                f"{b:,.1f}",
                f"{a / b:.2f}x",
            ]
        )
        results["metadata_only_us"][m] = {"today": a, "msgspec": b}
    print(_common.markdown_table(["message", "today µs", "msgspec µs", "ratio"], rows))

    print()
    print(
        "Where the time goes, µs per message, each phase timed alone on a prepared input (header bytes: the "
        "msgpack header frame; the tensors' own frames are the same on both sides). The tensors are framed "
        "in today's encode but in msgspec's build (registered as the Struct is built), and turned back into "
        "tensors in both decodes. check: today worker.request.parse (fields.Body.from_body); msgspec the "
        "frame indices resolved (its checks run in decode). Phases timed alone add up to less than the "
        "whole round trip (caches and allocator warm on one phase), today's more so: 'whole' is the measure."
    )
    print()
    phase_rows = []
    for m in ("Forward", "Backward"):
        for p in ("today", "msgspec"):
            cells = [us.get((m, p, ph)) for ph in ("build", "body()", "encode", "decode", "check")]
            phase_rows.append(
                [
                    m,
                    p,
                    sizes[(m, p)],
                    *("-" if c is None else f"{c:,.1f}" for c in cells),
                    f"{us[(m, p, 'whole')]:,.1f}",
                ]
            )
    print(
        _common.markdown_table(
            ["message", "path", "header bytes", "build", "body()", "encode", "decode", "check", "whole"], phase_rows
        )
    )
    for m in ("Forward", "Backward"):
        own = us[(m, "today", "body()")] + us[(m, "today", "check")]
        whole = us[(m, "today", "whole")]
        print(
            f"- {m}: fields.Body's own work (body() + from_body) is {own:,.1f} of {whole:,.1f} µs ({own / whole:.0%})"
        )

    print()
    print("What each side refuses of a malformed Forward body (today: Forward.from_body; msgspec: the typed decode):")
    print()
    print(_common.markdown_table(["body", "today", "msgspec"], refusals(t)))

    print()
    print(_common.markdown_table(["hand-written machinery (context)", "lines"], loc_rows()))

    print()
    worst_today = max(us[(m, "today", "whole")] for m in ("Forward", "Backward"))
    worst_ms = max(us[(m, "msgspec", "whole")] for m in ("Forward", "Backward"))
    step_us = args.step_ms * 1000
    print(
        f"Share of a step: {args.messages} messages x at most {worst_today:,.1f} µs today = "
        f"{args.messages * worst_today:,.0f} µs, at most {args.messages * worst_today / step_us:.1%} of a "
        f"{args.step_ms:g} ms step (msgspec: {args.messages * worst_ms:,.0f} µs, "
        f"{args.messages * worst_ms / step_us:.1%}; the switch would save at most "
        f"{args.messages * (worst_today - worst_ms) / step_us:.1%} of a step, spread over the processes)."
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "msgspec_spike.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


def _header_bytes(message: str, path: str, t: dict[str, Any]) -> int:
    if path == "today":
        msg = today_forward(t) if message == "Forward" else today_backward(t)
        return len(protocol.encode(msg.KIND, REQ_ID, SESSION, msg.body())[0])
    out = Outgoing()
    body = (ms_forward if message == "Forward" else ms_backward)(t, out)
    return len(out.encode(REQ_ID, SESSION, body)[0])


if __name__ == "__main__":
    _common.exit_now(main())
