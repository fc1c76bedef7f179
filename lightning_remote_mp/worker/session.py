"""One driver session on a worker: its stages, its optimizers, and the handler of each request kind.

Parameters are named ``"<key>/<global layer index>.<param name>"`` (``key`` names the driver's
SpecSequential), so a driver can map them to its own parameters, optimizer groups and
checkpoint entries without knowing the worker's internals.
"""

from __future__ import annotations

import inspect
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from lightning_remote_mp.errors import LrmpError, ProtocolError, SpecError
from lightning_remote_mp.flow import DRIVER
from lightning_remote_mp.model.build import build_layer, resolve_class, source_digest
from lightning_remote_mp.model.entries import normalize_entry
from lightning_remote_mp.model.graph_layer import GraphLayer
from lightning_remote_mp.model.program_table import untabled
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.body import Body
from lightning_remote_mp.wire.grads import GradAllreduce, GradClamp, GradNorms, Grads, GradScale
from lightning_remote_mp.wire.messages import Backward, Forward
from lightning_remote_mp.wire.requests import (
    Fetch,
    GroupInit,
    Loss,
    OptimCreate,
    OptimStep,
    Profile,
    Release,
    Setup,
    Sync,
    Timeline,
    ZeroGrad,
)
from lightning_remote_mp.wire.state import GetOptimState, GetState, LoadOptimState, LoadState, ReadOptim, Save, Saved
from lightning_remote_mp.worker.allocator import device_memory
from lightning_remote_mp.worker.collective import GradGroup
from lightning_remote_mp.worker.order import Order
from lightning_remote_mp.worker.profile import profile_layers
from lightning_remote_mp.worker.route import Outgoing, RoutedStage
from lightning_remote_mp.worker.runtime import StageRuntime, StageRuntimes
from lightning_remote_mp.worker.stage import StageExecutor
from lightning_remote_mp.worker.timeline import EventLog
from lightning_remote_mp.worker.weights import PROGRESS, read_optimizer_state, read_stage_files, save_shard, saved

if TYPE_CHECKING:
    from lightning_remote_mp.worker.outbox import Outbox

#: Loss programs one session may hold (`requests.Loss`); the driver makes at most 64 per model.
MAX_LOSS_PROGRAMS = 256


log = logging.getLogger(__name__)

