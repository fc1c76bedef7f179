"""The driver's session with its workers: connect, place SpecSequentials, mirror optimizers,
move weights back and forth, and close. No Lightning here: the strategy is a thin layer on top.

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
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_remote_mp._version import __version__
from lightning_remote_mp.driver import ties
from lightning_remote_mp.driver.groups import Groups
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
from lightning_remote_mp.errors import (
    ConfigurationError,
    LrmpError,
    ProtocolVersionError,
    SpecError,
    WorkerError,
    WorkerLostError,
)
from lightning_remote_mp.flow import SplitBackward
from lightning_remote_mp.model import partition
from lightning_remote_mp.model.build import source_digest, user_code_modules
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.schedule import check_schedule
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.addresses import dial_name, normalize_address, relay_address, resolved, route_dialin
from lightning_remote_mp.wire.heartbeat import Heartbeat
from lightning_remote_mp.wire.keys import KeyPair
from lightning_remote_mp.wire.requests import Hello, Profile, Setup
from lightning_remote_mp.wire.switchboard import Switchboard
from lightning_remote_mp.wire.transport import (
    DEFAULT_CALL_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    Connection,
    Curve,
    broadcast,
)

log = logging.getLogger(__name__)

Balance = Sequence[int] | str | None


class DriverSession:
    """One training session with its workers: one row per pipeline, one worker per stage.

    Its `topology` (`lightning_remote_mp.driver.options.Topology`) says how many replicas and stages
    there are and where each worker is; ``grid`` holds the connections in the same rows.

    Args:
        hosts: the workers as a `Topology` (the strategy's, normalised once), or their addresses,
            one per stage in pipeline order; or, for data parallel training, a list of such rows
            (replicas of the same stage layout), e.g. ``[["a:1", "b:1"], ["c:1", "d:1"]]``.
        heartbeat_timeout: seconds of silence after which a worker is declared lost.
        connect_timeout: seconds to wait for each worker's first answer.
        call_timeout: seconds one call may go on without progress while its worker still answers
            heartbeats (a layer that never returns, a deadlock) before it fails with WorkerLostError;
            in a pipeline, per micro-batch (a call's results come together). ``None`` waits forever.
        processes: the worker processes this driver started, by address: one whose process ended is lost at once.
        store_host: the address workers reach this process at, for the rendezvous of replicas
            (default: this machine's address towards the first worker).
        keys: this driver's CURVE key pair; with it every connection is encrypted and authenticated.
        worker_keys: with ``keys``, each worker's public key (Z85) by address (as in ``hosts``).
        limits: bounds on what this driver accepts from the workers.
        allow_plaintext_allreduce: with ``keys``, let gradients be summed through torch.distributed,
            which CURVE does not cover (replicas, tied weights held by several stages).
        listen: where workers that dial in (``dial://NAME`` in ``hosts``) reach this driver,
            ``tcp://host:port`` (`lightning_remote_mp.wire.switchboard`).
    """

    def __init__(
        self,
        hosts: Topology | Sequence[str] | Sequence[Sequence[str]],
        *,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        processes: Mapping[str, subprocess.Popen] | None = None,
        store_host: str | None = None,
        keys: KeyPair | None = None,
        worker_keys: Mapping[str, bytes] | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
        allow_plaintext_allreduce: bool = False,
        listen: str | None = None,
    ) -> None:
        self.topology = Topology.of(hosts)
        rows, addresses = self.topology.rows, self.topology.addresses
        if (keys is None) != (worker_keys is None):
            raise ConfigurationError("CURVE needs both the driver's key pair and the workers' public keys")
        if worker_keys is not None:
            worker_keys = {normalize_address(a): k for a, k in worker_keys.items()}
            missing = [a for a in addresses if a not in worker_keys]
            if missing:
                raise ConfigurationError(f"no public key given for the workers at {missing}; give one per worker")
        self.keys = keys
        self.worker_keys = worker_keys
        # A dial-in worker's own link is encrypted; this process reaches it in-process.
        curves = {a: Curve(keys, worker_keys[a]) for a in addresses if not dial_name(a)} if keys and worker_keys else {}
        self.heartbeat_timeout = heartbeat_timeout
        self.connect_timeout = connect_timeout
        self.allow_plaintext_allreduce = allow_plaintext_allreduce
        self.id = uuid.uuid4().hex
        # Drawn from this process's generator, so a run under seed_everything repeats bit for bit on
        # the workers too (dropout masks), while each stage and replica draws its own stream.
        with torch.random.fork_rng(devices=[]):  # the draw leaves the driver's stream (data order) as it was
            self.seed = int(torch.randint(0, 2**62, ()).item())
        replicated = len(rows) > 1
        self.switchboard = self._listen(listen, limits) if any(map(dial_name, addresses)) else None
        self.grid: list[list[Connection]] = []
        try:
            for r, row in enumerate(rows):
                self.grid.append([])
                for s, a in enumerate(row):
                    self.grid[-1].append(
                        Connection(
                            a,
                            stage=s,
                            replica=r if replicated else None,
                            heartbeat_timeout=heartbeat_timeout,
                            process=(processes or {}).get(a),
                            curve=curves.get(a),
                            limits=limits,
                            call_timeout=call_timeout,
                        )
                    )
        except BaseException:
            for c in (c for row in self.grid for c in row):
                c.close()
            self._close_switchboard()
            raise
        self.conns = [c for row in self.grid for c in row]
        seal_keys: dict[str, bytes] = {}
        for c in self.conns:
            c.session = self.id
            c.seal_key = seal_keys.setdefault(c.address, c.seal_key)  # one per worker, however many stages
            c.session_conns = self.conns  # a failed sum of gradients may be another worker's loss
        self.store_host = store_host
        self.groups = Groups(self)  # where workers sum gradients: replicas, stages holding tied weights
        self.heartbeat: Heartbeat | None = None
        self.placements: dict[str, Placement] = {}
        self.predicted_stage_seconds: dict[str, list[float]] = {}  # from balance="time"
        self.mirrors: list[OptimizerMirror] = []
        try:
            # Pinging from the start keeps the sessions of the workers that answer alive while a late one is awaited.
            self.heartbeat = Heartbeat(self.addresses, self.id, min(1.0, heartbeat_timeout / 4), curves or None)
            self.workers = self._hello(connect_timeout)
            for c in self.conns:
                c.heartbeat = self.heartbeat
            if replicated:
                self.groups.form_replica_groups()
        except BaseException:
            self.close()
            raise

    def _listen(self, listen: str | None, limits: protocol.Limits) -> Switchboard:
        """Wait for the workers that dial in, on a switchboard listening at ``listen``."""
        names = list(self.dial_names.values())
        if listen is None:
            raise ConfigurationError(
                f"hosts names workers that dial in ({', '.join(names)}), but there is no listen= address for them "
                "to dial: give the strategy listen='tcp://0.0.0.0:PORT'"
            )
        if self.topology.replicas > 1:
            raise ConfigurationError(
                f"hosts has {self.topology.replicas} rows (replicas) and workers that dial in ({', '.join(names)}): "
                "replicas sum their gradients through torch.distributed, whose workers must accept connections from "
                "each other, which a worker that dials in cannot. Train one pipeline with them, or start those "
                "workers with --bind where they can accept connections"
            )
        worker_keys = None
        if self.keys is not None and self.worker_keys is not None:
            worker_keys = {n: self.worker_keys[a] for a, n in self.dial_names.items()}
        switchboard = Switchboard(listen, keys=self.keys, worker_keys=worker_keys, limits=limits)
        route_dialin(names, switchboard.local_endpoint)
        try:
            switchboard.wait_for(names, self.connect_timeout)
        except BaseException:
            route_dialin(names, None)
            switchboard.close()
            raise
        return switchboard

    def _close_switchboard(self) -> None:
        if self.switchboard is not None:
            route_dialin(list(self.dial_names.values()), None)
            self.switchboard.close()
            self.switchboard = None

    def peer_address(self, target: Connection, sender: Connection) -> str:
        """Where the worker of ``sender`` reaches the worker of ``target``: at the IP this driver
        reaches it at (it need not resolve the names this host knows), or, for a worker that
        dialed in, through this driver's switchboard: via the driver a dial-in sender dialed itself,
        via this machine's address towards any other."""
        name = dial_name(target.address)
        if name is None:
            return resolved(target.address)
        assert self.switchboard is not None
        via = "" if dial_name(sender.address) else self.switchboard.via_toward(resolved(sender.address))
        return relay_address(name, via, self.keys.public if self.keys is not None else None)

    def grads_version(self) -> int:
        """How many backward passes ran through remote stages: gradients changed if this moved."""
        return sum(r.backwards for pl in self.placements.values() for r in (pl.remote, *pl.views))

    @property
    def addresses(self) -> list[str]:
        """Every worker's address, row by row (as `conns`)."""
        return self.topology.addresses

    @property
    def dial_names(self) -> dict[str, str]:
        """The workers that dial in: their name, by address (``dial:NAME``)."""
        return {a: n for a in self.addresses if (n := dial_name(a))}

    def _hello(self, timeout: float) -> list[dict[str, Any]]:
        driver = f"{socket.gethostname()} pid {os.getpid()}"
        hello = Hello(
            driver,
            protocol.PROTOCOL_VERSION,
            __version__,
            torch.__version__,
            float(self.heartbeat_timeout),
            limits=self.conns[0].limits if self.conns else protocol.DEFAULT_LIMITS,
        )
        deadline = time.monotonic() + timeout
        bodies = {id(c): dataclasses.replace(hello, seal_key=c.seal_key).body() for c in self.conns}
        pending = {id(c): (c, c.send(protocol.HELLO, bodies[id(c)])) for c in self.conns}
        replies: dict[int, dict[str, Any]] = {}
        while pending:
            waits = []
            for key, (c, i) in list(pending.items()):
                try:
                    replies[key] = c.recv(i, timeout=max(0.0, deadline - time.monotonic()), what="connect")
                    del pending[key]
                except WorkerError as err:
                    if err.remote_type == "ProtocolVersionError":
                        raise ProtocolVersionError(str(err)) from None
                    wait = _wait_for_silent_session(c, err, deadline)
                    if wait is None:
                        raise
                    waits.append(wait)
            if pending:  # held by sessions of a driver that is gone: ask again once they are dropped
                time.sleep(max(waits))
                pending = {key: (c, c.send(protocol.HELLO, bodies[key])) for key, (c, _) in pending.items()}
        infos = [replies[id(c)] for c in self.conns]
        for c, info in zip(self.conns, infos):
            if info.get("protocol") != protocol.PROTOCOL_VERSION:
                raise ProtocolVersionError(
                    protocol.version_mismatch(c.where(), info.get("protocol"), info.get("lrmp"), "this driver")
                )
            c.remote_limits = protocol.Limits.from_dict(info.get("limits"))
            if info.get("lrmp") != __version__ or info.get("torch") != torch.__version__:
                log.warning(
                    "%s runs lrmp %s / torch %s; this driver runs lrmp %s / torch %s",
                    c.where(),
                    info.get("lrmp"),
                    info.get("torch"),
                    __version__,
                    torch.__version__,
                )
            free, curve = info.get("free_memory", 0) / 2**30, ", CURVE: encrypted, keys checked" if c.curve else ""
            log.info("%s: %s, %.1f GiB free%s", c.where(), info.get("device_name"), free, curve)
        return infos

    # --- placing stages --------------------------------------------------------------
    def plan(
        self,
        module: SpecSequential,
        balance: Balance = None,
        what: str = "SpecSequential",
        compute: Sequence[float] | None = None,
        training: bool = True,
    ) -> list[partition.Stage]:
        """Cut ``module`` into one stage per worker (see the strategy's ``balance``); refuse a split
        whose stage cannot fit its worker's free memory (``training``: with gradients and optimizer
        state). ``compute``: each layer's estimated cost (from `preflight`), computed here when not given."""
        n_layers, n_stages = len(module.layers), self.topology.stages
        if n_layers < n_stages:
            raise SpecError(f"{what} has {n_layers} layers but there are {n_stages} workers; each stage needs a layer")
        layer_bytes = [partition.estimate_layer_bytes(e, m, training) for e, m in zip(module.entries, module.layers)]
        free = self.stage_free_memory()
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
    ) -> None:
        """Ship ``module``'s layers to the workers and make its forward run there, each batch split
        into ``microbatches`` flowing through the stages. ``split_backward``: defer linear layers'
        weight gradients (`worker.deferred_grads`). ``training``: the stages must fit their workers
        with gradients and optimizer state. ``checkpoint``: `pipeline.CHECKPOINT_MODES`. ``checked``:
        what `preflight` found, if run already. ``deferred_batch_norm``: `worker.deferred_bn`.
        ``compression``: `wire.protocol.COMPRESSIONS`. ``schedule``: `lightning_remote_mp.schedule`.
        ``sources``: safetensors files the workers read tensors from (`WeightSources`); the driver
        sends only the rest. ``borrows``: a placed module's key whose units and tensors ``module``'s
        are (another call signature of a traced module; kept in that placement's ``views``)."""
        check_split_backward(split_backward)
        check_schedule(schedule)
        if key in self.placements:
            raise LrmpError(f"{module.kind} {key!r} is already placed")
        lender = self.placements[borrows] if borrows is not None else None
        check_checkpoint_mode(checkpoint)
        what = f"{module.kind} {key!r}"
        if checked is None:
            checked = checked_for_workers(module, what)
        if lender is None:
            stages = self.plan(module, balance, what, compute=checked, training=training)
        else:  # the lender's cut: each stage holds the same units, so the same tensors
            stages = partition.plan_stages([len(rs.stage.layer_indices) for rs in lender.remote.stages], module.wiring)
        for stage, conn in ((stage, row[stage.index]) for row in self.grid for stage in stages):
            cap = (conn.remote_limits or protocol.DEFAULT_LIMITS).max_layers
            if len(stage.layer_indices) > cap:
                raise SpecError(
                    f"{what}, stage {stage.index}: {len(stage.layer_indices)} layers, but {conn.where()} accepts "
                    f"at most {cap} per stage; start it with a larger --max-layers or balance differently"
                )
        meta = module.is_meta
        if lender is None and meta and not module.pending_state and not sources and module.weights_left_on_workers:
            raise SpecError(
                f"{what} lives on the meta device and was trained by an earlier run whose workers held its only "
                "weights; starting again from its seed would silently drop that training. Pass ckpt_path= "
                "(or load a state dict into the module) to continue from a checkpoint."
            )
        log.info(
            "%s placed:\n%s",
            what,
            partition.describe(stages, module.entries, module.layers, list(self.topology.rows[0])),
        )
        digests = {name: source_digest(name) for name in user_code_modules(module.entries)}
        # A view's stages hold its lender's tensors, shared and tied as they are there.
        shared, tied = ties.plan(module.shared() if lender is None else [], stages, trains=ties.trainable(module))
        self.groups.check_plaintext(what, tied)
        weights: dict[int, tuple[dict[str, torch.Tensor] | None, dict[str, list[str]]]] = {}
        for stage in stages:
            if lender is not None:
                weights[stage.index] = (None, {})
            elif sources or module.init_seed is None or not meta:
                where = f"{what}, stage {stage.index}"
                weights[stage.index] = stage_weights(module, stage, sources or WeightSources(), where)
            else:  # a seeded spec on the meta device: the state loaded, or its seed
                weights[stage.index] = (meta_stage_state(module, stage), {})
        if sources:
            read, sent = (sum(len(w[k] or {}) for w in weights.values()) for k in (1, 0))
            log.info("%s: the workers read %d tensors from %s; this driver sends %d", what, read, sources.roots(), sent)
        ids = []
        for r, row, stage in ((r, row, stage) for r, row in enumerate(self.grid) for stage in stages):
            conn = row[stage.index]
            peers = [k for k, _ in (*stage.sources, *stage.targets) if k != partition.DRIVER]
            entries = [module.entries[i].to_wire() for i in stage.layer_indices]
            setup = Setup(
                key=key,
                stage=stage.index,
                start=stage.start,
                entries=entries,
                exports=stage.exports,
                sources=stage.sources,
                targets=stage.targets,
                peers={k: self.peer_address(row[k], conn) for k in peers},
                # With CURVE, the keys of those peers: this worker checks them when it connects to one,
                # and lets them connect to it for this session's forward and backward messages.
                peer_keys={
                    k: self.worker_keys[row[k].address].decode("ascii") for k in peers if self.worker_keys is not None
                },
                state=weights[stage.index][0],
                files=weights[stage.index][1],
                init_seed=module.init_seed,
                split_backward=split_backward,
                code_digests={n: d for n, d in digests.items() if d is not None},
                # A view leaves the worker's random stream where it is: reseeding would replay it.
                seed=None if lender else (self.seed + 1_000_003 * (r * self.topology.stages + stage.index)) % 2**62,
                frozen=[
                    f"{i}.{name}"
                    for i in stage.layer_indices
                    for name, p in module.layers[i].named_parameters()
                    if not p.requires_grad
                ],
                shared=shared[stage.index],
                deferred_batch_norm=deferred_batch_norm,
                compression=compression,
                stages=len(stages) if schedule != "gpipe" else None,
                borrows=borrows,
            )
            try:
                ids.append(conn.send(protocol.SETUP, setup.body()))
            except protocol.LimitExceeded:
                raise
            except protocol.ProtocolError as err:
                raise SpecError(
                    f"{what}, stage {stage.index}: a layer's kwargs cannot be sent to a worker: {err}"
                ) from None
        with shown(self.heartbeat, [row[s.index] for row in self.grid for s in stages], f"{what}: reading weights"):
            for (conn, stage), i in zip(((row[stage.index], stage) for row in self.grid for stage in stages), ids):
                send_unread(conn, key, conn.recv(i, what="setup", bounded=False), weights[stage.index][1], what)
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
                        pl.module.state_owner.to("meta")  # no stale weights here: a later run loads the trained ones
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
        for c in self.conns:
            # The session is over: nothing more to confirm, and nothing held may run now (a step
            # could overtake a backward that is still running there).
            c.before_send.clear()
            c.discard_carried(after=0)
        live = [c for c in self.conns if not c.closed and c.lost_reason is None]
        ids = []
        for c in live:
            with contextlib.suppress(Exception):
                ids.append((c, c.send(protocol.BYE)))
        for c, i in ids:
            try:
                c.recv(i, timeout=2.0, what="bye")
            except Exception as err:  # the session is over either way
                log.debug("%s: bye not acknowledged: %s", c.where(), err)
        if self.heartbeat is not None:
            self.heartbeat.close()
        for c in self.conns:
            c.close()
        self._close_switchboard()
        self.groups.store = None


#: A session whose driver has been silent this long (seconds) is taken for one whose driver is gone:
#: a live driver pings every second.
_SILENT_SESSION = 2.0
#: A worker that will drop its session within this many seconds saw its connection close.
_DROPPED_SOON = 3.5


def _wait_for_silent_session(conn: Connection, err: WorkerError, deadline: float) -> float | None:
    """Seconds to wait before asking a busy worker again, when its session's driver has gone silent
    and the worker will drop that session before ``deadline``; ``None`` to give up (a live session)."""
    if err.remote_type != "WorkerBusy":
        return None
    silent, expires = err.details.get("silent_for"), err.details.get("expires_in")
    if not isinstance(silent, (int, float)) or not isinstance(expires, (int, float)):
        return None
    # Silent for a while, or about to be dropped because its connection closed (a killed driver).
    if silent < _SILENT_SESSION and expires > _DROPPED_SOON:
        return None
    if time.monotonic() + expires > deadline:
        return None
    log.info(
        "%s still holds a session whose driver has been silent for %.1f s (gone?); it drops it within %.1f s: waiting",
        conn.where(),
        silent,
        expires,
    )
    return min(expires + 0.2, max(0.0, deadline - time.monotonic()))


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
