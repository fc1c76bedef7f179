"""4-bit frozen weights (QLoRA's NF4 and FP4, as bitsandbytes stores them), in plain ATen operators.

A 4-bit weight is a group of tensors, named as bitsandbytes' ``state_dict`` names them beside the
weight (``q_proj.weight``, ``q_proj.weight.absmax``, ...): the packed values, two 4-bit codes a byte
(`PACKED`), one scale per block of ``blocksize`` values (``absmax``), the 16 values the codes stand
for (``quant_map``: NF4's or FP4's) and, with double quantization, the scales themselves quantized
to 8 bits per block of 256 (``nested_absmax``, ``nested_quant_map``, and ``offset``, their mean,
which bitsandbytes keeps in the JSON of ``quant_state.bitsandbytes__nf4``).

Workers run it as lrmp's own operator ``lrmp::linear_4bit`` (`linear_4bit`): a traced program names
it like an ATen operator, and it is the one operator outside ATen a worker runs. It dequantizes with
shifts, a 16-entry lookup and a multiply (as torchao's ``NF4Tensor`` does), computes the linear
layer, and keeps nothing in full precision: its backward dequantizes the weight again, as
bitsandbytes' ``MatMul4Bit`` does, so a stage holds a full-precision copy of a frozen weight only
while one of its layers runs. Numerics follow bitsandbytes' CPU kernels step for step
(tests/test_qlora.py compares the dequantized weights bit for bit): the backward dequantizes to
the weight's stored dtype before casting to the gradient's, as ``MatMul4Bit`` does.

`quantize` is bitsandbytes' ``quantize_4bit`` (with ``compress_statistics``) in the same operators:
a worker that reads a full-precision weight from ``pretrained=`` files quantizes it as it reads it.

>>> import torch
>>> fmt = Format(shape=(4, 64), quant_type="nf4", blocksize=64, nested=True, dtype=torch.float32)
>>> w = torch.linspace(-1, 1, 256).reshape(4, 64)
>>> parts = quantize(w, fmt)
>>> sorted(parts), tuple(parts[PACKED].shape), parts[PACKED].dtype
(['', 'absmax', 'nested_absmax', 'nested_quant_map', 'offset', 'quant_map'], (128, 1), torch.uint8)
>>> float((dequantize(parts, fmt) - w).abs().max()) < 0.15  # NF4's codes are 0.28 apart near ±1
True
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: The part of a 4-bit weight's group that is the packed weight itself: its name is the weight's.
PACKED = ""
#: Double quantization quantizes the scales in blocks of this many (bitsandbytes supports no other).
NESTED_BLOCKSIZE = 256
#: The quantization types a worker dequantizes (bitsandbytes' ``bnb_4bit_quant_type``).
QUANT_TYPES = ("nf4", "fp4")
#: The block sizes bitsandbytes quantizes with.
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
#: The dtypes a frozen weight is stored in before quantization and computed in.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: NormalFloat4 (QLoRA, arXiv:2305.14314): quantiles of N(0, 1), each bin of equal probability, scaled to [-1, 1].
_NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
#: bitsandbytes' FP4 (1 sign, 2 exponent, 1 mantissa bit, bias 2) in code order, scaled to [-1, 1].
_FP4 = tuple(v / 12 for v in (0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3))


def code(quant_type: str) -> torch.Tensor:
    """The 16 values the 4-bit codes of ``quant_type`` stand for (bitsandbytes' ``get_4bit_type``)."""
    if quant_type not in QUANT_TYPES:
        raise ValueError(f"4-bit quant_type {quant_type!r} is not one of {QUANT_TYPES}")
    return torch.tensor(_NF4 if quant_type == "nf4" else _FP4, dtype=torch.float32)


@functools.cache
def _dynamic_map() -> tuple[float, ...]:
    """The signed 8-bit dynamic map that double quantization codes the scales with (bitsandbytes'
    ``create_dynamic_map()``: a decimal exponent from 1e-6 to 1, the rest of the bits a fraction)."""
    values = [0.0, 1.0]
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        values += (10 ** (i - 6) * means).tolist() + (-(10 ** (i - 6)) * means).tolist()
    return tuple(sorted(values))


def dynamic_map() -> torch.Tensor:
    return torch.tensor(_dynamic_map(), dtype=torch.float32)


@dataclasses.dataclass(frozen=True)
class Format:
    """How one weight of ``shape`` (``[out_features, in_features]``) is stored in 4 bits: bitsandbytes'
    ``QuantState`` without its tensors. ``dtype`` is the weight's dtype before quantization (the
    backward dequantizes to it), ``storage`` the packed tensor's (``bnb_4bit_quant_storage``)."""

    shape: tuple[int, ...]
    quant_type: str = "nf4"
    blocksize: int = 64
    nested: bool = False
    dtype: torch.dtype = torch.float32
    storage: torch.dtype = torch.uint8

    def __post_init__(self) -> None:
        if self.quant_type not in QUANT_TYPES:
            raise ValueError(f"4-bit quant_type {self.quant_type!r} is not one of {QUANT_TYPES}")
        if self.blocksize not in BLOCKSIZES:
            raise ValueError(f"4-bit blocksize {self.blocksize} is not one of {BLOCKSIZES}")

    @property
    def numel(self) -> int:
        return math.prod(int(d) for d in self.shape)

    def parts(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Each tensor of the group: its suffix after the weight's name, its shape and dtype."""
        n, blocks = self.numel, -(-self.numel // self.blocksize)
        packed_bytes = (n + 1) // 2
        packed = (packed_bytes // self.storage.itemsize, 1)
        out = {PACKED: (packed, self.storage), "quant_map": ((16,), torch.float32)}
        if not self.nested:
            return {**out, "absmax": ((blocks,), torch.float32)}
        nested = -(-blocks // NESTED_BLOCKSIZE)
        return {
            **out,
            "absmax": ((blocks,), torch.uint8),
            "nested_absmax": ((nested,), torch.float32),
            "nested_quant_map": ((256,), torch.float32),
            "offset": ((), torch.float32),
        }

    def describe(self) -> dict[str, Any]:
        """As it travels in a `Setup.files` entry (`lightning_remote_mp.model.weights.QUANTIZE`): plain values."""
        return {
            "shape": list(self.shape),
            "quant_type": self.quant_type,
            "blocksize": self.blocksize,
            "nested": self.nested,
            "dtype": str(self.dtype).removeprefix("torch."),
            "storage": str(self.storage).removeprefix("torch."),
        }

    @classmethod
    def parse(cls, value: Any, where: str) -> Format:
        """`describe`'s value back, checked (it may have come over the network)."""
        dtypes = {str(d).removeprefix("torch."): d for d in (*FLOAT_DTYPES, torch.uint8, torch.int8)}
        try:
            if not isinstance(value, Mapping) or set(value) != {
                "shape",
                "quant_type",
                "blocksize",
                "nested",
                "dtype",
                "storage",
            }:
                raise ValueError("malformed")
            shape = value["shape"]
            if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int and d > 0 for d in shape)):
                raise ValueError(f"shape {shape!r:.40} is not [out_features, in_features]")
            if type(value["blocksize"]) is not int or type(value["nested"]) is not bool:
                raise ValueError("blocksize must be an int and nested a bool")
            return cls(
                tuple(shape),
                value["quant_type"],
                value["blocksize"],
                value["nested"],
                dtypes[value["dtype"]],
                dtypes[value["storage"]],
            )
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{where}: not a 4-bit weight format ({err})") from None


# --- quantizing ---------------------------------------------------------------------------------
def _blockwise_absmax(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's largest magnitude, and the values scaled by it into [-1, 1] (the last block may be short)."""
    n = flat.numel()
    full = n - n % blocksize
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=-1)
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1))).clamp_(-1, 1).reshape(-1)
    if full < n:
        last = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, last.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / last, -1, 1)])
    return absmax, scaled


