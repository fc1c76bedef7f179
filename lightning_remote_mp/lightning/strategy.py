"""RemoteModelParallelStrategy: Lightning's hooks, and nothing else.

>>> import lightning as L
>>> strategy = RemoteModelParallelStrategy(hosts=["10.0.0.5:5555", "tcp://10.0.0.6:5555"])
>>> strategy.hosts
['tcp://10.0.0.5:5555', 'tcp://10.0.0.6:5555']
>>> trainer = L.Trainer(strategy="remote_mp", logger=False, enable_progress_bar=False)  # registered name
>>> type(trainer.strategy).__name__
'RemoteModelParallelStrategy'
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO, CheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn

from lightning_remote_mp.driver import checkpoint as sharded
from lightning_remote_mp.driver.checkpoint import ShardedCheckpoint
from lightning_remote_mp.driver.options import (
    DEFAULT_GATHER_LIMIT,
    CurveOptions,
    LocalWorkerOptions,
    RecoveryOptions,
    Topology,
    balance_for,
    check_balance,
    check_count,
    check_curve,
    check_listen,
    check_optional_text,
    check_pretrained,
    check_replicas,
    check_split,
    check_split_backward,
    check_timeout,
)
from lightning_remote_mp.driver.pipeline import check_checkpoint_mode
from lightning_remote_mp.driver.placement import WeightSources, mark_placed, mark_trained_elsewhere
from lightning_remote_mp.driver.preflight import allow_modules_for, checked_for_workers, checked_traced
from lightning_remote_mp.driver.session import DriverSession
from lightning_remote_mp.driver.workers import Starting, Workers, load_keys
from lightning_remote_mp.errors import ConfigurationError, LrmpError, WeightsError
from lightning_remote_mp.flow import SplitBackward
from lightning_remote_mp.lightning import intercept
from lightning_remote_mp.lightning.checkpoint_io import FileCheckpointIO
from lightning_remote_mp.lightning.timeline import TimelineCallback
from lightning_remote_mp.logs import follow_lightning
from lightning_remote_mp.model.calls import TracedForward
from lightning_remote_mp.model.meta import fill_meta_buffers, kept_on_meta, on_meta, split_modules
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.model.trace import find_modules
from lightning_remote_mp.model.traced import TracedSequential
from lightning_remote_mp.schedule import check_schedule
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.compression import COMPRESSIONS
from lightning_remote_mp.wire.transport import DEFAULT_CALL_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT

if TYPE_CHECKING:  # imported when a run asks for recovery: it builds on Lightning's private _Launcher and _Stateful
    from lightning_remote_mp.lightning.recovery import FitRecovery

log = logging.getLogger(__name__)


def find_spec_modules(module: torch.nn.Module) -> dict[str, SpecSequential]:
    """Every outermost SpecSequential in ``module``, by its qualified name."""
    found: dict[str, SpecSequential] = {}
    for name, m in module.named_modules():
        if isinstance(m, SpecSequential) and not any(name.startswith(k + ".") for k in found):
            found[name or "<root>"] = m
    return found


class RemoteModelParallelStrategy(SingleDeviceStrategy):
    """Train the LightningModule's SpecSequential layers on remote ``lrmp-worker`` processes.

    Args:
        hosts: worker addresses (``"tcp://host:port"`` or ``"host:port"``), one stage per worker, in
            order. For data parallel training, a list of such rows, one per replica of the same stage
            layout: each batch is split across the replicas and each stage's replicas all-reduce their
            gradients (torch.distributed) before the optimizer steps. ``None`` starts local workers
            on loopback (see ``local_workers``) and stops them at teardown.
        balance: layers per stage (e.g. ``[5, 4]``); ``"memory"`` (the default) keeps every stage within
            its worker's free device memory and, among such splits, evens out the estimated compute
            (FLOPs from a dry run on the meta device); a traced HuggingFace causal LM is cut by its
            memory plan instead (``lrmp-plan``'s numbers, logged at its first call: docs/big_models.md);
            ``"parameters"`` evens out parameter counts;
            ``"time"`` times each layer (forward and backward at its example input shape) on every
            worker and minimises the slowest stage, logging the predicted stage times. With several
            SpecSequentials, a dict from their names to one of these. For a module traced with
            ``split``, also the names of the submodules where stages 1, 2, ... start.
        microbatches: split each batch into this many micro-batches that flow through the stages
            concurrently (GPipe); results equal unsplit training unless layers couple the samples
            of a batch (BatchNorm in training mode sees micro-batch statistics).
        split_backward: workers send each micro-batch's input gradient on before computing the
            weight gradients of its linear layers (``F.linear``: ``nn.Linear``, ``WrappedLinear``),
            which they compute once per batch after the last micro-batch, while the earlier stages
            still work (the B/W split of zero-bubble schedules). Same gradients, less idle time and
            less micro-batching overhead, for some Python per linear call. ``"auto"`` (the default)
            defers only the calls whose weight-gradient product is large enough to repay that (on a
            CPU worker, at least 2 M multiply-adds: a micro-batch's rows x in x out; on a GPU, every
            call, as ``True``); ``True`` every call; ``False`` none: plain autograd on the workers.
        checkpoint: activation recomputation on the workers, as torchgpipe names it: ``"never"``
            (keep every micro-batch's activations until its backward); ``"always"`` (keep only each
            micro-batch's stage inputs and recompute the forward at backward: activation memory of one
            micro-batch per stage, for about a third more compute); ``"except_last"`` (all but the
            last micro-batch, whose backward comes first). Results are the same.
        schedule: the order in which each stage runs its micro-batches' forwards (F), input
            gradients (B) and weight gradients (W) (`lightning_remote_mp.schedule`, docs/pipelining.md):
            ``"gpipe"`` (every forward, then every backward: every micro-batch's activations stay
            alive until its backward), ``"1f1b"`` (one forward, one backward: stage ``i`` holds at most
            ``stages - i`` micro-batches' activations) or ``"zero_bubble"`` (1F1B with weight gradients
            held back to fill the drain's idle time). 1F1B and zero-bubble start each micro-batch's
            backward on the last stage as soon as its forward is done, so they need the loss inside the
            model (``labels=``, for a traced module); a call without one runs as ``"gpipe"``. The
            results are the same.
        deferred_batch_norm: with micro-batches, batch norms in training mode normalise each
            micro-batch by its own statistics, and without this also update their running statistics
            (and ``num_batches_tracked``) once per micro-batch, from that micro-batch alone. With it, as
            torchgpipe's ``DeferredBatchNorm`` does, the workers update them once per mini-batch from the
            whole mini-batch's statistics and count one batch: the running statistics local training of
            the same batches would keep. For spec layers and traced models alike.
        compression: how activations and their gradients travel, between stages and to and from the
            driver (the model's inputs and outputs, and their gradients): ``None`` as they are;
            ``"bf16"`` as bfloat16 (half of float32's bytes); ``"int8"`` blockwise 8-bit with a float32
            scale per block of 64 values (17/64 of float32's bytes, as hivemind and SWARM send). Only
            floating tensors of at least 64 elements; lossy, so training no longer equals local training
            exactly (docs/multi_machine.md measures what each does to a loss curve). For slow links.
        replicas: how many pipelines the local workers form (``local_workers.count / replicas``
            stages each). With ``hosts``, its rows are the replicas: leave it at 1 (or give their number).
        local_workers: the ``lrmp-worker`` processes started on this machine when ``hosts`` is
            ``None`` (`LocalWorkerOptions`: ``count``, ``devices``, ``threads``); default: two workers.
            Refused together with ``hosts``.
        timeline: write a per-stage timeline of training (Chrome trace JSON, open it in Perfetto) to
            this path, and log the pipeline's bubble fraction as ``lrmp/bubble_fraction``.
        heartbeat_timeout: seconds of silence after which a worker is declared lost (the run fails
            with an error naming it).
        connect_timeout: seconds to wait for each worker's first answer.
        call_timeout: seconds a worker may compute one request (in a pipeline: one micro-batch; a
            call's results come together, so a call of m micro-batches may take m times it) while it
            still answers heartbeats, before the run fails naming it: a layer that
            never returns, a deadlock. ``None`` waits as long as the worker lives.
        store_host: with replicas, the address workers reach this machine at for their rendezvous
            (default: this machine's address on the route to the first worker).
        listen: where workers that dial in reach this machine, e.g. ``"tcp://0.0.0.0:7000"``: for a
            GPU box behind NAT or a firewall that accepts no connections, start ``lrmp-worker
            --connect tcp://THIS_HOST:7000 --name gpu-a`` there and name it in ``hosts`` by its name
            (``hosts=["gpu-a", "gpu-b"]``, or ``"dial://gpu-a"``; addresses of workers that listen
            may be mixed in). Setup waits ``connect_timeout`` for them and names who is missing. All
            of a dial-in worker's traffic takes its one connection; what other workers send it goes
            through this machine (docs/multi_machine.md).
        curve: CURVE encryption and authentication of every connection, driver to worker and worker
            to worker (`CurveOptions`: ``secret_key``, the path of this driver's ``NAME.key_secret``
            from ``lrmp-worker keygen``; ``worker_public_keys``, with ``hosts`` the workers'
            ``NAME.key`` files, one per host in order or one for all; ``allow_plaintext_allreduce``,
            needed with several replicas, whose gradient all-reduce CURVE does not cover). Without
            ``hosts``, the local workers get fresh key pairs of their own. The key files are read at setup.
        max_message_bytes: the most tensor data this driver accepts in one message from a worker
            (and, for local workers, what they accept); default 16 GiB.
        split: names of the LightningModule's submodules (dotted paths allowed, e.g. ``["model"]``)
            to trace with ``torch.export`` at their first call and split across the workers,
            unchanged: any ``nn.Module`` whose forward torch.export can trace (see docs/tracing.md).
            Workers then need none of its code. ``balance`` cuts them at module boundaries as it
            cuts specs, or at given submodule names: ``{"model": ["transformer.h.6"]}`` starts
            stage 1 there. Default: none (every SpecSequential is split, as always).
        device: the driver's device for layers outside any SpecSequential (default: follows the accelerator).
        pretrained: where the split modules' pretrained weights are: a ``save_pretrained`` directory
            (``model.safetensors``, or shards with ``model.safetensors.index.json``) or a
            ``.safetensors`` file; a dict by split module name with several. Each worker reads its own
            stage's tensors from there, by name, instead of receiving them from the driver; tensors the
            files lack (a LoRA adapter, a new head) come from the driver's module. Every worker must see
            the files at that path (the same machine, a shared file system, or a copy). A split module
            built on the meta device needs it (a HuggingFace model's own ``name_or_path``, when it is a
            local directory, is the default then). See docs/big_models.md.
        state_dict_type: how checkpoints hold the workers' weights and optimizer state: ``"full"``
            (one file, gathered through the driver: loads anywhere, needs the whole model in the
            driver's memory), ``"sharded"`` (a directory: each worker writes its own stage as
            safetensors, in parallel, and the driver only Lightning's state; resumes onto any layout),
            or ``"auto"`` (the default): sharded when the placed weights exceed ``gather_limit``.
        gather_limit: the most bytes of placed weights the driver brings back from the workers: into a
            full checkpoint under ``state_dict_type="auto"``, and at the end of a run, when the module
            gets its trained weights back as after local training (default 1 GiB). A larger model's
            trained weights stay in the checkpoints; its split modules are left on the meta device, and
            a later ``validate``, ``test`` or ``predict`` needs ``ckpt_path=``.
        recovery: what ``fit`` does when it loses a worker: ``None`` (the default) fails the run
            naming the worker; ``True`` (or `RecoveryOptions`: spares, how long to wait for the
            worker to come back, bounds) places the lost stage again, restores every stage from the
            newest whole checkpoint and runs the steps since then again on the same batches
            (docs/recovery.md). It needs checkpoints: ``ModelCheckpoint(every_n_train_steps=N)``.

    Every argument is checked here, before any file is read or worker started; a mistake raises
    `ConfigurationError` (a ``ValueError``) naming the argument.
    """

    strategy_name = "remote_mp"

    def __init__(
        self,
        hosts: list[str] | list[list[str]] | None = None,
        *,
        balance: list[int] | list[str] | dict[str, list[int] | list[str] | str] | str | None = None,
        microbatches: int = 1,
        split_backward: SplitBackward = "auto",
        checkpoint: Literal["never", "except_last", "always"] = "never",
        schedule: Literal["gpipe", "1f1b", "zero_bubble"] = "gpipe",
        deferred_batch_norm: bool = False,
        compression: Literal["bf16", "int8"] | None = None,
        replicas: int = 1,
        local_workers: LocalWorkerOptions | dict[str, Any] | None = None,
        timeline: str | None = None,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
        store_host: str | None = None,
        listen: str | None = None,
        curve: CurveOptions | None = None,
        max_message_bytes: int | None = None,
        split: list[str] | None = None,
        device: str | None = None,
        pretrained: str | dict[str, str] | None = None,
        state_dict_type: Literal["auto", "full", "sharded"] = "auto",
        gather_limit: int = DEFAULT_GATHER_LIMIT,
        recovery: RecoveryOptions | dict[str, Any] | bool | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        # Every argument is checked before anything else happens: no file is read, no process started.
        self.topology = Topology.of(hosts, dial_in=listen is not None) if hosts is not None else None
        check_listen(listen, self.topology)
        if self.topology is not None and local_workers is not None:
            raise ConfigurationError(
                "local_workers is for the workers the strategy starts itself (hosts=None); with hosts, start "
                "lrmp-worker on each host and leave local_workers out"
            )
        if isinstance(local_workers, dict):  # from a YAML config: LocalWorkerOptions' fields
            local_workers = LocalWorkerOptions.of(local_workers)
        self.local_workers = (local_workers or LocalWorkerOptions()) if self.topology is None else None
        self.replicas = check_replicas(replicas, self.topology, self.local_workers)
        check_balance(balance, self.num_stages)
        check_count("microbatches", microbatches)
        check_split_backward(split_backward)
        if compression not in COMPRESSIONS:
            raise ConfigurationError(f"compression must be None, 'bf16' or 'int8', got {compression!r}")
        if not isinstance(deferred_batch_norm, bool):
            raise ConfigurationError(f"deferred_batch_norm must be True or False, got {deferred_batch_norm!r}")
        self.checkpoint = check_checkpoint_mode(checkpoint)
        self.schedule = check_schedule(schedule)
        check_timeout("heartbeat_timeout", heartbeat_timeout)
        check_timeout("connect_timeout", connect_timeout)
        check_timeout("call_timeout", call_timeout, optional=True)
        check_count("max_message_bytes", max_message_bytes, optional=True)
        check_optional_text("timeline", timeline)
        check_optional_text("store_host", store_host)
        check_curve(curve, self.topology, self.replicas)
        self.split = check_split(split)
        self.pretrained = check_pretrained(pretrained, self.split)
        if state_dict_type not in ("auto", "full", "sharded"):
            raise ConfigurationError(f"state_dict_type must be 'auto', 'full' or 'sharded', got {state_dict_type!r}")
        self.state_dict_type = state_dict_type
        check_count("gather_limit", gather_limit)
        self.gather_limit = gather_limit
        self.recovery = RecoveryOptions.of(recovery)
        if self.recovery and self.recovery.spares and curve is not None and len(curve.worker_public_keys) > 1:
            raise ConfigurationError(
                "recovery.spares with curve.worker_public_keys naming one key per host: a spare has no key there; "
                "give one public key shared by every worker (spares included)"
            )
        super().__init__(
            device=device or "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.balance = balance
        self.microbatches = microbatches
        self.split_backward = split_backward
        self.deferred_batch_norm = deferred_batch_norm
        self.compression = compression
        self.timeline = timeline
        self.heartbeat_timeout = heartbeat_timeout
        self.connect_timeout = connect_timeout
        self.call_timeout = call_timeout
        self.store_host = store_host
        self.listen = listen
        self.curve = curve
        self.limits = (
            protocol.Limits(max_message_bytes=max_message_bytes) if max_message_bytes else protocol.DEFAULT_LIMITS
        )
        self._traced: list[TracedForward] = []
        self._device_given = device is not None
        self._workers: Workers | None = None  # between setup and teardown
        self._starting: Starting | None = None  # local workers started at setup, until the first placement
        self._session: DriverSession | None = None
        self._resume: ShardedCheckpoint | None = None  # a sharded checkpoint being loaded
        self._loaded: dict[str, dict[str, torch.Tensor]] = {}  # a full checkpoint's values for meta modules
        self._loaded_full = False  # a full checkpoint was loaded into the modules (they are its values)
        self._dumping_sharded = False
        self._saves = sharded.Saves()  # a sharded checkpoint written in the background (AsyncCheckpointIO)
        self._fitting = False
        self._hosts_given = self.topology  # recovery changes self.topology; keys stay by address
        self._fit_recovery: FitRecovery | None = None  # this fit's losses, batches and checkpoints
        self._discarding = False  # a run torn down by recovery: nothing comes back from the workers

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The checkpoint I/O: the one given (to the strategy or in ``Trainer(plugins=...)``), else
        ``FileCheckpointIO``, which writes the driver's part of a full checkpoint without a second copy.
        Lightning's ``AsyncCheckpointIO`` without its own I/O wraps ``FileCheckpointIO`` too."""
        if self._checkpoint_io is None:
            self._checkpoint_io = FileCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            self._checkpoint_io.checkpoint_io = FileCheckpointIO()  # kept when it has one already
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @property
    def hosts(self) -> list[str] | list[list[str]] | None:
        """The worker addresses given, normalised (``tcp://``): a list, or a list of rows with replicas."""
        if self.topology is None:
            return None
        if self.topology.replicas == 1:
            return list(self.topology.rows[0])
        return [list(row) for row in self.topology.rows]

    @property
    def root_device(self) -> torch.device:
        if not self._device_given and self.accelerator is not None:
            from lightning.pytorch.accelerators import CUDAAccelerator

            if isinstance(self.accelerator, CUDAAccelerator):
                return torch.device("cuda", torch.cuda.current_device())
        return self._root_device

    @property
    def session(self) -> DriverSession | None:
        """The live session with the workers (between setup and teardown)."""
        return self._connected()

    def _connected(self) -> DriverSession | None:
        """The session, begun now with the local workers started at setup if it has not begun (`_connect`)."""
        if self._session is None and self._starting is not None:
            starting, self._starting = self._starting, None
            self._workers = starting.ready()
            self._connect(starting.keys)
        return self._session

    def _connect(self, keys: Any) -> None:
        """Begin the session with ``self._workers``, as this driver's ``keys`` (`_keys`)."""
        assert self._workers is not None
        self._session = DriverSession(
            self._workers.topology,
            heartbeat_timeout=self.heartbeat_timeout,
            connect_timeout=self.connect_timeout,
            call_timeout=self.call_timeout,
            processes=self._workers.processes,
            store_host=self.store_host,
            keys=keys,
            worker_keys=self._workers.worker_keys,
            limits=self.limits,
            allow_plaintext_allreduce=self.curve is not None and self.curve.allow_plaintext_allreduce,
            listen=self.listen,
        )
        if self._fit_recovery is not None:
            self._fit_recovery.recovery.placed()

    # --- Lightning hooks ---------------------------------------------------------------
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        intercept.mirror_assigned(getattr(self, "_session", None), optimizers)  # lightning/intercept.py
        SingleDeviceStrategy.optimizers.fset(self, optimizers)  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        # Before any callback's setup hook runs: refuse what cannot work while nothing has happened yet.
        if self.lightning_module is not None and self.lightning_module._trainer is not None:
            intercept.refuse_unsupported(self.lightning_module.trainer)
        super().setup_environment()

    def setup(self, trainer: pl.Trainer) -> None:
        intercept.use_remote_summary(trainer)
        super().setup(trainer)
        assert self.lightning_module is not None
        modules = find_spec_modules(self.lightning_module)
        traced = find_modules(self.lightning_module, self.split)
        if not modules and not traced:
            log.warning(
                "RemoteModelParallelStrategy: the LightningModule has no SpecSequential and split= names no "
                "submodule; nothing runs remotely"
            )
            return
        fitting = self._fitting = trainer.state.fn == TrainerFn.FITTING
        # Fail before any worker is started or contacted.
        names = list({**modules, **traced})
        balances = {key: balance_for(self.balance, key, names) for key in names}
        checks = {
            key: checked_for_workers(module, f"SpecSequential {key!r}", self.num_stages)
            for key, module in modules.items()
        }
        try:
            keys, worker_keys = self._keys(self.topology)
            if self.topology is not None:
                self._workers = Workers(self.topology, worker_keys)
                self._connect(keys)
            else:
                assert self.local_workers is not None
                allow = allow_modules_for(modules, self.optimizers)
                self._starting = Workers.start(self.local_workers, self.replicas, keys, self.limits, allow)
                if modules:  # placed now; a traced module is placed at its first call, after its trace
                    self._connected()
            for key, module in modules.items():
                self._place(key, module, balances[key], fitting, checked=checks[key])
            for key, sub in traced.items():
                if on_meta(sub):
                    fill_meta_buffers(sub)  # rotary frequencies and the like: in no file
                place = functools.partial(self._place_traced, key, balances[key], fitting)
                self._traced.append(TracedForward(key, sub, place))
            if fitting:
                self.optimizers = self.optimizers  # mirrors them
                intercept.patch_clipping(self.precision_plugin)
                if self.timeline and not any(isinstance(cb, TimelineCallback) for cb in trainer.callbacks):
                    trainer.callbacks.append(TimelineCallback(self.timeline, self))
        except BaseException:
            self._close()
            raise

    def _place(
        self, key: str, module: SpecSequential, balance: Any, fitting: bool, checked: Any, view: str = ""
    ) -> None:
        """Place ``module`` as ``key`` (a ``view``: as that key, on ``key``'s stages and tensors) with
        this strategy's options, its tensors read from where they are now (`WeightSources.of`)."""
        assert self._session is not None
        sources = None
        if not view:
            sources = WeightSources.of(
                key,
                module,
                checkpoint=self._resume.weights_for(key) if self._resume is not None else None,
                loaded=self._loaded.pop(key, {}),
                pretrained=self.pretrained.get(key),
                loaded_full=self._loaded_full,
                base=self._resume.base_for(key) if self._resume is not None else None,
            )
        self._session.place(
            view or key,
            module,
            balance,
            self.microbatches,
            self.split_backward,
            training=fitting,
            checkpoint=self.checkpoint,
            deferred_batch_norm=self.deferred_batch_norm,
            compression=self.compression,
            checked=checked,
            schedule=self.schedule,
            sources=sources,
            borrows=key if view else None,
            optimizer=self._optimizer_kind(),
        )
        if not view:
            mark_placed(module)

    def _optimizer_kind(self) -> str | None:
        """The optimizer state a memory plan counts: plain SGD's none, else AdamW's two moments (SGD's
        momentum, one, is counted as two)."""
        if not self.optimizers:
            return None
        plain = all(
            isinstance(o, torch.optim.SGD) and not any(g.get("momentum") for g in o.param_groups)
            for o in self.optimizers
        )
        return "sgd" if plain else "adamw"

    def _place_traced(self, key: str, balance: Any, fitting: bool, module: TracedSequential, view: str = "") -> None:
        """Ship a module traced at its first call; its optimizers are mirrored from then on. A ``view``:
        another call signature's units, placed as that key on the stages and tensors of ``key``'s."""
        session = self._connected()
        if session is None:
            raise LrmpError(f"module {key!r} was first called outside a session with the workers")
        split = self.microbatches > 1 or self.replicas > 1
        balance = checked_traced(key, module, balance, self.num_stages, split)
        self._place(key, module, balance, fitting, checked=module.compute, view=view)
        if view:
            return
        if fitting:
            self.optimizers = self.optimizers  # mirrors them over the newly remote parameters
            if self._resume is not None and self.lightning_module is not None:
                self._resume.load_optimizers(session, self.lightning_module, key)

    def model_to_device(self) -> None:
        assert self.model is not None
        with kept_on_meta(self.model, self.split):
            self.model.to(self.root_device)

    def on_train_end(self) -> None:
        # Weights that will not come back here (past gather_limit) must be somewhere: a checkpoint of
        # the last step, written by the workers, unless a ModelCheckpoint saved that step already.
        super().on_train_end()
        session, trainer = self._session, self.lightning_module.trainer if self.lightning_module else None
        if session is None or trainer is None or session.placed_bytes() <= self.gather_limit:
            return
        if any(
            getattr(cb, "_last_global_step_saved", -1) == trainer.global_step for cb in trainer.checkpoint_callbacks
        ):
            return
        path = os.path.join(trainer.default_root_dir, f"lrmp-last-step={trainer.global_step}.ckpt")
        trainer.save_checkpoint(path)
        log.warning("the trained weights do not come back here (past gather_limit): saved them as %s", path)

    # --- checkpoints (lightning_remote_mp.driver.checkpoint) ------------------------------
    def _sharded_checkpoints(self) -> bool:
        session = self._session
        if session is None or not session.placements or self.state_dict_type == "full":
            return False
        return self.state_dict_type == "sharded" or session.placed_bytes() > self.gather_limit

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        sharded.check_savable(split_modules(self.lightning_module, self.split), self._session)
        self._dumping_sharded = self._sharded_checkpoints()
        if not self._dumping_sharded:
            return super().lightning_module_state_dict()
        assert self._session is not None
        with self._session.gathering(False):
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        if not self._dumping_sharded or self._session is None:
            return super().optimizer_state(optimizer)
        with self._session.gathering(False):
            return super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        dumped, self._dumping_sharded = self._dumping_sharded, False
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        whole = self._fit_recovery.saving(trainer, filepath) if self._fit_recovery and trainer else None
        if not dumped or self._session is None:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return whole() if whole else None
        assert self.lightning_module is not None
        # With Lightning's AsyncCheckpointIO, the workers write in the background; the small
        # Lightning state is written at once, by the plugin it wraps, before the directory is named.
        background = isinstance(self.checkpoint_io, AsyncCheckpointIO)
        io = self.checkpoint_io.checkpoint_io if background else self.checkpoint_io
        self._saves.wait()
        pending = sharded.save(
            self._session,
            self.lightning_module,
            checkpoint,
            filepath,
            lambda ckpt, path: io.save_checkpoint(ckpt, path, storage_options=storage_options),
            background,
        )
        self._saves.start(pending, background, whole)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self._fit_recovery is not None:
            self._fit_recovery.whole.removed(filepath)
        self._saves.remove(functools.partial(super().remove_checkpoint, filepath))

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._saves.poll()
        return super().training_step(*args, **kwargs)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        self._saves.wait()
        if not sharded.is_sharded(checkpoint_path):
            self._resume = None
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume = ShardedCheckpoint(checkpoint_path)
        return super().load_checkpoint(self._resume.lightning_state_path(), weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        assert self.lightning_module is not None
        state = checkpoint["state_dict"]
        # A split module on the meta device keeps nothing loaded into it: its values wait for placement.
        for key, module in split_modules(self.lightning_module, self.split).items():
            if on_meta(module):
                head = key + "."
                self._loaded[key] = {k[len(head) :]: v for k, v in state.items() if k.startswith(head)}
        with warnings.catch_warnings():  # loading into meta tensors "is a no-op": their values are kept above
            warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
            if self._resume is None:
                self._loaded_full = True  # the driver's values are the checkpoint's now, not the pretrained files'
                return super().load_model_state_dict(checkpoint, strict=strict)
            missing, unexpected = self.lightning_module.load_state_dict(state, strict=False)
        absent = [k for k in missing if not self._resume.holds(k)]
        if strict and (absent or unexpected):
            raise WeightsError(
                f"sharded checkpoint {self._resume.path} does not fit this model: it lacks {absent[:5]} and has "
                f"{list(unexpected)[:5]} that the model does not; it is a checkpoint of another model"
            )
        if self._session is not None:
            self._resume.load_into_placed(self._session)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        super().load_optimizer_state_dict(checkpoint)
        if self._resume is not None and self._session is not None and self.lightning_module is not None:
            for key in list(self._session.placements):
                self._resume.load_optimizers(self._session, self.lightning_module, key)

    @property
    def num_stages(self) -> int:
        """Stages per pipeline: workers per row of ``hosts``, or local workers per replica."""
        if self.topology is not None:
            return self.topology.stages
        assert self.local_workers is not None
        return self.local_workers.count // self.replicas

    def teardown(self) -> None:
        self._close()
        with kept_on_meta(self.lightning_module, self.split):
            super().teardown()

    def _close(self) -> None:
        intercept.unpatch_clipping(self.precision_plugin)
        for forward in self._traced:
            forward.detach()
        self._traced.clear()
        session, self._session = self._session, None
        try:
            self._resume, self._loaded, self._loaded_full = None, {}, False
            if session is not None:
                try:
                    self._saves.wait()
                    # After a loss the run resumes from a checkpoint: nothing comes back (gather_limit -1).
                    discard = self._discarding
                    left = session.restore(-1 if discard else self.gather_limit, trained=self._fitting and not discard)
                    for owner in left:
                        if not isinstance(owner, SpecSequential):  # a spec records it itself (weights_left_on_workers)
                            mark_trained_elsewhere(owner)
                finally:
                    session.close()
        finally:
            workers, self._workers = self._workers, None
            starting, self._starting = self._starting, None
            if workers is not None:
                workers.stop()
            if starting is not None:
                starting.stop()

    # --- recovery (lightning/recovery.py: the launcher, the batches; driver/recovery.py: the places) ---
    def _configure_launcher(self) -> None:
        if self.recovery:
            from lightning_remote_mp.lightning.recovery import RecoveringLauncher

            self._launcher = RecoveringLauncher(self)
        else:
            self._launcher = None

    def _keys(self, topology: Topology | None) -> tuple[Any, dict[str, bytes] | None]:
        """This driver's key pair and the workers' public keys by address (`load_keys`): a key shared
        by all fits any address (a spare); keys per host fit the hosts given."""
        shared = self.curve is not None and len(self.curve.worker_public_keys) == 1
        return load_keys(self.curve, topology if shared else self._hosts_given)

    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        return self._fit_recovery.wrap(dataloader, trainer) if self._fit_recovery and trainer else dataloader

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="layers of SpecSequential modules trained on remote lrmp-workers"
        )


if RemoteModelParallelStrategy.strategy_name not in StrategyRegistry:
    RemoteModelParallelStrategy.register_strategies(StrategyRegistry)
follow_lightning()  # lrmp's messages show where Lightning's do, with no logging set-up
