"""The optimizer mirror: the user's optimizer keeps driving, its remote share runs on workers.

Each worker builds the same optimizer class with the same per-group hyperparameters over the
parameters it holds. The local optimizer object stays the one Lightning and LR schedulers see:

- after every ``step()`` (a step post-hook, so it follows the closure's forward and backward),
  each worker steps with the groups' current hyperparameters, so scheduler changes reach it;
- ``zero_grad()`` is mirrored to the workers;
- gradient clipping spans every stage's gradients (`OptimizerMirror.clip_grad_norm`);
- ``state_dict()`` carries the workers' state under the local parameter indices, and
  ``load_state_dict()`` pushes the remote share of a loaded state to the workers,

so checkpoints look exactly like a local run's, and resume either way.

How the mirror reaches the workers
----------------------------------
Through three mechanisms; no single one reaches every caller. The callers: Lightning's automatic
loop, ``self.optimizers()`` in manual optimization (a ``LightningOptimizer``), the optimizer object
itself (``self.optimizers(use_pl_optimizer=False)``, a reference the user kept, a `DriverSession`
used without a Trainer), ``lr_find`` and checkpoint save and restore.

1. **torch's optimizer hooks** for ``step``, ``state_dict`` and ``load_state_dict``. They run
   inside those methods however they are called, so they reach every caller above (Lightning's
   checkpoints call the same methods). ``step``'s post-hook runs after the closure (forward,
   backward and Lightning's gradient clipping) and sees the hyperparameters schedulers set.
   Overriding ``step`` in a subclass instead fails: every LR scheduler replaces ``opt.step`` on
   the instance with a wrapper around the class's ``step`` when it is built (in
   ``configure_optimizers``, before the mirror), so the override would never run. Overriding
   ``Strategy.optimizer_step`` fails for ``opt.step()`` on the optimizer itself.
2. **A subclass of the optimizer's class** (`_mirrored_class`: same name, only ``zero_grad``),
   swapped in by `OptimizerMirror` and out again at `OptimizerMirror.detach`; ``isinstance``
   still holds. torch has no ``zero_grad`` hook and Lightning no strategy hook for it (the
   automatic loop calls ``LightningModule.optimizer_zero_grad``, which calls
   ``optimizer.zero_grad()``). An instance attribute fails: ``LightningOptimizer`` subclasses the
   optimizer's class and finds ``zero_grad`` there, never on the wrapped instance. So the swap
   happens before Lightning builds its wrappers (``RemoteModelParallelStrategy.optimizers``).
3. **The Trainer's precision plugin**: the strategy replaces its ``clip_grad_by_norm`` and
   ``clip_grad_by_value`` on the instance for the fit (`lightning_remote_mp.lightning.intercept`). Lightning clips
   (``gradient_clip_val``, ``self.clip_gradients``) only through the plugin, over the local
   ``.grad`` of the optimizer's parameters; the remote ones are on the workers. A plugin subclass
   shipped with the strategy fails: Lightning takes a strategy's plugin in place of the one
   ``precision=`` selects without a word (``precision="bf16-mixed"`` would train in float32),
   and the class to extend depends on that choice (``Precision``, ``MixedPrecision``,
   ``HalfPrecision``...).

A wrapper object put in place of the user's optimizer (as the DeepSpeed and ColossalAI strategies
do) would cover only calls that go through ``trainer.optimizers``: the object the user built
would still step and zero locally only, and a `DriverSession` has no Trainer to put it in place.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_remote_mp.driver.pipeline import confirm_outstanding
from lightning_remote_mp.errors import LrmpError
from lightning_remote_mp.model.build import refuse_main
from lightning_remote_mp.model.entries import layer_path
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.grads import GradAllreduce, GradClamp, GradNorms, GradScale
from lightning_remote_mp.wire.requests import OptimCreate, OptimStep, ZeroGrad
from lightning_remote_mp.wire.state import GetOptimState, LoadOptimState
from lightning_remote_mp.wire.transport import Connection, broadcast, post_all, request_all

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Holder:
    """Where one copy of a remote parameter lives: the workers holding it (one per replica, replica 0
    first), and its name there. A tied weight has a holder per stage that uses it
    (`lightning_remote_mp.driver.ties`); its first holder's copy answers for its norm and state."""

    conns: list[Connection]
    name: str


