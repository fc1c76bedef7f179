"""Split modules on the meta device: the driver holds no storage for their tensors, which only
ever exist on the workers (read there from files). `kept_on_meta` keeps Lightning's moves of the
whole LightningModule from touching them; `fill_meta_buffers` gives their few non-persistent
buffers, which no file holds, their values; `to_meta` moves a trained module there, ties kept."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from lightning_remote_mp.errors import WeightsError


def split_modules(model: torch.nn.Module, split: list[str]) -> dict[str, torch.nn.Module]:
    """The submodules ``split`` names, by name; a name the model lacks is left out (setup names it)."""
    out = {}
    for name in split:
        try:
            out[name] = model.get_submodule(name)
        except AttributeError:
            pass
    return out


def on_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _kept(module: torch.nn.Module, fn: Any, recurse: bool = True) -> torch.nn.Module:
    return module


@contextlib.contextmanager
def kept_on_meta(model: torch.nn.Module | None, split: list[str]) -> Iterator[None]:
    """While inside, moving or casting ``model`` leaves its split modules on the meta device alone:
    their weights only ever exist on the workers (Lightning moves the whole LightningModule)."""
    meta = [m for m in split_modules(model, split).values() if on_meta(m)] if model is not None else []
    for m in meta:
        vars(m)["_apply"] = functools.partial(_kept, m)
    try:
        yield
    finally:
        for m in meta:
            vars(m).pop("_apply", None)


def to_meta(module: torch.nn.Module) -> None:
    """Move ``module`` to the meta device keeping its tied weights tied: ``Module.to("meta")`` makes
    each module's parameter a new one, and a tie (an embedding and its head) would become two
    weights, which a later run could not find in a checkpoint that holds the tie once."""
    names: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append((m, name))
    module.to("meta")
    for held in names.values():
        first = held[0][0]._parameters[held[0][1]]
        for m, name in held[1:]:
            m._parameters[name] = first


def fill_meta_buffers(module: torch.nn.Module) -> None:
    """Give a module built on the meta device values for its non-persistent buffers, which no file
    holds (rotary frequencies, masks): allocated here and computed by the model's own
    ``_init_weights``, as transformers does after loading onto the meta device. They are small.
    A module without ``_init_weights`` gets none and its buffers stay on meta (placement then names them)."""
    owners = []
    names = []
    for path, m in module.named_modules():
        for name in getattr(m, "_non_persistent_buffers_set", ()):
            buf = m._buffers.get(name)
            if buf is not None and buf.is_meta:
                m._buffers[name] = torch.empty_like(buf, device="cpu")
                owners.append(m)
                names.append(f"{path}.{name}" if path else name)
    if not owners:
        return
    init: Any = next((m._init_weights for m in module.modules() if hasattr(m, "_init_weights")), None)
    if init is None:
        raise WeightsError(
            f"the meta-device module's non-persistent buffers {names[:3]} are in no weights file and it has no "
            "_init_weights to compute them: build them with values (outside the meta device context)"
        )
    filled = [(m, name) for m in dict.fromkeys(owners) for name in m._non_persistent_buffers_set if name in m._buffers]
    filled = [(m, name) for m, name in filled if m._buffers[name] is not None and not m._buffers[name].is_meta]

    def unset_value(t: torch.Tensor) -> float | int:
        return float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).min if t.dtype != torch.bool else 0

    with torch.no_grad():
        for m, name in filled:  # a value no init writes, to tell which buffers init left alone
            m._buffers[name].fill_(unset_value(m._buffers[name]))  # type: ignore[union-attr]
        for m in dict.fromkeys(owners):
            init(m)
    unset = []
    for m, name in filled:
        t = m._buffers[name]
        assert t is not None
        marker = unset_value(t)
        if t.dtype != torch.bool and bool((t.isnan() if t.is_floating_point() else t == marker).any()):
            unset.append(name)
    if unset:
        raise WeightsError(
            f"the meta-device module's non-persistent buffers {unset[:3]} are in no weights file and its _init_weights "
            "does not compute them: build them with values (outside the meta device context)"
        )
