"""A model's tensors at rest: safetensors files, read and written by tensor name.

Two kinds of directory hold a model's tensors by name, and both are read the same way, one tensor
at a time, by whoever needs it (torchtitan and Petals load this way; nothing is pickled):

- a **pretrained model** as ``save_pretrained`` writes it: ``model.safetensors``, or shards listed by
  ``model.safetensors.index.json``'s ``weight_map``;
- a **sharded checkpoint** as lrmp writes it (`SHARDED_MANIFEST`): one file per stage, written by
  the worker that holds the stage, plus the driver's small Lightning state.

`TensorFiles` indexes such a directory by name from the files' headers alone (no tensor is read);
`iter_tensors` reads the named tensors a stage needs from it, one at a time; `write_tensors` writes a stage's file.
The driver indexes; the workers read and write.

>>> import tempfile, torch
>>> d = tempfile.mkdtemp()
>>> write_tensors(d, "stage0.safetensors", {"w": torch.ones(2, 3)}) > 24  # bytes: a header, then the data
True
>>> files = TensorFiles.of(d)
>>> files.find("w").shape
(2, 3)
>>> dict(iter_tensors({"w": (files.find("w").path, "w")}, {"w": (torch.Size([2, 3]), torch.float64)}))["w"].dtype
torch.float64
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_remote_mp.errors import WeightsError
from lightning_remote_mp.model import four_bit

#: The manifest of a sharded checkpoint directory (`lightning_remote_mp.driver.checkpoint`).
SHARDED_MANIFEST = "lrmp-checkpoint.json"
#: In the name of the directory a sharded checkpoint is written into before it takes its own: the
#: only kind of directory a worker writes in (`write_tensors`).
PARTIAL = ".lrmp-partial-"
#: The index ``save_pretrained`` writes beside sharded safetensors.
HF_INDEX = "model.safetensors.index.json"
HF_SINGLE = "model.safetensors"

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class FileTensor:
    """One tensor in a safetensors file: where it is (``path``, its ``name`` there), its shape and dtype."""

    path: str
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class TensorFiles:
    """The tensors of a directory of safetensors files (or of one file), by name, read from the
    files' headers only. ``find`` looks a name up, also as peft names a base model's tensors
    (``base_model.model.`` before, ``.base_layer`` inside): a LoRA model finds its base weights in
    the pretrained files."""

    def __init__(self, root: str, tensors: Mapping[str, FileTensor]) -> None:
        self.root = root
        self.tensors = dict(tensors)

    @classmethod
    def of(cls, path: str | os.PathLike[str], files: list[str] | None = None) -> TensorFiles:
        """Index ``path``: a ``.safetensors`` file, or a directory (``files`` in it, or those its
        index names, or every ``*.safetensors`` in it)."""
        root = Path(path)
        if not root.exists():
            raise WeightsError(f"weights path {str(root)!r} does not exist")
        if root.is_file():
            return cls(str(root.parent), dict(_headers(root)))
        if not root.is_dir():
            raise WeightsError(f"weights path {str(root)!r} is neither a safetensors file nor a directory")
        if files is None:
            index = root / HF_INDEX
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_text())["weight_map"]
                except (ValueError, KeyError, TypeError) as err:
                    raise WeightsError(f"{index}: not a safetensors index ({err})") from None
                files = sorted(set(weight_map.values()))
            else:
                files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise WeightsError(
                f"weights directory {str(root)!r} holds no safetensors files ({HF_SINGLE}, or shards with {HF_INDEX}); "
                "save the model with save_pretrained(..., safe_serialization=True)"
            )
        tensors: dict[str, FileTensor] = {}
        for name in files:
            tensors.update(_headers(root / name))
        return cls(str(root), tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def find(self, name: str) -> FileTensor | None:
        for candidate in _candidates(name):
            found = self.tensors.get(candidate)
            if found is not None:
                return found
        return None

    def under(self, prefix: str) -> TensorFiles:
        """The tensors whose names start with ``prefix``, without it."""
        n = len(prefix)
        return TensorFiles(self.root, {k[n:]: v for k, v in self.tensors.items() if k.startswith(prefix)})


def _candidates(name: str) -> Iterator[str]:
    yield name
    plain = name.replace(".base_layer.", ".")
    for head in ("base_model.model.", ""):
        if plain.startswith(head) and plain[len(head) :] != name:
            yield plain[len(head) :]


def _headers(path: Path) -> Iterator[tuple[str, FileTensor]]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = _DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise WeightsError(f"{path}: tensor {name!r} has dtype {sl.get_dtype()}, which lrmp does not read")
                yield name, FileTensor(str(path), name, tuple(sl.get_shape()), dtype)
    except FileNotFoundError:
        raise WeightsError(f"weights file {str(path)!r} does not exist") from None
    except WeightsError:
        raise
    except Exception as err:  # safetensors raises its own error types for a damaged header
        raise WeightsError(f"weights file {str(path)!r} is not a readable safetensors file: {err}") from None


#: How a stage's tensor comes out of a file when not as it is there: the third element of a
#: `Setup.files` entry (``[path, name, how]``), plain data the worker checks (`_how`):
#:
#: - ``{"quantize": Format.describe(), "part": PART}``: part PART of the 4-bit weight (`four_bit`) that
#:   quantizing the file's full-precision tensor gives: a QLoRA base read from bf16/fp32 files;
#: - ``{"quant_state": "offset"}``: the double quantization's offset, from the JSON tensor bitsandbytes
#:   writes beside a 4-bit weight (``<weight>.quant_state.bitsandbytes__nf4``): a pre-quantized file.
QUANTIZE, QUANT_STATE = "quantize", "quant_state"


def _how(how: Any, where: str) -> tuple[four_bit.Format, str] | None:
    """A `Setup.files` entry's third element, checked: ``(format, part)`` to quantize, ``None`` for the offset."""
    if isinstance(how, dict) and how == {QUANT_STATE: "offset"}:
        return None
    if not (isinstance(how, dict) and set(how) == {QUANTIZE, "part"} and isinstance(how["part"], str)):
        raise WeightsError(f"{where}: {how!r:.80} is not a way to read a tensor")
    try:
        fmt = four_bit.Format.parse(how[QUANTIZE], where)
    except ValueError as err:
        raise WeightsError(str(err)) from None
    if how["part"] not in fmt.parts():
        raise WeightsError(f"{where}: a 4-bit weight has no part {how['part']!r}")
    return fmt, how["part"]


