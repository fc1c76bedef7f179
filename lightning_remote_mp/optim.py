"""The optimizer mirror: the user's optimizer keeps driving, its remote share runs on workers.

Each worker builds the same optimizer class with the same per-group hyperparameters over the
parameters it holds. The local optimizer object stays the one Lightning and LR schedulers see:

- after every ``step()`` (a step post-hook, so it follows the closure's forward and backward),
  each worker steps with the groups' current hyperparameters, so scheduler changes reach it;
- ``zero_grad()`` is mirrored to the workers;
- ``state_dict()`` carries the workers' state under the local parameter indices, and
  ``load_state_dict()`` pushes the remote share of a loaded state to the workers,

so checkpoints look exactly like a local run's, and resume either way.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from lightning_remote_mp import protocol
from lightning_remote_mp.errors import LrmpError
from lightning_remote_mp.spec import layer_path
from lightning_remote_mp.transport import Connection, broadcast

log = logging.getLogger(__name__)


def _hparams(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class OptimizerMirror:
    """Mirrors ``optimizer`` (the driver's index ``index``) onto the workers holding its parameters.

    Args:
        optimizer: the torch optimizer ``configure_optimizers`` returned.
        index: its position among the Trainer's optimizers (the workers' key for it).
        remote: for each remote parameter (by ``id``), the connection of its worker and its name there.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, index: int, remote: Mapping[int, tuple[Connection, str]]
    ) -> None:
        self.optimizer = optimizer
        self.index = index
        self.remote = {id(p): remote[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in remote}
        self.conns: list[Connection] = list({id(c): c for c, _ in self.remote.values()}.values())
        self._handles: list[Any] = []
        self._zero_grad = optimizer.zero_grad
        self._create()
        self._handles.append(optimizer.register_step_post_hook(self._after_step))
        self._handles.append(optimizer.register_state_dict_post_hook(self._state_dict_post))
        self._handles.append(optimizer.register_load_state_dict_post_hook(self._load_state_dict_post))
        optimizer.zero_grad = self.zero_grad  # type: ignore[method-assign]

    def _create(self) -> None:
        cls = type(self.optimizer)
        if cls.__module__ == "__main__":
            raise LrmpError(
                f"optimizer {cls.__qualname__} is defined in __main__, which workers cannot import; "
                "move it into a module and allow that module on the workers with --allow-module"
            )
        defaults = dict(self.optimizer.defaults)
        for conn in self.conns:
            groups = [
                {
                    "params": [
                        self.remote[id(p)][1] for p in g["params"] if self.remote.get(id(p), (None,))[0] is conn
                    ],
                    **_hparams(g),
                }
                for g in self.optimizer.param_groups
            ]
            try:
                conn.request(
                    protocol.OPTIM_CREATE,
                    {"index": self.index, "cls": layer_path(cls), "defaults": defaults, "groups": groups},
                )
            except protocol.ProtocolError as err:
                raise LrmpError(
                    f"optimizer {self.index} ({cls.__qualname__}) cannot be mirrored on {conn.where()}: {err}"
                ) from None
        # The workers own the remote share of the state from now on.
        self._drop_local_state()

    def _drop_local_state(self) -> None:
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if id(p) in self.remote:
                    self.optimizer.state.pop(p, None)

    # --- hooks ----------------------------------------------------------------------
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        hparams = [_hparams(g) for g in optimizer.param_groups]
        broadcast(self.conns, protocol.OPTIM_STEP, {"index": self.index, "hparams": hparams})

    def zero_grad(self, set_to_none: bool = True) -> None:
        ids = [c.send(protocol.ZERO_GRAD, {"index": self.index, "set_to_none": set_to_none}) for c in self.conns]
        self._zero_grad(set_to_none=set_to_none)
        for c, i in zip(self.conns, ids):
            c.recv(i, what=protocol.ZERO_GRAD)

    def _positions(self) -> dict[str, int]:
        """Remote parameter name -> its index in the local optimizer's packed state_dict."""
        positions = {}
        k = 0
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if id(p) in self.remote:
                    positions[self.remote[id(p)][1]] = k
                k += 1
        return positions

    def _state_dict_post(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        positions = self._positions()
        replies = broadcast(self.conns, protocol.GET_OPTIM_STATE, {"index": self.index})
        state = dict(state_dict["state"])
        for reply in replies:
            for name, param_state in reply["state"].items():
                state[positions[name]] = {
                    k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in param_state.items()
                }
        state_dict["state"] = dict(sorted(state.items()))
        return state_dict

    def _load_state_dict_post(self, optimizer: torch.optim.Optimizer) -> None:
        per_conn: dict[int, dict[str, Any]] = {id(c): {} for c in self.conns}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) in self.remote and p in optimizer.state:
                    conn, name = self.remote[id(p)]
                    per_conn[id(conn)][name] = dict(optimizer.state[p])
        ids = [c.send(protocol.LOAD_OPTIM_STATE, {"index": self.index, "state": per_conn[id(c)]}) for c in self.conns]
        for c, i in zip(self.conns, ids):
            c.recv(i, what=protocol.LOAD_OPTIM_STATE)
        self._drop_local_state()

    def detach(self, restore_state: bool = True) -> None:
        """Stop mirroring; with ``restore_state``, bring the workers' state back into the local optimizer."""
        full = self.optimizer.state_dict() if restore_state else None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        vars(self.optimizer).pop("zero_grad", None)
        if full is not None:
            self.optimizer.load_state_dict(full)