def _hparams(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class OptimizerMirror:
    """Mirrors ``optimizer`` (the driver's index ``index``) onto the workers holding its parameters.

    Args:
        optimizer: the torch optimizer ``configure_optimizers`` returned.
        index: its position among the Trainer's optimizers (the workers' key for it).
        remote: for each remote parameter (by ``id``), its `Holder`s: one per stage holding a copy.
        grads_version: a counter that moves whenever remote gradients change (a backward ran); with
            replicas or tied weights held by several stages, the copies' gradients are summed before
            they are read or applied, once per change.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        index: int,
        remote: Mapping[int, list[Holder]],
        grads_version: Callable[[], int] = lambda: 0,
    ) -> None:
        self.optimizer = optimizer
        self.index = index
        self._adopt(remote)
        self.grads_version = grads_version
        self._synced_version = grads_version()
        self.allreduced_bytes = 0  # gradient bytes each stage's replicas summed, over the session
        #: Whether ``state_dict()`` brings the workers' state here (False: a sharded checkpoint).
        self.gather = True
        self._handles: list[Any] = []
        self.cls = type(optimizer)
        self._create()
        self._handles.append(optimizer.register_step_post_hook(self._after_step))
        self._handles.append(optimizer.register_state_dict_post_hook(self._state_dict_post))
        self._incoming: dict[str, Any] = {}
        self._handles.append(optimizer.register_load_state_dict_pre_hook(self._load_state_dict_pre))
        self._handles.append(optimizer.register_load_state_dict_post_hook(self._load_state_dict_post))
        # torch has no zero_grad hook: see "How the mirror reaches the workers" above.
        optimizer.__class__ = _mirrored_class(self.cls)
        optimizer._lrmp_mirror = self  # type: ignore[attr-defined]

    def _params(self) -> list[torch.Tensor]:
        """The optimizer's parameters, group by group (the order of its packed state_dict)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _adopt(self, remote: Mapping[int, list[Holder]]) -> None:
        self.remote = {id(p): remote[id(p)] for p in self._params() if id(p) in remote}
        every = [h for holders in self.remote.values() for h in holders]
        self.conns: list[Connection] = list({id(c): c for h in every for c in h.conns}.values())
        # Replica 0's workers of the first copies answer for state and gradient norms; every replica,
        # and every copy of a tied weight, holds the same.
        self.primary: list[Connection] = list(dict.fromkeys(holders[0].conns[0] for holders in self.remote.values()))
        self.replicated = any(len(h.conns) > 1 for h in every)
        self.tied = any(len(holders) > 1 for holders in self.remote.values())
        # The gradient bytes a stage's replicas sum per step (its weights that train, once per stage).
        params = {id(p): p for p in self._params()}
        self._replicated_bytes = sum(
            params[k].numel() * params[k].element_size() * sum(1 for h in holders if len(h.conns) > 1)
            for k, holders in self.remote.items()
            if params[k].requires_grad
        )

    def extend(self, remote: Mapping[int, list[Holder]]) -> None:
        """Take in parameters placed after the mirror was made (a traced module placed at its first
        call): the workers' optimizers are built again over all of them, with the state they had."""
        if not any(id(p) in remote and id(p) not in self.remote for p in self._params()):
            return
        kept = self._remote_state()
        self._adopt(remote)
        self._create()
        if kept:
            self._push_state(kept)

    def _create(self) -> None:
        cls = self.cls
        refuse_main(f"{cls.__module__}.{cls.__qualname__}", f"optimizer {self.index}", LrmpError)
        if issubclass(cls, torch.optim.LBFGS):
            raise LrmpError(
                f"optimizer {self.index} ({cls.__qualname__}) cannot be mirrored: LBFGS re-evaluates the whole "
                "model through its closure several times inside one step, which a worker holding one stage "
                "cannot do. Use a first-order optimizer (SGD, Adam, AdamW...) with RemoteModelParallelStrategy."
            )
        defaults = dict(self.optimizer.defaults)
        for conn in self.conns:
            groups = [
                {
                    "params": [h.name for p in g["params"] for h in self.remote.get(id(p), ()) if conn in h.conns],
                    **_hparams(g),
                }
                for g in self.optimizer.param_groups
            ]
            copies = [h.name for holders in self.remote.values() for h in holders[1:] if conn in h.conns]
            try:
                create = OptimCreate(self.index, layer_path(cls), defaults, groups, copies)
                conn.request(protocol.OPTIM_CREATE, create.body())
            except protocol.ProtocolError as err:
                raise LrmpError(
                    f"optimizer {self.index} ({cls.__qualname__}) cannot be mirrored on {conn.where()}: {err}"
                ) from None
        # State the optimizer already has for parameters that are now remote (a checkpoint loaded
        # before a traced module was placed at its first call) goes to the workers, which own the
        # remote share of the state from now on.
        held = {
            self.remote[id(p)][0].name: self.optimizer.state[p]
            for p in self._params()
            if id(p) in self.remote and self.optimizer.state.get(p)
        }
        if held:
            self._push_state(held)
        self._drop_local_state()

    def _drop_local_state(self) -> None:
        for p in self._params():
            if id(p) in self.remote:
                self.optimizer.state.pop(p, None)

    # --- hooks ----------------------------------------------------------------------
    def sync_grads(self) -> None:
        """All-reduce (sum) the gradients of each stage's replicas, and of the copies of tied weights,
        if they changed since last time: each replica saw a share of the batch, each copy of a tied
        weight its stage's uses of it, and the sums are the whole batch's gradients."""
        version = self.grads_version()
        if self._unsummed(version):
            replies = broadcast(self.conns, protocol.GRADS, GradAllreduce(self.index).body())
            primary = {id(c) for c in self.primary}
            self.allreduced_bytes += sum(r["bytes"] for c, r in zip(self.conns, replies) if id(c) in primary)
        self._synced_version = version

    def _unsummed(self, version: int) -> bool:
        """Whether there are copies (replicas, tied weights) whose gradients changed (to ``version``
        of `grads_version`) since they were last summed."""
        return (self.replicated or self.tied) and version != self._synced_version

    def confirm_backward(self) -> None:
        """Before the driver's own layers step (`_mirrored_class`): make sure that the backward the
        driver did not wait for succeeded (`confirm_outstanding`), or a failure there would leave
        them a step ahead of the workers' layers, whose step is then dropped."""
        if self.conns and self.local_grads():
            confirm_outstanding(self.conns)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # The gradients of replicas and of tied weights' copies are summed by the step itself,
        # unless clipping summed them already (`sync_grads`).
        version = self.grads_version()
        sync = self._unsummed(version)
        self._synced_version = version
        if sync:
            self.allreduced_bytes += self._replicated_bytes
        hparams = [_hparams(g) for g in optimizer.param_groups]
        # Carried: the step travels with the next call's micro-batches, each stage running it
        # before them (`Connection.carry`), so it costs the driver no message of its own; whatever
        # the driver sends a worker first sends it.
        for c in self.conns:
            c.carry(OptimStep(self.index, hparams, sync=sync), linked=self.conns if sync else ())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for c in self.conns:
            c.carry(ZeroGrad(self.index, bool(set_to_none)))
        self.cls.zero_grad(self.optimizer, set_to_none=set_to_none)

    # --- gradients across stages ----------------------------------------------------
    def local_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params() if id(p) not in self.remote and p.grad is not None]

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters, wherever they live."""
        confirm_outstanding(self.conns)  # the backward that made the gradients
        self.sync_grads()
        local = self.local_grads()
        norms = [torch.linalg.vector_norm(g, norm_type) for g in local]
        device = local[0].device if local else torch.device("cpu")
        for reply in broadcast(self.primary, protocol.GRADS, GradNorms(self.index, norm_type).body()):
            norms.extend(reply["norms"].to(device).unbind())
        if not norms:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        scaling = post_all(
            ((c, protocol.GRADS, GradScale(self.index, coef).body()) for c in self.conns),
            what="gradient clipping",
        )
        if local:
            torch._foreach_mul_(local, coef.to(device))
        scaling()
        return total

    def clip_grad_value(self, value: float) -> None:
        """``torch.nn.utils.clip_grad_value_`` over the optimizer's parameters, wherever they live."""
        confirm_outstanding(self.conns)  # the backward that made the gradients
        self.sync_grads()
        clamping = post_all(
            ((c, protocol.GRADS, GradClamp(self.index, float(value)).body()) for c in self.conns),
            what="gradient clipping",
        )
        torch.nn.utils.clip_grad_value_([p for p in self._params() if id(p) not in self.remote], value)
        clamping()

    def _positions(self) -> dict[str, int]:
        """Remote parameter name -> its index in the local optimizer's packed state_dict."""
        return {self.remote[pid][0].name: k for pid, k in self.positions_by_id().items()}

    def positions_by_id(self) -> dict[int, int]:
        """Each remote parameter (by ``id``): its index in the local optimizer's packed state_dict."""
        return {id(p): k for k, p in enumerate(self._params()) if id(p) in self.remote}

    def _state_dict_post(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        if not self.gather:  # a sharded checkpoint: the workers write their state themselves
            return state_dict
        positions = self._positions()
        state = dict(state_dict["state"])
        for name, param_state in self._remote_state().items():
            state[positions[name]] = {
                k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in param_state.items()
            }
        state_dict["state"] = dict(sorted(state.items()))
        return state_dict

    def _remote_state(self) -> dict[str, Any]:
        """The workers' optimizer state, by remote parameter name (replica 0's: every replica holds the same)."""
        replies = broadcast(self.primary, protocol.GET_OPTIM_STATE, GetOptimState(self.index).body())
        return {name: param_state for reply in replies for name, param_state in reply["state"].items()}

    def _push_state(self, state: Mapping[str, Any]) -> None:
        """Send per-parameter state (by remote name) to every worker holding those parameters."""
        per_conn: dict[int, dict[str, Any]] = {id(c): {} for c in self.conns}
        for holders in self.remote.values():
            first = holders[0].name  # the state of every copy of a tied weight is its first copy's
            if first in state:
                for h in holders:
                    for conn in h.conns:
                        per_conn[id(conn)][h.name] = dict(state[first])
        request_all(
            (c, protocol.LOAD_OPTIM_STATE, LoadOptimState(self.index, per_conn[id(c)]).body()) for c in self.conns
        )

    def _load_state_dict_pre(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        # Keep the remote share as it arrives: loading casts state to each parameter's device, and a
        # parameter on the meta device would keep no data.
        state = state_dict.get("state", {})
        self._incoming = {name: state[k] for name, k in self._positions().items() if k in state}

    def _load_state_dict_post(self, optimizer: torch.optim.Optimizer) -> None:
        incoming, self._incoming = self._incoming, {}
        self._push_state(incoming)
        self._drop_local_state()

    def detach(self, restore_state: bool = True) -> None:
        """Stop mirroring; with ``restore_state``, bring the workers' state back into the local optimizer."""
        full = self.optimizer.state_dict() if restore_state else None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.optimizer.__class__ = self.cls
        vars(self.optimizer).pop("_lrmp_mirror", None)
        if full is not None:
            # Parameters on the meta device (weights that live only on workers) get no local state.
            params = self._params()
            full["state"] = {k: v for k, v in full["state"].items() if not params[k].is_meta}
            self.optimizer.load_state_dict(full)


_MIRRORED: dict[type, type] = {}


def _mirrored_class(cls: type) -> type:
    """``cls`` with a ``zero_grad`` that reaches the workers too (mechanism 2 in the module
    docstring), and a ``step`` that steps the driver's own layers only once the backward is known to
    have succeeded on the workers (`OptimizerMirror.confirm_backward`): after the closure, which
    runs it (Lightning's automatic optimization), or before the step."""
    if cls not in _MIRRORED:

        def step(self: Any, closure: Any = None) -> Any:
            mirror = getattr(self, "_lrmp_mirror", None)
            if mirror is None:
                return cls.step(self) if closure is None else cls.step(self, closure)
            if closure is None:
                mirror.confirm_backward()
                return cls.step(self)

            def confirmed() -> Any:
                loss = closure()
                mirror.confirm_backward()
                return loss

            return cls.step(self, confirmed)

        # ``cls.step`` runs the optimizer's step hooks: torch must not wrap this one with them again
        # (it does so for a class whose ``step`` is not marked, when an instance is unpickled).
        step.hooked = True  # type: ignore[attr-defined]

        def zero_grad(self: Any, set_to_none: bool = True) -> None:
            mirror = getattr(self, "_lrmp_mirror", None)
            if mirror is None:  # a LightningOptimizer built during the session, used after it ended
                cls.zero_grad(self, set_to_none=set_to_none)
            else:
                mirror.zero_grad(set_to_none=set_to_none)

        _MIRRORED[cls] = type(
            cls.__name__, (cls,), {"zero_grad": zero_grad, "step": step, "__module__": cls.__module__}
        )
    return _MIRRORED[cls]


def mirror_of(optimizer: Any) -> OptimizerMirror | None:
    """The mirror attached to ``optimizer`` (or to the optimizer a LightningOptimizer wraps)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    return vars(optimizer).get("_lrmp_mirror")
