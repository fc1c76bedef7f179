"""A module placed on workers keeps its ``state_dict()`` and ``load_state_dict()`` truthful.

While a `SpecSequential` (or a traced module) lives on workers, the driver's copy of its weights
goes stale as they train. `Placement` hooks the module's state-dict methods: taking a state dict
first refreshes the local copy from the workers (for a module on the meta device, the workers'
tensors go straight into the state dict), and loading one sends what was loaded to the workers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from lightning_remote_mp.driver.pipeline import RemoteSpec
from lightning_remote_mp.errors import SpecError, WeightsError
from lightning_remote_mp.model import partition
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.model.weights import FileTensor, TensorFiles
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.requests import GetState, LoadState
from lightning_remote_mp.wire.transport import broadcast, request_all


def placed_module_state(module: SpecSequential, stage: partition.Stage) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{name}": t.detach()
        for i in stage.layer_indices
        for name, t in module.layers[i].state_dict(keep_vars=True).items()
    }


def meta_stage_state(module: SpecSequential, stage: partition.Stage) -> dict[str, torch.Tensor] | None:
    """Weights loaded into a meta module before placement (a checkpoint), or None: the workers then
    initialise the stage from the module's seed."""
    pending = module.pending_state
    if not pending:
        return None
    mine = {k: v for k, v in pending.items() if int(k.partition(".")[0]) in stage.layer_indices}
    expected = {f"{i}.{n}" for i in stage.layer_indices for n in module.layers[i].state_dict()}
    if set(mine) != expected:
        raise SpecError(f"the state loaded into meta module misses {sorted(expected - set(mine))[:5]}")
    return mine


def find_in(sources: Sequence[TensorFiles], names: Sequence[str]) -> FileTensor | None:
    """The first of ``sources`` to hold one of ``names`` (a tensor's keys), and where."""
    for files in sources:
        for name in names:
            found = files.find(name)
            if found is not None:
                return found
    return None


def stage_weights(
    module: SpecSequential, stage: partition.Stage, sources: Sequence[TensorFiles], what: str
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """A stage's tensors split by where its worker gets them: from files (``sources``: a sharded
    checkpoint's, then a pretrained model's), by name, or from this driver's module (the rest: a
    LoRA adapter, a new head). A tensor on the meta device must be in the files."""
    keys = module.state_keys()
    state: dict[str, torch.Tensor] = {}
    files: dict[str, list[str]] = {}
    for i in stage.layer_indices:
        for name, t in module.layers[i].state_dict(keep_vars=True).items():
            local = f"{i}.{name}"
            names = keys.get(local, [])
            found = find_in(sources, names)
            if found is not None:
                if tuple(found.shape) != tuple(t.shape):
                    raise WeightsError(
                        f"{what}: tensor {found.name!r} in {found.path} has shape {found.shape}, but the model's "
                        f"{names[0]} has {tuple(t.shape)}: the files hold another model or configuration"
                    )
                files[local] = [found.path, found.name]
            elif t.is_meta:
                where = ", ".join(repr(f.root) for f in sources) or "no weights files (pretrained= names none)"
                raise WeightsError(
                    f"{what}: {names[0] if names else local} is on the meta device and not in {where}; give "
                    "pretrained= the model's save_pretrained directory, or build that tensor with a value"
                )
            else:
                state[local] = t.detach()
    return state, files


def placed_bytes(placements: Iterable[Placement]) -> int:
    """The bytes of every weight and buffer of ``placements`` (one copy of each)."""
    seen: dict[int, int] = {}
    for pl in placements:
        for layer in pl.module.layers:
            for t in layer.state_dict(keep_vars=True).values():
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


@contextlib.contextmanager
def gathering(holders: Sequence[Any], gather: bool) -> Iterator[None]:
    """Set ``gather`` on placements and optimizer mirrors while inside (see `Placement.gather`)."""
    flags = [(x, x.gather) for x in holders]
    for x, _ in flags:
        x.gather = gather
    try:
        yield
    finally:
        for x, g in flags:
            x.gather = g


class Placement:
    """A placed SpecSequential (see the module docstring), by its key, module and pipeline front end."""

    def __init__(self, key: str, module: SpecSequential, remote: RemoteSpec) -> None:
        self.key = key
        self.module = module
        self.remote = remote
        self.meta = module.is_meta
        #: Whether a ``state_dict()`` brings the workers' tensors here (a full checkpoint); while
        #: False (a sharded one, `lightning_remote_mp.driver.checkpoint`), it leaves them out.
        self.gather = True
        self._loaded: dict[str, torch.Tensor] = {}
        owner = module.state_owner  # whose state_dict keys hold the layers' tensors
        self.hooks = [
            owner.register_state_dict_pre_hook(self._before_state_dict),
            owner.register_state_dict_post_hook(functools.partial(Placement._after_state_dict, self)),
            owner._register_load_state_dict_pre_hook(self._before_load_state_dict, with_module=True),
            owner.register_load_state_dict_post_hook(self._after_load_state_dict),
        ]

    def _before_state_dict(self, module: Any, prefix: str, keep_vars: bool) -> None:
        if not self.meta and self.gather:
            self.pull()

    def _after_state_dict(self, module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if not self.gather:
            for names in self.module.state_keys().values():
                for name in names:
                    state_dict.pop(prefix + name, None)
            return
        if self.meta:
            keys = self.module.state_keys()
            for local, t in self.fetch().items():
                for name in keys.get(local, ()):
                    state_dict[prefix + name] = t

    def _before_load_state_dict(self, module: Any, state_dict: Any, prefix: str, *args: Any) -> None:
        self._loaded = self.module.layer_state(state_dict, prefix)

    def _after_load_state_dict(self, module: Any, incompatible: Any) -> None:
        loaded, self._loaded = self._loaded, {}
        self.push(loaded)

    def fetch(self) -> dict[str, torch.Tensor]:
        """The workers' weights and buffers, named ``"<layer index>.<name>"``."""
        out: dict[str, torch.Tensor] = {}
        conns = [rs.conn for rs in self.remote.stages]  # replica 0
        for reply in broadcast(conns, protocol.GET_STATE, GetState().body(), bounded=False):
            out.update(reply.get(self.key, {}))
        return out

    def pull(self) -> None:
        """Copy the workers' weights and buffers into the local module."""
        with torch.no_grad():
            for name, t in self.fetch().items():
                index, _, rest = name.partition(".")
                self.module.layers[int(index)].state_dict(keep_vars=True)[rest].copy_(t)

    def push(self, state: dict[str, torch.Tensor]) -> None:
        """Send weights and buffers (named ``"<layer index>.<name>"``) to the workers holding them."""
        requests = []
        for rs in (rs for row in self.remote.replicas for rs in row):
            mine = {k: v for k, v in state.items() if int(k.partition(".")[0]) in rs.stage.layer_indices}
            if mine:
                requests.append((rs.conn, protocol.LOAD_STATE, LoadState({self.key: mine}).body()))
        request_all(requests, bounded=False)

    def detach(self) -> None:
        for h in self.hooks:
            h.remove()
        self.module.detach()
