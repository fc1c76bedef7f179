"""The driver's typed control requests: what is built on the driver arrives equal on the worker,
through the real codec, and a malformed body is refused naming the kind and the field."""

from __future__ import annotations

import re

import pytest
import torch
import zmq

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.carry import Carried, Carry
from lightning_remote_mp.wire.grads import GradAllreduce, GradClamp, GradNorms, Grads, GradScale
from lightning_remote_mp.wire.requests import (
    SEAL_KEY_BYTES,
    Fetch,
    GroupInit,
    Hello,
    Loss,
    LossGrad,
    OptimCreate,
    OptimStep,
    Profile,
    Release,
    Setup,
    Sync,
    Timeline,
    ZeroGrad,
)
from lightning_remote_mp.wire.state import GetOptimState, GetState, LoadOptimState, LoadState, ReadOptim, Save, Saved
from lightning_remote_mp.worker.request import REQUESTS

PEER_KEY = zmq.curve_keypair()[0].decode("ascii")

SETUP = Setup(
    key="net",
    stage=1,
    stages=3,
    start=3,
    entries=[
        {"layer": "torch.nn.Linear", "kwargs": {"in_features": 4, "out_features": 4}, "input_shape": [2, 4]},
        ["torch.nn.Conv2d", {"in_channels": 1, "out_channels": 1, "kernel_size": (3, 3)}, [1, 1, 8, 8]],
    ],
    exports=["skip"],
    sources=((0, ("res",)),),
    targets=((2, ("skip",)), (-1, ())),
    peers={0: "tcp://10.0.0.1:5555", 2: "tcp://10.0.0.3:5555"},
    peer_keys={0: PEER_KEY},
    state={"3.weight": torch.randn(4, 4), "3.bias": torch.zeros(4, dtype=torch.bfloat16)},
    init_seed=None,
    split_backward="auto",
    code_digests={"my_layers": "ab" * 32},
    seed=2**62 - 1,
    frozen=["3.bias"],
)