def _nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The index of the nearest entry of ``table`` (any order) for each value, as uint8."""
    order = torch.argsort(table)
    ordered = table[order]
    q = torch.bucketize(values, (ordered[:-1] + ordered[1:]) / 2, out_int32=True)
    if torch.equal(order, torch.arange(len(table))):
        return q.to(torch.uint8)
    return order.to(torch.uint8)[q]


#: Rows of a weight quantized at a time: about this many values (a worker reads a weight from its
#: file in such slices, so no full-precision copy of it is ever in its memory).
QUANTIZE_CHUNK = 1 << 20


def quantize(weight: Any, fmt: Format) -> dict[str, torch.Tensor]:
    """``weight`` in 4 bits as ``fmt`` says: the group's tensors by suffix (`Format.parts`), as
    bitsandbytes' ``quantize_4bit`` computes them. ``weight`` is a tensor, or anything its rows can be
    sliced from (``weight[a:b]``: a safetensors slice, read a few rows at a time) with a ``shape``.

    The packed values and (without double quantization) the scales equal bitsandbytes'; double
    quantization codes each scale with the nearest 8-bit value, where bitsandbytes' CPU and CUDA
    kernels, by their own approximate searches, pick a neighbour for about one scale in a thousand
    (tests/test_qlora.py measures it)."""
    shape = tuple(weight.shape)
    if shape != tuple(fmt.shape):
        raise ValueError(f"a weight of shape {shape} quantized as one of {fmt.shape}")
    rows, cols = fmt.shape
    step = fmt.blocksize // math.gcd(cols, fmt.blocksize)  # rows whose values fill whole blocks
    chunk = max(step, QUANTIZE_CHUNK // cols // step * step)
    table = code(fmt.quant_type)
    packed = torch.empty((fmt.numel + 1) // 2, dtype=torch.uint8)
    absmax = []
    for r in range(0, rows, chunk):
        flat = torch.as_tensor(weight[r : r + chunk]).to(fmt.dtype).reshape(-1).float()
        scales, scaled = _blockwise_absmax(flat, fmt.blocksize)
        absmax.append(scales)
        if scaled.numel() % 2:  # only the last chunk can be odd
            scaled = torch.nn.functional.pad(scaled, (0, 1))
        q = _nearest(scaled, table)
        start = r * cols // 2
        torch.bitwise_or(q[::2] << 4, q[1::2], out=packed[start : start + q.numel() // 2])
    packed = packed.view(fmt.storage).unsqueeze(1) if fmt.storage != torch.uint8 else packed.unsqueeze(1)
    out = {PACKED: packed, "quant_map": table, "absmax": torch.cat(absmax)}
    if not fmt.nested:
        return out
    offset = out["absmax"].mean()
    nested_absmax, scaled2 = _blockwise_absmax(out["absmax"] - offset, NESTED_BLOCKSIZE)
    table = dynamic_map()
    return {
        **out,
        "absmax": _nearest(scaled2, table),
        "nested_absmax": nested_absmax,
        "nested_quant_map": table,
        "offset": offset,
    }


# --- dequantizing -------------------------------------------------------------------------------
def _scales(absmax: torch.Tensor, nested_absmax: Any, nested_quant_map: Any, offset: Any) -> torch.Tensor:
    """The per-block scales, as float32: ``absmax`` itself, or decoded from its 8-bit codes."""
    if nested_absmax is None:
        return absmax.float()
    n = absmax.numel()
    decoded = nested_quant_map[absmax.reshape(-1).int()]
    full = n - n % NESTED_BLOCKSIZE
    head = (
        decoded[:full].reshape(-1, NESTED_BLOCKSIZE) * nested_absmax[: full // NESTED_BLOCKSIZE].view(-1, 1)
    ).reshape(-1)
    if full < n:
        head = torch.cat([head, decoded[full:] * nested_absmax[-1]])
    return head + offset


#: A 4-bit weight's tensors, in the order the operator takes them (after ``x``): the packed values,
#: ``absmax``, ``quant_map``, and double quantization's three (``None`` without it).
STATE = ("packed", "absmax", "quant_map", "nested_absmax", "nested_quant_map", "offset")
#: Where the operator takes the bias: after ``x`` and the weight's tensors (`_Linear4bit.backward`).
_BIAS = 1 + len(STATE)


def _dequantize(
    state: Sequence[Any], shape: Any, blocksize: int, dtype: torch.dtype, scratch: bool = False
) -> torch.Tensor:
    """The weight of ``shape`` that ``state`` (its tensors, as `STATE` orders them) stands for, in
    ``dtype``."""
    packed, absmax, quant_map, nested_absmax, nested_quant_map, offset = state
    # One lookup per byte in a 256-entry table of value pairs (its high and its low code), each pair
    # read as one 8-byte element: a flat gather, twice as fast as gathering rows of two floats. With
    # ``scratch``, into this thread's buffers (`_scratch`), which the caller uses before the next call.
    n, data = int(shape[0]) * int(shape[1]), packed.reshape(-1).view(torch.uint8)
    if not (0 < n <= 2 * data.numel() and blocksize in BLOCKSIZES and len(shape) == 2):
        raise ValueError(f"a 4-bit weight of shape {list(shape)} in blocks of {blocksize} is not {data.numel()} bytes")
    scales = _scales(absmax, nested_absmax, nested_quant_map, offset)
    byte = torch.arange(256, device=quant_map.device)
    pairs = torch.stack([quant_map[byte >> 4], quant_map[byte & 0xF]], dim=-1).float().view(torch.int64).view(-1)
    if scratch:
        index = _scratch("index", data.numel(), torch.int32, data.device).copy_(data)
        into = _scratch("pairs", data.numel(), torch.int64, data.device)
        out = torch.index_select(pairs, 0, index, out=into)
    else:
        out = pairs[data.int()]
    out = out.view(torch.float32)[:n]
    full = n - n % blocksize
    out[:full].view(-1, blocksize).mul_(scales[: full // blocksize].view(-1, 1))
    if full < n:
        out[full:].mul_(scales[-1])
    out = out.view(int(shape[0]), int(shape[1]))
    if dtype == torch.float32:
        return out
    return _scratch(str(dtype), n, dtype, data.device).view_as(out).copy_(out) if scratch else out.to(dtype)


_SCRATCH = threading.local()


def _scratch(kind: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's buffer ``kind`` on ``device``, at least ``numel`` long: a stage dequantizes each
    of its 4-bit weights into the same memory, in turn, instead of allocating it for every call
    (which a worker's allocator keeps once freed, `lightning_remote_mp.worker.allocator`)."""
    buffers = vars(_SCRATCH).setdefault("buffers", {})
    held = buffers.get((kind, device))
    if held is None or held.numel() < numel:
        buffers[(kind, device)] = held = None  # the smaller one goes before the larger is made
        buffers[(kind, device)] = held = torch.empty(numel, dtype=dtype, device=device)
    return held[:numel]


