"""The pipeline's typed messages: what is built on one side arrives equal on the other, through the
real codec, and a malformed body is refused naming the field, whoever sent it."""

from __future__ import annotations

import pytest
import torch

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.flow import DRIVER
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.messages import Backward, Forward, Generation


def _through_the_wire(kind: str, body: dict) -> dict:
    return protocol.decode(protocol.encode(kind, 0, "s", body)).body


def test_a_forward_arrives_as_it_was_built():
    sent = Forward(
        key="net",
        call=7,
        mb=2,
        sender=DRIVER,
        x=(torch.randn(3, 4), torch.arange(3)),  # a traced model's tuple
        vars={"skip": torch.ones(3, 4)},
        requires_grad={"x": [True, False], "skip": True},
        grad=True,
        autocast={"enabled": True, "dtype": torch.bfloat16},
        modes=[True, False],
        checkpoint=True,
        sent_at=12.5,
    )
    got = Forward.from_body(_through_the_wire(protocol.FORWARD, sent.body()))
    assert (got.key, got.call, got.mb, got.sender, got.grad, got.checkpoint, got.sent_at) == (
        "net",
        7,
        2,
        -1,
        True,
        True,
        12.5,
    )
    assert torch.equal(got.x[0], sent.x[0]) and torch.equal(got.x[1], sent.x[1])
    assert torch.equal(got.vars["skip"], sent.vars["skip"])
    assert got.requires_grad == sent.requires_grad and got.modes == [True, False]
    assert got.autocast == {"enabled": True, "dtype": torch.bfloat16}


def test_a_backward_arrives_as_it_was_built():
    sent = Backward(key="net", call=7, mb=0, sender=1, grad_out=(torch.ones(2), None), grads={"skip": None})
    got = Backward.from_body(_through_the_wire(protocol.BACKWARD, sent.body()))
    assert (got.key, got.call, got.mb, got.sender, got.sent_at) == ("net", 7, 0, 1, None)
    assert torch.equal(got.grad_out[0], torch.ones(2)) and got.grad_out[1] is None
    assert got.grads == {"skip": None}
    assert got.loss_grads is None and "loss_grads" not in sent.body()  # left out unless a loss was computed there


def test_a_backward_brings_the_gradients_of_the_losses_the_last_stage_computed():
    sent = Backward(key="net", call=7, mb=1, sender=-1, loss_grads=[torch.tensor(0.25), None])
    got = Backward.from_body(_through_the_wire(protocol.BACKWARD, sent.body()))
    assert torch.equal(got.loss_grads[0], torch.tensor(0.25)) and got.loss_grads[1] is None
    with pytest.raises(ProtocolError, match="loss_grads"):
        Backward.from_body({**sent.body(), "loss_grads": [1.0]})


GOOD = {"key": "net", "call": 1, "mb": 0, "from": 0, "x": torch.ones(1)}
GOOD_BACKWARD = {k: v for k, v in GOOD.items() if k != "x"}  # a field a backward has not: refused


@pytest.mark.parametrize(
    "change, match",
    [
        ({"key": 5}, "field 'key': expected a str, got an int"),
        ({"call": "1"}, "field 'call': expected an int, got a str"),
        ({"mb": True}, "field 'mb': expected an int, got a bool"),
        ({"from": None}, "field 'from' is missing"),
        ({"x": "tensor"}, "'x' must be a tensor or a tuple of tensors"),
        ({"x": (torch.ones(1), 3)}, "'x' must be a tensor or a tuple of tensors"),
        ({"vars": {"a": 3}}, r"field 'vars\[...\]': expected a tensor, got int"),
        ({"vars": [torch.ones(1)]}, "field 'vars': expected a dict, got a list"),
        ({"requires_grad": {"x": "yes"}}, r"field 'requires_grad\[...\]': expected a bool or a list, got a str"),
        ({"autocast": {"enabled": True, "dtype": "float16"}}, "'autocast' must be"),
        ({"autocast": {"enabled": 1, "dtype": None}}, "'autocast' must be"),
        # A step of generate(): exactly [id, capacity, rows or None].
        ({"generation": [1, 2]}, "field 'generation': expected a list of at least length 3, got 2"),
        ({"generation": [1, 2, None, 5]}, "field 'generation': expected a list of at most length 3, got 4"),
        ({"generation": [-1, 2, None]}, r"field 'generation\[0\]': expected an int >= 0"),
        # The schedule alone picks a stage's plan: it comes with the loss's output, under grad.
        ({"schedule": "1f1b", "grad": True}, "'schedule' and 'loss_output' come together"),
        ({"loss_output": 0, "grad": True}, "'schedule' and 'loss_output' come together"),
        ({"schedule": "1f1b", "loss_output": 0}, "a 'schedule' is for a forward under grad"),
    ],
)
def test_a_malformed_forward_is_refused_naming_the_field(change, match):
    with pytest.raises(ProtocolError, match=match):
        Forward.from_body({**GOOD, **change})


