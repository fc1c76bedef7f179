"""The driver's session with its workers: plan and place SpecSequentials on them, mirror
optimizers, move weights back and forth, and bring everything back at the end. Connecting to the
workers, greeting them and closing the links is `lightning_remote_mp.driver.links`. No Lightning
here: the strategy is a thin layer on top.

>>> import torch
>>> from lightning_remote_mp.driver.launch import LocalWorkers
>>> from lightning_remote_mp.model.spec import SpecSequential
>>> workers = LocalWorkers(2, threads=1)
>>> net = SpecSequential([("torch.nn.Linear", {"in_features": 4, "out_features": 4}, (1, 4))] * 2)
>>> expected = net(torch.ones(1, 4))
>>> session = DriverSession(workers.start())
>>> session.place("net", net)
>>> torch.allclose(net(torch.ones(1, 4)), expected)
True
>>> session.close(); workers.stop()
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_remote_mp.driver import ties
from lightning_remote_mp.driver.groups import Groups
from lightning_remote_mp.driver.links import WorkerLinks
from lightning_remote_mp.driver.memory_plan import PLAN_MARGIN, plan_traced
from lightning_remote_mp.driver.optim import Holder, OptimizerMirror
from lightning_remote_mp.driver.options import Topology, check_split_backward
from lightning_remote_mp.driver.pipeline import RemoteSpec, RemoteStage, check_checkpoint_mode
from lightning_remote_mp.driver.placement import (
    Placement,
    WeightSources,
    gathering,
    meta_stage_state,
    placed_bytes,
    send_unread,
    stage_weights,
)
from lightning_remote_mp.driver.preflight import checked_for_workers
from lightning_remote_mp.driver.progress import shown
from lightning_remote_mp.errors import LrmpError, SpecError, WorkerError, WorkerLostError
from lightning_remote_mp.flow import SplitBackward
from lightning_remote_mp.model import partition
from lightning_remote_mp.model.build import source_digest, user_code_modules
from lightning_remote_mp.model.meta import to_meta
from lightning_remote_mp.model.program_table import tabled
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.schedule import check_schedule
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.keys import KeyPair
from lightning_remote_mp.wire.requests import Profile, Setup
from lightning_remote_mp.wire.transport import (
    DEFAULT_CALL_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    Process,
    broadcast,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Trains:
    """How the strategy trains a module it places, as a memory plan counts it (`plan_traced`)."""

    microbatches: int = 1
    schedule: str = "gpipe"
    optimizer: str | None = None  # "adamw", "sgd"; None: not known (AdamW's state is counted)


Balance = Sequence[int] | str | None
#: A stage's tensors as `placement.stage_weights` gives them: those sent, and those its worker reads from files.
StageWeights = tuple[dict[str, torch.Tensor] | None, dict[str, list[str]]]


class DriverSession(WorkerLinks):
    """One training session with its workers (`WorkerLinks`: one row per pipeline, one worker per
    stage), and the modules placed on them.

    Args:
        hosts, heartbeat_timeout, connect_timeout, call_timeout, processes, keys, worker_keys,
            limits, listen: the links to the workers (`WorkerLinks`).
        store_host: the address workers reach this process at, for the rendezvous of replicas
            (default: this machine's address towards the first worker).
        allow_plaintext_allreduce: with ``keys``, let gradients be summed through torch.distributed,
            which CURVE does not cover (replicas, tied weights held by several stages).
    """

    def __init__(
        self,
        hosts: Topology | Sequence[str] | Sequence[Sequence[str]],
        *,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        processes: Mapping[str, Process] | None = None,
        store_host: str | None = None,
        keys: KeyPair | None = None,
        worker_keys: Mapping[str, bytes] | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
        allow_plaintext_allreduce: bool = False,
        listen: str | None = None,
    ) -> None:
        super().__init__(
            hosts,
            heartbeat_timeout=heartbeat_timeout,
            connect_timeout=connect_timeout,
            processes=processes,
            keys=keys,
            worker_keys=worker_keys,
            limits=limits,
            call_timeout=call_timeout,
            listen=listen,
        )
        # Drawn from this process's generator, so a run under seed_everything repeats bit for bit on
        # the workers too (dropout masks), while each stage and replica draws its own stream.
        with torch.random.fork_rng(devices=[]):  # the draw leaves the driver's stream (data order) as it was
            self.seed = int(torch.randint(0, 2**62, ()).item())
        # Where workers sum gradients: replicas, stages holding tied weights.
        self.groups = Groups(self, store_host, allow_plaintext_allreduce)
        self.placements: dict[str, Placement] = {}
        self.predicted_stage_seconds: dict[str, list[float]] = {}  # from balance="time"
        self.mirrors: list[OptimizerMirror] = []
        if self.topology.replicas > 1:
            try:
                self.groups.form_replica_groups()
            except BaseException:
                self.close()
                raise

    def grads_version(self) -> int:
        """How many backward passes ran through remote stages: gradients changed if this moved."""
        return sum(r.backwards for pl in self.placements.values() for r in (pl.remote, *pl.views))

    # --- placing stages --------------------------------------------------------------
    def plan(
        self,
        module: SpecSequential,
        balance: Balance = None,
        what: str = "SpecSequential",
        compute: Sequence[float] | None = None,
        training: bool = True,
        trains: Trains | None = None,
    ) -> list[partition.Stage]:
        """Cut ``module`` into one stage per worker (see the strategy's ``balance``); refuse a split
        whose stage cannot fit its worker's free memory (``training``: with gradients and optimizer
        state). ``compute``: each layer's estimated cost (from `preflight`), computed here when not given.
        A traced causal LM trained with ``balance="memory"`` is cut by its memory plan (`plan_traced`,
        ``trains`` saying how), which is logged."""
        n_layers, n_stages = len(module.layers), self.topology.stages
        if n_layers < n_stages:
            raise SpecError(f"{what} has {n_layers} layers but there are {n_stages} workers; each stage needs a layer")
        free = self.stage_free_memory()
        if training and trains is not None and balance in (None, "memory"):
            counts = self._by_plan(module, what, free, trains)
            if counts is not None:
                return partition.plan_stages(counts, module.wiring)
        layer_bytes = [partition.estimate_layer_bytes(e, m, training) for e, m in zip(module.entries, module.layers)]
        if balance is None or balance == "memory":
            compute = list(compute) if compute is not None else checked_for_workers(module, what)
            budgets = [f if f > 0 else math.inf for f in free]
            try:
                counts = partition.split_min_max([compute] * n_stages, memory=(layer_bytes, budgets))
            except SpecError:
                counts = partition.split_contiguous(layer_bytes, [f or 1.0 for f in free])
            log.info(
                "%s: balance='memory' keeps every stage within its worker's free memory and, among such "
                "splits, evens out the estimated compute: %s GFLOP per forward at the example shapes",
                what,
                ", ".join(f"{t / 1e9:.3g}" for t in partition.stage_loads(counts, [compute] * n_stages)),
            )
        elif balance == "time":
            entries = [e.to_wire() for e in module.entries]
            replies = broadcast(self.grid[0], protocol.PROFILE, Profile(entries).body(), bounded=False)
            times = [r["seconds"] for r in replies]
            counts = partition.split_min_max(times)
            predicted = partition.stage_loads(counts, times)
            log.info(
                "%s: balance='time' predicts stage times (forward+backward at the example shapes) of %s ms",
                what,
                ", ".join(f"{1e3 * t:.2f}" for t in predicted),
            )
            self.predicted_stage_seconds[what] = predicted
        elif balance == "parameters":
            costs = [sum(p.numel() for p in m.parameters()) for m in module.layers]
            counts = partition.split_contiguous(costs, [1.0] * n_stages)
        elif isinstance(balance, str):
            raise SpecError(
                f"{what}: unknown balance {balance!r}; use a list of layer counts, 'memory', 'parameters' or 'time'"
            )
        else:
            counts = partition.check_balance(balance, n_layers, n_stages, what)
        self._check_memory(what, counts, layer_bytes, free, training)
        return partition.plan_stages(counts, module.wiring)

    def _by_plan(self, module: SpecSequential, what: str, free: Sequence[float], trains: Trains) -> list[int] | None:
        """The units per stage of a traced causal LM's memory plan, which is logged; refuse a plan
        whose stage needs more than its worker's free memory beyond the plan's measured error
        (`PLAN_MARGIN`), warn within it. ``None``: no plan for this module."""
        planned = plan_traced(
            module,
            microbatches=trains.microbatches,
            schedule=trains.schedule,
            optimizer=trains.optimizer,
            free=[int(f) or None for f in free],
        )
        if planned is None:
            return None
        plan, counts = planned
        log.info("%s: balance='memory' cuts it by its memory plan: %s\n%s", what, plan.describe(), plan.table())
        over = [s for s in plan.stages if s.free and s.needs > s.free]
        if any(s.needs > PLAN_MARGIN * s.free for s in over):  # type: ignore[operator]
            raise SpecError(f"{what} does not fit its workers' memory by its plan:\n{plan.report()}")
        if over:
            log.warning(
                "%s: by its memory plan, stage %s may not fit its worker's free memory (the plan is within "
                "about 20%% of what workers measure):\n%s",
                what,
                ", ".join(str(s.index) for s in over),
                "\n".join(f"- {line}" for line in plan.advice()),
            )
        return counts

    def _free_of(self, address: str) -> float:
        return float(self.workers[self.addresses.index(address)].get("free_memory") or 0.0)

    def stage_free_memory(self) -> list[float]:
        """Free device memory (bytes) each stage may use: the least among its replicas' workers
        (0 where a worker does not say)."""
        return [min(self._free_of(row[s].address) for row in self.grid) for s in range(self.topology.stages)]

    def _check_memory(
        self, what: str, counts: Sequence[int], layer_bytes: Sequence[int], free: Sequence[float], training: bool
    ) -> None:
        start = 0
        for s, n in enumerate(counts):
            need = sum(layer_bytes[start : start + n])
            if free[s] and need > free[s]:
                tightest = min((row[s] for row in self.grid), key=lambda c: self._free_of(c.address))
                needs = (
                    "to train (weights, gradients, two optimizer moments and activations at the example shapes)"
                    if training
                    else "for its weights"
                )
                raise SpecError(
                    f"{what}, stage {s} (layers {start}-{start + n - 1}) needs about {_gib(need)} {needs}, but "
                    f"{tightest.where()} has {_gib(free[s])} free. Add workers (more stages), give this "
                    "stage fewer layers (balance=[...]), or use workers with more device memory; building the "
                    "model on the meta device saves the driver's memory, not the workers'."
                )
            start += n

    def place(
        self,
        key: str,
        module: SpecSequential,
        balance: Balance = None,
        microbatches: int = 1,
        split_backward: SplitBackward = "auto",
        training: bool = True,
        checkpoint: str = "never",
        checked: Sequence[float] | None = None,
        deferred_batch_norm: bool = False,
        compression: str | None = None,
        schedule: str = "gpipe",
        sources: WeightSources | None = None,
        borrows: str | None = None,
        optimizer: str | None = None,
    ) -> None:
        """Ship ``module``'s layers to the workers and make its forward run there, each batch split
        into ``microbatches`` flowing through the stages. ``split_backward``: defer linear layers'
        weight gradients (`worker.deferred_grads`). ``training``: the stages must fit their workers
        with gradients and optimizer state. ``checkpoint``: `pipeline.CHECKPOINT_MODES`. ``checked``:
        what `preflight` found, if run already. ``deferred_batch_norm``: `worker.deferred_bn`.
        ``compression``: `wire.compression.COMPRESSIONS`. ``schedule``: `lightning_remote_mp.schedule`.
        ``sources``: safetensors files the workers read tensors from (`WeightSources`); the driver
        sends only the rest. ``borrows``: a placed module's key whose units and tensors ``module``'s
        are (another call signature of a traced module; kept in that placement's ``views``).
        ``optimizer``: ``"adamw"`` or ``"sgd"``, the state a memory plan counts (`Trains`)."""
        check_split_backward(split_backward)
        check_schedule(schedule)
        if key in self.placements:
            raise LrmpError(f"{module.kind} {key!r} is already placed")
        lender = self.placements[borrows] if borrows is not None else None
        check_checkpoint_mode(checkpoint)
        what = f"{module.kind} {key!r}"
        if checked is None:
            checked = checked_for_workers(module, what)
        trains = Trains(microbatches, schedule, optimizer)
        stages = self._cut(module, what, lender, balance, checked, training, trains)
        if lender is None:
            _refuse_dropping_training(module, what, sources)
        log.info(
            "%s placed:\n%s",
            what,
            partition.describe(stages, module.entries, module.layers, list(self.topology.rows[0])),
        )
        # A view's stages hold its lender's tensors, shared and tied as they are there.
        shared, tied = ties.plan(module.shared() if lender is None else [], stages, trains=ties.trainable(module))
        self.groups.check_plaintext(what, tied)
        weights = _weights_by_stage(module, stages, what, borrowed=lender is not None, sources=sources)
        self._set_up(
            key,
            module,
            what,
            stages,
            weights,
            shared,
            borrows=borrows,
            split_backward=split_backward,
            deferred_batch_norm=deferred_batch_norm,
            compression=compression,
        )
        if tied:
            self.groups.form_tie_groups(key, tied)
        remote = RemoteSpec(
            key,
            [[RemoteStage(key, s, row[s.index]) for s in stages] for row in self.grid],
            microbatches,
            modes=module.modes,
            checkpoint=checkpoint,
            batched=module.batched,
            keep=module.kept_outputs(),
            compression=compression,
            schedule=schedule,
            loss=(module.loss_output(), module.loss_count_output()),
        )
        self._attach(key, module, remote, lender, tied=bool(tied))
        if lender is None and sources is not None and sources.pretrained is not None:
            self.placements[key].base = sources.pretrained.root  # where a QLoRA checkpoint finds its base

    def _cut(
        self,
        module: SpecSequential,
        what: str,
        lender: Placement | None,
        balance: Balance,
        checked: Sequence[float],
        training: bool,
        trains: Trains | None = None,
    ) -> list[partition.Stage]:
        """``module``'s stages: planned (`plan`), or a view's, its lender's cut (each stage holds the
        same units, so the same tensors); each within what its workers accept (``--max-layers``)."""
        if lender is None:
            stages = self.plan(module, balance, what, compute=checked, training=training, trains=trains)
        else:
            stages = partition.plan_stages([len(rs.stage.layer_indices) for rs in lender.remote.stages], module.wiring)
        for stage, conn in ((stage, row[stage.index]) for row in self.grid for stage in stages):
            cap = (conn.remote_limits or protocol.DEFAULT_LIMITS).max_layers
            if len(stage.layer_indices) > cap:
                raise SpecError(
                    f"{what}, stage {stage.index}: {len(stage.layer_indices)} layers, but {conn.where()} accepts "
                    f"at most {cap} per stage; start it with a larger --max-layers or balance differently"
                )
        return stages

    def _set_up(
        self,
        key: str,
        module: SpecSequential,
        what: str,
        stages: Sequence[partition.Stage],
        weights: Mapping[int, StageWeights],
        shared: Mapping[int, list[list[str]]],
        **options: Any,
    ) -> None:
        """Send every worker its stage (SETUP, `_setup`), then read their replies, sending each the
        tensors it could not read from the files (`placement.send_unread`)."""
        digests = {name: source_digest(name) for name in user_code_modules(module.entries)}
        code_digests = {n: d for n, d in digests.items() if d is not None}
        placed = [(r, stage) for r in range(len(self.grid)) for stage in stages]
        ids = []
        for r, stage in placed:
            setup = self._setup(
                key, module, r, stage, len(stages), weights[stage.index], shared[stage.index], code_digests, **options
            )
            try:
                ids.append(self.grid[r][stage.index].send(protocol.SETUP, setup.body()))
            except protocol.LimitExceeded:
                raise
            except protocol.ProtocolError as err:
                raise SpecError(
                    f"{what}, stage {stage.index}: a layer's kwargs cannot be sent to a worker: {err}"
                ) from None
        conns = [self.grid[r][stage.index] for r, stage in placed]
        with shown(self.heartbeat, conns, f"{what}: reading weights"):
            for conn, (_, stage), i in zip(conns, placed, ids):
                send_unread(conn, key, conn.recv(i, what="setup", bounded=False), weights[stage.index][1], what)

    def _setup(
        self,
        key: str,
        module: SpecSequential,
        replica: int,
        stage: partition.Stage,
        stages: int,
        weights: StageWeights,
        shared: list[list[str]],
        code_digests: dict[str, str],
        *,
        borrows: str | None,
        split_backward: SplitBackward,
        deferred_batch_norm: bool,
        compression: str | None,
    ) -> Setup:
        """The SETUP of ``stage``, one of ``stages``, for its worker in row ``replica`` of the grid."""
        row = self.grid[replica]
        conn = row[stage.index]
        peers = [k for k, _ in (*stage.sources, *stage.targets) if k != partition.DRIVER]
        entries, programs = tabled([module.entries[i].to_wire() for i in stage.layer_indices])
        return Setup(
            key=key,
            stage=stage.index,
            stages=stages,
            start=stage.start,
            entries=entries,
            programs=programs or None,
            exports=stage.exports,
            sources=stage.sources,
            targets=stage.targets,
            peers={k: self.peer_address(row[k], conn) for k in peers},
            # With CURVE, the keys of those peers: this worker checks them when it connects to one,
            # and lets them connect to it for this session's forward and backward messages.
            peer_keys={
                k: self.worker_keys[row[k].address].decode("ascii") for k in peers if self.worker_keys is not None
            },
            state=weights[0],
            files=weights[1],
            init_seed=module.init_seed,
            split_backward=split_backward,
            code_digests=code_digests,
            # A view leaves the worker's random stream where it is: reseeding would replay it.
            seed=None
            if borrows is not None
            else (self.seed + 1_000_003 * (replica * self.topology.stages + stage.index)) % 2**62,
            frozen=[
                f"{i}.{name}"
                for i in stage.layer_indices
                for name, p in module.layers[i].named_parameters()
                if not p.requires_grad
            ],
            shared=shared,
            deferred_batch_norm=deferred_batch_norm,
            compression=compression,
            borrows=borrows,
        )

    def _attach(
        self, key: str, module: SpecSequential, remote: RemoteSpec, lender: Placement | None, tied: bool
    ) -> None:
        """From now on ``module``'s forward runs through ``remote``, kept as a placement of its own
        or as a view of its lender's. A loss's gradient is deferred (`RemoteSpec.loss_grads`) only
        for the one module placed on these workers, and only without tied weights."""
        remote.loss_grads.enabled = remote.loss_grads.enabled and not tied and not self.placements
        for other in self.placements.values():
            other.remote.loss_grads.enabled = False
        module.attach(remote)
        if lender is None:
            self.placements[key] = Placement(key, module, remote)
        else:
            lender.views.append(remote)

    def placed_stages(self, key: str) -> list[list[RemoteStage]]:
        """The stages of the module placed as ``key``: one row per replica, in stage order; each
        `RemoteStage` holds its `partition.Stage` (index, layers) and its worker's `Connection`."""
        placement = self.placements.get(key)
        if placement is None:
            raise LrmpError(f"nothing is placed as {key!r}; placed: {sorted(self.placements)}")
        return [list(row) for row in placement.remote.replicas]

    def remote_parameters(self) -> dict[int, list[Holder]]:
        """For every placed parameter (by ``id``): where its copies live, one `Holder` per stage that
        holds it (several for a tied weight), in stage order; the first holds the first copy."""
        out: dict[int, dict[int, Holder]] = {}
        for key, pl in self.placements.items():
            for column in zip(*pl.remote.replicas):
                s = column[0].stage.index
                for i in column[0].stage.layer_indices:
                    for name, p in pl.module.layers[i].named_parameters():
                        # A tensor several of the stage's layers hold is one there, named after the first.
                        out.setdefault(id(p), {}).setdefault(s, Holder([rs.conn for rs in column], f"{key}/{i}.{name}"))
        return {k: [held[s] for s in sorted(held)] for k, held in out.items()}

    def mirror_optimizer(self, index: int, optimizer: torch.optim.Optimizer) -> OptimizerMirror | None:
        """Mirror ``optimizer`` on the workers holding its parameters (once; later calls return the mirror,
        extended to parameters placed since)."""
        remote = self.remote_parameters()
        for mirror in self.mirrors:
            if mirror.optimizer is optimizer:
                mirror.extend(remote)  # parameters placed since (a traced module's, at its first call)
                return mirror
        if not any(id(p) in remote for g in optimizer.param_groups for p in g["params"]):
            return None
        mirror = OptimizerMirror(optimizer, index, remote, grads_version=self.grads_version)
        self.mirrors.append(mirror)
        return mirror

    def placed_bytes(self) -> int:  # every placed weight and buffer, one copy of each
        return placed_bytes(self.placements.values())

    def gathering(self, gather: bool) -> contextlib.AbstractContextManager[None]:
        """While inside, ``state_dict()`` of the placed modules and their optimizers brings the
        workers' tensors here (``True``) or leaves them out (``False``: a sharded checkpoint)."""
        return gathering([*self.placements.values(), *self.mirrors], gather)

    # --- ending --------------------------------------------------------------------------
    def restore(self, gather_limit: int | None = None, trained: bool = True) -> list[torch.nn.Module]:
        """Bring weights and optimizer state back into the local objects and stop delegating. Past
        ``gather_limit`` bytes placed nothing comes back, and modules the run ``trained`` go to the meta
        device (their trained weights are in the checkpoints). Returns the modules whose trained
        weights are not here (those, and trained tensors that were on the meta device)."""
        failures: list[WorkerError | WorkerLostError] = []
        lost = {c.lost_reason for c in self.conns if c.lost_reason}  # the run raises these: named once, there
        gather = gather_limit is None or self.placed_bytes() <= gather_limit
        # A posted request that failed (the last optimizer step, say) is raised at the end, once
        # everything that can come back has.
        late: WorkerError | None = None
        for conn in self.conns:
            while not conn.closed and conn.lost_reason is None:
                try:
                    conn.settle()
                    break
                except WorkerLostError as err:
                    failures.append(err)
                except WorkerError as err:  # one failed reply read; go on with the rest
                    late = late or err
        for mirror in self.mirrors:
            try:
                mirror.detach(restore_state=gather)
            except (WorkerError, WorkerLostError) as err:
                mirror.detach(restore_state=False)
                failures.append(err)
        self.mirrors.clear()
        left: list[torch.nn.Module] = []
        for key, pl in list(self.placements.items()):
            try:
                for remote in (pl.remote, *pl.views):
                    remote.materialize()  # outputs the last stages kept that something here may still read
                tensors = [t for layer in pl.module.layers for t in layer.state_dict(keep_vars=True).values()]
                if gather and not all(t.is_meta for t in tensors):
                    pl.pull()
                stale = trained and (not gather or any(t.is_meta and t.requires_grad for t in tensors))
                if stale:
                    log.info("%s %r: its trained weights stay in the workers' checkpoints", pl.module.kind, key)
                    left.append(pl.module.state_owner)
                    if not gather:
                        to_meta(pl.module.state_owner)  # no stale weights here: a later run loads the trained ones
            except (WorkerError, WorkerLostError) as err:
                failures.append(err)
            pl.detach()
        self.placements.clear()
        if failures:
            log.warning(
                "could not bring everything back; those layers here keep the weights of their last sync:\n  %s",
                "\n  ".join(dict.fromkeys(f"{f.where} is lost" if str(f) in lost else str(f) for f in failures)),
            )
        if late is not None:
            raise late
        return left

    def close(self) -> None:
        super().close()
        self.groups.store = None


def _refuse_dropping_training(module: SpecSequential, what: str, sources: WeightSources | None) -> None:
    """Refuse to place a module on the meta device whose only trained weights an earlier run's
    workers held, with nothing to load them from: starting again from its seed would drop them."""
    if module.is_meta and not module.pending_state and not sources and module.weights_left_on_workers:
        raise SpecError(
            f"{what} lives on the meta device and was trained by an earlier run whose workers held its only "
            "weights; starting again from its seed would silently drop that training. Pass ckpt_path= "
            "(or load a state dict into the module) to continue from a checkpoint."
        )


def _weights_by_stage(
    module: SpecSequential, stages: Sequence[partition.Stage], what: str, borrowed: bool, sources: WeightSources | None
) -> dict[int, StageWeights]:
    """Each stage's tensors: those the driver sends and those its worker reads from ``sources``'
    files (`placement.stage_weights`); none for a view (``borrowed``: they are its lender's); for a
    seeded spec on the meta device, the state loaded into it, or nothing (its seed)."""
    weights: dict[int, StageWeights] = {}
    meta = module.is_meta
    for stage in stages:
        if borrowed:
            weights[stage.index] = (None, {})
        elif sources or module.init_seed is None or not meta:
            where = f"{what}, stage {stage.index}"
            weights[stage.index] = stage_weights(module, stage, sources or WeightSources(), where)
        else:  # a seeded spec on the meta device: the state loaded, or its seed
            weights[stage.index] = (meta_stage_state(module, stage), {})
    if sources:
        read, sent = (sum(len(w[k] or {}) for w in weights.values()) for k in (1, 0))
        log.info("%s: the workers read %d tensors from %s; this driver sends %d", what, read, sources.roots(), sent)
    return weights


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