def dequantize(parts: Mapping[str, torch.Tensor], fmt: Format, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight a 4-bit group stands for, in ``dtype`` (its stored dtype by default)."""
    state = [parts[PACKED], parts["absmax"], parts["quant_map"], *(parts.get(k) for k in STATE[3:])]
    return _dequantize(state, fmt.shape, fmt.blocksize, dtype or fmt.dtype)


# --- the operator workers run -------------------------------------------------------------------
# Registered with torch.library's plain ``Library`` API: ``torch.library.custom_op``'s wrappers import
# torch's compiler stack (~800 modules, 68 MB of a worker's memory) at the first call.
_LIBRARY = torch.library.Library("lrmp", "FRAGMENT")  # noqa: TOR901 (one library, defined once at import)
_LIBRARY.define(
    "linear_4bit(Tensor x, Tensor packed, Tensor absmax, Tensor quant_map, Tensor? nested_absmax, "
    "Tensor? nested_quant_map, Tensor? offset, Tensor? bias, int[] shape, int blocksize, ScalarType dtype) -> Tensor"
)


def _linear_4bit(x: torch.Tensor, *args: Any) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for the 4-bit weight ``W`` (its tensors, `STATE`; then the bias, its
    ``shape``, ``blocksize`` and stored ``dtype``), dequantized to ``x``'s dtype for the product, as
    bitsandbytes' ``matmul_4bit`` computes it."""
    *state, bias, shape, blocksize, _ = args
    return torch.nn.functional.linear(x, _dequantize(state, shape, blocksize, x.dtype, scratch=True), bias)


def _linear_4bit_meta(x: torch.Tensor, *args: Any) -> torch.Tensor:
    *_, shape, _, _ = args
    return x.new_empty((*x.shape[:-1], shape[0]))


class _Linear4bit(torch.autograd.Function):
    """The operator's gradient: the input's, from the weight dequantized again (never kept), and the bias's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        *state, bias, shape, blocksize, dtype = rest
        ctx.save_for_backward(*state)
        ctx.shape, ctx.blocksize, ctx.dtype = shape, blocksize, dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.lrmp.linear_4bit(x, *rest)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            weight = _dequantize(ctx.saved_tensors, ctx.shape, ctx.blocksize, ctx.dtype, scratch=True)
            grad_x = torch.matmul(grad, weight.to(grad.dtype))
        if ctx.needs_input_grad[_BIAS]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        return grad_x, *(None,) * len(STATE), grad_bias, None, None, None


_LIBRARY.impl("linear_4bit", _linear_4bit, "CompositeExplicitAutograd")
_LIBRARY.impl("linear_4bit", _linear_4bit_meta, "Meta")
_LIBRARY.impl("linear_4bit", _Linear4bit.apply, "Autograd")

#: lrmp's own operators, which a traced program may name besides ATen's (``lrmp::NAME``).
OPERATORS = {"linear_4bit": torch.ops.lrmp.linear_4bit}


def offset_of(blob: torch.Tensor, where: str) -> torch.Tensor:
    """The double quantization's ``offset`` from the JSON bitsandbytes stores as the uint8 tensor
    ``<weight>.quant_state.bitsandbytes__<type>`` (a pre-quantized ``save_pretrained`` file)."""
    try:
        value = json.loads(bytes(blob.to(torch.uint8).tolist()).decode("utf-8"))["nested_offset"]
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"nested_offset {value!r:.40} is no number")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise ValueError(f"{where}: not a bitsandbytes quant_state ({err})") from None
    return torch.tensor(float(value), dtype=torch.float32)
