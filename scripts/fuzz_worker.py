"""Fuzz a live lrmp-worker over its socket: random and mutated messages, then a normal session.

    python scripts/fuzz_worker.py --messages 200000 --seed 7          # starts a local worker
    python scripts/fuzz_worker.py --address tcp://127.0.0.1:5555 ...  # or fuzz one you started

The fuzzer opens a session and sets up a middle stage (stage 1 of 3, with a residual input from
stage 0) whose peers are a socket of the fuzzer, so pipelined messages really run and really travel
worker to worker. Then it sends, in bursts and without waiting for each reply:

- random bytes, and valid messages mutated (bits flipped, bytes set, cut, inserted, frames dropped
  or duplicated);
- valid headers that lie: tensor frames of the wrong size, unknown or mismatched dtypes, too many
  dimensions, frames missing or extra, truncated frames;
- pipeline messages (forward/backward) with random call, micro-batch and sender, in any order, with
  tensors of random shapes and dtypes;
- requests of every kind with random bodies, for the open session and for sessions that do not exist.

After every burst it drains the replies (bounded poll) and checks that the worker still answers a
ping; every few bursts, that its compute thread still answers a request. At the end the fuzz
session must still work, and a new driver session must place a model and compute what a local
copy computes. Prints a summary (``--json`` for one JSON line) and exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
import random
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgpack
import torch
import zmq

from lightning_remote_mp.driver.session import DriverSession
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.wire import protocol

KEY = "fz"
WIDTH = 4
KINDS = sorted(protocol.REQUEST_KINDS - {protocol.BYE}) + ["result", "done", "ok", "error", "nope"]
DTYPE_NAMES = sorted(protocol.DTYPES) + ["object", "float128", "", "int4"]


class FuzzFailure(AssertionError):
    pass


class Fuzzer:
    def __init__(self, address: str, seed: int, burst: int = 250) -> None:
        self.address = address
        self.rng = random.Random(seed)
        self.burst = burst
        ctx = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 100_000)
        self.sock.connect(address)
        self.sink = ctx.socket(zmq.ROUTER)  # stages 0 and 2 of the fuzzed pipeline
        self.sink.setsockopt(zmq.LINGER, 0)
        self.sink_address = f"tcp://127.0.0.1:{self.sink.bind_to_random_port('tcp://127.0.0.1')}"
        self.session = uuid.uuid4().hex
        self.stats: collections.Counter[str] = collections.Counter()
        self.replies: collections.Counter[str] = collections.Counter()
        self.max_ping = 0.0
        self.max_compute = 0.0
        self._id = 1_000_000

    # --- plumbing ------------------------------------------------------------------------
    def close(self) -> None:
        self.sock.close(0)
        self.sink.close(0)

    def request(self, kind: str, body: Any = None, session: str | None = None, timeout: float = 10.0) -> Any:
        """Send one request and wait (bounded) for the reply with its id, keeping other replies counted."""
        self._id += 1
        req_id = self._id
        self.sock.send_multipart(protocol.encode(kind, req_id, self.session if session is None else session, body))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(min(left, 0.1) * 1000):
                msg = self._read()
                if msg is not None and msg.id == req_id:
                    return msg
            self._drain_sink()
        raise FuzzFailure(f"no reply to {kind} within {timeout:.0f} s: the worker hangs")

    def _read(self) -> protocol.Message | None:
        frames = self.sock.recv_multipart()
        try:
            msg = protocol.decode(frames)
        except protocol.ProtocolError as err:
            raise FuzzFailure(f"the worker sent an undecodable reply: {err}") from None
        body = msg.body if isinstance(msg.body, dict) else {}
        self.replies[f"{msg.kind}:{body.get('type', '')}" if msg.kind == protocol.ERROR else msg.kind] += 1
        return msg

    def _drain_sink(self) -> None:
        while self.sink.poll(0):
            self.sink.recv_multipart()
            self.stats["peer messages out"] += 1

    def drain(self, quiet: float = 0.05, limit: float = 5.0) -> None:
        """Read replies until none came for ``quiet`` seconds (at most ``limit`` seconds)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            self._drain_sink()
            if not self.sock.poll(quiet * 1000):
                break
            while self.sock.poll(0):
                self._read()

    def check_responsive(self, compute: bool) -> None:
        start = time.monotonic()
        msg = self.request(protocol.PING, session="")
        if msg.kind != protocol.OK:
            raise FuzzFailure(f"ping answered with {msg.kind}: {msg.body}")
        self.max_ping = max(self.max_ping, time.monotonic() - start)
        if compute:  # goes through the compute thread's queue, behind every fuzzed request
            start = time.monotonic()
            msg = self.request(protocol.GET_STATE, timeout=60.0)
            if msg.kind != protocol.OK or KEY not in msg.body:
                raise FuzzFailure(f"the fuzz session lost its stage: {msg.kind} {msg.body!r:.200}")
            self.max_compute = max(self.max_compute, time.monotonic() - start)

    # --- the session under attack ----------------------------------------------------------
    def open(self) -> None:
        msg = self.request(protocol.HELLO, {"driver": "fuzz_worker.py", "heartbeat_timeout": 2.0})
        if msg.kind != protocol.OK:
            raise FuzzFailure(f"the worker refused the fuzz session: {msg.body}")
        setup = {
            "key": KEY,
            "stage": 1,
            "start": 3,
            "entries": [
                [
                    "lightning_remote_mp.layers.WrappedLinear",
                    {"in_features": WIDTH, "out_features": WIDTH, "dependencies": ["res"]},
                    [[2, WIDTH], [2, WIDTH]],
                ],
                ["torch.nn.ReLU", {}, [2, WIDTH]],
            ],
            "exports": [],
            "init_seed": 3,
            "sources": [[0, ["res"]]],
            "targets": [[2, []]],
            "peers": {0: self.sink_address, 2: self.sink_address},
            "stages": 3,  # so that forwards naming a schedule run its list (`lightning_remote_mp.schedule`)
        }
        msg = self.request(protocol.SETUP, setup)
        if msg.kind != protocol.OK:
            raise FuzzFailure(f"setup failed: {msg.body}")

    def close_session(self) -> None:
        msg = self.request(protocol.BYE)
        if msg.kind != protocol.OK:
            raise FuzzFailure(f"the fuzz session did not survive: bye answered {msg.kind} {msg.body}")

    # --- generators ------------------------------------------------------------------------
    def tensor(self) -> torch.Tensor:
        r = self.rng
        shape = r.choice([[2, WIDTH], [2, WIDTH], [1, WIDTH], [3, WIDTH + 1], [0, WIDTH], [], [2, WIDTH, 1], [7]])
        dtype = r.choice([torch.float32] * 6 + [torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.uint8])
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=torch.Generator().manual_seed(r.randrange(2**31))).to(dtype)
            if r.random() < 0.1:
                t = t.fill_(r.choice([math.inf, -math.inf, math.nan, 1e38]))
            return t
        return torch.zeros(shape, dtype=dtype)

    def value(self, depth: int = 0) -> Any:
        r = self.rng
        choices: list[Callable[[], Any]] = [
            lambda: None,
            lambda: r.choice([True, False]),
            lambda: r.randint(-(2**63), 2**63 - 1),
            lambda: r.choice([0, 1, -1, 2, 3, 4096, 2**31]),
            lambda: r.random() * 10 ** r.randint(-5, 5),
            lambda: r.choice([math.nan, math.inf]),
            lambda: r.choice(["", KEY, "x" * r.randint(1, 300), "torch.nn.Linear", "os.system", "net"]),
            lambda: r.randbytes(r.randint(0, 16)),
            self.tensor,
            lambda: r.choice(list(protocol.DTYPES.values())),
        ]
        if depth < 3:
            choices += [
                lambda: [self.value(depth + 1) for _ in range(r.randint(0, 4))],
                lambda: tuple(self.value(depth + 1) for _ in range(r.randint(0, 3))),
                lambda: {self.key(): self.value(depth + 1) for _ in range(r.randint(0, 4))},
            ]
        return r.choice(choices)()

    def key(self) -> Any:
        r = self.rng
        return r.choice(
            ["key", "call", "mb", "from", "x", "vars", "grad", "grads", "grad_out", "index", "state", "entries"]
            + [r.randint(-3, 5), "".join(r.choices("abc_", k=r.randint(0, 5)))]
        )

    def session_id(self) -> str:
        r = self.rng.random()
        if r < 0.6:
            return self.session
        if r < 0.8:
            return uuid.uuid4().hex
        return self.rng.choice(["", "x", self.session[:-1], self.session + "0"])

    def pipeline(self) -> list[Any]:
        """Forward/backward with random call, mb and sender; mostly well-formed tensors."""
        r = self.rng
        call, mb = r.choice([1, 1, 2, 3, r.randint(0, 10**6), -1, 2**62]), r.choice([0, 0, 1, 2, -5, 4095])
        sender = r.choice([0, 0, 0, 2, 2, -1, 1, 3, 99, -7])
        kind = r.choice([protocol.FORWARD, protocol.BACKWARD])
        if r.random() < 0.4:  # well-formed: runs the stage, and sends on to the peers
            self.stats["pipeline (well-formed)"] += 1
            x = torch.randn(2, WIDTH)
            if kind == protocol.FORWARD:
                body = {"key": KEY, "call": call, "mb": mb, "from": 0, "x": x, "vars": {"res": x}, "grad": True}
                body["requires_grad"] = {"x": True, "res": True}
            else:
                body = {"key": KEY, "call": call, "mb": mb, "from": 2, "grad_out": x, "grads": {}}
            self._scheduled(body, kind)
            return protocol.encode(kind, 0, self.session, body)
        if kind == protocol.FORWARD:
            body: dict[str, Any] = {
                "key": r.choice([KEY] * 8 + ["nope", ""]),
                "call": call,
                "mb": mb,
                "from": sender,
                "x": self.tensor(),
                "vars": r.choice([{"res": self.tensor()}, {"res": self.tensor()}, {}, {"other": self.tensor()}]),
                "requires_grad": {"x": r.random() < 0.5, "res": r.random() < 0.5},
                "grad": r.random() < 0.5,
                "autocast": r.choice([None, None, {"enabled": True, "dtype": torch.bfloat16}, {"enabled": "x"}]),
                "modes": self.modes(),
            }
        else:
            body = {
                "key": r.choice([KEY] * 8 + ["nope"]),
                "call": call,
                "mb": mb,
                "from": sender,
                "grad_out": r.choice([self.tensor(), None]),
                "grads": r.choice([{}, {"res": self.tensor()}, {"x": 1}]),
            }
        self._scheduled(body, kind)
        for _ in range(r.choice([0, 0, 0, 1, 2])):  # sometimes a field goes missing or gets odd
            field = r.choice(sorted(body))
            if r.random() < 0.5:
                del body[field]
            else:
                body[field] = self.value()
        self.stats["pipeline"] += 1
        return protocol.encode(kind, r.randint(0, 2**40), self.session_id(), body)

    def carry(self) -> list[Any]:
        """A CARRY (the driver's quiet requests passed stage to stage): well-formed or not, from the
        driver or a peer, for this stage or others, its requests' ids and bodies sane or odd."""
        r = self.rng

        def request() -> Any:
            kinds = [protocol.OPTIM_STEP, protocol.ZERO_GRAD, protocol.ZERO_GRAD, protocol.LOSS_GRAD, protocol.SETUP]
            kind = r.choice([*kinds, "nope", 3])
            body = r.choice(
                [
                    {"index": 0},
                    {"index": 0, "hparams": [{"lr": 0.1}], "sync": False},
                    {"index": "x"},
                    {"key": KEY, "call": r.choice([1, 2, -1]), "grad": r.choice([torch.tensor(0.5), self.tensor()])},
                    self.value(),
                ]
            )
            req_id = r.choice([r.randint(1, 50), r.randint(1, 2**40), 0, -1])
            after = r.choice([req_id - 1, 0, req_id, r.randint(0, 2**40)]) if isinstance(req_id, int) else 0
            try:
                frames = [bytes(f) for f in protocol.encode(str(kind), max(req_id, 0), self.session_id(), body)]
            except Exception:
                frames = [r.randbytes(r.choice([0, 8, 64]))]
            # Never the driver's seal: only the driver and the worker know the key.
            seal = r.choice([r.randbytes(32), r.randbytes(32), r.randbytes(7), b"", "seal"])
            entry = [after, r.choice([frames] * 4 + [[r.randbytes(40)], frames + frames, self.value()]), seal]
            return r.choice([entry] * 4 + [entry[:2], [req_id, after, kind, body], self.value()])

        requests = {
            r.choice([0, 1, 1, 2, 2, 3, -1, "1"]): [request() for _ in range(r.choice([1, 1, 2, 3, 0]))]
            for _ in range(r.choice([1, 1, 2]))
        }
        body = {
            "key": r.choice([KEY] * 8 + ["nope"]),
            "call": r.choice([1, 2, r.randint(0, 10**6), -1]),
            "from": r.choice([0, 0, 2, -1, 1, 99]),
            "toward": r.choice([1, 1, -1, -1, 0, 2, "down"]),
            "requests": r.choice([requests] * 6 + [self.value()]),
        }
        self.stats["carry"] += 1
        return protocol.encode(protocol.CARRY, r.choice([0, r.randint(0, 2**40)]), self.session_id(), body)

    def _scheduled(self, body: dict[str, Any], kind: str) -> None:
        """Sometimes the fields of a call that runs a schedule: its name and the loss's output on a
        forward, the action whose input a backward brings (B, or the loss's scale S) and the scale."""
        r = self.rng
        if r.random() >= 0.25:
            return
        body["microbatches"] = r.choice([1, 2, 3, 4, 0, -1])
        if kind == protocol.FORWARD:
            body["schedule"] = r.choice(["1f1b", "zero_bubble", "gpipe", "2f2b", 3])
            body["seed"] = r.choice([0, 0, 1, -1, "loss"])
        else:
            body["action"] = r.choice(["B", "S", "S", "W", 1])
            if r.random() < 0.5:
                body["scale"] = r.choice([torch.tensor(0.5), torch.ones(2), torch.tensor(1), 0.5])

    def modes(self) -> Any:
        """Train/eval flags, well-formed or not."""
        r = self.rng
        return r.choice(
            [True, False, 1, None, [], [True], [True] * 8, [[True, "x"]] * 8, [torch.ones(1)], [[True] * 99] * 8]
        )

    def entry(self) -> Any:
        """A layer entry a hostile driver might write: refused classes, class values reached through
        imports, odd wiring fields, dtype names that would import modules."""
        r = self.rng
        nested = r.choice(
            [
                {"object": "torch.nn.modules.utils.repeat", "kwargs": {"object": 1}},
                {"class": "torch.nn.attention._fa3.Library"},
                {"object": "os.system", "kwargs": {"command": "true"}},
                {"object": "torch.nn.Identity", "kwargs": {"x": {"object": "torch.nn.Identity"}}},
                {"class": 5},
            ]
        )
        entry = {
            "layer": r.choice(["os.system", "torch.nn.Nope", "x", "", "torch.nn.Identity"]),
            "kwargs": r.choice([{}, {"x": nested}]),
            "input_shape": [1],
        }
        for field, values in {
            "dependencies": [{"1bad": "v"}, {"k": 3}, ["v"], "v", [None]],
            "out_variables": [["a", "a"], [""], 7],
            "output": [0, "k", True, 1.5, [0]],
            "input_dtype": ["_inductor", "float32", "nope", 3],
        }.items():
            if r.random() < 0.3:
                entry[field] = r.choice(values)
        return entry if r.random() < 0.8 else [entry["layer"], entry["kwargs"], [1]]

    def graph_entry(self) -> Any:
        """A GraphLayer entry (a traced program) a hostile driver might write: operators outside the
        allowlist, attribute names that are not operators, references to nothing, odd markers,
        malformed tensor descriptions."""
        r = self.rng
        target = r.choice(
            [
                ["aten", "relu", "default"],
                ["aten", "from_file", "default"],
                ["aten", "__class__", "default"],
                ["aten", "relu", "__dict__"],
                ["aten", "_reshape_alias", "default"],
                ["aten", "set_", "source_Tensor_storage_offset"],
                ["aten", "_sparse_coo_tensor_unsafe", "default"],
                ["aten", "set_grad_enabled", "default"],
                ["aten", "empty", "memory_format"],
                ["aten", "new_empty_strided", "default"],  # allowed, an allocator: hostile sizes and strides
                ["aten", "_unsafe_view", "default"],  # refused: a view that autograd does not track
                ["aten", "resize_as_", "default"],  # refused
                # the denylist (lightning_remote_mp.model.operators.DENIED), whatever the schema allows
                ["aten", "sparse_coo_tensor", "indices"],
                ["aten", "pin_memory", "default"],
                ["aten", "bincount", "default"],
                ["aten", "empty_permuted", "default"],
                ["aten", "fbgemm_pack_quantized_matrix", "default"],
                ["aten", "set_", "source_Tensor"],
                ["aten", "vstack", "default"],  # allowed, derived from its schema
                ["aten", "_foreach_add", "List"],  # refused: private
                ["python", "pow"],
                ["mylib", "evil", "default"],
                ["python", "eval"],
                ["python", "getitem"],
                ["prims", "nope", "default"],
                ["aten"],
                "aten.relu.default",
                [1, 2, 3],
            ]
        )
        arg = r.choice(
            [
                {"ref": "x"},
                {"ref": "nowhere"},
                {"device": True},
                {"layout": "nope"},
                {"memory_format": "channels_last"},
                "cuda:3",
                10**30,
                {"object": "os.system"},
                [[[[[[[[[[{"ref": "x"}]]]]]]]]]],
                self.value(),
            ]
        )
        program = {
            "inputs": r.choice([["x"], ["x", "x"], "x", []]),
            "tensors": r.choice([{}, {"w": "w"}, {"w": "missing"}, {"x": "w"}, [1]]),
            "steps": [["y", target, [arg], r.choice([{}, {"k": arg}, {1: 2}])]] * r.randint(0, 3),
            "outputs": r.choice([["y"], ["x"], ["z"], "y"]),
        }
        tensors = r.choice(
            [
                {},
                {"w": {"shape": [2], "dtype": "float32", "parameter": True}},
                {"w": {"shape": [-1], "dtype": "float32"}},
                {"w": {"shape": [2], "dtype": "_inductor"}},
                {"__class__": {"shape": [1], "dtype": "float32"}},
                {"w": {"shape": "big", "dtype": torch.float32}},
            ]
        )
        programs = r.choice(
            [{"train": program}, {"eval": program, "train": program}, {"other": program}, {}, [program]]
        )
        return {
            "layer": "lightning_remote_mp.graph.GraphLayer",
            "kwargs": {"programs": programs, "tensors": tensors},
            "input_shape": [1],
        }

    def request_kinds(self) -> list[Any]:
        """Any request kind with a random body (never a valid layer to build: that is a driver's right)."""
        r = self.rng
        kind = r.choice(KINDS)
        body: Any = self.value()
        if kind in (protocol.SETUP, protocol.PROFILE) and isinstance(body, dict):
            body["entries"] = [self.entry() if r.random() < 0.7 else self.graph_entry()]
            if r.random() < 0.5:
                body["code_digests"] = r.choice([{"x": "y"}, {"torch": "0" * 64}, [1], {1: 2}, self.value()])
                body["seed"] = r.choice([True, -1, 2**63, 2**64 - 1, 0, "7", None])
        if kind == protocol.HELLO and r.random() < 0.5:
            body = {"driver": "fuzz", "protocol": r.choice([1, 2, "1", None])}
        self.stats["requests"] += 1
        return protocol.encode(kind, r.randint(0, 2**40), self.session_id(), body)

    def lying_header(self) -> list[Any]:
        """A valid-looking header whose description of the tensor frames does not hold."""
        r = self.rng
        t = self.tensor()
        frames = protocol.encode(r.choice([protocol.FORWARD, protocol.LOAD_STATE]), 7, self.session_id(), {"x": t})
        header = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        data = bytes(frames[1]) if len(frames) > 1 else b""
        op = r.choice(["size", "dtype", "dims", "missing", "extra", "truncate", "shape", "count"])
        if op == "size":
            data = data + b"\0" * r.randint(1, 9) if r.random() < 0.5 or not data else data[: -r.randint(1, len(data))]
        elif op == "dtype":
            header[4][0][0] = r.choice(DTYPE_NAMES)
        elif op == "dims":
            header[4][0][1] = [1] * r.randint(33, 80)
        elif op == "shape":
            header[4][0][1] = r.choice([[-1], [2**62], [2**40, 2**40], ["2"], None, [1.5], [True]])
        elif op == "count":
            header[4] = header[4] * r.randint(2, 5)
        out = [msgpack.packb(header, use_bin_type=True)]
        if op == "missing":
            pass
        elif op == "extra":
            out += [data, r.randbytes(r.randint(0, 64))]
        elif op == "truncate":
            out = [out[0][: r.randint(0, len(out[0]) - 1)], data]
        else:
            out.append(data)
        self.stats[f"lying header ({op})"] += 1
        return out

    def build_pool(self, size: int) -> None:
        """Structured messages to send and to mutate: building each costs about a millisecond, mutating
        one microseconds, so a pool keeps the rate of messages up."""
        makers = [self.pipeline] * 5 + [self.carry] + [self.request_kinds] * 2 + [self.lying_header] * 3
        self.pool = [[bytes(f) for f in self.rng.choice(makers)()] for _ in range(size)]

    def pooled(self) -> list[Any]:
        self.stats["structured"] += 1
        return self.rng.choice(self.pool)

    def mutated(self) -> list[Any]:
        r = self.rng
        frames = [bytearray(f) for f in r.choice(self.pool)]
        for _ in range(r.randint(1, 4)):
            i = r.randrange(len(frames))
            f = frames[i]
            op = r.choice(["flip", "set", "cut", "insert", "drop_frame", "dup_frame"])
            if op == "flip" and f:
                f[r.randrange(len(f))] ^= 1 << r.randrange(8)
            elif op == "set" and f:
                f[r.randrange(len(f))] = r.choice([0x00, 0x7F, 0x80, 0x90, 0xC1, 0xD4, 0xDD, 0xFF])
            elif op == "cut":
                del f[r.randint(0, len(f)) :]
            elif op == "insert":
                pos = r.randint(0, len(f))
                f[pos:pos] = r.randbytes(r.randint(1, 8))
            elif op == "drop_frame" and len(frames) > 1:
                del frames[i]
            elif op == "dup_frame":
                frames.insert(i, bytearray(f))
        self.stats["mutated"] += 1
        return [bytes(f) for f in frames]

    def random_bytes(self) -> list[Any]:
        r = self.rng
        self.stats["random bytes"] += 1
        return [r.randbytes(r.randint(0, 200)) for _ in range(r.randint(1, 4))]

    def message(self) -> list[Any]:
        r = self.rng.random()
        if r < 0.15:
            return self.random_bytes()
        if r < 0.55:
            return self.mutated()
        return self.pooled()

    # --- the run ------------------------------------------------------------------------------
    def run(self, messages: int, deadline: float, pool: int = 1500) -> None:
        self.build_pool(pool)
        self.open()
        sent = 0
        bursts = 0
        while sent < messages:
            if time.monotonic() > deadline:
                raise FuzzFailure(f"out of time after {sent} messages")
            for _ in range(min(self.burst, messages - sent)):
                frames = self.message()
                self.stats["frames"] += len(frames)
                self.stats["bytes"] += sum(len(f) for f in frames)
                self.sock.send_multipart(frames)
                sent += 1
            self.stats["messages"] = sent
            bursts += 1
            self.drain()
            self.check_responsive(compute=bursts % 8 == 0)
        self.drain(limit=10.0)
        self.check_responsive(compute=True)
        self.close_session()