#: Optimizer classes come from here, or from the worker's --allow-module prefixes.
DEFAULT_OPTIMIZER_PREFIXES: tuple[str, ...] = ("torch.optim",)


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
        seal_key: bytes | None = None,
    ) -> None:
        self.id = session_id
        self.outbox = outbox
        self.limits = limits
        self.announce_peer_keys = announce_peer_keys
        self.runtimes = StageRuntimes()  # by stage key: what runs when
        self.peers: dict[str, dict[int, str]] = {}
        self.compression: dict[str, str | None] = {}  # by stage key: how its pipelined tensors travel
        self.device = device
        self.allowed_prefixes = list(allowed_prefixes)
        self.stages: dict[str, StageExecutor] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self._optim_params: dict[int, list[str]] = {}
        self._writes: dict[str, Future[dict[str, Any]]] = {}  # checkpoint files, by name (`Save`)
        self._optim_copies: dict[int, frozenset[str]] = {}  # copies of tied weights, by optimizer (OptimCreate)
        # The handler of each typed request (`lightning_remote_mp.worker.request.REQUESTS` reads them).
        self._handlers: dict[type[Body], Callable[[Any], Any]] = {
            Setup: self.setup,
            Release: self.release,
            GetState: self.get_state,
            Save: self.save,
            Saved: lambda msg: saved(msg, self._writes),
            ReadOptim: self.read_optim,
            LoadState: self.load_state,
            OptimCreate: self.optim_create,
            OptimStep: self.optim_step,
            ZeroGrad: self.zero_grad,
            GetOptimState: self.get_optim_state,
            LoadOptimState: self.load_optim_state,
            GradNorms: self.grads,
            GradScale: self.grads,
            GradClamp: self.grads,
            GradAllreduce: self.grads,
            Profile: self.profile,
            Timeline: self.timeline,
            GroupInit: self.group_init,
            Sync: lambda msg: None,  # the requests before it have run: they run in order
            Fetch: self.fetch,
            Loss: self.loss,
        }
        self._loss_programs: dict[tuple[str, int], list[GraphLayer]] = {}  # (key, number) -> its layers
        self.group: GradGroup | None = None  # this stage's replicas
        self.tie_groups: list[tuple[GradGroup, list[str]]] = []  # stages holding copies of tied weights: theirs here
        self.events: EventLog | None = None
        # Which request runs when; it runs micro-batches (through their stage's runtime), `Carry` and `LossGrad` itself.
        self.order = Order(self.runtimes, self.handle, self.peers, outbox, seal_key, session_id)
        # A call's answers to the driver (RESULTs, DONEs), kept until they are all there: (key, call, kind) -> answers.
        self._answers: dict[tuple[str, int, str], list[tuple[Any, Any, dict[str, Any] | None]]] = {}

    # --- order between the driver's requests and the micro-batches from peers (`order`) ------
    def beat(self) -> dict[str, Any]:
        """What a heartbeat answer tells the driver of this session (read by the main thread): the
        micro-batches that wait for it (named when the pipeline stalls), the last of its requests
        run, and how far a long piece of work has come (`PROGRESS`)."""
        return {**self.order.held_back(), "ran": self.order.driver_ran, **PROGRESS.answer()}

    def layer_name(self, index: int) -> str | None:
        """The name of layer ``index`` among this session's stages (for an error's report), if one holds it."""
        names = [name for stage in self.stages.values() if (name := stage.layer_name(index))]
        return names[-1] if names else None

    def handle(self, message: Body) -> Any:
        """Run ``message`` (as `lightning_remote_mp.worker.request.REQUESTS` read it) through its handler."""
        return self._handlers[type(message)](message)

    # --- stages ---------------------------------------------------------------
    def setup(self, msg: Setup) -> Any:
        key, index, start = msg.key, msg.stage, msg.start
        self._check_layer_count(len(msg.entries))
        entries = untabled(msg.entries, msg.programs or {})  # each program checked once
        _check_code_versions(msg.code_digests)  # before building runs any stale code
        stage = StageExecutor(
            key,
            index,
            start,
            entries,
            msg.exports,
            self.device,
            self.allowed_prefixes,
            init_seed=msg.init_seed if msg.state is None and not msg.files else None,
            split_backward=msg.split_backward,
            deferred_batch_norm=msg.deferred_batch_norm,
            state_arrives=msg.state is not None or bool(msg.files) or msg.borrows is not None,
        )
        unread: list[str] = []
        if msg.borrows is not None:
            stage.borrow(self.runtimes[msg.borrows].route.stage)
        elif msg.state is not None or msg.files:
            state = dict(msg.state or {})
            read, unread = read_stage_files(stage, msg.files, self.id)
            state.update(read)
            held = stage.layers.state_dict()
            state.update({k: torch.zeros_like(held[k], device=self.device) for k in unread})  # sent next
            stage.load_state_dict(state, assign=True, owned=[*read, *unread])
        stage.share(msg.shared)
        _check_code_versions(msg.code_digests)  # and modules first imported by this build: another copy?
        if msg.seed is not None:
            torch.manual_seed(msg.seed)  # this stage's random stream (dropout), from the driver's generator
        frozen = set(msg.frozen)
        for name, p in stage.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
        runtime = StageRuntime(RoutedStage(stage, msg.sources, msg.targets), self._send, stages=msg.stages)
        runtime.route.events = self.events
        peer_keys = {msg.peers[s]: k.encode("ascii") for s, k in msg.peer_keys.items()}
        self.stages[key] = stage
        self.runtimes[key] = runtime
        self.peers[key] = dict(msg.peers)
        self.compression[key] = msg.compression
        if peer_keys:
            self.outbox.peer_keys.update(peer_keys)
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
        return {"parameters": params, **({"unread": unread} if unread else {})}

    def _check_layer_count(self, count: int) -> None:
        if count > self.limits.max_layers:
            raise protocol.LimitExceeded(
                f"{count} layers in one stage; this worker accepts at most {self.limits.max_layers} (its --max-layers)",
                "max_layers",
            )

    def _settle_grads(self) -> None:
        """Make every ``.grad`` complete (deferred weight gradients added) before it is read; a W
        action that failed after its micro-batches were reported done is raised here, so it reaches
        the driver."""
        for runtime in self.runtimes.values():
            failure, runtime.weights_failed = runtime.weights_failed, None
            if failure is not None:
                why = f"computing the weight gradients after the last backward failed: {failure}"
                raise LrmpError(why) from failure
        for stage in self.stages.values():
            stage.flush_weight_grads()

    def _send(self, outgoing: list[Outgoing]) -> None:
        """Send each message on: a forward's to a peer as FORWARD, to the driver as RESULT; a
        backward's as BACKWARD, or DONE. (A schedule's action may send either kind.)"""
        for target, msg in outgoing:
            peer_kind, driver_kind = (
                (protocol.FORWARD, protocol.RESULT) if isinstance(msg, Forward) else (protocol.BACKWARD, protocol.DONE)
            )
            if self.events is not None:
                msg = msg.replace(sent_at=time.time())
            body, ready, about = msg.body(), None, None
            io = self.stages[msg.key].io
            if io is not None:  # a GPU stage: the message leaves once its tensors are copied off the device
                body, ready = io.to_host(body)
                about = {"key": msg.key, "call": msg.call, "mb": msg.mb}
            if target == DRIVER:
                self._answer_together(msg, driver_kind, (body, ready, about))
            else:
                compression = self.compression.get(msg.key)
                self.outbox.to_peer(self.peers[msg.key][target], peer_kind, body, ready, about, compression)

    def _answer_together(self, msg: Forward | Backward, kind: str, answer: tuple[Any, Any, Any]) -> None:
        """Keep a micro-batch's answer to the driver until the call's others are there too, then
        send them all at once (`messages.Forward.microbatches`; a call of one goes at once)."""
        answers = self._answers.setdefault((msg.key, msg.call, kind), [])
        answers.append(answer)
        if len(answers) >= msg.microbatches:
            del self._answers[(msg.key, msg.call, kind)]
            self.outbox.to_driver_all(kind, answers, self.compression.get(msg.key))

    def fetch(self, msg: Fetch) -> Any:
        """The outputs this (last) stage kept of a call, by micro-batch: tensors, copied off a GPU."""
        kept = self.runtimes[msg.key].route.fetch(msg.call)
        if not kept:
            raise SpecError(f"stage {self.runtimes[msg.key].index} keeps no outputs of call {msg.call} (released?)")
        return {"outputs": self._to_host(msg.key, {mb: [[i, t] for i, t in o.items()] for mb, o in kept.items()})}

    def _to_host(self, key: str, value: Any) -> Any:
        """``value``'s tensors copied off stage ``key``'s GPU (as they are on a CPU stage), for a reply."""
        io = self.stages[key].io
        if io is None:
            return value
        value, ready = io.to_host(value)
        if ready is not None:
            ready.synchronize()  # a reply goes as it is: the copies off the GPU must be done
        return value

    def loss(self, msg: Loss) -> Any:
        """A loss over an output this (last) stage kept, per micro-batch (`requests.Loss`)."""
        route = self.runtimes[msg.key].route
        layers = self._loss_program(msg)

        def run(output: torch.Tensor, mb: int) -> tuple:
            target = msg.targets.get(mb)
            if target is None:
                raise ProtocolError(f"the loss message brings no target for micro-batch {mb}")
            arguments = [output, target.to(output.device), *(t.to(output.device) for t in msg.whole)]
            if any(not 0 <= i < len(arguments) for i in msg.inputs):
                raise ProtocolError(f"the loss program's inputs {list(msg.inputs)} name arguments it was not given")
            values = tuple(arguments[i] for i in msg.inputs)
            for layer in layers:
                values = layer(values)
            return values

        return {"values": self._to_host(msg.key, route.loss(msg.call, msg.position, run, msg.grad, msg.differentiate))}

    def _loss_program(self, msg: Loss) -> list[GraphLayer]:
        """The loss program ``msg`` names: built from its entries the first time (traced programs
        only, on the operator allowlist like any traced layer), then the one built."""
        name = (msg.key, msg.program)
        if msg.entries is None or msg.state is None:
            if name not in self._loss_programs:
                raise ProtocolError(f"loss program {msg.program} of {msg.key!r:.80} was never sent here")
            return self._loss_programs[name]
        if len(self._loss_programs) >= MAX_LOSS_PROGRAMS:
            raise SpecError(f"more than {MAX_LOSS_PROGRAMS} loss programs; the driver makes at most 64 per model")
        layers = []
        for i, (raw, state) in enumerate(zip(msg.entries, msg.state)):
            layer = build_layer(normalize_entry(raw, i), i, self.allowed_prefixes)
            if not isinstance(layer, GraphLayer):
                raise SpecError(f"loss program {msg.program}: entry {i} is no traced program")
            layer.load_state_dict(dict(state))
            layers.append(layer.to(self.device))
        self._loss_programs[name] = layers
        return layers

    def release(self, msg: Release) -> Any:
        for key, generations in msg.generations.items():
            if key in self.stages:
                self.stages[key].caches.release(generations)
        for key, calls in msg.outputs.items():
            if key in self.runtimes:
                self.runtimes[key].route.release_outputs(calls)
        for key, calls in msg.calls.items():
            if key in self.runtimes:  # a stage whose setup failed holds nothing to release
                self.runtimes[key].release(calls)
            for held in [h for h in self._answers if h[0] == key and h[1] in calls]:
                del self._answers[held]  # a failed call's answers: the driver stopped waiting
        return None

    def _named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter this worker holds, by ``"<key>/<layer index>.<name>"``; a borrowing stage's
        are its lender's (`StageExecutor.borrow`), named there."""
        return {
            f"{key}/{name}": p
            for key, stage in self.stages.items()
            if stage.borrowed is None
            for name, p in stage.named_parameters()
        }

    def save(self, msg: Save) -> Any:
        """Write this worker's share of a sharded checkpoint (`Save`): one new safetensors file,
        written by the time the answer comes, or in the background (`Saved` says when)."""
        self._settle_grads()
        stages = {key: self.runtimes[key].route.stage for key in msg.tensors}
        self._writes[msg.file] = save_shard(msg, stages, self.optimizers, self._named_parameters(), self.id)
        return {} if msg.background else self._writes[msg.file].result()

    def read_optim(self, msg: ReadOptim) -> Any:
        """Load optimizer ``msg.index``'s state from a sharded checkpoint's files (`ReadOptim`)."""
        read = read_optimizer_state(msg)
        opt = self.optimizers.get(msg.index)
        if opt is not None:  # merged: another module's stages here keep their state
            names = self._optim_params[msg.index]
            read = {**{names[k]: s for k, s in opt.state_dict()["state"].items()}, **read}
        return self.load_optim_state(LoadOptimState(msg.index, read))

    def get_state(self, msg: GetState) -> Any:
        return {key: stage.state_dict() for key, stage in self.stages.items() if stage.borrowed is None}

    def load_state(self, msg: LoadState) -> Any:
        for key, state in msg.state.items():
            self.runtimes[key].route.stage.load_state_dict(state)
        return None

    # --- optimizers -------------------------------------------------------------
    def optim_create(self, msg: OptimCreate) -> Any:
        index, defaults = msg.index, msg.defaults
        cls = resolve_class(
            msg.class_path, torch.optim.Optimizer, list(DEFAULT_OPTIMIZER_PREFIXES) + self.allowed_prefixes
        )
        named = self._named_parameters()
        param_groups = []
        names: list[str] = []
        for g, group in enumerate(msg.groups):
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
        self._optim_copies[index] = frozenset(msg.copies)
        return {"parameters": len(names)}

    def optim_step(self, msg: OptimStep) -> Any:
        if self.order.no_step is not None:
            raise LrmpError(f"optimizer {msg.index} did not step: {self.order.no_step}")
        opt = self.optimizers.get(msg.index)
        if opt is not None:
            self._settle_grads()
        if msg.sync:
            self._allreduce(opt)  # every member of a group joins each sum, holding nothing or not
        if opt is None:
            return None
        if len(msg.hparams) != len(opt.param_groups):
            raise ProtocolError(
                f"step carries {len(msg.hparams)} groups' hyperparameters; the optimizer has {len(opt.param_groups)}"
            )
        for group, values in zip(opt.param_groups, msg.hparams):
            group.update({k: v for k, v in values.items() if k != "params"})
        for runtime in self.runtimes.values():
            runtime.route.before_step()  # logits read after the step are still the forward's
        opt.step()
        return None

    def zero_grad(self, msg: ZeroGrad) -> Any:
        opt = self.optimizers.get(msg.index)
        if opt is not None:
            self._settle_grads()
            opt.zero_grad(set_to_none=msg.set_to_none)
        return None

    def timeline(self, msg: Timeline) -> Any:
        """``start`` / ``stop`` recording, ``fetch`` (and clear) the events, or read the ``clock``."""
        op = msg.op
        if op == "start":
            self.events = self.events or EventLog()
        elif op == "stop":
            self.events = None
        elif op == "fetch":
            return {"events": self.events.drain() if self.events else []}
        for runtime in self.runtimes.values():
            runtime.route.events = self.events
        return {"time": time.time()}

    def group_init(self, msg: GroupInit) -> Any:
        """Join the process group of this stage's replicas, or of the stages holding copies of tied
        weights (``msg.params``); blocks until all members have joined."""
        group = GradGroup(msg.host, msg.port, msg.prefix, msg.rank, msg.world, msg.backend, msg.timeout)
        if msg.params is None:
            self.group = group
        else:
            named = self._named_parameters()
            unknown = [n for n in msg.params if n not in named]
            if unknown:
                raise SpecError(f"a group of tied weights names parameters this worker does not hold: {unknown[:3]}")
            self.tie_groups.append((group, list(msg.params)))
        return None

    def profile(self, msg: Profile) -> Any:
        """Seconds of forward plus backward of each layer of ``entries``, measured here."""
        self._check_layer_count(len(msg.entries))
        repeats = min(max(3 if msg.repeats is None else msg.repeats, 1), 50)
        return {"seconds": profile_layers(msg.entries, self.device, self.allowed_prefixes, repeats)}

    def grads(self, msg: Grads) -> Any:
        """Gradient operations over one optimizer's parameters, for clipping across stages:
        ``norms`` returns each gradient's norm, ``scale`` multiplies them, ``clamp`` clips by value."""
        opt = self.optimizers.get(msg.index)
        self._settle_grads()
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None] if opt else []
        grads = [p.grad for p in params]
        if isinstance(msg, GradNorms):
            copies = self._copies(msg.index)  # a tied weight's norm is its first copy's, counted once
            norms = [torch.linalg.vector_norm(p.grad, msg.norm_type) for p in params if id(p) not in copies]
            return {"norms": torch.stack(norms).cpu() if norms else torch.zeros(0)}
        if isinstance(msg, GradScale):
            if grads:
                torch._foreach_mul_(grads, msg.coef.to(grads[0].device))
            return None
        if isinstance(msg, GradAllreduce):
            return {"bytes": self._allreduce(opt)}
        assert isinstance(msg, GradClamp)  # the handler table sends only the four operations here
        for g in grads:
            g.clamp_(-msg.value, msg.value)
        return None

    def _copies(self, index: int) -> set[int]:
        """The ``id`` of each parameter of optimizer ``index`` that is the copy of a tied weight
        whose first copy another stage holds (`OptimCreate.copies`)."""
        named = self._named_parameters()
        return {id(named[n]) for n in self._optim_copies.get(index, ()) if n in named}

    def _allreduce(self, opt: torch.optim.Optimizer | None) -> int:
        """Sum the gradients of ``opt``'s parameters over this stage's replicas, then those of tied
        weights over the stages holding copies of them; returns the bytes reduced with the replicas.
        Every member runs its groups in the order the driver formed them, so no two wait on each other.
        A stage in no group (it holds no copy of a tied weight, and has no replicas) has nothing to sum."""
        params = [p for g in opt.param_groups for p in g["params"]] if opt else []
        reduced = self.group.allreduce_grads(params) if self.group is not None else 0
        mine = {id(p) for p in params}
        named = self._named_parameters()
        for group, names in self.tie_groups:
            group.allreduce_grads([named[n] for n in names if id(named[n]) in mine])
        return reduced

    def get_optim_state(self, msg: GetOptimState) -> Any:
        index = msg.index
        opt = self.optimizers.get(index)
        if opt is None:
            return {"state": {}}
        by_param = {id(p): n for n, p in self._named_parameters().items()}
        copies = self._copies(index)
        return {
            "state": {
                by_param[id(p)]: dict(s) for p, s in opt.state.items() if id(p) in by_param and id(p) not in copies
            },
            "order": self._optim_params[index],
        }

    def load_optim_state(self, msg: LoadOptimState) -> Any:
        index, state = msg.index, msg.state
        opt = self.optimizers.get(index)
        if opt is None:
            if state:
                raise SpecError("optimizer state sent for parameters this worker does not optimise")
            return None
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
        self.tie_groups.clear()
        self._answers.clear()
        self.runtimes.clear()
        self.stages.clear()
        self.optimizers.clear()


def _check_code_versions(digests: Mapping[str, str]) -> None:
    """Refuse a stage whose classes this (long-lived) worker imported in another version than the
    driver has: Python keeps the first import, so an edited layer would silently run its old body."""
    for name, theirs in digests.items():
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
    return {k: v for k, v in defaults.items() if k in accepted}


def describe_device(device: torch.device) -> Mapping[str, Any]:
    """What the driver needs to plan stages: device name and free memory in bytes; for a GPU, its
    UUID too (two workers on one GPU cannot join one NCCL group)."""
    gpu: dict[str, Any] = {}
    free, total = device_memory(device)
    name = "cpu"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            gpu["device_uuid"] = str(uuid)
    return {"device": str(device), "device_name": name, **gpu, "free_memory": free, "total_memory": total}
