"""The driver's requests that move a stage's tensors: weights and buffers (`GetState`,
`LoadState`), optimizer state (`GetOptimState`, `LoadOptimState`), and a sharded checkpoint's
files, written and read by the workers themselves (`Save`, `Saved`, `ReadOptim`; the files' format is
`lightning_remote_mp.model.weights`). Checked as every request is (`lightning_remote_mp.wire.requests`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.fields import (
    BOOL,
    INT,
    STR,
    Body,
    each,
    field,
    is_int,
    is_str,
    is_str_keyed,
    is_tensor,
    map_of,
)

_INDEX = field(INT)  # the optimizer's position among the driver's optimizers


def is_tensor_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and is_tensor(v) for k, v in value.items())


def is_file_tensor(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and all(map(is_str, value))


def is_file_source(value: Any) -> bool:
    """``[path, name]``, or ``[path, name, how]`` with ``how`` a dict the worker checks when it reads
    the tensor (`lightning_remote_mp.model.weights.QUANTIZE`)."""
    return is_file_tensor(value[:2]) and len(value) <= 3 and (len(value) == 2 or isinstance(value[2], dict))


def _is_names(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


@dataclasses.dataclass(frozen=True)
class Save(Body):
    """SAVE: write this worker's share of a sharded checkpoint (`lightning_remote_mp.driver.checkpoint`)
    as one new safetensors file ``file`` in ``directory``: the stages' tensors under the names
    ``tensors`` gives them (by key, ``"<layer index>.<name>"`` to the LightningModule's state-dict
    key), and each optimizer's state of the parameters ``optim`` names (by optimizer index, the
    worker's parameter name to that key), as ``optimizer.<index>.<key>.<state name>``."""

    KIND: ClassVar[str] = protocol.SAVE

    directory: str = field(STR)
    file: str = field(STR)
    tensors: Mapping[str, Mapping[str, str]] = field(
        map_of(is_str, _is_names, "keys to {name: name} dicts"), write=each(dict)
    )
    optim: Mapping[int, Mapping[str, str]] = field(
        map_of(is_int, _is_names, "optimizer indices to {name: name} dicts"), default_factory=dict, write=dict
    )
    #: Answer once the tensors are copied to host memory and write the file in the background
    #: (`Saved` says when it is written): a save then blocks training only for the copy.
    background: bool = field(BOOL, default=False)


@dataclasses.dataclass(frozen=True)
class Saved(Body):
    """SAVED: whether this worker's file ``file`` of a sharded checkpoint (`Save`) is written:
    ``{"done": bool, "bytes": int}``, or the error its writing raised. ``wait`` waits for it."""

    KIND: ClassVar[str] = protocol.SAVED

    file: str = field(STR)
    wait: bool = field(BOOL, default=False)


@dataclasses.dataclass(frozen=True)
class ReadOptim(Body):
    """READ_OPTIM: load optimizer ``index``'s state from a sharded checkpoint's files: for each of
    its parameters here, the file and the state-dict key it was saved under (`Save`). Parameters
    the checkpoint has no state for (never stepped) start without."""

    KIND: ClassVar[str] = protocol.READ_OPTIM

    index: int = _INDEX
    params: Mapping[str, Sequence[str]] = field(
        map_of(is_str, is_file_tensor, "parameter names to [path, key] pairs"), write=dict
    )


@dataclasses.dataclass(frozen=True)
class GetState(Body):
    """GET_STATE: the weights and buffers of every stage on the worker. It carries nothing."""

    KIND: ClassVar[str] = protocol.GET_STATE


@dataclasses.dataclass(frozen=True)
class LoadState(Body):
    """LOAD_STATE: copy weights and buffers into stages. ``state``: by SpecSequential key, tensors
    named ``"<layer index>.<name>"``."""

    KIND: ClassVar[str] = protocol.LOAD_STATE

    state: Mapping[str, Mapping[str, torch.Tensor]] = field(
        map_of(is_str, is_tensor_map, "keys to {name: tensor} dicts"), write=each(dict)
    )


@dataclasses.dataclass(frozen=True)
class GetOptimState(Body):
    """GET_OPTIM_STATE: optimizer ``index``'s per-parameter state, by parameter name."""

    KIND: ClassVar[str] = protocol.GET_OPTIM_STATE

    index: int = _INDEX


@dataclasses.dataclass(frozen=True)
class LoadOptimState(Body):
    """LOAD_OPTIM_STATE: set optimizer ``index``'s per-parameter ``state`` (by parameter name; each
    a dict such as ``{"step": ..., "exp_avg": ...}``)."""

    KIND: ClassVar[str] = protocol.LOAD_OPTIM_STATE

    index: int = _INDEX
    state: Mapping[str, Mapping[str, Any]] = field(
        map_of(is_str, is_str_keyed, "parameter names to state dicts"), write=each(dict)
    )
