"""A stage's tensors at rest, on the worker: read at setup from safetensors files by name (a
pretrained model's, a sharded checkpoint's), and written as this worker's share of a sharded
checkpoint, weights and optimizer state together (`lightning_remote_mp.driver.checkpoint`).
The file format is `lightning_remote_mp.model.weights`'; the session's handlers call these."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from lightning_remote_mp.errors import SpecError
from lightning_remote_mp.model.weights import (
    check_readable,
    check_writable,
    file_metadata,
    iter_tensors,
    json_metadata,
    write_tensors,
)
from lightning_remote_mp.wire.state import ReadOptim, Save, Saved
from lightning_remote_mp.worker.stage import StageExecutor

log = logging.getLogger(__name__)


class Progress:
    """How far the long work of this worker has come (reading a stage's weights; writing its share
    of a checkpoint, which counts once its file is written): bytes done out of the total, as its
    heartbeat answers say (``progress``), so that the driver can show it. Set by the serving thread;
    read by the main thread."""

    def __init__(self) -> None:
        self.what = ""
        self.total = 0
        self.done = 0

    @contextmanager
    def of(self, what: str, total: int) -> Iterator[Progress]:
        self.what, self.total, self.done = what, total, 0
        try:
            yield self
        finally:
            self.what = ""

    def add(self, nbytes: int) -> None:
        self.done += nbytes

    def answer(self) -> dict[str, Any]:
        """What a heartbeat answer says of it: ``{"progress": [what, done, total]}``, or nothing."""
        what = self.what
        return {"progress": [what, min(self.done, self.total), self.total]} if what else {}


#: This worker's one piece of long work at a time (a worker serves one session).
PROGRESS = Progress()

#: This worker's own copies of weights files (``lrmp-worker --weights-root DRIVER_DIR=LOCAL_DIR``):
#: a file the driver names under DRIVER_DIR is read from the same place under LOCAL_DIR.
ROOTS: dict[str, str] = {}


def local_path(path: str) -> str:
    """Where this worker reads the file the driver names ``path`` (`ROOTS`)."""
    for remote, local in ROOTS.items():
        head = remote.rstrip("/")
        if path == head or path.startswith(head + "/"):
            return local.rstrip("/") + path[len(head) :]
    return path


def read_stage_files(
    stage: StageExecutor, files: Mapping[str, Sequence[Any]], session: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The stage's tensors named in ``files`` (`Setup.files`), read from their files, one at a time,
    in the dtypes the stage's layers have; and the names of those in files this worker does not
    see (the driver sends them, `lightning_remote_mp.driver.placement.send_unread`)."""
    if not files:
        return {}, []
    started = time.monotonic()
    held = {k: (v.shape, v.dtype) for k, v in stage.layers.state_dict(keep_vars=True).items()}
    unknown = sorted(set(files) - set(held))
    if unknown:
        raise SpecError(f"stage {stage.index}: weights from files for tensors it does not hold: {unknown[:3]}")
    files = {k: (local_path(v[0]), *v[1:]) for k, v in files.items()}
    paths = {v[0] for v in files.values()}
    unseen = {path for path in paths if not os.path.exists(path)}
    for path in paths - unseen:
        check_readable(path)
    wanted = {k: v for k, v in files.items() if v[0] not in unseen}
    total = sum(held[k][0].numel() * held[k][1].itemsize for k in wanted)
    tensors: dict[str, torch.Tensor] = {}
    with PROGRESS.of("reading weights", total):
        for local, tensor in iter_tensors(wanted, held):
            tensors[local] = tensor
            PROGRESS.add(tensor.nbytes)
    log.info(
        "session %s: stage %d read %d tensors (%.1f MB) from %d files in %.1f s%s",
        session,
        stage.index,
        len(tensors),
        total / 1e6,
        len({v[0] for v in wanted.values()}),
        time.monotonic() - started,
        f"; {len(unseen)} files are not on this machine, the driver sends their tensors" if unseen else "",
    )
    return tensors, sorted(set(files) - set(wanted))


def save_shard(
    msg: Save,
    stages: Mapping[str, StageExecutor],
    optimizers: Mapping[int, torch.optim.Optimizer],
    named: Mapping[str, torch.nn.Parameter],
    session: str,
) -> Future[dict[str, Any]]:
    """Write the tensors and optimizer state ``msg`` names as one new safetensors file; optimizer
    state that is no tensor (a step count kept as a number) goes in the file's metadata. With
    ``msg.background``, the tensors are copied to host memory here and the file is written by a
    thread while training goes on; the future says when it is written."""
    started = time.monotonic()
    check_writable(msg.directory)
    tensors: dict[str, torch.Tensor] = {}
    for key, names in msg.tensors.items():
        state = stages[key].state_dict()
        missing = sorted(set(names) - set(state))
        if missing:
            raise SpecError(f"checkpoint asks for tensors stage {stages[key].index} does not hold: {missing[:3]}")
        tensors.update({full: state[local] for local, full in names.items()})
    scalars: dict[str, Any] = {}
    for index, params in msg.optim.items():
        opt = optimizers.get(index)
        if opt is None:
            continue
        for name, full in params.items():
            param = named.get(name)
            if param is None:
                raise SpecError(f"checkpoint asks for the optimizer state of {name}, which this worker does not hold")
            for k, v in opt.state.get(param, {}).items():
                (tensors if isinstance(v, torch.Tensor) else scalars)[f"optimizer.{index}.{full}.{k}"] = v
    metadata = json_metadata({"scalars": scalars})

    def write() -> dict[str, Any]:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with PROGRESS.of("writing a checkpoint", total):
            size = write_tensors(msg.directory, msg.file, tensors, metadata)
        seconds = time.monotonic() - started
        log.info("session %s: wrote %s (%.1f MB) in %.1f s", session, msg.file, size / 1e6, seconds)
        return {"bytes": size, "seconds": seconds}

    if not msg.background:
        done: Future[dict[str, Any]] = Future()
        done.set_result(write())
        return done
    tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}  # what the step changes next
    log.info("session %s: copied %s's tensors in %.2f s", session, msg.file, time.monotonic() - started)
    return _WRITER.submit(write)


#: Writes this worker's checkpoint files in the background (`Save.background`), one at a time.
_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lrmp-checkpoint")


def saved(msg: Saved, writes: Mapping[str, Future[dict[str, Any]]]) -> dict[str, Any]:
    """Whether the file ``msg`` names is written (`Saved`): its bytes, or the error writing it raised."""
    future = writes.get(msg.file)
    if future is None:
        raise SpecError(f"this worker writes no checkpoint file {msg.file!r} in this session")
    if not msg.wait and not future.done():
        return {"done": False}
    return {"done": True, **future.result()}


def read_optimizer_state(msg: ReadOptim) -> dict[str, dict[str, Any]]:
    """Each parameter's optimizer state that ``msg`` points at in a sharded checkpoint's files."""
    from safetensors import safe_open

    state: dict[str, dict[str, Any]] = {}
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name, (path, full) in msg.params.items():
        by_file.setdefault(local_path(path), []).append((name, f"optimizer.{msg.index}.{full}."))
    for path, wanted in by_file.items():
        check_readable(path)
        with safe_open(path, framework="pt") as f:
            scalars = (file_metadata(f) or {}).get("scalars", {})
            keys = list(f.keys())
            for name, head in wanted:
                entry: dict[str, Any] = {k[len(head) :]: f.get_tensor(k) for k in keys if k.startswith(head)}
                entry.update({k[len(head) :]: v for k, v in scalars.items() if k.startswith(head)})
                if entry:
                    state[name] = entry
    return state
