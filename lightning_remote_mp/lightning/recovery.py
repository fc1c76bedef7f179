"""Recovery inside ``fit`` (``RemoteModelParallelStrategy(recovery=...)``, docs/recovery.md).

Lightning runs ``fit`` through its strategy's launcher, when it has one; `RecoveringLauncher` is
that launcher. When ``fit`` raises `WorkerLostError`, it recovers (`RecoveringLauncher._recover`:
the run is torn down, the lost stage placed again, the newest whole checkpoint chosen) and runs
``fit`` again from that checkpoint, as a restarted script with ``ckpt_path=`` would, in the same
process: Lightning restores the weights, the optimizers, the schedulers, the loops and the
callbacks, and the workers read their stages.

What Lightning cannot restore is where a plain ``DataLoader`` was: it would start the epoch again.
`BatchReplay` keeps the training batches since the newest whole checkpoint (`ReplayLoader` wraps
the train loader and records what it yields), and the run after a recovery is fed those first,
then the rest of the very iterator the lost run was reading: the same batches in the same order,
shuffled or not, so the final weights equal an uninterrupted run's. A stateful loader
(``state_dict``/``load_state_dict``) is left to Lightning, which restores its position itself.
"""

from __future__ import annotations

import inspect
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from lightning_remote_mp.driver.options import RecoveryOptions, Topology
from lightning_remote_mp.driver.recovery import Recovery, Replacement, Saved, WholeCheckpoints
from lightning_remote_mp.driver.recovery import answers as address_answers
from lightning_remote_mp.errors import LrmpError, WorkerLostError

log = logging.getLogger(__name__)

#: A position in the training data: (the epoch's iterator, counted from 0 within one ``fit``,
#: and how many of its batches the steps before it consumed).
Position = tuple[int, int]


class BatchReplay:
    """The training batches since the newest whole checkpoint, to run again after a recovery.

    Each epoch's iterator of the train loader is numbered, from 0 within one ``fit``; ``kept[e]``
    holds epoch ``e``'s batches from index ``first[e]`` on. At most ``limit`` batches are kept (the
    oldest go).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept: dict[int, list[Any]] = {}
        self.first: dict[int, int] = {}
        self.live: Iterator[Any] | None = None
        self.live_epoch = -1
        self.current = -1  # the epoch being read; the next epoch's iterator is the one after it
        self.resume_at: Position | None = None
        self.disabled = ""  # why nothing is kept

    def position(self, batch_idx: int, batches: float) -> Position:
        """Where a checkpoint written now stands: after batch ``batch_idx`` of the live epoch
        (of ``batches``), or at the start of the next when that was its last."""
        done = batch_idx + 1
        return (self.current + 1, 0) if done >= batches else (self.current, done)

    def trim(self, at: Position) -> None:
        """A checkpoint at ``at`` is whole: nothing before it is replayed any more."""
        e, i = at
        for old in [k for k in self.kept if k < e]:
            self._drop(old)
        if e in self.kept and i > self.first[e]:
            del self.kept[e][: i - self.first[e]]
            self.first[e] = i

    def disable(self, why: str) -> None:
        """Keep nothing from now on (``why``: the reason a recovery gives)."""
        if not self.disabled:
            log.warning("recovery: the training batches are not kept to run again, since %s", why)
        self.disabled = why
        self.kept.clear()
        self.first.clear()

    def can_resume(self, at: Position) -> bool:
        """Whether every batch from ``at`` to the live iterator is kept."""
        e, i = at
        if self.disabled:
            return False
        for k in range(e, self.live_epoch + 1):
            if k not in self.kept or self.first[k] > (i if k == e else 0):
                return False
        return e <= self.live_epoch + 1

    def resume(self, at: Position) -> None:
        """The next epoch's iterator starts at ``at``."""
        self.resume_at = at

    def iterate(self, inner: Iterable[Any]) -> Iterator[Any]:
        """One epoch's batches: after a recovery, the kept ones from the resume position, then the
        lost run's iterator goes on; otherwise a new iterator of ``inner``, recorded."""
        e, start = self.resume_at or (self.current + 1, 0)
        self.resume_at, self.current = None, e
        return self._stream(inner, e, start)

    def _stream(self, inner: Iterable[Any], e: int, start: int) -> Iterator[Any]:
        if e in self.kept:
            yield from self.kept[e][start - self.first[e] :]
            if e != self.live_epoch:
                return  # an earlier epoch's: all kept
            source = self.live  # the lost run's; one that ran out stays out (the iterator protocol)
        else:
            source = iter(inner)
            self.live, self.live_epoch = source, e
            self.kept[e], self.first[e] = [], 0
        assert source is not None
        for batch in source:
            self._keep(e, batch)
            yield batch

    def _keep(self, e: int, batch: Any) -> None:
        self.kept.setdefault(e, []).append(batch)
        self.first.setdefault(e, 0)
        while sum(map(len, self.kept.values())) > self.limit:
            oldest = min(k for k, v in self.kept.items() if v)
            self.kept[oldest].pop(0)
            self.first[oldest] += 1

    def _drop(self, e: int) -> None:
        self.kept.pop(e, None)
        self.first.pop(e, None)