def check_normal_session(address: str) -> None:
    """A real driver session: place a two-layer model, forward and backward equal a local copy."""
    torch.manual_seed(0)
    net = SpecSequential([("torch.nn.Linear", {"in_features": 3, "out_features": 3}, (2, 3))] * 2)
    local = copy.deepcopy(net)
    session = DriverSession([address], connect_timeout=30)
    try:
        session.place("net", net)
        x = torch.randn(2, 3)
        y = net(x)
        if not torch.allclose(y, local(x), atol=1e-6):
            raise FuzzFailure("after fuzzing, the worker computes something else than a local copy")
        y.sum().backward()
    finally:
        session.close()


def fuzz(address: str, messages: int, seed: int, time_limit: float = 600.0, burst: int = 250) -> dict[str, Any]:
    """Fuzz the worker at ``address``; returns the summary or raises FuzzFailure."""
    start = time.monotonic()
    fuzzer = Fuzzer(address, seed, burst)
    try:
        fuzzer.run(messages, start + time_limit)
    finally:
        fuzzer.close()
    fuzz_seconds = time.monotonic() - start
    check_normal_session(address)
    return {
        "address": address,
        "seed": seed,
        "messages": fuzzer.stats["messages"],
        "frames": fuzzer.stats["frames"],
        "bytes": fuzzer.stats["bytes"],
        "seconds": round(fuzz_seconds, 2),
        "max_ping_seconds": round(fuzzer.max_ping, 3),
        "max_compute_seconds": round(fuzzer.max_compute, 3),
        "sent": {k: v for k, v in sorted(fuzzer.stats.items()) if k not in ("messages", "frames", "bytes")},
        "replies": dict(sorted(fuzzer.replies.items())),
        "normal_session_after": "ok",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", help="a running worker to fuzz (default: start a local one)")
    p.add_argument("--messages", type=int, default=100_000, help="messages to send (default 100000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst", type=int, default=250, help="messages sent between two reply drains")
    p.add_argument("--time-limit", type=float, default=3600.0, help="give up (and fail) after this many seconds")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    args = p.parse_args(argv)
    workers = None
    address = args.address
    if address is None:
        from lightning_remote_mp.driver.launch import LocalWorkers

        workers = LocalWorkers(1, devices=["cpu"], threads=1, log_level="ERROR")
        address = workers.start()[0]
    try:
        summary = fuzz(address, args.messages, args.seed, args.time_limit, args.burst)
        if workers is not None:
            if (why := workers.why_dead(0)) is not None:
                raise FuzzFailure(f"the worker died: {why}")
            summary["worker_alive"] = True
    except FuzzFailure as err:
        print(f"FAILED: {err}", file=sys.stderr)
        return 1
    finally:
        if workers is not None:
            workers.stop()
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"fuzzed {address} with {summary['messages']} messages ({summary['frames']} frames, "
            f"{summary['bytes']} bytes) in {summary['seconds']} s, seed {args.seed}"
        )
        print(f"slowest ping {summary['max_ping_seconds']} s, slowest request {summary['max_compute_seconds']} s")
        print("sent:", ", ".join(f"{k} {v}" for k, v in summary["sent"].items()))
        print("replies:", ", ".join(f"{k} {v}" for k, v in summary["replies"].items()))
        print("then a normal session: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
