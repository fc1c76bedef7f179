"""A HuggingFace causal LM as sizes: its decoder layers, their linear layers, and the parameters
before and after them, from its config alone (built on the meta device: no weights read, nothing
allocated). `lightning_remote_mp.driver.memory_plan` plans a stage's memory from it.

>>> from transformers import LlamaConfig
>>> shape = model_shape(LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
...                                 num_attention_heads=4, num_key_value_heads=2))
>>> shape.layers_path, len(shape.layers), [lin.name for lin in shape.layers[0].linears][:3]
('model.layers', 2, ['self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj'])
>>> [[lin.leaf for lin in group] for group in shape.layers[0].input_groups()]
[['q_proj', 'k_proj', 'v_proj'], ['o_proj'], ['gate_proj', 'up_proj'], ['down_proj']]
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch

from lightning_remote_mp.errors import ConfigurationError

#: Linear layers that read the same input (it is saved once for all of them): Llama's family's names.
SHARED_INPUTS = (frozenset({"q_proj", "k_proj", "v_proj"}), frozenset({"gate_proj", "up_proj"}))
#: The names of a gated MLP's gate (it then keeps gate, activation and up outputs, else one).
GATES = frozenset({"gate_proj", "w1", "gate_up_proj"})


@dataclasses.dataclass(frozen=True)
class Linear:
    """A linear layer of a decoder layer: its path inside the layer and its shape."""

    name: str
    in_features: int
    out_features: int
    bias: bool

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@dataclasses.dataclass(frozen=True)
class DecoderLayer:
    """What one decoder layer holds: its linear layers, its other parameters (norms), and its norms."""

    linears: tuple[Linear, ...]
    other_params: int
    norms: int

    @property
    def gated(self) -> bool:
        return any(lin.leaf in GATES for lin in self.linears)

    def input_groups(self) -> list[list[Linear]]:
        """The linear layers by the input they read: q/k/v together, gate/up together, others alone."""
        groups: dict[Any, list[Linear]] = {}
        for lin in self.linears:
            parent = lin.name.rpartition(".")[0]
            shared = next((s for s in SHARED_INPUTS if lin.leaf in s), None)
            groups.setdefault((parent, shared) if shared else lin.name, []).append(lin)
        return list(groups.values())


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A causal LM as the plan sees it: its dimensions (from the config) and, from its modules built on
    the meta device, its decoder layers and the parameters before them (the first stage's: embeddings)
    and after them (the last stage's: the final norm and the head; a tied embedding in both)."""

    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers_path: str
    layers: tuple[DecoderLayer, ...]
    first_params: int
    last_params: int
    head_params: int
    tied: bool

    @property
    def parameters(self) -> int:
        per_layer = sum(
            sum(lin.in_features * lin.out_features + lin.out_features * lin.bias for lin in layer.linears)
            + layer.other_params
            for layer in self.layers
        )
        return self.first_params + self.last_params - (self.head_params if self.tied else 0) + per_layer


def load_config(config: Any) -> Any:
    """A transformers config from a ``PretrainedConfig``, a ``config.json`` path, or a directory holding one."""
    if not isinstance(config, (str, os.PathLike)):
        if not hasattr(config, "to_dict"):
            raise ConfigurationError(
                f"config must be a transformers PretrainedConfig, a config.json path or a directory holding "
                f"one, got {type(config).__name__}"
            )
        return config
    path = Path(config).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        where = f"directory {str(path)!r} holds no config.json" if path.is_dir() else f"{str(path)!r} does not exist"
        raise ConfigurationError(
            f"config: {where}; give a transformers config.json, or the directory save_pretrained wrote"
        )
    try:
        values = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigurationError(f"config {str(file)!r} is not readable JSON: {err}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ConfigurationError(
            f'config {str(file)!r} has no "model_type" (e.g. "llama"): transformers cannot tell which model it is'
        )
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise ConfigurationError(
            f"reading {str(file)!r} needs transformers: pip install transformers ({err})"
        ) from None
    try:
        return AutoConfig.for_model(**values)
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigurationError(f"config {str(file)!r}: transformers cannot read it: {err}") from None


def _linear_of(name: str, module: torch.nn.Module) -> Linear | None:
    if isinstance(module, torch.nn.Linear):
        return Linear(name, module.in_features, module.out_features, module.bias is not None)
    if type(module).__name__ == "Conv1D":  # GPT-2's transposed linear layer: weight [in, out]
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        rows, cols = weight.shape
        return Linear(name, int(rows), int(cols), getattr(module, "bias", None) is not None)
    return None


def _decoder_layer(layer: torch.nn.Module) -> DecoderLayer:
    linears: list[Linear] = []
    counted: set[int] = set()
    for name, module in layer.named_modules():
        lin = _linear_of(name, module)
        if lin is not None:
            linears.append(lin)
            counted.update(id(p) for p in module.parameters(recurse=False))
    other = sum(p.numel() for p in layer.parameters() if id(p) not in counted)
    norms = sum(1 for m in layer.modules() if type(m).__name__.lower().endswith("norm"))
    return DecoderLayer(tuple(linears), other, norms)


def model_shape(config: Any) -> ModelShape:
    """``config``'s causal LM built on the meta device (nothing allocated), as the plan needs it."""
    config = load_config(config)
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise ConfigurationError(
            f"planning a HuggingFace model needs transformers: pip install transformers ({err})"
        ) from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as err:
        raise ConfigurationError(
            f"config of model_type {getattr(config, 'model_type', '?')!r} is no causal LM transformers can build: {err}"
        ) from None
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    if not lists:
        raise ConfigurationError(f"{type(model).__name__} has no list of decoder layers (a ModuleList) to split")
    path, layers = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    first = last = 0
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    for name, p in model.named_parameters(remove_duplicate=False):
        if name.startswith(path + "."):
            continue
        owner = name.rpartition(".")[0]
        if order.get(owner, 0) < order[path]:
            first += p.numel()
        else:
            last += p.numel()
    tied = head_weight is not None and any(
        p is head_weight
        for n, p in model.named_parameters(remove_duplicate=False)
        if order.get(n.rpartition(".")[0], 0) < order[path]
    )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    return ModelShape(
        name=type(model).__name__,
        hidden=hidden,
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or hidden // heads),
        intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        vocab=int(text.vocab_size),
        layers_path=path,
        layers=tuple(_decoder_layer(layer) for layer in layers),
        first_params=first,
        last_params=last,
        head_params=head_weight.numel() if head_weight is not None else 0,
        tied=tied,
    )
