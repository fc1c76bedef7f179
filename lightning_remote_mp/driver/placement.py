"""A module placed on workers keeps its ``state_dict()`` and ``load_state_dict()`` truthful.

While a `SpecSequential` (or a traced module) lives on workers, the driver's copy of its weights
goes stale as they train. `Placement` hooks the module's state-dict methods: taking a state dict
first refreshes the local copy from the workers (for a module on the meta device, the workers'
tensors go straight into the state dict), and loading one sends what was loaded to the workers.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lightning_remote_mp.driver.pipeline import RemoteSpec
from lightning_remote_mp.errors import SpecError
from lightning_remote_mp.model import partition
from lightning_remote_mp.model.spec import SpecSequential
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


class Placement:
    """A placed SpecSequential (see the module docstring), by its key, module and pipeline front end."""

    def __init__(self, key: str, module: SpecSequential, remote: RemoteSpec) -> None:
        self.key = key
        self.module = module
        self.remote = remote
        self.meta = module.is_meta
        self._loaded: dict[str, torch.Tensor] = {}
        owner = module.state_owner  # whose state_dict keys hold the layers' tensors
        self.hooks = [
            owner.register_state_dict_pre_hook(self._before_state_dict),
            owner.register_state_dict_post_hook(functools.partial(Placement._after_state_dict, self)),
            owner._register_load_state_dict_pre_hook(self._before_load_state_dict, with_module=True),
            owner.register_load_state_dict_post_hook(self._after_load_state_dict),
        ]

    def _before_state_dict(self, module: Any, prefix: str, keep_vars: bool) -> None:
        if not self.meta:
            self.pull()

    def _after_state_dict(self, module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if self.meta:
            for name, t in self.fetch().items():
                state_dict[f"{prefix}layers.{name}"] = t

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