class ReplayLoader:
    """The train loader as `BatchReplay` feeds it: its length and samplers are the loader's (Lightning
    counts batches and sets the sampler's epoch through them), its batches recorded or replayed."""

    def __init__(self, loader: Iterable[Any], replay: BatchReplay, alone: Callable[[], bool]) -> None:
        self.loader = loader
        self.replay = replay
        self.alone = alone  # whether it is the only train loader (several cycle within an epoch)

    def __iter__(self) -> Iterator[Any]:
        if not self.alone():
            self.replay.disable("fit has several train loaders")
        if self.replay.disabled:
            return iter(self.loader)
        return self.replay.iterate(self.loader)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)


class RecoveringLauncher(_Launcher):
    """Runs ``fit`` again from the newest whole checkpoint after a worker is lost (see the module).

    Args:
        strategy: the `lightning_remote_mp.RemoteModelParallelStrategy` whose ``fit`` this
            launches (with ``recovery=``): its record of the run (``_fit_recovery``) starts when a
            ``fit`` begins, and `_recover` tears the run down and places its stages again after a loss.
    """

    def __init__(self, strategy: Any) -> None:  # the strategy imports this module: no import back
        self.strategy = strategy

    def _begin(self) -> None:
        s = self.strategy
        assert s.recovery is not None

        def answers(address: str, timeout: float) -> bool:
            keys, worker_keys = s._keys(Topology.of([address]))
            return address_answers(
                address, timeout, keys=keys, worker_keys=worker_keys, limits=s.limits, listen=s.listen
            )

        s._fit_recovery = FitRecovery(s.recovery, s.topology, s.balance, answers)

    def _recover(self, trainer: Any, err: WorkerLostError) -> str:
        """After ``fit`` lost a worker: end the run, place its stages again and return the checkpoint
        ``fit`` resumes from (`FitRecovery.resume`); past a bound, or with no whole checkpoint,
        raise the run's end, naming every loss."""
        s = self.strategy
        fit = s._fit_recovery
        assert fit is not None
        fit.lost(err)
        try:
            s._saves.wait()
        except LrmpError as lost:
            log.warning("the checkpoint being written in the background is lost: %s", lost)
        saved = fit.checkpoint()
        s._discarding = True  # the stages come from a checkpoint: nothing comes back here
        try:
            trainer._teardown()
        finally:
            s._discarding = False
        s.topology = fit.resume(err, saved, s.connect_timeout).topology or s.topology
        return saved.path

    @property
    def is_interactive_compatible(self) -> bool:
        return True

    def kill(self, signum: Any) -> None:
        """Nothing to kill: the run stays in this process."""

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        from lightning.pytorch import Trainer

        fit_impl = getattr(Trainer, "_fit_impl", None)  # private to Lightning: how fit is told apart
        if fit_impl is None or getattr(function, "__func__", None) is not fit_impl:
            if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                warnings.warn(
                    f"recovery= cannot attach to this fit: Lightning launched it through "
                    f"{getattr(function, '__qualname__', function)!r}, not Trainer._fit_impl (private to Lightning, "
                    "which lrmp's recovery hooks; lrmp is tested with Lightning 2.6). A lost worker ends this run.",
                    stacklevel=2,
                )
            return function(*args, **kwargs)
        call = inspect.signature(function).bind(*args, **kwargs)
        self._begin()
        recovered = False
        while True:
            try:
                with warnings.catch_warnings():
                    if recovered:  # the batches are replayed, and the checkpoints are this run's own
                        warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before")
                        warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
                    return function(*call.args, **call.kwargs)
            except WorkerLostError as err:
                started = time.monotonic()
                call.arguments["ckpt_path"] = self._recover(trainer, err)
                recovered = True
                # What Trainer.fit sets before it runs _fit_impl: a loss during validation left VALIDATING.
                trainer.state.fn, trainer.state.status = TrainerFn.FITTING, TrainerStatus.RUNNING
                trainer.training = True
                log.info("recovery: %.1f s from the loss to running fit again", time.monotonic() - started)