@pytest.mark.parametrize(
    "body, match",
    [
        ([1, 2], "the body must be a dict"),
        ({**GOOD_BACKWARD, "grad_out": [1.0]}, "'grad_out' must be a tensor, a tuple of tensors or None"),
        ({**GOOD_BACKWARD, "grads": {"a": "b"}}, r"field 'grads\[...\]': expected a tensor, got str"),
        # protocol 17's S input (a loss scale between stages), from a worker that should have been refused:
        ({**GOOD_BACKWARD, "action": "S"}, "backward message: unknown field 'action'"),
    ],
)
def test_a_malformed_backward_is_refused_naming_the_field(body, match):
    with pytest.raises(ProtocolError, match=match):
        Backward.from_body(body)


def test_the_fence_travels_and_a_malformed_one_is_refused():
    sent = Backward(key="net", call=1, mb=0, sender=2, grad_out=torch.ones(2), fence={0: 7, 1: 9})
    assert Backward.from_body(protocol.decode(protocol.encode(protocol.BACKWARD, 0, "s", sent.body())).body).fence == {
        0: 7,
        1: 9,
    }
    body = Forward(key="net", call=1, mb=0, sender=DRIVER).body()
    for bad in ({True: 1}, {0: -1}, {"0": 1}, {0: 1.5}, [1]):
        with pytest.raises(ProtocolError, match="fence"):
            Forward.from_body({**body, "fence": bad})


# sha256 of a forward and a backward message's frames: a change here changes what older workers
# receive. Bump protocol.PROTOCOL_VERSION with it (and say so in the CHANGELOG), then update these.
PIPELINED_GOLDEN = {
    "forward": "b6d2de4982bba75e",
    "backward": "692b17988651573c",
    "scheduled forward": "cae81fdca735ba0c",
    "generation step": "1d883aca4e429a82",
}


def test_the_wire_format_of_pipelined_messages_is_pinned():
    import hashlib

    t = torch.arange(6.0).reshape(2, 3)
    messages = {
        "forward": Forward(
            key="net",
            call=3,
            mb=1,
            sender=0,
            x=t,
            vars={"r": t[0]},
            requires_grad={"x": True, "r": False},
            grad=True,
            autocast={"enabled": True, "dtype": torch.bfloat16},
            modes=[True, [1, 2]],
            checkpoint=True,
            fence={1: 4},
            microbatches=4,
        ),
        "backward": Backward(
            key="net", call=3, mb=1, sender=1, grad_out=t, grads={"r": None}, fence={0: 2}, microbatches=4
        ),
        # What a schedule adds (`lightning_remote_mp.schedule`): the forward names it and the loss's
        # output; the driver's gradient of the loss follows as each stage's `requests.LossGrad`.
        "scheduled forward": Forward(key="net", call=3, mb=1, sender=0, x=t, grad=True, schedule="1f1b", loss_output=0),
        # A step of generate(): the stage's cache of generation 7 (134 tokens), its rows reordered first.
        "generation step": Forward(key="net", call=3, mb=1, sender=0, x=t, generation=Generation(7, 134, [1, 0])),
    }
    got = {}
    for name, msg in messages.items():
        frames = protocol.encode(msg.KIND, 0, "session", msg.body())
        got[name] = hashlib.sha256(b"".join(bytes(f) for f in frames)).hexdigest()[:16]
    assert got == PIPELINED_GOLDEN, "the wire format changed: bump protocol.PROTOCOL_VERSION, then update the hashes"
