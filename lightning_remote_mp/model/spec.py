"""The layer spec and `SpecSequential`, the module built from it (its entries read:
`lightning_remote_mp.model.entries`; their classes resolved and built under a worker's allowlist:
`lightning_remote_mp.model.build`; the residual variables they wire: `lightning_remote_mp.model.wiring`).

A spec is a list of entries ``(layer, kwargs, input_shape)``:

- ``layer``: an ``nn.Module`` subclass or its dotted import path (``"torch.nn.Linear"``);
- ``kwargs``: the constructor's keyword arguments (plain values, so they can travel to a worker);
- ``input_shape``: an example input shape, a tuple, or a list of tuples when the layer also takes
  residual inputs. It feeds validation and memory estimates; it never fixes the batch size.

Residual variables cross layers (and machines) by name. A layer instance whose attribute
``out_variables`` is a non-empty list returns ``(output, [(name, tensor), ...])``; a layer whose
attribute ``dependencies`` lists names receives those tensors as extra positional arguments
after its main input, in that order.

Dict entries can wire layers that know nothing of this convention (``torch.nn``, HuggingFace):

- ``"dependencies": ["mask"]`` passes those variables as extra positional arguments, and
  ``"dependencies": {"attention_mask": "mask"}`` as keyword arguments;
- ``"out_variables": ["skip"]`` publishes the layer's output under those names (and passes it on);
- ``"output": 0`` keeps one element of a layer that returns a tuple (or a key of a dict output);
- a kwarg value ``{"object": "torch.nn.BatchNorm2d", "kwargs": {...}}`` is built (an instance) and
  ``{"class": "torch.nn.BatchNorm2d"}`` is the class itself, both resolved through the worker's
  allowlist, so constructor arguments such as ``norm_layer=`` or a config object stay plain data
  (YAML; LightningCLI's own ``class_path`` spelling would be built by jsonargparse on the driver).

This module imports no Lightning: the worker builds its stages with it.

>>> import torch
>>> from lightning_remote_mp.layers import WrappedLinear
>>> net = SpecSequential([
...     ("torch.nn.Linear", {"in_features": 4, "out_features": 8}, (32, 4)),
...     (WrappedLinear, {"in_features": 8, "out_features": 8, "out_variables": ["skip"]}, (32, 8)),
...     (WrappedLinear, {"in_features": 8, "out_features": 8, "dependencies": ["skip"]}, [(32, 8), (32, 8)]),
... ])
>>> net(torch.ones(5, 4)).shape
torch.Size([5, 8])
>>> SpecSequential([(WrappedLinear, {"in_features": 8, "out_features": 8, "dependencies": ["nope"]}, (32, 8))])
Traceback (most recent call last):
...
lightning_remote_mp.errors.SpecError: layer 0 (WrappedLinear) depends on 'nope', which no earlier layer produces.
>>   0 WrappedLinear  needs ['nope']
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_remote_mp.errors import SpecError
from lightning_remote_mp.model.build import build_layer
from lightning_remote_mp.model.entries import LayerEntry, normalize_spec
from lightning_remote_mp.model.wiring import check_wiring, run_layers, variables_of


def _check_shapes(entries: Sequence[LayerEntry], layers: Sequence[nn.Module]) -> None:
    for i, (entry, layer) in enumerate(zip(entries, layers)):
        deps, _ = variables_of(layer)
        shapes = entry.input_shapes
        if isinstance(entry.input_shape[0] if entry.input_shape else None, tuple) and len(shapes) != 1 + len(deps):
            raise SpecError(
                f"layer {i} ({entry.name}) takes 1 input plus dependencies {deps}, "
                f"but its input_shape lists {len(shapes)} shapes"
            )


class SpecSequential(nn.Module):
    """An ``nn.Module`` built from a layer spec; trains locally as-is.

    Under `RemoteModelParallelStrategy` its layers run on workers;
    its parameters here are then a copy that the strategy refreshes from the workers whenever
    ``state_dict()`` is taken, and restores when the run ends.

    >>> import torch
    >>> net = SpecSequential([
    ...     ("torch.nn.Linear", {"in_features": 3, "out_features": 5}, (8, 3)),
    ...     (torch.nn.ReLU, {}, (8, 5)),
    ... ])
    >>> net(torch.zeros(2, 3)).shape
    torch.Size([2, 5])
    """

    #: The tensors that are parts of a 4-bit frozen weight (a traced QLoRA base), by ``"<layer index>.<name>"``:
    #: the weight's ``state_dict`` key, the part (`lightning_remote_mp.model.four_bit.Format.parts`), its format.
    quantized: Mapping[str, tuple[str, str, Any]] = {}

    def __init__(
        self, spec: Iterable[Any], *, init_seed: int | None = None, device: torch.device | str | None = None
    ) -> None:
        """
        Args:
            spec: the layer spec.
            init_seed: initialise layer ``i`` from seed ``init_seed + i``, independently of the others.
                Needed with ``device="meta"``: the workers then initialise their own layers from it.
            device: where to build the layers; ``"meta"`` builds no weights at all on this process,
                for models larger than the driver (they only ever exist on the workers).
        """
        super().__init__()
        self.entries = normalize_spec(spec)
        if init_seed is not None and (type(init_seed) is not int or not 0 <= init_seed < 2**62):
            raise SpecError(f"init_seed must be None or an integer in [0, 2**62), got {init_seed!r}")
        self.init_seed = init_seed
        if device is not None and torch.device(device).type == "meta" and init_seed is None:
            raise SpecError("a SpecSequential on the meta device needs init_seed, so that workers can initialise it")
        self._hold(
            self.entries, [build_layer(e, i, init_seed=init_seed, device=device) for i, e in enumerate(self.entries)]
        )
        _check_shapes(self.entries, self.layers)
        self._register_load_state_dict_pre_hook(_stash_state_for_meta, with_module=True)

    def _hold(self, entries: Sequence[LayerEntry], layers: Sequence[nn.Module]) -> None:
        """Take ``layers`` (built from ``entries``) as this module's, with checked wiring and no remote
        state yet. Subclasses that build their layers otherwise (a traced module's) start here."""
        self.entries = list(entries)
        self.layers = nn.ModuleList(layers)
        self.wiring = check_wiring(self.layers, [e.name for e in self.entries])
        self._remote: Any = None  # set by the strategy while the layers live on workers
        # Weights loaded into a meta module before it is placed wait here for the workers.
        self._pending_state: dict[str, torch.Tensor] = {}
        self._weights_left_on_workers = False  # a meta module whose trained weights only a run's workers had

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.layers)

    @property
    def is_remote(self) -> bool:
        return self._remote is not None

    # --- the remote life cycle (the driver session calls these) --------------------------------------
    @property
    def remote(self) -> Any:
        """What runs the layers while they live on workers (a `lightning_remote_mp.driver.pipeline.RemoteSpec`),
        else ``None``."""
        return self._remote

    @property
    def pending_state(self) -> dict[str, torch.Tensor]:
        """Weights loaded into this meta module (a checkpoint) that wait for its placement, by
        ``"<layer index>.<name>"``; empty when there are none."""
        return self._pending_state

    @property
    def weights_left_on_workers(self) -> bool:
        """A meta module whose trained weights only an earlier run's workers had."""
        return self._weights_left_on_workers

    def attach(self, remote: Any) -> None:
        """From now on ``forward`` runs on the workers through ``remote``; the weights waiting for
        placement have gone to them."""
        self._remote = remote
        self._pending_state = {}

    def detach(self) -> None:
        """Run locally again. A meta module keeps no weights here: its trained ones were only on the workers."""
        if self._remote is not None and self.is_meta:
            self._weights_left_on_workers = True
        self._remote = None

    @property
    def is_meta(self) -> bool:
        """Whether the layers have no weights here (built on the meta device)."""
        return any(t.is_meta for t in itertools.chain(self.layers.parameters(), self.layers.buffers()))

    def _apply(self, fn: Any, recurse: bool = True) -> SpecSequential:
        # Moving or casting weights that do not exist here (meta) is a no-op, not an error:
        # Lightning moves the whole LightningModule to its device.
        if self.is_meta:
            return self
        return super()._apply(fn, recurse)

    def forward(self, x: Any) -> Any:
        if self._remote is not None:
            return self._remote(x)
        return run_layers(enumerate(self.layers), x, {})

    @property
    def state_owner(self) -> nn.Module:
        """The module whose ``state_dict`` holds the layers' tensors (this one, for a spec)."""
        return self

    #: What errors and logs call it.
    kind = "SpecSequential"

    #: For a pipeline of tuples (a traced model): which input elements carry the batch, and how each
    #: output element joins across the parts of a batch (`lightning_remote_mp.model.joins.Join`).
    batched: tuple[list[bool], list[Any]] | None = None

    def kept_outputs(self) -> Keep | None:
        """Which elements of the output the last stage keeps until they are read
        (`lightning_remote_mp.driver.outputs`, `Keep`): a traced
        module's interface says; a spec's one output is kept in calls where it is large, its size
        learned from the first call."""
        if getattr(self, "generation", None):
            return None  # a step of generate(): its logits (the last position's) go to the driver at once
        interface = getattr(self, "interface", None)
        if interface is not None:
            return interface.kept()
        return Keep([True], [0])

    def loss_output(self) -> int | None:
        """The position of the module's loss among its outputs, where it computes one (a traced
        module's, `lightning_remote_mp.model.traced.Interface.loss_output`); ``None`` for a layer spec."""
        interface = getattr(self, "interface", None)
        return interface.loss_output() if interface is not None else None

    def loss_count_output(self) -> int | None:
        """The position of the count that loss is divided by (`Interface.loss_count`), or ``None``."""
        interface = getattr(self, "interface", None)
        return interface.loss_count() if interface is not None else None

    def shared(self) -> list[list[str]]:
        """The tensors several layers hold, one list of their names (``"<layer index>.<name>"``) each:
        a traced model's tied weights. A stage holding several of the names keeps one tensor; stages
        that each hold one keep a copy each, and sum their gradients."""
        names: dict[int, list[str]] = {}
        for i, layer in enumerate(self.layers):
            for name, t in layer.state_dict(keep_vars=True).items():
                names.setdefault(id(t), []).append(f"{i}.{name}")
        return [group for group in names.values() if len(group) > 1]

    def state_keys(self) -> dict[str, list[str]]:
        """Each layer tensor (``"<layer index>.<name>"``): its keys in ``state_owner``'s ``state_dict``,
        the first one first (a tied weight has several; a spec's tensors have one each)."""
        return {
            f"{i}.{name}": [f"layers.{i}.{name}"]
            for i, layer in enumerate(self.layers)
            for name in layer.state_dict(keep_vars=True)
        }

    def layer_state(self, state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        """The entries of ``state_owner``'s ``state_dict`` (under ``prefix``) that belong to the layers,
        named ``"<layer index>.<name>"``."""
        head = prefix + "layers."
        return {k[len(head) :]: v for k, v in state_dict.items() if k.startswith(head)}

    def modes(self) -> Modes:
        """The train/eval flags of every layer and its submodules, as they are now.

        Remote stages follow these at each call: Lightning switches modes by ``.train()``/``.eval()``
        and also by setting ``.training`` directly (when it restores them after validation), so
        the flags are read, not intercepted.
        """
        per_layer = [layer_modes(layer) for layer in self.layers]
        first = per_layer[0]
        if isinstance(first, bool) and all(m is first for m in per_layer):
            return first
        return per_layer

    def extra_repr(self) -> str:
        return f"remote={self._remote!r}" if self._remote is not None else ""


#: A call's outputs that come to this many bytes stay on the last stage until read (`Keep`): about
#: what a 1 Gbit/s link carries in the time a round trip to fetch them costs.
KEEP_BYTES = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Keep:
    """Which of a module's outputs the last stage keeps until they are read (a traced module's:
    `lightning_remote_mp.model.traced.Interface.kept`; a layer spec's: `SpecSequential.kept_outputs`).

    ``outputs``: the candidates (those carrying the batch). ``row_bytes``: each output's bytes per
    row of the batch; a candidate is kept in a call where its rows come to `KEEP_BYTES` or more.
    ``None``: always kept (a module that computes its own loss).

    >>> Keep([True, False], [4096, 4]).at(8), Keep([True, False], [4096, 4]).at(16)
    (None, [True, False])
    >>> Keep([True], [0]).learned([torch.zeros(4, 2048)], 4).at(8)
    [True]
    """

    outputs: list[bool]
    row_bytes: list[int] | None

    def learned(self, parts: Sequence[Any], rows: int) -> Keep:
        """This rule with each output's bytes per row as a call of ``rows`` rows returned them
        (``parts``: its micro-batches' outputs, a tensor or a tuple each): for a model whose output
        sizes are not known before it runs (a layer spec)."""
        if self.row_bytes is None or rows < 1:
            return self
        sizes = [0] * len(self.outputs)
        for part in parts:
            for i, t in enumerate(part if isinstance(part, tuple) else (part,)):
                if i < len(sizes) and isinstance(t, torch.Tensor):
                    sizes[i] += t.nbytes
        return Keep(self.outputs, [max(old, n // rows) for old, n in zip(self.row_bytes, sizes)])

    def at(self, rows: int) -> list[bool] | None:
        """What to keep of a call of ``rows`` rows (``None``: nothing)."""
        if self.row_bytes is None:
            return list(self.outputs)
        flags = [c and rows * n >= KEEP_BYTES for c, n in zip(self.outputs, self.row_bytes)]
        return flags if any(flags) else None


#: Train/eval flags: one bool for every layer, or per layer a bool (for all its submodules) or a
#: list of bools (one per ``layer.modules()`` entry, in that order).
Modes = bool | list[bool | list[bool]]


def layer_modes(layer: nn.Module) -> bool | list[bool]:
    flags = [m.training for m in layer.modules()]
    return flags[0] if all(f is flags[0] for f in flags) else flags


def apply_modes(layers: Sequence[nn.Module], modes: Any, first_index: int) -> None:
    """Set the flags of ``layers`` (global indices from ``first_index``) from a `Modes` value; the
    flag counts are checked first, so that a malformed value changes nothing."""
    for i, layer in enumerate(layers):
        flags = modes if isinstance(modes, bool) else modes[first_index + i]
        if not isinstance(flags, bool) and len(flags) != sum(1 for _ in layer.modules()):
            raise SpecError(f"layer {first_index + i}: {len(flags)} mode flags for its modules")
    for i, layer in enumerate(layers):
        flags = modes if isinstance(modes, bool) else modes[first_index + i]
        if isinstance(flags, bool):
            for m in layer.modules():
                m.training = flags
            continue
        for m, f in zip(layer.modules(), flags):  # as many as the modules: checked above
            m.training = f


def _stash_state_for_meta(module: SpecSequential, state_dict: Any, prefix: str, *args: Any) -> None:
    # Loading into meta tensors keeps nothing; keep the tensors until the module is placed.
    if module.is_meta and not module.is_remote:
        head = prefix + "layers."
        module._pending_state = module.layer_state(state_dict, prefix)
        module._weights_left_on_workers = False
        # What is loaded here is then meta too: the same no-op, without torch's warning per parameter
        # ("copying from a non-meta parameter ... is a no-op"), which would alarm for nothing.
        for name in module._pending_state:
            value = state_dict[head + name]
            if isinstance(value, torch.Tensor):
                state_dict[head + name] = value.to("meta")
