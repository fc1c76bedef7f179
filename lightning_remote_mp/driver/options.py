"""The strategy's configuration as typed values: its option groups (`LocalWorkerOptions`,
`CurveOptions`, `RecoveryOptions`), the `Topology` that ``hosts`` describes, and the checks of the other arguments.

Everything here is checked when it is built, without reading a file or starting a process, and a
mistake raises `ConfigurationError` naming the argument: a typo in a YAML config fails before any
worker is started, not minutes later at setup.

>>> LocalWorkerOptions(count=4, threads=1)
LocalWorkerOptions(count=4, devices=None, threads=1)
>>> LocalWorkerOptions(count=0)
Traceback (most recent call last):
...
lightning_remote_mp.errors.ConfigurationError: local_workers.count must be at least 1, got 0
>>> Topology.of(["10.0.0.5:5555", "tcp://10.0.0.6:5555"]).rows
(('tcp://10.0.0.5:5555', 'tcp://10.0.0.6:5555'),)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from lightning_remote_mp.errors import ConfigurationError, LrmpError
from lightning_remote_mp.flow import is_split_backward
from lightning_remote_mp.wire.addresses import DIAL, WORKER_NAME, dial_name, normalize_address

log = logging.getLogger(__name__)

#: The automatic ``balance`` choices.
BALANCE_MODES = ("memory", "parameters", "time")


def _fields_of(cls: type, values: dict[str, Any], argument: str) -> dict[str, Any]:
    """``values`` (an option group as a dict, from a YAML config), each key a field of ``cls``; else
    the error naming the first that is not, and the fields there are."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        give = ", ".join(names[:-1]) + " and/or " + names[-1]
        raise ConfigurationError(f"{argument}: no option {unknown[0]!r}; give {give} ({cls.__name__})")
    return values


@dataclasses.dataclass(frozen=True)
class LocalWorkerOptions:
    """The ``lrmp-worker`` processes the strategy starts on this machine when ``hosts`` is ``None``.

    Args:
        count: how many workers (stages times replicas).
        devices: one device per worker, e.g. ``["cuda:0", "cuda:1"]`` (default: CUDA devices
            round-robin when CUDA is available, else CPU).
        threads: torch threads per worker (default: this machine's cores shared among the workers).
    """

    count: int = 2
    devices: list[str] | None = None
    threads: int | None = None

    @classmethod
    def of(cls, values: dict[str, Any]) -> LocalWorkerOptions:
        """From a dict of its fields (a YAML config's), naming a key that is none of them."""
        return cls(**_fields_of(cls, values, "local_workers"))

    def __post_init__(self) -> None:
        check_count("local_workers.count", self.count)
        if self.devices is not None:
            if isinstance(self.devices, str) or not all(isinstance(d, str) and d.strip() for d in self.devices):
                raise ConfigurationError(
                    f"local_workers.devices must be a list of device names like ['cuda:0', 'cpu'], got {self.devices!r}"
                )
            if len(self.devices) != self.count:
                raise ConfigurationError(
                    f"local_workers.devices names {len(self.devices)} devices for local_workers.count={self.count} "
                    "workers; give one device per worker"
                )
            object.__setattr__(self, "devices", list(self.devices))
        check_count("local_workers.threads", self.threads, optional=True)


@dataclasses.dataclass(frozen=True)
class RecoveryOptions:
    """What ``fit`` does when it loses a worker (docs/recovery.md): it places the lost stage again,
    restores every stage from the last whole checkpoint and runs the steps since then again, on the
    same batches, so that the run ends where an uninterrupted one would.

    Args:
        spares: idle workers' addresses, tried in order for a lost stage (with ``hosts``;
            ``dial://NAME`` for one that dials in).
        wait: seconds to wait for the lost worker to answer again at its own address (a restarted
            ``lrmp-worker`` service, a cable plugged back in) when no spare answers.
        rebalance: when neither comes, split the model over the workers that remain (one stage
            fewer; with replicas, the lost worker's row goes). Needs an automatic ``balance``.
        max_recoveries: recoveries per ``fit``; the next loss ends the run, naming every loss.
        max_seconds: the most seconds the recoveries of one ``fit`` may take together, from each
            loss to the end of its placement.
        max_replay_batches: the most training batches kept here to run again (those since the last
            whole checkpoint); past it, the next recovery resumes as Lightning does, with the
            loader's position only if it is stateful, and says so.

    >>> RecoveryOptions(spares=["10.0.0.9:5555"]).spares
    ['tcp://10.0.0.9:5555']
    """

    spares: list[str] = dataclasses.field(default_factory=list)
    wait: float = 60.0
    rebalance: bool = True
    max_recoveries: int = 3
    max_seconds: float = 600.0
    max_replay_batches: int = 1000

    @classmethod
    def of(cls, value: Any) -> RecoveryOptions | None:
        """The strategy's ``recovery`` argument: ``None``/``False`` (off), ``True`` (the defaults), a
        `RecoveryOptions`, or a dict of its fields (a YAML config's)."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls(**_fields_of(cls, value, "recovery"))
        raise ConfigurationError(
            f"recovery must be True, False, a RecoveryOptions or a dict of its fields, got {value!r}"
        )

    def __post_init__(self) -> None:
        if isinstance(self.spares, str) or not isinstance(self.spares, Sequence):
            raise ConfigurationError(f"recovery.spares must be a list of worker addresses, got {self.spares!r}")
        object.__setattr__(self, "spares", [normalize_address(a) for a in self.spares])
        check_timeout("recovery.wait", self.wait)
        check_timeout("recovery.max_seconds", self.max_seconds)
        if not isinstance(self.rebalance, bool):
            raise ConfigurationError(f"recovery.rebalance must be True or False, got {self.rebalance!r}")
        check_count("recovery.max_recoveries", self.max_recoveries)
        check_count("recovery.max_replay_batches", self.max_replay_batches)


@dataclasses.dataclass(frozen=True)
class CurveOptions:
    """CURVE encryption and authentication of every ZeroMQ link, driver to worker and worker to worker.

    Only paths are kept here; the key files are read when the strategy sets up.

    Args:
        secret_key: path of this driver's key pair (``NAME.key_secret`` from ``lrmp-worker keygen``).
        worker_public_keys: with ``hosts``, the workers' public key files (``NAME.key``), one per
            host in ``hosts`` order (row by row with replicas), or a single one when every worker
            runs with the same key pair. Without ``hosts``, leave it empty: the local workers get
            fresh key pairs of their own.
        allow_plaintext_allreduce: with several replicas, let them all-reduce their gradients
            through torch.distributed (gloo or NCCL), which CURVE does not cover: that traffic is
            neither encrypted nor authenticated, so whoever is on the network between the workers
            can read every stage's gradients and alter them. Without it, replicas with keys are
            refused. Only for a network whose hosts are all trusted.
    """

    secret_key: str
    worker_public_keys: list[str] = dataclasses.field(default_factory=list)
    allow_plaintext_allreduce: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "secret_key", _path("curve.secret_key", self.secret_key))
        publics = self.worker_public_keys
        if isinstance(publics, (str, os.PathLike)):
            publics = [publics]  # one key shared by every worker
        if not isinstance(publics, Sequence):
            raise ConfigurationError(f"curve.worker_public_keys must be a list of key file paths, got {publics!r}")
        object.__setattr__(self, "worker_public_keys", [_path("curve.worker_public_keys", p) for p in publics])
        if not isinstance(self.allow_plaintext_allreduce, bool):
            raise ConfigurationError(
                f"curve.allow_plaintext_allreduce must be True or False, got {self.allow_plaintext_allreduce!r}"
            )


@dataclasses.dataclass(frozen=True)
class Topology:
    """Worker addresses, normalised: one row per replica (pipeline), one address per stage.

    Built once from the strategy's ``hosts``; the driver session takes it as it is.
    """

    rows: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if not self.rows or not self.rows[0]:
            raise ConfigurationError("hosts must name at least one worker")
        if any(len(row) != len(self.rows[0]) for row in self.rows):
            raise ConfigurationError(
                f"every replica row of hosts needs the same number of stages, got {[len(r) for r in self.rows]}"
            )
        if len(set(self.addresses)) != len(self.addresses):
            raise ConfigurationError(
                f"worker addresses repeat in hosts: {self.addresses}; give each stage of each replica its own worker"
            )

    @classmethod
    def of(cls, hosts: Topology | Sequence[str] | Sequence[Sequence[str]], *, dial_in: bool = False) -> Topology:
        """``hosts`` as rows (a flat list is one replica), each address ``tcp://``-prefixed. With
        ``dial_in`` (the strategy listens), a bare name (no port) is a worker that dials in,
        ``dial://NAME``.

        >>> Topology.of(["gpu-a", "10.0.0.6:5555"], dial_in=True).rows
        (('dial://gpu-a', 'tcp://10.0.0.6:5555'),)
        """
        if isinstance(hosts, Topology):
            return hosts
        if isinstance(hosts, str) or not isinstance(hosts, Sequence) or not hosts:
            raise ConfigurationError(
                f"hosts must be a non-empty list of worker addresses (or of rows of them), got {hosts!r}"
            )
        nested = [isinstance(h, (list, tuple)) for h in hosts]
        if any(nested) and not all(nested):
            raise ConfigurationError("hosts mixes addresses and rows of addresses; give one or the other")
        rows = [list(row) for row in hosts] if all(nested) else [list(hosts)]
        if any(isinstance(h, (list, tuple)) for row in rows for h in row):
            raise ConfigurationError("hosts nests rows in rows; give a list of addresses, or a list of rows of them")

        def address(a: Any) -> str:
            if dial_in and isinstance(a, str) and WORKER_NAME.fullmatch(a.strip()):
                return DIAL + a.strip()
            return normalize_address(a)

        return cls(tuple(tuple(address(a) for a in row) for row in rows))

    @classmethod
    def in_rows(cls, addresses: Sequence[str], replicas: int) -> Topology:
        """``addresses`` cut into ``replicas`` equal rows, in order (local workers)."""
        per_row = len(addresses) // replicas
        return cls(tuple(tuple(addresses[r * per_row : (r + 1) * per_row]) for r in range(replicas)))

    @property
    def replicas(self) -> int:
        return len(self.rows)

    @property
    def stages(self) -> int:
        return len(self.rows[0])

    @property
    def addresses(self) -> list[str]:
        """Every worker's address, row by row."""
        return [a for row in self.rows for a in row]


def check_listen(listen: Any, topology: Topology | None) -> None:
    """``listen`` is a ``tcp://host:port`` to bind, given exactly when ``hosts`` names workers that dial in."""
    dialed = [n for a in (topology.addresses if topology else []) if (n := dial_name(a))]
    if listen is None:
        if dialed:
            raise ConfigurationError(
                f"hosts names workers that dial in ({', '.join(dialed)}), but listen is not set: give "
                "listen='tcp://0.0.0.0:PORT', the port they dial (lrmp-worker --connect tcp://THIS_HOST:PORT)"
            )
        return
    if not isinstance(listen, str) or not listen.startswith("tcp://") or ":" not in listen[len("tcp://") :]:
        raise ConfigurationError(f"listen must be an address to listen on like 'tcp://0.0.0.0:7000', got {listen!r}")
    if not dialed:
        raise ConfigurationError(
            "listen is for workers that dial in (lrmp-worker --connect), but hosts names none: name them in hosts "
            "by their --name, e.g. hosts=['gpu-a', 'gpu-b']"
        )


def check_replicas(replicas: int, topology: Topology | None, local: LocalWorkerOptions | None) -> int:
    """The number of pipelines: ``hosts``' rows, or ``replicas`` pipelines of the local workers."""
    check_count("replicas", replicas)
    if topology is not None:
        if replicas not in (1, topology.replicas):
            raise ConfigurationError(
                f"replicas={replicas}, but hosts has {topology.replicas} row(s): with hosts, its rows are the "
                "replicas (one row of addresses per pipeline); leave replicas out"
            )
        return topology.replicas
    assert local is not None
    if local.count % replicas:
        raise ConfigurationError(
            f"replicas={replicas} does not divide local_workers.count={local.count}: the local workers must form "
            "equal pipelines (count = stages x replicas)"
        )
    return replicas


def check_curve(curve: CurveOptions | None, topology: Topology | None, replicas: int) -> None:
    """``curve`` fits the workers: a public key per host (or one for all) with ``hosts``, none
    without; replicas only with ``allow_plaintext_allreduce``, since CURVE does not cover the
    replicas' gradient all-reduce (torch.distributed)."""
    if curve is None:
        return
    publics = curve.worker_public_keys
    if topology is None and publics:
        raise ConfigurationError(
            "curve.worker_public_keys is for workers given in hosts; the local workers (hosts=None) get fresh key "
            "pairs: leave it empty"
        )
    if topology is not None and not publics:
        raise ConfigurationError(
            "curve.worker_public_keys is empty: with hosts, give each worker's public key file (NAME.key from "
            "`lrmp-worker keygen`), in hosts order, or one shared by all workers"
        )
    if topology is not None and len(publics) not in (1, len(topology.addresses)):
        raise ConfigurationError(
            f"curve.worker_public_keys names {len(publics)} files for {len(topology.addresses)} hosts: give one per "
            "host, in order (row by row with replicas), or one for all"
        )
    if replicas < 2:
        return
    if not curve.allow_plaintext_allreduce:
        given = f"hosts has {replicas} rows (replicas)" if topology is not None else f"replicas={replicas}"
        raise ConfigurationError(
            f"curve is set and {given}, but the replicas' gradient all-reduce goes through torch.distributed "
            "(gloo or NCCL), which CURVE does not cover: anyone on the network between the workers could read every "
            "stage's gradients and alter them. Train one pipeline (one row of hosts, replicas=1), or set "
            "curve.allow_plaintext_allreduce=True if every host on that network is trusted."
        )
    log.warning(
        "curve.allow_plaintext_allreduce=True: CURVE encrypts and authenticates the driver's and the pipelines' "
        "links, but the %d replicas all-reduce their gradients through torch.distributed (gloo or NCCL) in the "
        "clear and unauthenticated: anyone on the network between the workers can read and alter them",
        replicas,
    )


def check_balance(balance: Any, stages: int) -> None:
    """What can be checked of ``balance`` before the model is seen: its kind, and a list's length
    against the ``stages`` of a pipeline (layer counts: one per stage; submodule names where stages
    1, 2, ... start: one fewer)."""
    if isinstance(balance, dict):
        for key, value in balance.items():
            if not isinstance(key, str) or not key:
                raise ConfigurationError(f"balance's keys must be SpecSequential or split names, got {key!r}")
            _check_one_balance(value, stages, f"balance[{key!r}]")
    else:
        _check_one_balance(balance, stages, "balance")


def balance_for(balance: Any, key: str, names: Sequence[str]) -> Any:
    """The balance of the module ``key`` among the split modules ``names`` (a dict's entry for it, or
    the one balance, which several modules may not share when it is a list)."""
    if isinstance(balance, dict):
        unknown = set(balance) - set(names)
        if unknown:
            raise LrmpError(
                f"balance names {sorted(unknown)}, but the SpecSequentials and split modules are {sorted(names)}"
            )
        return balance.get(key)
    if isinstance(balance, list) and len(names) > 1:
        raise LrmpError(
            f"balance {balance} is ambiguous with several SpecSequentials ({sorted(names)}); "
            "give a dict from their names to layer counts"
        )
    return balance


def _check_one_balance(balance: Any, stages: int, name: str) -> None:
    if balance is None:
        return
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise ConfigurationError(
                f"{name}={balance!r} is unknown; use a list of layers per stage, or one of "
                f"{', '.join(map(repr, BALANCE_MODES))}"
            )
        return
    if isinstance(balance, (list, tuple)) and balance and all(isinstance(b, str) and b for b in balance):
        if len(balance) != stages - 1:
            raise ConfigurationError(
                f"{name} names {len(balance)} submodules where stages 1..{stages - 1} start, but there are {stages} "
                f"stages; give {stages - 1} names"
            )
        return
    if not isinstance(balance, (list, tuple)) or not all(type(b) is int and b >= 1 for b in balance):
        raise ConfigurationError(
            f"{name} must be a list of layers per stage (each at least 1, e.g. [5, 5]), submodule names, or one of "
            f"{', '.join(map(repr, BALANCE_MODES))}; got {balance!r}"
        )
    if len(balance) != stages:
        raise ConfigurationError(f"{name}={list(balance)} has {len(balance)} entries but there are {stages} stages")


def check_timeout(name: str, value: Any, *, optional: bool = False) -> None:
    """``value`` is a number of seconds above zero (or ``None`` when ``optional``: no limit)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")


def check_split_backward(value: Any) -> None:
    """``split_backward`` is ``True``, ``False`` or ``"auto"``."""
    if not is_split_backward(value):
        raise ConfigurationError(f"split_backward must be True, False or 'auto', got {value!r}")


def check_optional_text(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, (str, os.PathLike)) and os.fspath(value).strip()):
        raise ConfigurationError(f"{name} must be a non-empty string, got {value!r}")


def check_split(split: Any) -> list[str]:
    """``split`` as a list of submodule names (empty when ``None``)."""
    if split is None:
        return []
    names = isinstance(split, (list, tuple)) and all(isinstance(n, str) and n for n in split)
    if not names:
        raise ConfigurationError(f"split must be a list of submodule names, e.g. ['model'], got {split!r}")
    return list(split)


def check_count(name: str, value: Any, *, optional: bool = False) -> None:
    """``value`` is an integer of at least 1 (or ``None`` when ``optional``)."""
    if value is None and optional:
        return
    if type(value) is not int:
        raise ConfigurationError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ConfigurationError(f"{name} must be at least 1, got {value!r}")


def _path(name: str, value: Any) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip():
        raise ConfigurationError(f"{name} must be a key file path, got {value!r}")
    return os.fspath(value)


#: ``gather_limit``'s default: 1 GiB of placed weights come back to the driver at most.
DEFAULT_GATHER_LIMIT = 1 << 30


def check_pretrained(pretrained: Any, split: list[str]) -> dict[str, str]:
    """``pretrained`` as a dict from split module names to weight paths (paths are read at setup)."""
    if pretrained is None:
        return {}
    if isinstance(pretrained, (str, os.PathLike)):
        if len(split) != 1:
            raise ConfigurationError(
                f"pretrained is one path, but split names {len(split)} modules ({split}); give a dict from "
                "split module names to their weights' paths"
            )
        pretrained = {split[0]: pretrained}
    if not isinstance(pretrained, dict) or not all(
        isinstance(k, str) and isinstance(v, (str, os.PathLike)) and os.fspath(v).strip() for k, v in pretrained.items()
    ):
        raise ConfigurationError(
            f"pretrained must be a path or a dict from split module names to paths, got {pretrained!r}"
        )
    unknown = sorted(set(pretrained) - set(split))
    if unknown:
        raise ConfigurationError(f"pretrained names {unknown}, which split does not name (split={split})")
    return {k: os.fspath(v) for k, v in pretrained.items()}
