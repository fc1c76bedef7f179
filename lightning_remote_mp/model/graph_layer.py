"""The layer a traced unit is on a worker: `GraphLayer`, which runs a checked program on a tuple of values.

A unit of a traced model reaches a worker as an ordinary spec entry for this layer, under the name
`LAYER_PATH` (`lightning_remote_mp.graph`), with its programs (`lightning_remote_mp.model.program`,
checked when the layer is built) and the shapes of its weights; the values arrive as its state.

>>> import torch
>>> shift = {"inputs": ["x"], "tensors": {"b": "bias"}, "outputs": ["y"],
...          "steps": [["y", ["aten", "add", "Tensor"], [{"ref": "x"}, {"ref": "b"}], {}]]}
>>> layer = GraphLayer({"train": shift}, {"bias": {"shape": [2], "dtype": torch.float32}})
>>> layer.bias  # zeros until the driver's values arrive
tensor([0., 0.])
>>> with torch.no_grad():
...     _ = layer.bias.fill_(0.5)
>>> layer((torch.tensor([[1.0, -1.0]]),))
(tensor([[ 1.5000, -0.5000]]),)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_remote_mp.errors import SpecError
from lightning_remote_mp.model.head_loss import Head, deferring
from lightning_remote_mp.model.program import load_program, run


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not (isinstance(value, (list, tuple)) and all(isinstance(d, int) and d >= 0 for d in value)):
        raise SpecError(f"{where}: malformed shape {value!r:.60}")
    return tuple(value)


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _dtype(value: Any, where: str) -> torch.dtype:
    # A fixed table: ``getattr(torch, name)`` would import torch's lazy submodules (``_dynamo``).
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    raise SpecError(f"{where}: {value!r:.60} is not a dtype")


#: The dotted path a `GraphLayer` travels under in a spec entry (`lightning_remote_mp.graph`).
LAYER_PATH = "lightning_remote_mp.graph.GraphLayer"


class GraphLayer(nn.Module):
    """A piece of a traced model: runs a program (one for train mode, one for eval) on a tuple of
    values and returns a tuple of values.

    Args:
        programs: ``{"train": program, "eval": program}`` as plain data (see the module docstring);
            ``self.training`` picks one, so the driver's train/eval switches apply as for any layer.
        tensors: the weights, buffers and constants the programs use, by attribute name:
            ``{"shape": [...], "dtype": ..., "parameter": bool, "requires_grad": bool}``. They are
            allocated empty here; the driver's values arrive as the layer's state.
        examples: what the traced call gave each input: ``{"shape": [...], "dtype": ...}`` for a
            tensor, ``{"scalar": value}`` for a number (a length); `example_inputs` builds inputs
            like them, to time the layer for ``balance="time"``.
        values: on the driver, the tensors themselves (shared with the traced module, not copied).
        checkpoint: recompute the program at backward when training with gradients, keeping only its
            inputs (the model's own gradient checkpointing, `lightning_remote_mp.model.gradient_checkpointing`).
    """

    def __init__(
        self,
        programs: Mapping[str, Any],
        tensors: Mapping[str, Mapping[str, Any]],
        examples: Sequence[Mapping[str, Any]] = (),
        values: Mapping[str, torch.Tensor] | None = None,
        checkpoint: bool = False,
    ) -> None:
        super().__init__()
        self.examples = list(examples)
        if not isinstance(checkpoint, bool):
            raise SpecError(f"GraphLayer: checkpoint must be true or false, not {checkpoint!r:.60}")
        self.checkpoint = checkpoint
        #: Set on a last stage's last layer: its logits that only the model's output reads are
        #: computed when the driver reads them (`lightning_remote_mp.model.head_loss`); ``deferred``
        #: then holds the last forward's `Head` per output position.
        self.defer_heads = False
        self.deferred: dict[int, Head] = {}
        if not isinstance(programs, Mapping) or not programs or not set(programs) <= {"train", "eval"}:
            raise SpecError("GraphLayer: programs must map 'train' and/or 'eval' to a program")
        self.programs = {mode: load_program(p, f"GraphLayer {mode} program") for mode, p in programs.items()}
        self.has_heads = any(
            step.fn is torch.ops.lrmp.deferred_linear.default for p in self.programs.values() for step in p.steps
        )
        if not isinstance(tensors, Mapping) or not all(isinstance(d, Mapping) for d in tensors.values()):
            raise SpecError("GraphLayer: tensors must map attribute names to {'shape': ..., 'dtype': ...}")
        for name, desc in tensors.items():
            where = f"GraphLayer tensor {name!r}"
            if not (isinstance(name, str) and name.isidentifier() and not name.startswith("_")):
                raise SpecError(f"{where}: not a valid attribute name")
            if values is not None:
                t = values[name]
            else:
                # Zeros, not empty: the driver might send no weights (init_seed), and state taken
                # before any arrive must not be memory this process freed.
                t = torch.zeros(_shape(desc.get("shape"), where), dtype=_dtype(desc.get("dtype"), where))
            if desc.get("parameter"):
                param = (
                    t
                    if isinstance(t, nn.Parameter)
                    else nn.Parameter(t, requires_grad=bool(desc.get("requires_grad", True)))
                )
                self.register_parameter(name, param)
            else:
                self.register_buffer(name, t)
        for mode, program in self.programs.items():
            missing = sorted(set(program.tensors.values()) - set(tensors))
            if missing:
                raise SpecError(f"GraphLayer {mode} program uses tensors {missing[:5]} it was not given")

    def example_inputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Inputs shaped like the traced call's (random floats, zero integers), for timing."""
        out = []
        for i, example in enumerate(self.examples):
            where = f"GraphLayer example input {i}"
            if not isinstance(example, Mapping):
                raise SpecError(f"{where}: malformed")
            if "scalar" in example:
                if not isinstance(example["scalar"], (bool, int, float)):
                    raise SpecError(f"{where}: a scalar must be a number")
                out.append(torch.tensor(example["scalar"], device=device))
                continue
            shape, dtype = _shape(example.get("shape"), where), _dtype(example.get("dtype"), where)
            if dtype.is_floating_point:
                out.append(torch.randn(shape, dtype=dtype, device=device, requires_grad=True))
            else:
                out.append(torch.zeros(shape, dtype=dtype, device=device))
        return tuple(out)

    def _device(self, inputs: Sequence[Any]) -> torch.device:
        for t in (*self._parameters.values(), *self._buffers.values(), *inputs):
            if isinstance(t, torch.Tensor):
                return t.device
        return torch.device("cpu")

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        program = self.programs.get("train" if self.training else "eval") or next(iter(self.programs.values()))
        tensors = {**self._parameters, **self._buffers}
        if self.checkpoint and self.training and torch.is_grad_enabled():
            # Non-reentrant: the same gradients as the reentrant form, with no input required to need grad.
            return checkpoint(run, program, inputs, tensors, self._device(inputs), use_reentrant=False)  # type: ignore[no-any-return]
        if self.defer_heads and self.has_heads:
            with deferring() as heads:
                out = run(program, inputs, tensors, self._device(inputs))  # type: ignore[arg-type]
            self.deferred = {i: h for i, v in enumerate(out) for h in heads if v is h.stand_in}
            return out
        return run(program, inputs, tensors, self._device(inputs))  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        steps = max(len(p.steps) for p in self.programs.values())
        recomputed = ", recomputed at backward" if self.checkpoint else ""
        return f"{steps} steps, {len(self._parameters)} parameters, {len(self._buffers)} buffers{recomputed}"
