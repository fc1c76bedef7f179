"""The driver's links to a session's workers: connected, greeted, kept alive, and closed.

`WorkerLinks` opens one `lightning_remote_mp.wire.transport.Connection` per worker of the topology,
each stage of each replica (through a switchboard for the workers that dial in,
`lightning_remote_mp.wire.switchboard`), with CURVE where the driver has keys. It greets them
(HELLO): both sides learn each other's protocol, lrmp and torch versions, and the driver learns each
worker's device, free memory and limits; a worker still held by the session of a driver that is
gone is waited for until it drops that session. A heartbeat keeps the links alive from the first
HELLO on, and `close` says goodbye. What is placed on the workers, and how, is the session's
(`lightning_remote_mp.driver.session.DriverSession`, a `WorkerLinks`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_remote_mp._version import __version__
from lightning_remote_mp.driver.options import Topology
from lightning_remote_mp.errors import ConfigurationError, ProtocolVersionError, WorkerError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.addresses import dial_name, normalize_address, relay_address, resolved, route_dialin
from lightning_remote_mp.wire.heartbeat import Heartbeat
from lightning_remote_mp.wire.keys import KeyPair
from lightning_remote_mp.wire.requests import Hello
from lightning_remote_mp.wire.switchboard import Switchboard
from lightning_remote_mp.wire.transport import (
    DEFAULT_CALL_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    Connection,
    Curve,
    Process,
)

log = logging.getLogger(__name__)


class WorkerLinks:
    """The links to one session's workers: one row per pipeline, one worker per stage.

    Its `topology` (`lightning_remote_mp.driver.options.Topology`) says how many replicas and stages
    there are and where each worker is; ``grid`` holds the connections in the same rows, ``conns``
    the same row by row, and ``workers`` what each worker said of itself when greeted (its device,
    free memory, limits, versions).

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
        keys: this driver's CURVE key pair; with it every connection is encrypted and authenticated.
        worker_keys: with ``keys``, each worker's public key (Z85) by address (as in ``hosts``).
        limits: bounds on what this driver accepts from the workers.
        listen: where workers that dial in (``dial://NAME`` in ``hosts``) reach this driver,
            ``tcp://host:port`` (`lightning_remote_mp.wire.switchboard`).
    """

    def __init__(
        self,
        hosts: Topology | Sequence[str] | Sequence[Sequence[str]],
        *,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        processes: Mapping[str, Process] | None = None,
        keys: KeyPair | None = None,
        worker_keys: Mapping[str, bytes] | None = None,
        limits: protocol.Limits = protocol.DEFAULT_LIMITS,
        call_timeout: float | None = DEFAULT_CALL_TIMEOUT,
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
        self.id = uuid.uuid4().hex
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
            c.order.seal_key = seal_keys.setdefault(c.address, c.order.seal_key)  # one per worker, however many stages
            c.session_conns = self.conns  # a failed sum of gradients may be another worker's loss
        self.heartbeat: Heartbeat | None = None
        try:
            # Pinging from the start keeps the sessions of the workers that answer alive while a late one is awaited.
            self.heartbeat = Heartbeat(self.addresses, self.id, min(1.0, heartbeat_timeout / 4), curves or None)
            self.workers = self._hello(connect_timeout)
            for c in self.conns:
                c.heartbeat = self.heartbeat
                c.order.heard = self.heartbeat.ran
        except BaseException:
            WorkerLinks.close(self)  # what a subclass adds is not set up yet
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
        bodies = {id(c): hello.replace(seal_key=c.order.seal_key).body() for c in self.conns}
        pending = {id(c): (c, c.send(protocol.HELLO, bodies[id(c)])) for c in self.conns}
        replies: dict[int, dict[str, Any]] = {}
        looked_again: set[int] = set()  # busy workers already asked a second time
        while pending:
            waits = []
            for key, (c, i) in list(pending.items()):
                try:
                    replies[key] = c.recv(i, timeout=max(0.0, deadline - time.monotonic()), what="connect")
                    del pending[key]
                except WorkerError as err:
                    if err.remote_type == "ProtocolVersionError":
                        raise ProtocolVersionError(str(err)) from None
                    wait = _wait_for_silent_session(c, err, deadline, looked_again=key in looked_again)
                    if wait is None:
                        raise
                    looked_again.add(key)
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

    def close(self) -> None:
        """Say goodbye to every live worker (each drops the session), and close every link."""
        for c in self.conns:
            # The session is over: nothing more to confirm, and nothing held may run now (a step
            # could overtake a backward that is still running there).
            c.order.before_send.clear()
            c.order.discard_carried(after=0)
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


#: A session whose driver has been silent this long (seconds) is taken for one whose driver is gone:
#: a live driver pings every second.
_SILENT_SESSION = 2.0
#: A worker that will drop its session within this many seconds saw its connection close.
_DROPPED_SOON = 3.5


def _wait_for_silent_session(
    conn: Connection, err: WorkerError, deadline: float, *, looked_again: bool
) -> float | None:
    """Seconds to wait before asking a busy worker again, when its session's driver has gone silent
    and the worker will drop that session before ``deadline``; ``None`` to give up (a live session).

    A session whose driver was heard from lately and whose connection the worker still holds open
    is a live run's, or one whose driver was killed a moment ago and whose closed connection the
    worker has not read yet (on a loaded machine, a second later than its peer worker did): the
    worker is asked once more, when a live driver would have pinged again (it pings every second)."""
    if err.remote_type != "WorkerBusy":
        return None
    silent, expires = err.details.get("silent_for"), err.details.get("expires_in")
    if not isinstance(silent, (int, float)) or not isinstance(expires, (int, float)):
        return None
    # Silent for a while, or about to be dropped because its connection closed (a killed driver).
    if silent < _SILENT_SESSION and expires > _DROPPED_SOON:
        wait = _SILENT_SESSION - silent + 0.1
        if looked_again or time.monotonic() + wait > deadline:
            return None
        log.debug("%s is busy with a session heard from %.1f s ago: asking again in %.1f s", conn.where(), silent, wait)
        return wait
    if time.monotonic() + expires > deadline:
        return None
    log.info(
        "%s still holds a session whose driver has been silent for %.1f s (gone?); it drops it within %.1f s: waiting",
        conn.where(),
        silent,
        expires,
    )
    return min(expires + 0.2, max(0.0, deadline - time.monotonic()))
