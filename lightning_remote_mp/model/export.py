"""The ``torch.export`` front end: an unchanged ``nn.Module``, called once, as an ATen graph.

`export` exports a module in train or in eval mode, with every dimension of every tensor input
dynamic where the model's code allows (a short last batch, another sequence length), and inlines
the blocks ``torch.export`` wraps in higher-order operators (``torch.no_grad()``, ``torch.autocast``)
into steps marked with their context. A failure becomes a `lightning_remote_mp.errors.TraceError`
that names the user's line and what to change.
"""

from __future__ import annotations

import inspect
import logging
import operator
import re
import traceback
from typing import Any

import torch
from torch import fx, nn

from lightning_remote_mp.errors import TraceError


def _dynamic(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return {d: torch.export.Dim.AUTO for d in range(value.dim())}
    if isinstance(value, (list, tuple)):
        return type(value)(_dynamic(v) for v in value)
    if isinstance(value, dict):
        return {k: _dynamic(v) for k, v in value.items()}
    return None


def _dynamic_shapes(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return {name: _dynamic(value) for name, value in bound.arguments.items()}


def export(module: nn.Module, args: tuple, kwargs: dict, name: str, training: bool) -> fx.GraphModule:
    flags = [(m, m.training) for m in module.modules()]
    module.train(training)
    # torch.export logs each dimension it keeps static (a channel count of 1) as a warning; the
    # trace records them, and a call that differs gets an error naming the dimension.
    quiet = logging.getLogger("torch._export.non_strict_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices=[]):
            ep = torch.export.export(module, args, kwargs, dynamic_shapes=_dynamic_shapes(module, args, kwargs))
    except Exception as err:  # torch.export raises many types; all mean "cannot trace this"
        raise TraceError(_export_failure(name, err)) from err
    finally:
        quiet.setLevel(level)
        for m, f in flags:
            m.training = f
    gm = ep.module()
    gm.lrmp_ranges = dict(ep.range_constraints)  # type: ignore[assignment]
    _inline_blocks(gm, name)
    gm.lrmp_out_spec = ep.call_spec.out_spec  # type: ignore[assignment]
    return gm


def _block_context(node: fx.Node) -> tuple[dict[str, Any], int] | None:
    """For a ``torch.no_grad()`` / ``torch.autocast`` block that export wrapped in a higher-order
    operator: the context its steps run in, and where its submodule and arguments start."""
    name = getattr(node.target, "__name__", "")
    if name == "wrap_with_set_grad_enabled":
        return {"grad": bool(node.args[0])}, 1
    if name == "wrap_with_autocast":
        dtype = node.args[1] if isinstance(node.args[1], torch.dtype) else None
        return {"autocast": {"enabled": bool(node.args[2]), "dtype": dtype}}, 4
    return None


def _inline_blocks(gm: fx.GraphModule, name: str) -> None:
    """Replace grad-mode and autocast blocks by their steps, each marked with the block's context."""
    while True:
        found = next((n for n in gm.graph.nodes if n.op == "call_function" and _block_context(n) is not None), None)
        if found is None:
            gm.graph.lint()
            return
        _inline_block(gm, found, name)


def _inline_block(gm: fx.GraphModule, found: fx.Node, name: str) -> None:
    context, at = _block_context(found)  # type: ignore[misc]
    sub = getattr(gm, found.args[at].target)
    outer = found.meta.get("lrmp_context", {})
    env: dict[fx.Node, Any] = dict(zip([p for p in sub.graph.nodes if p.op == "placeholder"], found.args[at + 1 :]))
    outs: Any = None
    with gm.graph.inserting_before(found):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                continue
            if sn.op == "output":
                outs = fx.map_arg(sn.args[0], env.__getitem__)
                continue
            if sn.op == "get_attr":
                raise TraceError(f"module {name!r}: a no_grad/autocast block holds its own weights; not supported")
            new = gm.graph.node_copy(sn, env.__getitem__)
            new.meta["lrmp_context"] = {**outer, **context, **sn.meta.get("lrmp_context", {})}
            if "nn_module_stack" not in new.meta and "nn_module_stack" in found.meta:
                new.meta["nn_module_stack"] = found.meta["nn_module_stack"]
            env[sn] = new
    for user in list(found.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
    if found.users:
        found.replace_all_uses_with(outs)
    gm.graph.erase_node(found)


def _export_failure(name: str, err: BaseException) -> str:
    text = str(err).strip()
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)\n\s+(.+)', text)
    user = [f for f in frames if "site-packages/torch" not in f[0]]
    where = ""
    if user:
        file, line, func, code = user[-1]
        where = f" at {file}:{line} in {func} ({code.strip()})"
    elif err.__traceback__ is not None:
        tb = [f for f in traceback.extract_tb(err.__traceback__) if "/torch/" not in f.filename]
        if tb:
            where = f" at {tb[-1].filename}:{tb[-1].lineno} in {tb[-1].name}"
    first = text.splitlines()[0] if text else type(err).__name__
    if "data-dependent" in text or "DataDependent" in type(err).__name__ or "guard on" in text.lower():
        hint = (
            "Data-dependent control flow (an `if` on a tensor's value, a loop over its contents) cannot be "
            "traced. Rewrite that part with torch.where"
        )
    elif "Found <class" in text and "output" in text:
        hint = (
            "The module returns an object torch.export cannot flatten (a HuggingFace model's key/value cache: "
            "pass use_cache=False in its config)"
        )
    else:
        hint = "torch.export could not trace it"
    return (
        f"module {name!r} cannot be traced by torch.export{where}: {type(err).__name__}: {first[:400]}\n"
        f"{hint}; or split only the submodules around that part (split=[...] takes dotted names), or "
        "describe the model as a layer spec (SpecSequential)."
    )