def iter_tensors(
    wanted: Mapping[str, Sequence[Any]], expected: Mapping[str, tuple[torch.Size, torch.dtype]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``wanted`` (a local name: its file, its name there, and optionally how it comes
    out of it, `QUANTIZE`), read one at a time, file by file, as ``(local name, tensor)``; with
    ``expected``, checked against its shape and cast to its dtype. A weight quantized to 4 bits is
    read and quantized once for all its parts. A missing file or tensor, or another shape, raises
    `WeightsError` naming both."""
    from safetensors import safe_open

    by_file: dict[str, list[tuple[str, str, Any]]] = {}
    for local, (path, name, *how) in wanted.items():
        by_file.setdefault(path, []).append((local, name, how[0] if how else None))
    for path, names in by_file.items():
        try:
            f = safe_open(path, framework="pt")
        except FileNotFoundError:
            raise WeightsError(
                f"weights file {path!r} does not exist on this machine: give every worker the files at the same path "
                "(a shared file system, or a copy)"
            ) from None
        except Exception as err:
            raise WeightsError(f"weights file {path!r} cannot be read: {err}") from None
        with f:
            held = set(f.keys())
            quantized: dict[tuple[str, four_bit.Format], dict[str, torch.Tensor]] = {}
            for local, name, how in names:
                if name not in held:
                    raise WeightsError(f"weights file {path!r} holds no tensor {name!r} (wanted for {local})")
                where = f"weights file {path!r}, tensor {name!r} (for {local})"
                if how is None:
                    tensor = f.get_tensor(name)
                elif (recipe := _how(how, where)) is None:
                    tensor = _offset(f.get_tensor(name), where)
                else:
                    fmt, part = recipe
                    if (name, fmt) not in quantized:
                        quantized.clear()  # one weight's parts at a time: they come one after the other
                        quantized[(name, fmt)] = _quantized(f.get_slice(name), fmt, where)
                    tensor = quantized[(name, fmt)][part]
                if expected is None:
                    yield local, tensor
                    continue
                shape, dtype = expected[local]
                if tuple(tensor.shape) != tuple(shape):
                    raise WeightsError(
                        f"tensor {name!r} in {path!r} has shape {tuple(tensor.shape)}, but the model's {local} "
                        f"has {tuple(shape)}: the files are of another model or configuration"
                    )
                yield local, tensor.to(dtype)


def _quantized(weight: Any, fmt: four_bit.Format, where: str) -> dict[str, torch.Tensor]:
    """The 4-bit parts of the full-precision tensor ``weight`` (a safetensors slice, read a few rows at a time)."""
    shape, dtype = tuple(weight.get_shape()), _DTYPES.get(weight.get_dtype())
    if shape != fmt.shape or dtype is None or not dtype.is_floating_point:
        raise WeightsError(
            f"{where}: a {weight.get_dtype()} tensor of shape {shape} cannot be quantized as the model's 4-bit "
            f"weight of shape {fmt.shape}: the files hold another model or configuration"
        )
    return four_bit.quantize(_Rows(weight, shape), fmt)


class _Rows:
    """A safetensors slice as `four_bit.quantize` reads it: ``rows[a:b]`` as a tensor, and a shape."""

    def __init__(self, weight: Any, shape: tuple[int, ...]) -> None:
        self.weight, self.shape = weight, shape

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.weight[rows]


def _offset(blob: torch.Tensor, where: str) -> torch.Tensor:
    try:
        return four_bit.offset_of(blob, where)
    except ValueError as err:
        raise WeightsError(str(err)) from None


def write_tensors(
    directory: str, file: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` as ``directory/file`` (a new file: never over another), through a
    temporary name, so the file is whole or absent. Returns its bytes."""
    from safetensors.torch import save_file

    if not file.endswith(".safetensors") or "/" in file or "\\" in file or file.startswith("."):
        raise WeightsError(f"{file!r} is not a plain .safetensors file name")
    target = Path(directory) / file
    if target.exists():
        raise WeightsError(f"{target} exists already; a checkpoint file is never written over")
    partial = target.with_name(f".{file}.partial")
    # Created here, new (never through a link, never over a file), then filled.
    try:
        os.close(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644))
    except FileNotFoundError:
        raise WeightsError(
            f"directory {directory!r} does not exist on this worker: sharded checkpoints need a path every worker "
            "sees (the same machine, or a shared file system)"
        ) from None
    contiguous = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(partial), metadata=dict(metadata or {}))
    os.replace(partial, target)
    return target.stat().st_size


