"""The driver's requests that move a stage's tensors: weights and buffers (`GetState`,
`LoadState`), optimizer state (`GetOptimState`, `LoadOptimState`), and a sharded checkpoint's
files, written and read by the workers themselves (`Save`, `Saved`, `ReadOptim`; the files' format is
`lightning_remote_mp.model.weights`). Checked as every request is (`lightning_remote_mp.wire.requests`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

import msgspec
import torch

from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.body import Body, each, plain

#: A tensor in a file: ``[path, name in the file]``.
FileTensor = Annotated[list[str], msgspec.Meta(min_length=2, max_length=2)]
#: ``[path, name]``, or ``[path, name, how]`` with ``how`` a dict the worker checks when it reads the
#: tensor (`lightning_remote_mp.model.weights.QUANTIZE`).
FileSource = Annotated[list[Any], msgspec.Meta(min_length=2, max_length=3)]


def check_file_sources(files: Mapping[str, list[Any]]) -> None:
    """Each of ``files`` is a `FileSource` (its length the type checks)."""
    for name, source in files.items():
        if not (all(isinstance(p, str) for p in source[:2]) and (len(source) == 2 or isinstance(source[2], dict))):
            raise ValueError(
                f"field 'files' must map names to [path, name] or [path, name, how]; entry {name!r:.40} does not"
            )


class Save(Body, frozen=True):
    """SAVE: write this worker's share of a sharded checkpoint (`lightning_remote_mp.driver.checkpoint`)
    as one new safetensors file ``file`` in ``directory``: the stages' tensors under the names
    ``tensors`` gives them (by key, ``"<layer index>.<name>"`` to the LightningModule's state-dict
    key), and each optimizer's state of the parameters ``optim`` names (by optimizer index, the
    worker's parameter name to that key), as ``optimizer.<index>.<key>.<state name>``."""

    KIND: ClassVar[str] = protocol.SAVE
    WRITE: ClassVar[dict[str, Any]] = {"tensors": each(plain), "optim": plain}

    directory: str
    file: str
    tensors: dict[str, dict[str, str]]
    optim: dict[int, dict[str, str]] = {}
    #: Answer once the tensors are copied to host memory and write the file in the background
    #: (`Saved` says when it is written): a save then blocks training only for the copy.
    background: bool = False


class Saved(Body, frozen=True):
    """SAVED: whether this worker's file ``file`` of a sharded checkpoint (`Save`) is written:
    ``{"done": bool, "bytes": int}``, or the error its writing raised. ``wait`` waits for it."""

    KIND: ClassVar[str] = protocol.SAVED

    file: str
    wait: bool = False


class ReadOptim(Body, frozen=True):
    """READ_OPTIM: load optimizer ``index``'s state from a sharded checkpoint's files: for each of
    its parameters here, the file and the state-dict key it was saved under (`Save`). Parameters
    the checkpoint has no state for (never stepped) start without."""

    KIND: ClassVar[str] = protocol.READ_OPTIM
    WRITE: ClassVar[dict[str, Any]] = {"params": plain}

    index: int
    params: dict[str, FileTensor]


class GetState(Body, frozen=True):
    """GET_STATE: the weights and buffers of every stage on the worker. It carries nothing."""

    KIND: ClassVar[str] = protocol.GET_STATE


class LoadState(Body, frozen=True):
    """LOAD_STATE: copy weights and buffers into stages. ``state``: by SpecSequential key, tensors
    named ``"<layer index>.<name>"``."""

    KIND: ClassVar[str] = protocol.LOAD_STATE
    WRITE: ClassVar[dict[str, Any]] = {"state": each(plain)}

    state: dict[str, dict[str, torch.Tensor]]


class GetOptimState(Body, frozen=True):
    """GET_OPTIM_STATE: optimizer ``index``'s per-parameter state, by parameter name."""

    KIND: ClassVar[str] = protocol.GET_OPTIM_STATE

    index: int


class LoadOptimState(Body, frozen=True):
    """LOAD_OPTIM_STATE: set optimizer ``index``'s per-parameter ``state`` (by parameter name; each
    a dict such as ``{"step": ..., "exp_avg": ...}``)."""

    KIND: ClassVar[str] = protocol.LOAD_OPTIM_STATE
    WRITE: ClassVar[dict[str, Any]] = {"state": each(plain)}

    index: int
    state: dict[str, dict[str, Any]]
