"""Compression of floating tensors on the wire: what an activation or a gradient travels as.

``compression`` on the strategy says how pipelined messages carry floating tensors: as they are,
as bfloat16, or blockwise 8-bit. `lightning_remote_mp.wire.protocol` frames the parts `compress`
makes as raw frames, each referred to by index from an extension value ``[mode, dtype name, shape,
frame indices]``, and gives a received one to `decompressed`, which checks it before it builds
anything.

>>> x = torch.linspace(-1, 1, 256)
>>> q, scale = compress(x, "int8")
>>> q.dtype, q.numel(), scale.numel()
(torch.int8, 256, 4)
>>> bool((decompress("int8", torch.float32, [256], [q, scale]) - x).abs().max() <= 1 / 254)
True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_remote_mp.errors import ProtocolError

#: ``compression`` on the strategy: how pipelined messages carry floating tensors (activations and their
#: gradients): as they are, as bfloat16 (half of float32's bytes), or blockwise 8-bit (`INT8_BLOCK` values
#: per block, each block with its float32 scale: 17/64 of float32's bytes, as hivemind and SWARM send).
COMPRESSIONS = (None, "bf16", "int8")
INT8_BLOCK = 64
#: Tensors with fewer elements travel as they are: a loss's sum, a count, a scale.
COMPRESS_FROM = 64


def compressible(t: torch.Tensor, compression: str) -> bool:
    """Whether ``t`` travels compressed under ``compression``; otherwise it travels as it is."""
    if t.numel() < COMPRESS_FROM or t.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        return False
    if compression == "bf16":
        return t.dtype in (torch.float32, torch.float64)  # bf16 of a 16-bit type saves nothing
    # A block's scale is its largest magnitude: one infinity (an additive attention mask's -inf)
    # or NaN would turn the whole block into NaN. Such a tensor travels as it is, exactly.
    return bool(torch.isfinite(t).all())


def compress(t: torch.Tensor, compression: str) -> list[torch.Tensor]:
    """The frames a floating tensor travels as: bfloat16 values; or, for ``"int8"``, 8-bit values in
    blocks of `INT8_BLOCK` (the last one padded with zeros) and each block's float32 scale (its
    largest magnitude over 127)."""
    flat = t.detach().reshape(-1)
    if compression == "bf16":
        return [flat.to(torch.bfloat16)]
    blocks = torch.nn.functional.pad(flat.float(), (0, -flat.numel() % INT8_BLOCK)).view(-1, INT8_BLOCK)
    scale = blocks.abs().amax(1) / 127
    q = torch.round(blocks / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
    return [q.to(torch.int8).reshape(-1), scale]


def decompress(compression: str, dtype: torch.dtype, shape: list[int], parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` from its compressed ``parts`` (`compress`)."""
    n = math.prod(shape)
    if compression == "bf16":
        return parts[0].to(dtype).reshape(shape)
    q, scale = parts
    return (q.view(-1, INT8_BLOCK).float() * scale[:, None]).reshape(-1)[:n].to(dtype).reshape(shape)


def decompressed(
    spec: Any, tensors: Sequence[torch.Tensor], dtypes: Mapping[str, torch.dtype], max_dims: int
) -> torch.Tensor:
    """A received compressed tensor, ``spec`` (``[mode, dtype name, shape, frame indices]``) over the
    message's ``tensors``, checked and decompressed; a malformed one raises `ProtocolError`."""
    try:
        compression, name, shape, frames = spec
    except Exception:
        raise ProtocolError("malformed compressed tensor") from None
    dtype = dtypes.get(name) if isinstance(name, str) else None
    if compression not in ("bf16", "int8") or dtype is None or not dtype.is_floating_point:
        raise ProtocolError(f"unknown compression {compression!r:.20} or dtype {name!r:.20}")
    if not (isinstance(shape, list) and len(shape) <= max_dims and all(type(d) is int and d >= 0 for d in shape)):
        raise ProtocolError("malformed compressed tensor shape")
    if not (isinstance(frames, list) and all(type(i) is int and 0 <= i < len(tensors) for i in frames)):
        raise ProtocolError("compressed tensor refers to tensors that did not arrive")
    parts = [tensors[i] for i in frames]
    n = math.prod(shape)
    if compression == "bf16":
        well_formed = len(parts) == 1 and parts[0].dtype == torch.bfloat16 and parts[0].numel() == n
    else:
        blocks = -(-n // INT8_BLOCK)
        well_formed = (
            len(parts) == 2
            and parts[0].dtype == torch.int8
            and parts[0].numel() == blocks * INT8_BLOCK
            and parts[1].dtype == torch.float32
            and parts[1].numel() == blocks
        )
    if not well_formed:
        raise ProtocolError(f"a {compression} tensor of shape {shape!r:.60} arrived with frames that do not fit it")
    return decompress(compression, dtype, shape, parts)
