"""Recovery from a lost worker (`RecoveryOptions`): where the lost stage goes, and the bounds.

`Recovery` keeps one ``fit``'s losses. For each it picks where the stages go next, in order: a
spare that answers, the lost worker's own address once it answers again (a restarted service),
or, failing both, the workers that remain (one stage fewer, or one replica fewer). Whether an
address answers is a real greeting (`WorkerLinks`: HELLO, versions, CURVE), closed at once.
Local workers (``hosts=None``) are started afresh by the next setup, so they need no choice.
Past ``max_recoveries`` losses or ``max_seconds`` spent recovering, the run fails with the last
loss, naming every one.

`WholeCheckpoints` knows which checkpoints are whole (written to the end: a background save is
whole once its files are named) and where in the data each one stands, so that recovery resumes
from the newest whole one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from lightning_remote_mp.driver.links import WorkerLinks
from lightning_remote_mp.driver.options import RecoveryOptions, Topology
from lightning_remote_mp.errors import LrmpError, WorkerLostError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.keys import KeyPair

log = logging.getLogger(__name__)


def answers(
    address: str,
    timeout: float,
    *,
    keys: KeyPair | None = None,
    worker_keys: Mapping[str, bytes] | None = None,
    limits: protocol.Limits = protocol.DEFAULT_LIMITS,
    listen: str | None = None,
) -> bool:
    """Whether a worker at ``address`` greets this driver within ``timeout`` seconds."""
    try:
        links = WorkerLinks(
            [address],
            connect_timeout=timeout,
            keys=keys,
            worker_keys=worker_keys,
            limits=limits,
            listen=listen,
        )
    except LrmpError as err:
        log.info("worker %s does not answer: %s", address, err)
        return False
    links.close()
    return True


@dataclasses.dataclass
class Replacement:
    """Where a recovered run's stages go: its ``topology`` (``None``: new local workers), said as ``how``."""

    topology: Topology | None
    how: str


class Recovery:
    """One ``fit``'s losses and recoveries.

    Args:
        options: the strategy's `RecoveryOptions`.
        topology: the workers given (``None``: local workers, which setup starts afresh).
        rebalance_refused: why the stages cannot be rebalanced onto fewer workers (a ``balance``
            that names stage sizes), or ``""``.
        answers: whether an address answers within a number of seconds (`answers`, bound to the
            run's keys).
    """

    def __init__(
        self,
        options: RecoveryOptions,
        topology: Topology | None,
        rebalance_refused: str,
        answers: Callable[[str, float], bool],
    ) -> None:
        self.options = options
        self.topology = topology
        self.spares = list(options.spares)
        self.rebalance_refused = rebalance_refused
        self.answers = answers
        self.losses: list[WorkerLostError] = []
        self.spent = 0.0  # seconds spent recovering, summed over the losses
        self._since: float | None = None

    def lost(self, err: WorkerLostError) -> None:
        """Count the loss ``err``; raise the run's end when a bound is past."""
        self.losses.append(err)
        self._since = time.monotonic()
        if len(self.losses) > self.options.max_recoveries:
            raise self.gave_up(f"more than recovery.max_recoveries={self.options.max_recoveries} losses")
        if self.spent >= self.options.max_seconds:
            raise self.gave_up(f"recoveries took {self.spent:.0f} s, recovery.max_seconds={self.options.max_seconds:g}")

    def placed(self) -> None:
        """The recovered run has its workers: the time since the loss counts against ``max_seconds``."""
        if self._since is not None:
            took = time.monotonic() - self._since
            self.spent += took
            self._since = None
            log.info("recovery: the workers are connected again, %.1f s after the loss", took)

    def gave_up(self, why: str) -> WorkerLostError:
        """The run's end: the last loss, naming every loss and why recovery stopped."""
        last = self.losses[-1]
        named = "; ".join(f"{i + 1}. {str(e).splitlines()[0]}" for i, e in enumerate(self.losses))
        err = WorkerLostError(
            f"{last} -- recovery gave up ({why}); the losses of this run: {named}",
            address=last.address,
            stage=last.stage,
            replica=last.replica,
        )
        err.__cause__ = last
        return err

    def place(self, lost: str, connect_timeout: float) -> Replacement:
        """Where the stages go after losing ``lost`` (see the module's docstring)."""
        if self.topology is None:
            return Replacement(None, "new local workers")
        budget = max(1.0, self.options.max_seconds - self.spent)
        for spare in list(self.spares):
            self.spares.remove(spare)
            if self.answers(spare, min(connect_timeout, budget)):
                self.topology = _replaced(self.topology, lost, spare)
                return Replacement(self.topology, f"spare {spare}")
        if lost in self.topology.addresses:
            log.warning("waiting up to %.0f s for a worker to answer at %s again", self.options.wait, lost)
            if self.answers(lost, min(self.options.wait, budget)):
                return Replacement(self.topology, f"the worker back at {lost}")
        why = self._why_not_rebalance(lost)
        if why:
            raise self.gave_up(
                f"no spare answered, {lost} did not answer within recovery.wait={self.options.wait:g} s, and {why}"
            )
        rows = self.topology.rows
        if self.topology.replicas > 1:
            left = tuple(row for row in rows if lost not in row)
            how = f"the {len(left)} replicas that remain"
        else:
            left = (tuple(a for a in rows[0] if a != lost),)
            how = f"the {len(left[0])} workers that remain"
        self.topology = Topology(left)
        return Replacement(self.topology, how)

    def _why_not_rebalance(self, lost: str) -> str:
        assert self.topology is not None
        if not self.options.rebalance:
            return "recovery.rebalance is False"
        if self.rebalance_refused:
            return self.rebalance_refused
        if self.topology.replicas == 1 and self.topology.stages == 1:
            return "no worker remains"
        if lost not in self.topology.addresses:
            return f"{lost} is not one of the run's workers"
        return ""


def _replaced(topology: Topology, lost: str, spare: str) -> Topology:
    return Topology(tuple(tuple(spare if a == lost else a for a in row) for row in topology.rows))


@dataclasses.dataclass
class Saved:
    """A checkpoint written by this run: its path and where it stands in the data (``position``,
    opaque here: the driver's batch replay reads it)."""

    path: str
    position: Any


class WholeCheckpoints:
    """The checkpoints of a run that are whole, newest last, while their files exist."""

    def __init__(self) -> None:
        self.saved: list[Saved] = []

    def whole(self, path: Any, position: Any) -> None:
        """The checkpoint at ``path`` is written to the end."""
        path = os.fspath(path)
        self.saved = [s for s in self.saved if s.path != path] + [Saved(path, position)]

    def removed(self, path: Any) -> None:
        path = os.fspath(path)
        self.saved = [s for s in self.saved if s.path != path]

    def newest(self) -> Saved | None:
        """The newest whole checkpoint whose files are still there."""
        return next((s for s in reversed(self.saved) if os.path.exists(s.path)), None)
