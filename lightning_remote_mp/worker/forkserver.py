"""The fork server of local workers: one process imports torch and the worker and pays their
first-use costs once, then forks every ``lrmp-worker`` a driver starts on this machine
(`lightning_remote_mp.driver.launch`).

Started apart, each local worker imports torch and lrmp (1.1 s of CPU on this project's 2-core
machine) and warms up (`lightning_remote_mp.worker.server._warm_up`: 0.85 s, ``torch._dynamo`` and
sympy) beside the driver, which traces the model at the same time. Forked, the workers share one
import, and the pages it filled until they write to them: ``benchmarks/depth.py --apart`` measures
the first step both ways (docs/tracing.md, "Deep models"), and two idle forked workers and their
server hold 287 MB of memory (proportional set size) against 495 MB for two started apart.

The driver runs ``python -m lightning_remote_mp.worker.forkserver`` and writes one line of JSON to
its stdin, a list with one ``{"argv": [lrmp-worker flags], "output": FD}`` a worker, FD the write end
of a pipe the driver passed. Each worker is forked with FD as its stdout and stderr and /dev/null as
its stdin, and runs `lightning_remote_mp.worker.cli.main` on its flags: a worker as ``lrmp-worker``
starts it, but for the imports. The server reports on its stdout, a line each: ``forked INDEX
PID`` and ``ended INDEX CODE`` (``CODE`` as `subprocess.Popen.returncode` gives it). When its stdin
ends (the driver stopped them, or died) it SIGTERMs the workers left, SIGKILLs those still there
`STOP_GRACE` seconds later, and exits once every one has ended. A worker dies with the server: the
kernel SIGKILLs it when the server ends (``PR_SET_PDEATHSIG``). The server runs in a session of its
own, and ignores SIGINT: a ^C in the driver's terminal reaches the driver alone, which brings the
weights back from the workers before it stops them. If the imports fail, every worker's
output gets the traceback, as each would have printed it, and the server exits with 1.

Linux only (the driver starts workers apart elsewhere). Before forking the server imports and runs
nothing else: no tensor operation on more than one thread (GNU OpenMP's threads do not survive a
fork: a product of two 2,000 x 2,000 matrices in a child forked after one on 2 threads never
returned), no autograd (its engine counts the devices, CUDA's included, and refuses to run in a
child forked after it started its threads), nothing of CUDA (which a forked child could not use).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
import traceback
import warnings

#: Seconds the workers left get between SIGTERM and SIGKILL once the server's stdin ends.
STOP_GRACE = 5.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prepare() -> None:
    """Import what every worker imports, torch's first-use imports included (what
    `lightning_remote_mp.worker.server._warm_up` pays apart: ``torch._dynamo`` and sympy, 0.94 s
    here, after which it takes 4 ms), and run nothing."""
    import torch._dynamo  # noqa: F401 (the first optimizer step's; it imports sympy, the first backward's)

    from lightning_remote_mp.worker import cli  # noqa: F401 (torch, zmq, the server)


def _die_with(server: int) -> None:
    """Have the kernel SIGKILL this process when the server ends (``PR_SET_PDEATHSIG``), and end now if
    it has already."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != server:
        os._exit(1)


def _fork(argv: list[str], output: int, others: list[int]) -> int:
    """Fork a worker writing to ``output`` (``others``: the outputs of the workers still to fork, which
    it closes); the child never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    server = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _die_with(server)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python process
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        for fd in {devnull, output, *others}:
            os.close(fd)
        sys.argv = ["lrmp-worker", *argv]
        from lightning_remote_mp.worker import cli

        code = cli.main(argv)
    except SystemExit as stop:  # as the interpreter reads it
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _read_line() -> bytes:
    """The first line of stdin, read without Python's buffered reader (see `_stop_on_eof`)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(0, 1)
        if not chunk:
            break
        data += chunk
    return data


def _stop_on_eof(pids: dict[int, int]) -> None:
    """Wait for the end of stdin, then stop the workers left (`STOP_GRACE`). Read with ``os.read``: a
    daemon thread blocked in ``sys.stdin.buffer.read`` holds the reader's lock, and the interpreter
    aborts at exit when it finds it held."""
    while os.read(0, 65536):
        pass
    for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, 0.0)):
        for pid in list(pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        threading.Event().wait(wait)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops the server, through its stdin
    spec = json.loads(_read_line() or b"[]")
    outputs = [int(worker["output"]) for worker in spec]
    try:
        _prepare()
    except BaseException:
        text = traceback.format_exc().encode()
        for fd in outputs:
            os.write(fd, text)
        return 1
    # The server has a thread of numpy's OpenBLAS, which OpenBLAS itself handles at a fork.
    warnings.filterwarnings("ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning)
    pids: dict[int, int] = {}
    for index, worker in enumerate(spec):
        pid = _fork([str(a) for a in worker["argv"]], outputs[index], outputs[index + 1 :])
        pids[pid] = index
        os.close(outputs[index])
        _report(f"forked {index} {pid}")
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
    code = main()
    sys.stdout.flush()
    os._exit(code)  # nothing to tear down: skip the interpreter's slow teardown of torch
