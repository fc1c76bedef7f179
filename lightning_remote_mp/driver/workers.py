"""Where a run's workers come from: the hosts given, each with the public key the driver was given
for it, or ``lrmp-worker`` processes started on this machine (`launch.LocalWorkers`), each with a
fresh CURVE key pair when the driver has one; and, at the end, the local ones stopped and their keys
removed. The key files are read here, when the run sets up, never when the strategy is built.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lightning_remote_mp.driver.launch import LocalWorkers
from lightning_remote_mp.driver.options import CurveOptions, LocalWorkerOptions, Topology
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.keys import KeyPair, generate_keypair, load_keypair, load_public_key, write_public_key
from lightning_remote_mp.wire.transport import Process


def load_keys(curve: CurveOptions | None, topology: Topology | None) -> tuple[KeyPair | None, dict[str, bytes] | None]:
    """This driver's key pair, and each given worker's public key by address (``None`` without
    CURVE, or for local workers, which get fresh keys)."""
    if curve is None:
        return None, None
    keys = load_keypair(curve.secret_key)
    if topology is None:
        return keys, None
    flat = topology.addresses
    worker_keys = [load_public_key(p) for p in curve.worker_public_keys]
    return keys, dict(zip(flat, worker_keys * len(flat) if len(worker_keys) == 1 else worker_keys))


class Workers:
    """A run's workers: where they are (``topology``), their public keys by address (with CURVE),
    and the processes of those started here, by address (a worker whose process ended is lost at once).

    Args:
        topology: the workers, in rows of stages.
        worker_keys: with CURVE, each worker's public key by address.
        local: the local workers, when they were started here (`start`).
        keys_dir: the directory of their fresh key pairs, removed by `stop`.
    """

    def __init__(
        self,
        topology: Topology,
        worker_keys: dict[str, bytes] | None = None,
        local: LocalWorkers | None = None,
        keys_dir: str | None = None,
    ) -> None:
        self.topology = topology
        self.worker_keys = worker_keys
        self.local = local
        self.keys_dir = keys_dir

    @property
    def processes(self) -> dict[str, Process] | None:
        """The local workers' processes, by address (``None`` for the hosts given)."""
        return dict(zip(self.local.addresses, self.local.procs)) if self.local is not None else None

    @classmethod
    def start(
        cls,
        options: LocalWorkerOptions,
        replicas: int,
        keys: KeyPair | None,
        limits: protocol.Limits,
        allow_modules: Sequence[str],
    ) -> Starting:
        """Start ``options.count`` local workers in ``replicas`` rows; with the driver's ``keys``, each
        gets a fresh key pair and accepts only this driver's key. ``limits``: what the driver
        accepts, and so what they accept too; ``allow_modules``: what they may build beyond the
        defaults. The processes start now; `Starting.ready` waits until they serve, so that the
        driver can go on meanwhile (trace a module, say)."""
        keys_dir: str | None = None
        local: LocalWorkers | None = None
        try:
            secret_files, authorized, worker_keys = None, None, None
            if keys is not None:
                # Local workers with CURVE: a key pair each, and this driver's public key as the only authorized one.
                keys_dir = tempfile.mkdtemp(prefix="lrmp-keys-")
                pairs = [generate_keypair(keys_dir, f"worker{i}") for i in range(options.count)]
                secret_files = [str(secret) for _, secret in pairs]
                worker_keys = [load_public_key(public) for public, _ in pairs]
                authorized_dir = Path(keys_dir) / "authorized"
                authorized_dir.mkdir()
                write_public_key(authorized_dir / "driver.key", keys.public)
                authorized = str(authorized_dir)
            extra = []
            if limits.max_message_bytes != protocol.DEFAULT_LIMITS.max_message_bytes:
                extra = ["--max-message-bytes", str(limits.max_message_bytes)]
            local = LocalWorkers(
                options.count,
                devices=options.devices,
                threads=options.threads,
                allow_modules=allow_modules,
                secret_keys=secret_files,
                authorized_keys=authorized,
                extra_args=extra,
            )
            local.launch()
        except BaseException:
            _remove(local, keys_dir)
            raise
        return Starting(local, replicas, keys, worker_keys, keys_dir)

    def stop(self) -> None:
        """Stop the local workers and remove their keys (nothing for the hosts given)."""
        local, keys_dir, self.local, self.keys_dir = self.local, self.keys_dir, None, None
        _remove(local, keys_dir)


def _remove(local: LocalWorkers | None, keys_dir: str | None) -> None:
    try:
        if local is not None:
            local.stop()
    finally:
        if keys_dir is not None:
            shutil.rmtree(keys_dir, ignore_errors=True)


@dataclasses.dataclass
class Starting:
    """Local workers whose processes started (`Workers.start`) and may not serve yet; ``keys``: the
    driver's key pair they accept (``None`` without CURVE)."""

    local: LocalWorkers
    replicas: int
    keys: KeyPair | None
    worker_keys: list[bytes] | None
    keys_dir: str | None

    def ready(self) -> Workers:
        """The workers, once each serves; if one cannot, all are stopped and their keys removed."""
        try:
            addresses = self.local.wait_ready()
        except BaseException:
            self.stop()
            raise
        by_address = dict(zip(addresses, self.worker_keys)) if self.worker_keys is not None else None
        return Workers(Topology.in_rows(addresses, self.replicas), by_address, self.local, self.keys_dir)

    def stop(self) -> None:
        """Stop the processes and remove their keys (a run that ends before it needs them)."""
        _remove(self.local, self.keys_dir)
