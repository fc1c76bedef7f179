"""``lrmp-worker``: the command that serves stages on a machine with (or without) a GPU.

lrmp-worker --bind tcp://0.0.0.0:5555 --device cuda:0 --allow-module mypackage.layers
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Sequence

from lightning_remote_mp import transport
from lightning_remote_mp.worker.server import DEFAULT_SESSION_TIMEOUT, WorkerServer

log = logging.getLogger("lightning_remote_mp.worker")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lrmp-worker",
        description="Serve model stages to a lightning_remote_mp driver over ZeroMQ.",
    )
    p.add_argument(
        "--bind",
        default="tcp://127.0.0.1:5555",
        help="endpoint to listen on, e.g. tcp://0.0.0.0:5555 (port * picks a free one)",
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
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument(
        "--session-timeout",
        type=float,
        default=DEFAULT_SESSION_TIMEOUT,
        help="seconds without a driver heartbeat before a session is dropped",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s lrmp-worker %(levelname)s %(message)s")
    import torch

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        bind = transport.normalize_address(args.bind)
        server = WorkerServer(
            bind, device=args.device, allowed_prefixes=args.allow_module, session_timeout=args.session_timeout
        )
    except Exception as err:
        print(f"lrmp-worker: {err}", file=sys.stderr)
        return 2
    if not transport.is_loopback(server.endpoint):
        log.warning(
            "listening on %s without encryption or authentication: anyone who can reach this port "
            "can drive this worker (within its class allowlist)",
            server.endpoint,
        )
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>` prints every thread's stack: for a worker that seems stuck
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # The launcher of local workers reads this line to learn the bound port.
    print(f"lrmp-worker ready on {server.endpoint} device={server.device}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    # Sockets are closed and nothing is left to flush but logs; skip the interpreter's slow teardown
    # of torch's module graph so that a stopped worker is gone at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
