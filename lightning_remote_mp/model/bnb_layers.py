"""bitsandbytes' 4-bit layers (``Linear4bit``, QLoRA's frozen base) as the tracer sees them.

torch.export cannot trace a ``Linear4bit`` as it is: its weight is a ``Params4bit``, a tensor
subclass that fake tensors cannot stand for, and its product is bitsandbytes' autograd Function.
While a module is exported, `stand_ins` gives each such layer plain tensors in place of its weight
(the packed values and each tensor of its quantization state, in bitsandbytes' layout, named as
bitsandbytes' ``state_dict`` names them) and a ``forward`` that computes what ``Linear4bit.forward``
computes (the input cast to the compute dtype, the bias, the output cast back) with lrmp's ``lrmp::linear_4bit``
(`lightning_remote_mp.model.four_bit`). The module is as it was once the export returns.

A layer on the meta device (``from_pretrained(..., quantization_config=..., device_map="meta")``,
or ``replace_with_bnb_linear`` on a meta model) has no quantization state yet: its stand-ins are
meta tensors of the packed shapes, and the workers fill them from the files (`FourBitWeight`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lightning_remote_mp.errors import LrmpError, TraceError
from lightning_remote_mp.model.four_bit import NESTED_BLOCKSIZE, PACKED, Format


@dataclasses.dataclass(frozen=True)
class FourBitWeight:
    """One 4-bit weight of a traced module: its ``state_dict`` key (``...q_proj.weight``), its format,
    and for each part (`Format.parts`) the name torch.export gave the stand-in."""

    key: str
    format: Format
    targets: dict[str, str]  # part -> the export's name of its stand-in (a parameter's or buffer's path)


@dataclasses.dataclass
class StandIns:
    """What `stand_ins` put in place: the 4-bit weights, and each stand-in's tensor by export name."""

    weights: list[FourBitWeight] = dataclasses.field(default_factory=list)
    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def part_of(self, target: str) -> tuple[FourBitWeight, str] | None:
        """The 4-bit weight and the part whose stand-in the export named ``target``."""
        return next(((w, part) for w in self.weights for part, t in w.targets.items() if t == target), None)

    def state_key(self, target: str) -> str | None:
        """The ``state_dict`` key of the stand-in the export named ``target`` (bitsandbytes' own
        name for it; the double quantization's offset has none there: lrmp calls it ``<weight>.offset``)."""
        found = self.part_of(target)
        if found is None:
            return None
        weight, part = found
        return f"{weight.key}.{part}" if part != PACKED else weight.key


def _linear4bit_class() -> type | None:
    """bitsandbytes' ``Linear4bit``, if bitsandbytes was imported (a model holding one imported it)."""
    nn_modules = sys.modules.get("bitsandbytes.nn.modules")
    return getattr(nn_modules, "Linear4bit", None)


def _int8_classes() -> tuple[type, ...]:
    nn_modules = sys.modules.get("bitsandbytes.nn.modules")
    return tuple(c for c in (getattr(nn_modules, "Linear8bitLt", None),) if c is not None)


def _unpacked_for_cpu(layer: nn.Module) -> None:
    """Gives ``layer`` bitsandbytes' own layout back if bitsandbytes repacked it for its CPU kernel.

    bitsandbytes (0.50, a CPU with AVX512-BF16) repacks a ``Linear4bit``'s weight at its first call
    in eval mode without gradients (a local validation step), and undoes the double quantization,
    until something moves or saves it. That layout is its CPU kernel's alone; undone here as
    bitsandbytes undoes it for ``.cuda()`` and ``state_dict()``.
    """
    state = getattr(layer.weight, "quant_state", None)
    if state is None:
        return
    if getattr(state, "packing_format_for_cpu", False):  # bitsandbytes' own flag, set when it repacks
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu_inverse(layer.weight.data, state)
    if layer.weight.dim() != 2 or layer.weight.shape[1] != 1:  # its own layout is a column of packed bytes
        import bitsandbytes

        raise LrmpError(
            f"a 4-bit weight of shape {tuple(layer.weight.shape)} (bitsandbytes {bitsandbytes.__version__}) is not in "
            "bitsandbytes' own layout, a column of packed bytes, and its quantization state does not say it was "
            "repacked for the CPU (packing_format_for_cpu): lrmp would read its bytes wrong. lrmp is tested with "
            "bitsandbytes 0.50; use that version, or report this"
        )


