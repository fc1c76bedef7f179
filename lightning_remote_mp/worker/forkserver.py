"""The fork server of local workers: one process imports torch and the worker and pays their
first-use costs once, then forks every ``lrmp-worker`` a driver starts on this machine
(`lightning_remote_mp.driver.launch`).

Started apart, each local worker imports torch and lrmp (1.1 s of CPU on this project's 2-core
machine) and warms up (`lightning_remote_mp.worker.server._warm_up`: 0.85 s, ``torch._dynamo`` and
sympy) beside the driver, which traces the model at the same time. Forked, the workers share one
import, and the pages it filled until they write to them: ``benchmarks/depth.py --apart`` measures
the first step both ways (docs/tracing.md, "Deep models"), and two idle forked workers and their
server hold 256 MB of memory (proportional set size) against 468 MB for two started apart.

The driver runs ``python -m lightning_remote_mp.worker.forkserver SPEC``, SPEC a JSON list with one
``{"argv": [lrmp-worker flags], "output": FD}`` a worker, FD the write end of a pipe the driver
passed. Each worker is forked with FD as its stdout and stderr and /dev/null as its stdin, and runs
`lightning_remote_mp.worker.cli.main` on its flags: a worker as ``lrmp-worker`` starts it, but
for the imports. The server reports on its stdout, a line each: ``forked INDEX PID`` and
``ended INDEX CODE`` (``CODE`` as `subprocess.Popen.returncode` gives it). When its stdin ends
(the driver stopped them, or died) it SIGTERMs the workers left, SIGKILLs those still there
`STOP_GRACE` seconds later, and exits once every one has ended; workers started with
``--exit-with-parent`` stop by themselves if the server is killed. If the imports fail, every
worker's output gets the traceback, as each would have printed it, and the server exits with 1.

Linux only (the driver starts workers apart elsewhere): forking after torch's import is what
torch's own ``DataLoader`` workers do there. Nothing here touches CUDA, which a forked process
could not use.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import traceback

#: Seconds the workers left get between SIGTERM and SIGKILL once the server's stdin ends.
STOP_GRACE = 5.0


def _prepare() -> None:
    """Import what every worker imports and pay torch's first-use imports, before forking. The
    server computes on one thread: a pool of OpenMP threads started here would hang a worker's
    first parallel operation on its main thread (GNU OpenMP is not fork-safe: a product of two
    2,000 x 2,000 matrices in a child forked after one on 2 threads never returned; the stages
    compute on the serving thread, whose pool is its own)."""
    import torch

    torch.set_num_threads(1)
    from lightning_remote_mp.worker import cli  # noqa: F401 (torch, zmq, the server)
    from lightning_remote_mp.worker.server import _warm_up

    _warm_up()


def _fork(argv: list[str], output: int, others: list[int]) -> int:
    """Fork a worker writing to ``output`` (``others``: the outputs of the workers still to fork, which
    it closes); the child never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        for fd in {devnull, output, *others}:
            os.close(fd)
        sys.argv = ["lrmp-worker", *argv]
        from lightning_remote_mp.worker import cli

        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop_on_eof(pids: dict[int, int]) -> None:
    """Wait for the end of stdin, then stop the workers left (`STOP_GRACE`)."""
    sys.stdin.buffer.read()
    for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, 0.0)):
        for pid in list(pids):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        threading.Event().wait(wait)


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    outputs = [int(worker["output"]) for worker in spec]
    try:
        _prepare()
    except BaseException:
        text = traceback.format_exc().encode()
        for fd in outputs:
            os.write(fd, text)
        return 1
    pids: dict[int, int] = {}
    for index, worker in enumerate(spec):
        pid = _fork([str(a) for a in worker["argv"]], outputs[index], outputs[index + 1 :])
        pids[pid] = index
        os.close(outputs[index])
        _report(f"forked {index} {pid}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C reaches the workers (and the driver), which stop them
    threading.Thread(target=_stop_on_eof, args=(pids,), name="stop-on-eof", daemon=True).start()
    while pids:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid in pids:
            index = pids.pop(pid)
            _report(f"ended {index} {os.waitstatus_to_exitcode(status)}")
    return 0


def _report(line: str) -> None:
    with contextlib.suppress(OSError):  # the driver is gone: the workers are stopped all the same
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
