"""One driver session on a worker: its stages, its optimizers, and the handler of each request kind.

Parameters are named ``"<key>/<global layer index>.<param name>"`` (``key`` names the driver's
SpecSequential), so a driver can map them to its own parameters, optimizer groups and
checkpoint entries without knowing the worker's internals.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from lightning_remote_mp import protocol
from lightning_remote_mp.errors import LrmpError, ProtocolError, SpecError
from lightning_remote_mp.keys import is_z85_key
from lightning_remote_mp.messages import DRIVER, Backward, Forward
from lightning_remote_mp.spec import resolve_class, source_digest
from lightning_remote_mp.worker.collective import ReplicaGroup
from lightning_remote_mp.worker.profile import profile_layers
from lightning_remote_mp.worker.route import Outgoing, RoutedStage
from lightning_remote_mp.worker.stage import StageExecutor
from lightning_remote_mp.worker.timeline import EventLog

#: Returned by handlers whose answer travels as separate messages (pipelined forward/backward).
NO_REPLY = object()


class Outbox(Protocol):
    """Where a session's pipelined messages go: the driver, or a peer worker by address."""

    def to_driver(self, kind: str, body: Any) -> None: ...

    def to_peer(self, address: str, kind: str, body: Any) -> None: ...

    def add_peer_keys(self, keys: dict[str, bytes]) -> None: ...


log = logging.getLogger(__name__)

#: Optimizer classes come from here, or from the worker's --allow-module prefixes.
DEFAULT_OPTIMIZER_PREFIXES: tuple[str, ...] = ("torch.optim",)