def check_writable(directory: str) -> None:
    """A worker writes only into the hidden directory a sharded checkpoint is being written into
    (`PARTIAL`): a driver cannot make it write anywhere else."""
    if PARTIAL not in Path(directory).name or not Path(directory).name.startswith("."):
        raise WeightsError(f"{directory!r} is not a checkpoint being written; a worker writes nowhere else")


def check_readable(path: str) -> None:
    """A worker reads only safetensors files, by name, for weights (no other file is opened)."""
    if not path.endswith(".safetensors") or not Path(path).is_file():
        raise WeightsError(f"{path!r} is no safetensors file this worker can read")


def json_metadata(value: Any) -> dict[str, str]:
    """A JSON value as safetensors metadata (strings only); numbers of other types (numpy's) as numbers."""
    return {"lrmp": json.dumps(value, sort_keys=True, default=lambda v: v.item() if hasattr(v, "item") else str(v))}


def read_metadata(path: str) -> Any:
    """The JSON value `json_metadata` stored in the file at ``path`` (``None`` without one)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return file_metadata(f)


def file_metadata(f: Any) -> Any:
    """The JSON value `json_metadata` stored in an open safetensors file ``f`` (``None`` without one)."""
    return json.loads((f.metadata() or {}).get("lrmp", "null"))