class FitRecovery:
    """One ``fit``'s recovery: its losses and places (`Recovery`), the batches since its newest
    whole checkpoint (`BatchReplay`) and which checkpoints are whole (`WholeCheckpoints`).

    Args:
        options: the strategy's `RecoveryOptions`.
        topology: the workers now (``None``: local workers).
        balance: the strategy's ``balance``: stage sizes cannot be rebalanced onto fewer workers.
        answers: whether an address answers within a number of seconds.
    """

    def __init__(
        self, options: RecoveryOptions, topology: Topology | None, balance: Any, answers: Callable[[str, float], bool]
    ) -> None:
        sizes = isinstance(balance, list) or (
            isinstance(balance, dict) and not all(isinstance(v, str) for v in balance.values())
        )
        refused = "balance= gives each stage's layers, for as many stages as there were" if sizes else ""
        self.options = options
        self.recovery = Recovery(options, topology, refused, answers)
        self.replay = BatchReplay(options.max_replay_batches)
        self.whole = WholeCheckpoints()

    def lost(self, err: WorkerLostError) -> None:
        """Count the loss (raising the run's end past a bound) and say so."""
        self.recovery.lost(err)
        n, most = len(self.recovery.losses), self.options.max_recoveries
        log.warning("%s -- recovering (%d of at most %d)", str(err).splitlines()[0], n, most)

    def saving(self, trainer: Any, path: Any) -> Callable[[], None] | None:
        """A checkpoint is being written to ``path``: what to call once it is whole."""
        if trainer.state.fn != "fit":
            return None
        at = self.replay.position(trainer.fit_loop.epoch_loop.batch_idx, trainer.num_training_batches)

        def whole() -> None:
            self.whole.whole(path, at)
            self.replay.trim(at)

        return whole

    def wrap(self, dataloader: object, trainer: Any) -> object:
        """The train loader, recorded for replay (`ReplayLoader`); any other loader as it is, and
        a stateful one too: Lightning restores its position itself."""
        if trainer.state.stage != "train" or isinstance(dataloader, (_Stateful, ReplayLoader)):
            return dataloader
        fit_loop = trainer.fit_loop
        return ReplayLoader(dataloader, self.replay, lambda: len(fit_loop._combined_loader.flattened) == 1)

    def checkpoint(self) -> Saved:
        """The newest whole checkpoint, or the run's end when there is none: asked before the lost run
        is torn down, so that a run that cannot recover ends as it does without recovery (the
        survivors' weights brought back)."""
        saved = self.whole.newest()
        if saved is None:
            raise self.recovery.gave_up(
                "no whole checkpoint was written before the loss: save one every few steps, e.g. "
                "ModelCheckpoint(every_n_train_steps=N)"
            )
        return saved

    def resume(self, err: WorkerLostError, saved: Saved, connect_timeout: float) -> Replacement:
        """After the lost run is torn down: where its stages go, with the batch replay set to start
        where ``saved`` (the checkpoint ``fit`` resumes from) stands."""
        replacement = self.recovery.place(err.address, connect_timeout)
        if self.replay.can_resume(saved.position):
            self.replay.resume(saved.position)
        elif self.replay.kept or self.replay.disabled:
            why = self.replay.disabled or f"more than recovery.max_replay_batches={self.options.max_replay_batches}"
            log.warning(
                "the training batches since %s are not all kept here (%s): fit resumes as Lightning does, a "
                "stateful loader where it was and any other at the start of its epoch",
                saved.path,
                why,
            )
        log.warning("recovery: the stages go to %s, restored from %s", replacement.how, saved.path)
        return replacement