def _require(body: Any, field: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(body, dict) or field not in body:
        raise ProtocolError(f"request is missing field {field!r}")
    value = body[field]
    if not isinstance(value, kind):
        raise ProtocolError(f"field {field!r} has type {type(value).__name__}")
    return value


class WorkerSession:
    def __init__(
        self,
        session_id: str,
        device: torch.device,
        allowed_prefixes: Sequence[str],
        outbox: Outbox,
        *,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        announce_peer_keys: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        self.id = session_id
        self.outbox = outbox
        self.limits = limits
        self.announce_peer_keys = announce_peer_keys
        self.routes: dict[str, RoutedStage] = {}
        self.peers: dict[str, dict[int, str]] = {}
        self.device = device
        self.allowed_prefixes = list(allowed_prefixes)
        self.stages: dict[str, StageExecutor] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self._optim_params: dict[int, list[str]] = {}
        self._handlers: dict[str, Callable[[Any], Any]] = {
            protocol.SETUP: self.setup,
            protocol.FORWARD: self.forward,
            protocol.BACKWARD: self.backward,
            protocol.RELEASE: self.release,
            protocol.GET_STATE: self.get_state,
            protocol.LOAD_STATE: self.load_state,
            protocol.OPTIM_CREATE: self.optim_create,
            protocol.OPTIM_STEP: self.optim_step,
            protocol.ZERO_GRAD: self.zero_grad,
            protocol.GET_OPTIM_STATE: self.get_optim_state,
            protocol.LOAD_OPTIM_STATE: self.load_optim_state,
            protocol.GRADS: self.grads,
            protocol.PROFILE: self.profile,
            protocol.TIMELINE: self.timeline,
            protocol.GROUP: self.group_init,
        }
        self.group: ReplicaGroup | None = None
        self.events: EventLog | None = None
        self._deferred_failure: Exception | None = None

    def handle(self, kind: str, body: Any) -> Any:
        handler = self._handlers.get(kind)
        if handler is None:
            raise ProtocolError(f"unexpected message kind {kind!r:.40}")
        return handler(body)

    def stage(self, body: Any) -> StageExecutor:
        key = _require(body, "key", str)
        if key not in self.stages:
            raise SpecError(f"no stage {key!r:.80} on this worker; send setup first")
        return self.stages[key]

    def stage_of(self, key: str) -> StageExecutor | None:
        return self.stages.get(key)

    # --- stages ---------------------------------------------------------------
    def setup(self, body: Any) -> Any:
        key = _require(body, "key", str)
        index = _require(body, "stage", int)
        start = _require(body, "start", int)
        entries = self._entries(body)
        exports = _require(body, "exports", list)
        state = body.get("state")
        seed = body.get("init_seed")
        if state is None and not isinstance(seed, int):
            raise ProtocolError("setup needs the stage's state or an init_seed")
        _check_code_versions(body.get("code_digests"))  # before building runs any stale code
        stage = StageExecutor(
            key,
            index,
            start,
            entries,
            exports,
            self.device,
            self.allowed_prefixes,
            init_seed=seed if state is None else None,
            split_backward=body.get("split_backward") is True,
        )
        if state is not None:
            if not isinstance(state, dict):
                raise ProtocolError("field 'state' must be a dict")
            stage.load_state_dict(state, assign=True)
        _check_code_versions(body.get("code_digests"))  # and modules first imported by this build: another copy?
        rng_seed = body.get("seed")
        if isinstance(rng_seed, int) and 0 <= rng_seed < 2**63:
            torch.manual_seed(rng_seed)  # this stage's random stream (dropout), from the driver's generator
        frozen = set(body.get("frozen") or [])
        for name, p in stage.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
        routed = RoutedStage(stage, _require(body, "sources", list), _require(body, "targets", list))
        routed.events = self.events
        peers = _require(body, "peers", dict)
        peer_keys = _peer_keys(body.get("peer_keys"), peers)
        self.stages[key] = stage
        self.routes[key] = routed
        self.peers[key] = {int(k): str(v) for k, v in peers.items() if isinstance(k, int) and isinstance(v, str)}
        if peer_keys:
            self.outbox.add_peer_keys(peer_keys)
            if self.announce_peer_keys is not None:
                self.announce_peer_keys(list(peer_keys.values()))
        params = sum(p.numel() for _, p in stage.named_parameters())
        log.info(
            "session %s: stage %d of %r holds layers %d-%d (%s parameters) on %s",
            self.id,
            index,
            key,
            start,
            start + len(entries) - 1,
            f"{params:,}",
            self.device,
        )
        return {"parameters": params}

    def _entries(self, body: Any) -> list[Any]:
        entries = _require(body, "entries", list)
        if len(entries) > self.limits.max_layers:
            raise protocol.LimitExceeded(
                f"{len(entries)} layers in one stage; this worker accepts at most {self.limits.max_layers} "
                "(its --max-layers)",
                "max_layers",
            )
        return entries

    def forward(self, body: Any) -> Any:
        msg = Forward.from_body(body)
        self._send(self.route(msg.key).forward(msg), protocol.FORWARD, protocol.RESULT)
        return NO_REPLY

    def backward(self, body: Any) -> Any:
        msg = Backward.from_body(body)
        route = self.route(msg.key)
        self._send(route.backward(msg), protocol.BACKWARD, protocol.DONE)
        try:
            route.finish_backward(msg.call)
        except Exception as err:
            # The micro-batch is reported done already and the driver may have moved on: the failure
            # belongs to the next request that needs these gradients (step, clipping, zero_grad).
            log.warning("stage %d: computing the deferred weight gradients failed: %s", route.index, err)
            self._deferred_failure = err
        return NO_REPLY

    def _settle_grads(self) -> None:
        """Make every ``.grad`` complete (deferred weight gradients added) before it is read; a
        failure of an earlier attempt is raised here, so it reaches the driver."""
        failure, self._deferred_failure = self._deferred_failure, None
        if failure is not None:
            raise LrmpError(f"computing the weight gradients after the last backward failed: {failure}") from failure
        for stage in self.stages.values():
            stage.flush_weight_grads()

    def _send(self, outgoing: list[Outgoing], peer_kind: str, driver_kind: str) -> None:
        for target, msg in outgoing:
            if self.events is not None:
                msg = dataclasses.replace(msg, sent_at=time.time())
            if target == DRIVER:
                self.outbox.to_driver(driver_kind, msg.body())
            else:
                self.outbox.to_peer(self.peers[msg.key][target], peer_kind, msg.body())

    def route(self, key: str) -> RoutedStage:
        if key not in self.routes:
            raise SpecError(f"no stage {key!r:.80} on this worker; send setup first")
        return self.routes[key]

    def release(self, body: Any) -> Any:
        for key, calls in _require(body, "calls", dict).items():
            if key in self.routes and isinstance(calls, list):
                self.routes[key].release(c for c in calls if isinstance(c, int))
        return None

    def _named_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {f"{key}/{name}": p for key, stage in self.stages.items() for name, p in stage.named_parameters()}

    def get_state(self, body: Any) -> Any:
        return {key: stage.state_dict() for key, stage in self.stages.items()}

    def load_state(self, body: Any) -> Any:
        for key, state in _require(body, "state", dict).items():
            self.stage({"key": key}).load_state_dict(state)
        return None

    # --- optimizers -------------------------------------------------------------
    def optim_create(self, body: Any) -> Any:
        index = _require(body, "index", int)
        cls = resolve_class(
            _require(body, "cls", str), torch.optim.Optimizer, list(DEFAULT_OPTIMIZER_PREFIXES) + self.allowed_prefixes
        )
        defaults = _require(body, "defaults", dict)
        groups = _require(body, "groups", list)
        named = self._named_parameters()
        param_groups = []
        names: list[str] = []
        for g, group in enumerate(groups):
            if not isinstance(group, dict) or not isinstance(group.get("params"), list):
                raise ProtocolError(f"optimizer {index} group {g} is malformed")
            unknown = [n for n in group["params"] if n not in named]
            if unknown:
                raise SpecError(
                    f"optimizer {index} group {g} names parameters this worker does not hold: {unknown[:3]}"
                )
            names.extend(group["params"])
            param_groups.append({**group, "params": [named[n] for n in group["params"]]})
        if not names:
            self.optimizers.pop(index, None)
            return {"parameters": 0}
        try:
            opt = cls(param_groups, **constructor_kwargs(cls, defaults))
        except Exception as err:
            raise SpecError(f"building optimizer {cls.__qualname__} with {defaults} failed: {err}") from err
        # Defaults the constructor does not take (AdamW's decoupled_weight_decay) are still the
        # driver's: every group carries them, and so do the defaults.
        opt.defaults.update(defaults)
        self.optimizers[index] = opt
        self._optim_params[index] = names
        return {"parameters": len(names)}

    def _optimizer(self, body: Any) -> torch.optim.Optimizer | None:
        return self.optimizers.get(_require(body, "index", int))

    def optim_step(self, body: Any) -> Any:
        opt = self._optimizer(body)
        if opt is None:
            return None
        self._settle_grads()
        hparams = _require(body, "hparams", list)
        if len(hparams) != len(opt.param_groups):
            raise ProtocolError(
                f"step carries {len(hparams)} groups' hyperparameters; the optimizer has {len(opt.param_groups)}"
            )
        for group, values in zip(opt.param_groups, hparams):
            if isinstance(values, dict):
                group.update({k: v for k, v in values.items() if k != "params"})
        opt.step()
        return None

    def zero_grad(self, body: Any) -> Any:
        opt = self._optimizer(body)
        if opt is not None:
            self._settle_grads()
            opt.zero_grad(set_to_none=bool(body.get("set_to_none", True)))
        return None

    def timeline(self, body: Any) -> Any:
        """``start`` / ``stop`` recording, ``fetch`` (and clear) the events, or read the ``clock``."""
        op = _require(body, "op", str)
        if op == "start":
            self.events = self.events or EventLog()
        elif op == "stop":
            self.events = None
        elif op == "fetch":
            return {"events": self.events.drain() if self.events else []}
        elif op != "clock":
            raise ProtocolError(f"unknown timeline operation {op!r:.40}")
        for route in self.routes.values():
            route.events = self.events
        return {"time": time.time()}

    def group_init(self, body: Any) -> Any:
        """Join the process group of this stage's replicas (blocks until all have joined)."""
        if _require(body, "op", str) != "init":
            raise ProtocolError("unknown group operation")
        self.group = ReplicaGroup(
            _require(body, "host", str),
            _require(body, "port", int),
            _require(body, "prefix", str),
            _require(body, "rank", int),
            _require(body, "world", int),
            _require(body, "backend", str),
            float(_require(body, "timeout", (int, float))),
        )
        return None

    def profile(self, body: Any) -> Any:
        """Seconds of forward plus backward of each layer of ``entries``, measured here."""
        entries = self._entries(body)
        repeats = min(max(int(body.get("repeats", 3)), 1), 50)
        return {"seconds": profile_layers(entries, self.device, self.allowed_prefixes, repeats)}

    def grads(self, body: Any) -> Any:
        """Gradient operations over one optimizer's parameters, for clipping across stages:
        ``norms`` returns each gradient's norm, ``scale`` multiplies them, ``clamp`` clips by value."""
        opt = self._optimizer(body)
        self._settle_grads()
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None] if opt else []
        op = _require(body, "op", str)
        if op == "norms":
            norm_type = float(_require(body, "norm_type", (int, float)))
            norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
            return {"norms": torch.stack(norms).cpu() if norms else torch.zeros(0)}
        if op == "scale":
            coef = _require(body, "coef", torch.Tensor)
            if grads:
                torch._foreach_mul_(grads, coef.to(grads[0].device))
            return None
        if op == "allreduce":
            if self.group is None:
                raise ProtocolError("gradient all-reduce asked of a worker without replicas")
            params = [p for g in opt.param_groups for p in g["params"]] if opt else []
            return {"bytes": self.group.allreduce_grads(params)}
        if op == "clamp":
            value = float(_require(body, "value", (int, float)))
            for g in grads:
                g.clamp_(-value, value)
            return None
        raise ProtocolError(f"unknown gradient operation {op!r:.40}")

    def get_optim_state(self, body: Any) -> Any:
        opt = self._optimizer(body)
        if opt is None:
            return {"state": {}}
        index = _require(body, "index", int)
        by_param = {id(p): n for n, p in self._named_parameters().items()}
        return {
            "state": {by_param[id(p)]: dict(s) for p, s in opt.state.items() if id(p) in by_param},
            "order": self._optim_params[index],
        }

    def load_optim_state(self, body: Any) -> Any:
        opt = self._optimizer(body)
        state = _require(body, "state", dict)
        if opt is None:
            if state:
                raise SpecError("optimizer state sent for parameters this worker does not optimise")
            return None
        index = _require(body, "index", int)
        position = {n: i for i, n in enumerate(self._optim_params[index])}
        current = opt.state_dict()
        unknown = [n for n in state if n not in position]
        if unknown:
            raise SpecError(f"optimizer state for unknown parameters {unknown[:3]}")
        current["state"] = {position[n]: s for n, s in state.items()}
        opt.load_state_dict(current)
        return None

    def close(self) -> None:
        self.group = None
        self.routes.clear()
        self.stages.clear()
        self.optimizers.clear()


def _check_code_versions(digests: Any) -> None:
    """Refuse a stage whose classes this (long-lived) worker imported in another version than the
    driver has: Python keeps the first import, so an edited layer would silently run its old body."""
    if not isinstance(digests, dict):
        return
    for name, theirs in digests.items():
        if not isinstance(name, str) or not isinstance(theirs, str):
            raise ProtocolError("code_digests must map module names to digests")
        mine = source_digest(name, as_loaded=True)
        if mine is not None and mine != theirs:
            raise SpecError(
                f"this worker runs another version of {name} than the driver has (it imported "
                f"{getattr(sys.modules.get(name), '__file__', name)} before that file changed, or its copy differs): "
                "restart this worker so that it imports the current code, and install the same version of "
                f"{name.split('.')[0]} on the driver and every worker"
            )


def constructor_kwargs(cls: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of an optimizer's ``defaults`` its constructor accepts: torch keeps keys in
    ``defaults`` that are no constructor argument (AdamW's ``decoupled_weight_decay``)."""
    accepted: set[str] = set()
    for klass in cls.__mro__:  # a subclass's **kwargs go to its bases' constructors
        if "__init__" not in vars(klass):
            continue
        try:
            params = inspect.signature(vars(klass)["__init__"]).parameters
        except (TypeError, ValueError):
            return dict(defaults)
        accepted.update(n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            break
        if klass is torch.optim.Optimizer:
            break
    return {k: v for k, v in defaults.items() if k in accepted}


def _peer_keys(value: Any, peers: Mapping[Any, Any]) -> dict[str, bytes]:
    """``{stage: Z85 public key}`` from a SETUP, as ``{address: key}`` for the stages in ``peers``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError("field 'peer_keys' must be a dict")
    out = {}
    for stage, key in value.items():
        address = peers.get(stage)
        if not isinstance(address, str) or not is_z85_key(key):
            raise ProtocolError(f"peer_keys entry {stage!r:.20} is not a 40-character key of a stage in 'peers'")
        out[address] = key.encode("ascii")
    return out


def describe_device(device: torch.device) -> Mapping[str, Any]:
    """What the driver needs to plan stages: device name and free memory in bytes."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
    else:
        free = total = 0
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            free = int(info["MemAvailable"].split()[0]) * 1024
            total = int(info["MemTotal"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            pass
        name = "cpu"
    return {"device": str(device), "device_name": name, "free_memory": free, "total_memory": total}