def format_of(layer: nn.Module, where: str) -> Format:
    """The 4-bit format of a ``Linear4bit``: from its quantization state, or, on the meta device
    before it has one, from what its weight will be quantized with."""
    weight = layer.weight
    state = getattr(weight, "quant_state", None)
    shape = (int(layer.out_features), int(layer.in_features))
    if state is not None:
        if state.nested and state.state2.blocksize != NESTED_BLOCKSIZE:
            raise TraceError(f"{where}: double quantization in blocks of {state.state2.blocksize}; only 256 runs")
        return Format(shape, state.quant_type, int(state.blocksize), bool(state.nested), state.dtype, weight.dtype)
    dtype = weight.dtype if weight.dtype.is_floating_point else (layer.compute_dtype or torch.float32)
    storage = getattr(weight, "quant_storage", torch.uint8)
    return Format(
        shape,
        getattr(weight, "quant_type", "fp4"),
        int(getattr(weight, "blocksize", 64) or 64),
        bool(getattr(weight, "compress_statistics", True)),
        dtype,
        storage,
    )


def _parts(layer: nn.Module, fmt: Format) -> dict[str, torch.Tensor]:
    """The tensors of the layer's 4-bit weight by part: its own, or meta ones of the packed shapes."""
    state = getattr(layer.weight, "quant_state", None)
    if state is None or layer.weight.is_meta:
        return {part: torch.empty(shape, dtype=dtype, device="meta") for part, (shape, dtype) in fmt.parts().items()}
    parts = {PACKED: layer.weight.data, "absmax": state.absmax, "quant_map": state.code}
    if fmt.nested:
        parts.update(nested_absmax=state.state2.absmax, nested_quant_map=state.state2.code, offset=state.offset)
    return parts


def _forward(layer: nn.Module, fmt: Format, names: dict[str, str]) -> Any:
    """``Linear4bit.forward`` with lrmp's operator over the stand-ins (attributes ``names``)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not layer.compute_type_is_set:
            layer.set_compute_type(x)
            layer.compute_type_is_set = True
        dtype = x.dtype
        if layer.compute_dtype is not None:
            x = x.to(layer.compute_dtype)
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        t = {part: getattr(layer, name) for part, name in names.items()}
        out = torch.ops.lrmp.linear_4bit(
            x,
            t[PACKED],
            t["absmax"],
            t["quant_map"],
            t.get("nested_absmax"),
            t.get("nested_quant_map"),
            t.get("offset"),
            bias,
            list(fmt.shape),
            fmt.blocksize,
            fmt.dtype,
        )
        return out.to(dtype)

    return forward


@contextlib.contextmanager
def stand_ins(module: nn.Module, name: str) -> Iterator[StandIns]:
    """While exporting ``module``: its 4-bit layers with plain stand-in tensors and lrmp's operator
    (see the module docstring); refuses the quantized layers a worker cannot run, naming them."""
    found = StandIns()
    linear4bit = _linear4bit_class()
    refused = [
        path
        for path, m in module.named_modules()
        if isinstance(m, _int8_classes()) or type(m).__module__.split(".")[0] in ("auto_gptq", "gptqmodel", "awq")
    ]
    if refused:
        raise TraceError(
            f"module {name!r}: {refused[0]} is a {type(module.get_submodule(refused[0])).__name__}, a quantized layer "
            "lrmp does not run; workers run bitsandbytes' 4-bit layers (load_in_4bit=True: NF4 or FP4, with or without "
            "double quantization) and full-precision ones. Load the model with BitsAndBytesConfig(load_in_4bit=True) "
            "or unquantized."
        )
    if linear4bit is None:
        yield found
        return
    undo: list[Any] = []
    try:
        for path, layer in module.named_modules():
            if not isinstance(layer, linear4bit):
                continue
            _unpacked_for_cpu(layer)
            fmt = format_of(layer, f"module {name!r}, {path}")
            names: dict[str, str] = {}
            targets: dict[str, str] = {}
            for part, tensor in _parts(layer, fmt).items():
                attr = "weight" if part == PACKED else f"weight_{part}"
                names[part] = attr
                targets[part] = f"{path}.{attr}" if path else attr
                found.tensors[targets[part]] = tensor
            buffers = [attr for part, attr in names.items() if part != PACKED]
            undo.append((layer, layer._parameters["weight"], vars(layer).get("forward"), buffers))
            layer._parameters["weight"] = nn.Parameter(found.tensors[targets[PACKED]], requires_grad=False)
            for part, attr in names.items():
                if attr in buffers:
                    layer.register_buffer(attr, found.tensors[targets[part]], persistent=False)
            layer.forward = _forward(layer, fmt, names)
            key = f"{path}.weight" if path else "weight"
            found.weights.append(FourBitWeight(key, fmt, targets))
        yield found
    finally:
        for layer, weight, forward, buffers in undo:
            layer._parameters["weight"] = weight
            for attr in buffers:
                del layer._buffers[attr]
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward
