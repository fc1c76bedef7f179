"""``lrmp-worker``: the command that serves stages on a machine with (or without) a GPU.

lrmp-worker --bind tcp://0.0.0.0:5555 --device cuda:0 --allow-module mypackage.layers \\
    --secret-key keys/worker1.key_secret --authorized-keys keys/drivers

``lrmp-worker keygen [DIR] --name NAME`` writes a CURVE key pair (``NAME.key``, ``NAME.key_secret``),
into ``~/.lrmp`` without ``DIR``. ``lrmp-worker --version`` says which lrmp, wire protocol and torch
it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Sequence

from lightning_remote_mp._version import __version__
from lightning_remote_mp.errors import ConfigurationError
from lightning_remote_mp.model import operators
from lightning_remote_mp.wire import addresses, protocol
from lightning_remote_mp.worker import allocator, weights
from lightning_remote_mp.worker.admission import DEFAULT_SESSION_TIMEOUT
from lightning_remote_mp.worker.server import WorkerServer
from lightning_remote_mp.worker.signals import StopSignal

log = logging.getLogger("lightning_remote_mp.worker")

DEFAULT_BIND = "tcp://127.0.0.1:5555"  # loopback: a worker listens beyond this machine only when told to
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def parse_size(text: str) -> int:
    """``"1048576"``, ``"64MiB"``, ``"2GB"``... as a number of bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]i?)?b?\s*", text.lower())
    if not m or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 1048576, 64MiB or 2GB")
    return int(m.group(1)) * _UNITS[m.group(2) or ""]


def _size_text(n: int) -> str:
    """``16GiB``, ``64MiB``, ``512KiB`` or bytes: a size as `parse_size` reads it back."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def version_line() -> str:
    """``lrmp-worker 0.13.0 (wire protocol 13, torch 2.13.0+cpu)``: what ``--version`` prints."""
    import torch

    return f"lrmp-worker {__version__} (wire protocol {protocol.PROTOCOL_VERSION}, torch {torch.__version__})"


class _PrintVersion(argparse.Action):
    """``--version``: argparse's own action takes its text when the parser is built, which would
    import torch for every ``--help``; this one asks for it only when the flag is given."""

    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    d = protocol.DEFAULT_LIMITS
    p = argparse.ArgumentParser(
        prog="lrmp-worker",
        description="Serve model stages to a lightning_remote_mp driver over ZeroMQ. "
        "`lrmp-worker keygen [DIR] --name NAME` writes a CURVE key pair instead.",
    )
    p.add_argument(
        "--version", action=_PrintVersion, help="print lrmp's, the wire protocol's and torch's versions, and exit"
    )
    p.add_argument(
        "--bind",
        default=None,
        help=f"endpoint to listen on, e.g. tcp://0.0.0.0:5555 (port * picks a free one; default {DEFAULT_BIND})",
    )
    p.add_argument(
        "--connect",
        metavar="ADDRESS",
        help="dial the driver at this address (its listen=, e.g. tcp://driver:7000) and listen on nothing: for a "
        "machine behind NAT or a firewall that accepts no connections",
    )
    p.add_argument(
        "--name",
        default=None,
        help="with --connect: the name the driver's hosts list this worker by (default: this machine's hostname)",
    )
    p.add_argument("--device", default="cpu", help="where this worker keeps its layers: cpu or cuda:N")
    p.add_argument(
        "--allow-module",
        action="append",
        default=[],
        metavar="PREFIX",
        help="also build layer/optimizer classes under this module prefix (repeatable); "
        "torch.nn, torch.optim and lightning_remote_mp.layers are always allowed",
    )
    p.add_argument(
        "--allow-op",
        action="append",
        default=[],
        metavar="aten::NAME",
        help="also run this ATen operator in traced programs (repeatable), beyond those derived from torch's "
        "operator schemas (lightning_remote_mp.model.operators); never one the denylist names",
    )
    p.add_argument(
        "--weights-root",
        action="append",
        default=[],
        metavar="DRIVER_DIR=LOCAL_DIR",
        help="this machine's own copy of weights files: read a file the driver names under DRIVER_DIR (pretrained=, "
        "a checkpoint) from LOCAL_DIR instead (repeatable); without it, files not at the driver's path come from "
        "the driver",
    )
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument(
        "--session-timeout",
        type=float,
        default=DEFAULT_SESSION_TIMEOUT,
        help="seconds without a driver heartbeat before a session is dropped",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop when the process that started this worker ends (local workers a driver started)",
    )
    sec = p.add_argument_group("encryption and authentication (CURVE)")
    sec.add_argument(
        "--secret-key",
        metavar="FILE",
        help="this worker's key pair (NAME.key_secret from `lrmp-worker keygen`); requires --authorized-keys",
    )
    sec.add_argument(
        "--authorized-keys",
        metavar="DIR",
        help="directory of the public keys (*.key) of the drivers allowed to connect; re-read at each connection",
    )
    sec.add_argument(
        "--driver-key",
        metavar="FILE",
        help="with --connect: the public key (NAME.key) the driver must prove (default: the only key in "
        "--authorized-keys)",
    )
    lim = p.add_argument_group("limits on what this worker accepts")
    for f in dataclasses.fields(protocol.Limits):
        if "flag" not in f.metadata:
            continue
        default, in_bytes = getattr(d, f.name), f.metadata.get("bytes", False)
        lim.add_argument(
            f.metadata["flag"],
            dest=f.name,
            type=parse_size if in_bytes else _positive_int,
            default=default,
            metavar="SIZE" if in_bytes else "N",
            help=f"{f.metadata['help']} (default {_size_text(default) if in_bytes else default})",
        )
    return p


def insecure_bind_warning(endpoint: str, secure: bool) -> str | None:
    """The warning for a worker reachable beyond this machine without CURVE (``None`` otherwise)."""
    if secure or addresses.is_loopback(endpoint):
        return None
    return (
        f"listening on {endpoint} WITHOUT encryption or authentication: anyone who can reach this port can "
        "drive this worker (within its class allowlist), make it connect to addresses of their choosing, and "
        "read or alter what it computes. Start it with --secret-key and --authorized-keys (see "
        "`lrmp-worker keygen --help`) unless every host on this network is trusted"
    )


def loopback_hint(endpoint: str) -> str | None:
    """What the ready line adds for a worker that only this machine can reach (``None`` otherwise):
    ``--bind`` defaults to loopback, and a driver elsewhere would otherwise just time out."""
    if not endpoint.startswith("tcp://") or not addresses.is_loopback(endpoint):
        return None
    port = endpoint.rpartition(":")[2]
    return (
        f"(loopback: only this machine can reach it; start it with --bind tcp://0.0.0.0:{port} "
        "to accept other machines)"
    )


def ready_line(where: str, device: object, hint: str | None = None) -> str:
    """The line a worker prints once it serves; the launcher of local workers reads the address
    from its first word after ``ready on``."""
    line = f"lrmp-worker ready on {where} device={device} lrmp={__version__} protocol={protocol.PROTOCOL_VERSION}"
    return f"{line} {hint}" if hint else line


def dial_in(args: argparse.Namespace, secure: bool) -> tuple[str | None, str, bytes | None]:
    """``--connect``'s address, the worker's name, and the driver's public key to check (with CURVE)."""
    if args.connect is None:
        if args.name is not None or args.driver_key is not None:
            raise ConfigurationError("--name and --driver-key are for a worker that dials in: give --connect too")
        return None, "", None
    if args.bind is not None:
        raise ConfigurationError("--connect and --bind exclude each other: a worker that dials in listens on nothing")
    connect = addresses.normalize_address(args.connect)
    if not connect.startswith("tcp://"):
        raise ConfigurationError(f"--connect {args.connect}: give the driver's listen address, tcp://host:port")
    name = args.name if args.name is not None else socket.gethostname().split(".")[0]
    if not addresses.WORKER_NAME.fullmatch(name):
        raise ConfigurationError(
            f"--name {name!r}: use letters, digits, '.', '_' and '-' (at most 63), as the driver's hosts names it"
        )
    if not secure:
        return connect, name, None
    from lightning_remote_mp.wire.keys import load_authorized_keys, load_public_key

    if args.driver_key is not None:
        return connect, name, load_public_key(args.driver_key)
    keys = sorted(load_authorized_keys(args.authorized_keys))
    if len(keys) != 1:
        raise ConfigurationError(
            f"--authorized-keys {args.authorized_keys} holds {len(keys)} public keys; a worker that dials in checks "
            "exactly one driver's: name it with --driver-key FILE"
        )
    return connect, name, keys[0]


def keygen(argv: Sequence[str]) -> int:
    from lightning_remote_mp.wire.keys import DEFAULT_KEY_DIR, KeyFileError, generate_keypair

    p = argparse.ArgumentParser(
        prog="lrmp-worker keygen",
        description="Write a CURVE key pair: NAME.key (public: give it to the other side) and NAME.key_secret "
        "(private, readable by you only).",
    )
    p.add_argument(
        "dir",
        nargs="?",
        default=DEFAULT_KEY_DIR,
        help=f"directory to write the two files into (default {DEFAULT_KEY_DIR}; created readable by you only "
        "if missing)",
    )
    p.add_argument("--name", default="worker", help="base name of the files (default: worker)")
    p.add_argument("--force", action="store_true", help="replace existing files of that name")
    args = p.parse_args(argv)
    try:
        public_file, secret_file = generate_keypair(args.dir, args.name, overwrite=args.force)
    except (KeyFileError, OSError) as err:
        print(f"lrmp-worker keygen: {err}", file=sys.stderr)
        return 2
    print(f"wrote a key pair into {public_file.parent}")
    print(f"public key: {public_file}")
    print(f"secret key: {secret_file} (keep it private)")
    return 0


def weights_roots(values: Sequence[str]) -> dict[str, str]:
    """``--weights-root DRIVER_DIR=LOCAL_DIR`` values as a dict, each an absolute directory pair."""
    roots = {}
    for value in values:
        remote, sep, local = value.partition("=")
        if not sep or not os.path.isabs(remote) or not os.path.isabs(local):
            raise ConfigurationError(
                f"--weights-root {value!r}: give DRIVER_DIR=LOCAL_DIR, both absolute, e.g. /models=/data/models"
            )
        if not os.path.isdir(local):
            raise ConfigurationError(f"--weights-root {value!r}: {local} is no directory on this machine")
        roots[remote] = local
    return roots


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["keygen"]:
        return keygen(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s lrmp-worker %(levelname)s %(message)s")
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    allocator.keep_freed_memory()
    try:
        import zmq

        from lightning_remote_mp.wire.keys import load_keypair

        if (args.secret_key is None) != (args.authorized_keys is None):
            raise ConfigurationError(
                "--secret-key and --authorized-keys go together: the first is this worker's key pair, the "
                "second the directory of the public keys allowed to connect"
            )
        keys = None
        if args.secret_key is not None:
            if not zmq.has("curve"):
                raise ConfigurationError("this libzmq was built without CURVE support; install pyzmq's own wheel")
            keys = load_keypair(args.secret_key)
        from lightning_remote_mp.worker.deferred_grads import auto_min_macs

        auto_min_macs(torch.device("cpu"))  # a malformed LRMP_SPLIT_BACKWARD_MIN_MACS fails here, not at setup
        limits = protocol.Limits(**{name: getattr(args, name) for name in protocol.LIMIT_FLAGS})
        weights.ROOTS.update(weights_roots(args.weights_root))
        try:
            operators.allow(args.allow_op)
        except ValueError as err:
            raise ConfigurationError(f"--allow-op: {err}") from None
        connect, name, driver_key = dial_in(args, keys is not None)
        bind = addresses.normalize_address(args.bind or DEFAULT_BIND)
        server = WorkerServer(
            bind,
            device=args.device,
            allowed_prefixes=args.allow_module,
            session_timeout=args.session_timeout,
            limits=limits,
            keys=keys,
            authorized_keys=args.authorized_keys,
            parent=os.getppid() if args.exit_with_parent else None,
            connect=connect,
            name=name,
            driver_key=driver_key,
        )
    except Exception as err:
        print(f"lrmp-worker: {err}", file=sys.stderr)
        return 2
    if connect is not None:
        if not server.secure and not addresses.is_loopback(connect):
            log.warning(
                "dialing %s WITHOUT encryption or authentication: whoever answers at that address, or sits between, "
                "drives this worker. Start it with --secret-key and --authorized-keys unless the network is trusted",
                connect,
            )
    elif warning := insecure_bind_warning(server.endpoint, server.secure):
        log.warning("%s", warning)
    if server.secure:
        log.info(
            "CURVE on: public key %s; drivers allowed from %s",
            server.keys.public.decode() if server.keys else "?",
            args.authorized_keys,
        )
    stop_signal = StopSignal(server.stop)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack: for a worker that seems stuck
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The launcher of local workers reads this line to learn the bound port (or the name it dials in by).
    if connect is not None:
        print(ready_line(f"{addresses.DIAL}{name} (dialing {connect})", server.device), flush=True)
    else:
        print(ready_line(server.endpoint, server.device, loopback_hint(server.endpoint)), flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    if stop_signal.received is not None:
        log.info("stopped by %s", stop_signal.received)
    # Sockets are closed and nothing is left to flush but logs; skip the interpreter's slow teardown
    # of torch's module graph so that a stopped worker is gone at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
