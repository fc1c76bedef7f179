"""Compression on the wire: floating tensors of pipelined messages travel as bfloat16 or blockwise
8-bit, and arrive in their own dtype with the compression's error, smaller by what each promises;
training with it follows local training closely, and without it exactly (the other tests)."""

from __future__ import annotations

import msgpack
import pytest
import torch
from test_strategy import Net, assert_same_losses, data, residual_spec, trainer

from lightning_remote_mp import RemoteModelParallelStrategy
from lightning_remote_mp.errors import ConfigurationError, ProtocolError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.compression import compress


def _bytes(frames) -> int:
    return sum(len(memoryview(f)) for f in frames[1:])


@pytest.mark.parametrize("compression, ratio, error", [("bf16", 0.5, 2**-8), ("int8", 17 / 64, 1 / 254)])
def test_a_floating_tensor_arrives_in_its_dtype_smaller_within_the_compressions_error(compression, ratio, error):
    x = torch.randn(32, 100)
    plain = protocol.encode(protocol.FORWARD, 1, "s", {"x": x})
    frames = protocol.encode(protocol.FORWARD, 1, "s", {"x": x}, compression=compression)
    got = protocol.decode(frames).body["x"]
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert _bytes(frames) <= ratio * _bytes(plain) + 4 * 64  # the last block's padding and scale
    scale = x.abs().max() if compression == "bf16" else x.view(-1).abs().max()
    assert (got - x).abs().max() <= error * scale * 1.01


def test_integers_small_tensors_and_16_bit_ones_under_bf16_travel_as_they_are():
    body = {"ids": torch.arange(1000), "loss": torch.tensor(2.5), "half": torch.randn(100, dtype=torch.bfloat16)}
    frames = protocol.encode(protocol.RESULT, 1, "s", body, compression="bf16")
    got = protocol.decode(frames).body
    assert torch.equal(got["ids"], body["ids"]) and torch.equal(got["loss"], body["loss"])
    assert torch.equal(got["half"], body["half"])


@pytest.mark.parametrize("compression", ["bf16", "int8"])
def test_infinities_and_nans_arrive_as_they_left(compression):
    """An additive attention mask (0 and -inf) crosses stages in a spec'd transformer: under int8 a
    block's scale would be infinite and the whole block NaN; it travels as it is instead."""
    mask = torch.nn.Transformer.generate_square_subsequent_mask(16)
    odd = torch.randn(200)
    odd[[3, 150]] = torch.tensor([float("nan"), float("inf")])
    frames = protocol.encode(protocol.FORWARD, 1, "s", {"mask": mask, "odd": odd}, compression=compression)
    got = protocol.decode(frames).body
    assert torch.equal(got["mask"], mask)
    assert torch.equal(got["odd"].isnan(), odd.isnan()) and got["odd"][150] == float("inf")
    finite = odd.isfinite()
    assert (got["odd"][finite] - odd[finite]).abs().max() <= 2**-8 * odd[finite].abs().max()


def test_a_malformed_compressed_tensor_is_refused():
    """A claim of more values than the frames hold is refused, and nothing is allocated from it."""
    q, scale = compress(torch.randn(256), "int8")
    metas = [["int8", [256]], ["float32", [4]]]

    def message(shape: list[int]) -> list[bytes]:
        spec = msgpack.ExtType(4, msgpack.packb(["int8", "float32", shape, [0, 1]]))
        body = msgpack.ExtType(0, msgpack.packb({"x": spec}, use_bin_type=True))
        header = msgpack.packb([protocol.PROTOCOL_VERSION, "forward", 1, "s", metas, body], use_bin_type=True)
        return [header, q.numpy().tobytes(), scale.numpy().tobytes()]

    assert protocol.decode(message([256])).body["x"].shape == (256,)
    with pytest.raises(ProtocolError, match="do not fit"):
        protocol.decode(message([10**9]))


def test_compression_is_checked_with_the_other_arguments():
    with pytest.raises(ConfigurationError, match="compression"):
        RemoteModelParallelStrategy(compression="fp8")


@pytest.mark.parametrize("compression, tol", [("bf16", 2e-2), ("int8", 5e-2)])
def test_training_with_compression_follows_local_training(compression, tol, twin, pool):
    torch.manual_seed(0)
    local = Net(residual_spec())
    remote = twin(local)
    trainer(epochs=2).fit(local, data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2, compression=compression, balance=[4, 8])
    trainer(strategy, epochs=2).fit(remote, data())
    assert_same_losses(local.losses, remote.losses, tol)
    assert remote.losses != local.losses  # it is lossy: this did travel compressed