SENT = [
    SETUP,
    Setup(  # a stage built from its seed, every optional field left out
        key="net",
        stage=0,
        stages=1,
        start=0,
        entries=[],
        exports=[],
        sources=((-1, ()),),
        targets=((-1, ()),),
        peers={},
        init_seed=7,
    ),
    Release({"net": [3, 4], "head": []}),
    GetState(),
    LoadState({"net": {"3.weight": torch.ones(2, 2)}, "head": {}}),
    Profile([["torch.nn.ReLU", {}, [1]]]),
    Profile([], repeats=5),
    OptimCreate(
        1,
        "torch.optim.AdamW",
        {"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None, "amsgrad": False},
        [{"params": ["net/3.weight"], "lr": 1e-3, "betas": (0.9, 0.999)}, {"params": [], "lr": 0.1}],
    ),
    OptimStep(1, [{"lr": 5e-4, "initial_lr": 1e-3}, {"lr": 0.1}]),
    ZeroGrad(1),
    ZeroGrad(0, set_to_none=False),
    GetOptimState(2),
    LoadOptimState(1, {"net/3.weight": {"step": torch.tensor(3.0), "exp_avg": torch.ones(4, 4)}, "net/3.bias": {}}),
    GradNorms(0, float("inf")),
    GradScale(0, torch.tensor(0.25)),
    GradClamp(0, 0.5),
    GradAllreduce(3),
    *(Timeline(op) for op in ("start", "stop", "fetch", "clock")),
    GroupInit("10.0.0.9", 29500, "session/stage0", 1, 2, "gloo", 30.0),
    Fetch("net", 3),
    Loss("net", 3, 0, 1, [0, 1], {0: torch.tensor([1, 2]), 1: torch.tensor([3])}),
    Loss(
        "net",
        3,
        1,
        2,
        [0, 1, 2],
        {0: torch.ones(2)},
        whole=[torch.ones(4)],
        entries=[{"layer": "lightning_remote_mp.graph.GraphLayer", "kwargs": {}}],
        state=[{"c": torch.zeros(1)}],
        grad=True,
        differentiate=0,
    ),
]


def _through_the_wire(kind: str, body: object) -> object:
    return protocol.decode(protocol.encode(kind, 0, "s", body)).body


def _frames(kind: str, body: object) -> list[bytes]:
    return [bytes(f) for f in protocol.encode(kind, 0, "s", body)]


@pytest.mark.parametrize("sent", SENT, ids=lambda m: type(m).__name__)
def test_a_request_arrives_as_it_was_built(sent):
    kind = sent.KIND
    got = type(sent).from_body(_through_the_wire(kind, sent.body()))
    assert type(got) is type(sent)
    # Built again from what arrived, it encodes to the same bytes: every field, tensor and dtype survived.
    assert _frames(kind, got.body()) == _frames(kind, sent.body())


def test_setup_arrives_with_its_fields_typed():
    got = Setup.from_body(_through_the_wire(protocol.SETUP, SETUP.body()))
    assert got.sources == ((0, ("res",)),) and got.targets == ((2, ("skip",)), (-1, ()))
    assert got.peers == {0: "tcp://10.0.0.1:5555", 2: "tcp://10.0.0.3:5555"} and got.peer_keys == {0: PEER_KEY}
    assert got.entries[1][1]["kernel_size"] == (3, 3)  # a tuple stays a tuple
    assert got.state is not None and got.state["3.bias"].dtype == torch.bfloat16
    assert (got.init_seed, got.split_backward, got.seed, got.frozen) == (None, "auto", 2**62 - 1, ["3.bias"])


def test_grads_arrive_as_the_operation_their_op_names():
    for sent in (GradNorms(0, 2.0), GradScale(0, torch.tensor(0.5)), GradClamp(0, 1.0), GradAllreduce(0)):
        assert type(Grads.from_body(_through_the_wire(protocol.GRADS, sent.body()))) is type(sent)
    got = Grads.from_body({"index": 0, "op": "norms", "norm_type": 1})  # an int norm, as a user may give it
    assert got == GradNorms(0, 1.0)


def test_every_request_kind_has_one_typed_definition():
    # One table, every kind a worker accepts: FORWARD and BACKWARD are `messages`' Forward and Backward.
    assert set(REQUESTS) == protocol.REQUEST_KINDS
    assert all(cls.KIND == kind for kind, cls in REQUESTS.items())


GOOD_SETUP = SETUP.body()


@pytest.mark.parametrize(
    "cls, body, match",
    [
        (Setup, [1, 2], "setup message: the body must be a dict"),
        (Setup, {"key": "net"}, "setup message: field 'stage' is missing"),
        (Setup, {**GOOD_SETUP, "stage": "1"}, re.escape("setup message: field 'stage': expected an int, got a str")),
        (Setup, {**GOOD_SETUP, "stages": None}, "setup message: field 'stages' is missing"),
        (Setup, {**GOOD_SETUP, "stages": 0}, re.escape("setup message: field 'stages': expected an int >= 1")),
        (Setup, {**GOOD_SETUP, "stages": 1}, "field 'stage' must be in \\[0, stages=1\\), got 1"),
        (
            Setup,
            {**GOOD_SETUP, "entries": {}},
            re.escape("setup message: field 'entries': expected a list, got a dict"),
        ),
        (
            Setup,
            {**GOOD_SETUP, "exports": ["a", 1]},
            re.escape("setup message: field 'exports[1]': expected a str, got an int"),
        ),
        (Setup, {**GOOD_SETUP, "sources": [[0, "res"]]}, r"field 'sources\[0\]\[1\]': expected a list, got a str"),
        (Setup, {**GOOD_SETUP, "targets": [[True, []]]}, r"field 'targets\[0\]\[0\]': expected an int, got a bool"),
        (
            Setup,
            {**GOOD_SETUP, "peers": {"0": "tcp://a:1"}},
            re.escape("setup message: field 'peers': a key: expected an int, got a str"),
        ),
        (Setup, {**GOOD_SETUP, "peer_keys": {5: PEER_KEY}}, "field 'peer_keys' must map stages in 'peers'"),
        (Setup, {**GOOD_SETUP, "peer_keys": {0: "short"}}, "field 'peer_keys' must map stages in 'peers' to 40-char"),
        (
            Setup,
            {**GOOD_SETUP, "state": {"3.weight": b"\x80"}},
            re.escape("setup message: field 'state[...]': expected a tensor, got bytes"),
        ),
        (Setup, {**GOOD_SETUP, "state": None}, "'files', an 'init_seed', or the stage it 'borrows'"),
        (Setup, {**GOOD_SETUP, "seed": -1}, "setup message: field 'seed': expected an int >= 0"),
        (
            Setup,
            {**GOOD_SETUP, "split_backward": 1},
            re.escape("setup message: field 'split_backward': expected a bool or a str, got an int"),
        ),
        (
            Setup,
            {**GOOD_SETUP, "split_backward": "always"},
            re.escape("setup message: field 'split_backward': invalid enum value 'always'"),
        ),
        (
            Setup,
            {**GOOD_SETUP, "code_digests": [1]},
            re.escape("setup message: field 'code_digests': expected a dict, got a list"),
        ),
        (
            Setup,
            {**GOOD_SETUP, "code_digests": {1: 2}},
            re.escape("setup message: field 'code_digests': a key: expected a str, got an int"),
        ),
        (Setup, {**GOOD_SETUP, "frozen": 5}, re.escape("setup message: field 'frozen': expected a list, got an int")),
        (
            Release,
            {"calls": {"net": [1, "2"]}},
            re.escape("release message: field 'calls[...][1]': expected an int, got a str"),
        ),
        (GetState, [1], "get_state message: the body must be a dict"),
        (
            LoadState,
            {"state": {"net": {"0.w": 3}}},
            re.escape("load_state message: field 'state[...][...]': expected a tensor, got int"),
        ),
        (
            Profile,
            {"entries": [], "repeats": "3"},
            re.escape("profile message: field 'repeats': expected an int or None, got a str"),
        ),
        (
            OptimCreate,
            {"index": 0, "cls": 1},
            re.escape("optim_create message: field 'cls': expected a str, got an int"),
        ),
        (
            OptimCreate,
            {"index": 0, "cls": "torch.optim.SGD", "defaults": {}, "groups": [{"lr": 0.1}]},
            "optim_create message: field 'groups' must be a list of hyperparameter dicts with a 'params' list",
        ),
        (
            OptimStep,
            {"index": 0, "hparams": [{"lr": 0.1}, 3]},
            re.escape("optim_step message: field 'hparams[1]': expected a dict, got an int"),
        ),
        (
            ZeroGrad,
            {"index": 0, "set_to_none": "yes"},
            re.escape("zero_grad message: field 'set_to_none': expected a bool, got a str"),
        ),
        (
            GetOptimState,
            {"index": True},
            re.escape("get_optim_state message: field 'index': expected an int, got a bool"),
        ),
        (
            LoadOptimState,
            {"index": 0, "state": {"w": 3}},
            re.escape("load_optim_state message: field 'state[...]': expected a dict, got an int"),
        ),
        (Grads, {"index": 0, "op": "explode"}, "grads message: field 'op' must be one of 'norms', 'scale'"),
        (
            Grads,
            {"index": 0, "op": "norms", "norm_type": True},
            re.escape("grads message: field 'norm_type': expected a float, got a bool"),
        ),
        (
            Grads,
            {"index": 0, "op": "scale", "coef": 0.5},
            re.escape("grads message: field 'coef': expected a tensor, got float"),
        ),
        (Grads, {"index": 0, "op": "scale", "coef": torch.ones(2)}, "'coef' must be a floating-point scalar tensor"),
        (Grads, {"index": 0, "op": "clamp"}, "grads message: field 'value' is missing"),
        (Grads, {"index": 0}, "grads message: field 'op' is missing"),
        (Grads, {"index": 0, "op": ["norms"]}, "grads message: field 'op' must be one of 'norms', 'scale'"),
        (Timeline, {"op": "rewind"}, re.escape("timeline message: field 'op': invalid enum value 'rewind'")),
        (GroupInit, {"op": "leave"}, re.escape("group message: field 'op': invalid value 'leave'")),
        (
            GroupInit,
            {**GroupInit("h", 1, "p", 0, 1, "gloo", 1.0).body(), "port": "1"},
            re.escape("group message: field 'port': expected an int, got a str"),
        ),
    ],
)
def test_a_malformed_request_is_refused_naming_the_kind_and_the_field(cls, body, match):
    with pytest.raises(ProtocolError, match=match):
        cls.from_body(_through_the_wire(cls.KIND, body))


def test_a_hello_is_read_leniently_so_another_version_still_hears_what_differs():
    sent = Hello("host pid 1", protocol.PROTOCOL_VERSION, "0.1.0", "2.13.0", 9.0)
    assert Hello.from_body(protocol.decode(protocol.encode(protocol.HELLO, 1, "s", sent.body())).body) == sent
    odd = Hello.from_body({"protocol": 99, "lrmp": ["x"] * 100, "heartbeat_timeout": True, "torch": "2" * 500})
    assert odd.protocol_version == 99 and odd.heartbeat_timeout is None
    assert (odd.driver, odd.lrmp, len(odd.torch)) == ("?", "?", 100)
    assert Hello.from_body("not a dict").protocol_version == protocol.PROTOCOL_VERSION


def _golden() -> dict[str, object]:
    """One fixed request of every kind, with fixed tensors (no randomness)."""
    t = torch.arange(6.0).reshape(2, 3)
    return {
        "setup": Setup(
            key="net",
            stage=1,
            start=2,
            entries=[
                ["torch.nn.Linear", {"in_features": 3, "out_features": 2}, [2, 3]],
                {
                    "layer": "lightning_remote_mp.graph.GraphLayer",
                    "kwargs": {"programs": {"eval": {"program": "ab" * 16, "tensors": ["fc_weight"]}}},
                    "input_shape": [2, 3],
                },
            ],
            programs={
                "ab" * 16: {
                    "inputs": ["x"],
                    "tensors": {"w": "fc_weight"},
                    "steps": [["y", ["aten", "linear", "default"], [{"ref": "x"}, {"ref": "w"}], {}]],
                    "outputs": ["y"],
                }
            },
            exports=["r"],
            sources=((0, ("r",)),),
            targets=((-1, ()),),
            peers={0: "tcp://127.0.0.1:5555"},
            state={"2.weight": t[:, :2], "2.bias": torch.zeros(2)},
            code_digests={"m": "00" * 32},
            seed=5,
            frozen=["2.bias"],
            stages=3,
            files={
                "2.weight": ["/models/llama/model-00001-of-00002.safetensors", "lm_head.weight"],
                "3.q_proj__weight_absmax": [
                    "/models/llama/model-00001-of-00002.safetensors",
                    "model.layers.0.self_attn.q_proj.weight",
                    {
                        "quantize": {
                            "shape": [64, 64],
                            "quant_type": "nf4",
                            "blocksize": 64,
                            "nested": True,
                            "dtype": "bfloat16",
                            "storage": "uint8",
                        },
                        "part": "absmax",
                    },
                ],
            },
        ),
        "release": Release({"net": [1, 2]}, generations={"net": [3]}),
        "get_state": GetState(),
        "load_state": LoadState({"net": {"2.bias": torch.ones(2)}}),
        "profile": Profile([["torch.nn.ReLU", {}, [2, 3]]], repeats=3),
        "optim_create": OptimCreate(0, "torch.optim.SGD", {"lr": 0.1}, [{"params": ["net.2.weight"], "lr": 0.1}]),
        "optim_step": OptimStep(0, [{"lr": 0.05}]),
        "zero_grad": ZeroGrad(0, set_to_none=False),
        "get_optim_state": GetOptimState(0),
        "load_optim_state": LoadOptimState(0, {"net.2.weight": {"momentum_buffer": t}}),
        "grads": GradScale(0, torch.tensor(0.5)),
        "timeline": Timeline("clock"),
        "group": GroupInit("127.0.0.1", 29500, "p", 0, 2, "gloo", 30.0),
        "sync": Sync(),
        "hello": Hello("host pid 1", protocol.PROTOCOL_VERSION, "0.1.0", "2.13.0", 9.0, seal_key=b"k" * 32),
        "fetch": Fetch("net", 4),
        "save": Save(
            "/ckpt/.last.ckpt.partial",
            "net-stage1.safetensors",
            {"net": {"2.weight": "net.layers.2.weight"}},
            {0: {"net/2.weight": "net.layers.2.weight"}},
            background=True,
        ),
        "saved": Saved("net-stage1.safetensors", wait=True),
        "read_optim": ReadOptim(0, {"net/2.weight": ["/ckpt/last.ckpt/net-stage1.safetensors", "net.layers.2.weight"]}),
        "loss": Loss("net", 4, 1, 1, [0, 1, 2], {0: t[0], 1: t[1]}, whole=[t], grad=True),
        "carry": Carry(
            "net",
            4,
            0,
            1,
            {
                1: [Carried.sealed(OptimStep(0, [{"lr": 0.05}], sync=True), 7, 6, "s", bytes(SEAL_KEY_BYTES))],
                2: [
                    Carried.sealed(ZeroGrad(0), 3, 2, "s", bytes(SEAL_KEY_BYTES)),
                    Carried.sealed(LossGrad("net", 4, torch.tensor(0.25)), 4, 3, "s", bytes(SEAL_KEY_BYTES)),
                ],
            },
        ),
        "loss_grad": LossGrad("net", 4, torch.tensor(0.125), answer=True),
    }


# sha256 of each request's frames. A change here changes what older workers receive: bump
# protocol.PROTOCOL_VERSION with it (and say so in the CHANGELOG), then update these.
GOLDEN = {
    "setup": "9fb58950fa3ac5b7",
    "release": "38a7e6907b48879c",
    "get_state": "8891234432d2b9a6",
    "load_state": "9e41731c1f301981",
    "profile": "d897d16a3ee7a2ba",
    "optim_create": "864a10028c64a557",
    "optim_step": "e3cdeed6fae72dc4",
    "zero_grad": "678a7ec1161ee8fa",
    "get_optim_state": "e3d6af2da2bde9ef",
    "load_optim_state": "408fccfb377c2f84",
    "grads": "0abd8d13d8365550",
    "timeline": "7a29959e9ee77bb8",
    "group": "0537bde80e3c2aa5",
    "sync": "0bf2a6ae7712964a",
    "hello": "5141455243f3dbb4",
    "fetch": "4b944cbd3c7e0fce",
    "save": "c5884ceb17fea1db",
    "saved": "3cf2f8169376238c",
    "read_optim": "1be0fd35beada004",
    "loss": "89a4e841d48e0878",
    "carry": "869b7e0c0089bbc7",
    "loss_grad": "ad5927726976da9c",
}


def test_the_wire_format_of_every_request_is_pinned():
    import hashlib

    got = {}
    for kind, request in _golden().items():
        assert request.KIND == kind
        frames = protocol.encode(kind, 1, "session", request.body())
        got[kind] = hashlib.sha256(b"".join(bytes(f) for f in frames)).hexdigest()[:16]
    assert got == GOLDEN, "the wire format changed: bump protocol.PROTOCOL_VERSION, then update GOLDEN"


def test_a_tensor_read_from_a_carried_request_owns_its_memory():
    """A request carried along the pipeline keeps its frames as bytes (read-only): a tensor read
    from them is a copy, so writing to it changes nothing the request holds (torch warned on every
    worker under 1F1B, and the tensor aliased an immutable bytes object)."""
    carried = Carried.sealed(LossGrad("net", 4, torch.tensor(0.25)), 7, 6, "s", bytes(SEAL_KEY_BYTES))
    carry = Carry("net", 4, 0, 1, {1: (carried,)})
    first = Carry.from_body(carry.body()).requests[1][0]
    first.request.grad.add_(1.0)
    again = Carry.from_body(Carry("net", 4, 0, 1, {1: (first,)}).body()).requests[1][0]
    assert again.request.grad.item() == 0.25


@pytest.mark.parametrize("toward", [True, 1.0, torch.ones(2), 2])
def test_a_carry_goes_one_stage_down_or_up_and_nothing_else(toward):
    body = {"key": "net", "call": 4, "from": 0, "toward": toward, "requests": {}}
    with pytest.raises(ProtocolError, match="carry message: field 'toward': (expected an int|invalid enum value 2)"):
        Carry.from_body(_through_the_wire(protocol.CARRY, body))
