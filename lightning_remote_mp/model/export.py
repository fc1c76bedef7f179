"""The ``torch.export`` front end: an unchanged ``nn.Module``, called once, as an ATen graph.

`export` exports a module in train or in eval mode, with every dimension of every tensor input
dynamic where the model's code allows (a short last batch, another sequence length), and inlines
the blocks ``torch.export`` wraps in higher-order operators (``torch.no_grad()``, ``torch.autocast``)
into steps marked with their context. A failure becomes a `lightning_remote_mp.errors.TraceError`
that names the user's line and what to change.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
import re
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from lightning_remote_mp.errors import TraceError
from lightning_remote_mp.model import functions


def batch_rows(args: tuple, kwargs: dict) -> int | None:
    """The batch's rows in a call: dim 0 of its first tensor argument (``None`` without one)."""
    first = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    return None if first is None else int(first.shape[0])


def _dynamic_shapes(module: nn.Module, args: tuple, kwargs: dict, rows: int | None) -> Any:
    """Every dimension of every tensor argument dynamic where the code allows; dim 0 of each tensor
    with the batch's ``rows`` is one shared dimension, the batch, so that torch.export tells which
    inputs (masks, labels, position ids...) and outputs carry the batch by what the code does with
    them. With one row the batch cannot be told from a size the code fixes (torch.export
    specialises sizes 0 and 1): every dimension is then dynamic on its own."""
    shapes = torch.export.ShapesCollection()
    batch = torch.export.Dim("batch") if rows is not None and rows > 1 else None
    seen: set[int] = set()  # a tensor passed twice (ids as labels) gets one spec
    for t in pytree.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            spec: dict[int, Any] = {d: torch.export.Dim.AUTO for d in range(t.dim())}
            if batch is not None and t.dim() > 0 and t.shape[0] == rows:
                spec[0] = batch
            shapes[t] = spec
    return shapes.dynamic_shapes(module, args, kwargs)


@contextlib.contextmanager
def _explicit_signature(module: nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """While exporting, a ``forward(*args, **kwargs)`` (peft's wrappers) shows a signature naming
    this call's arguments: torch.export reorders the arguments of a variadic forward and then
    cannot match them with their dynamic shapes ("Must provide a tree_name")."""
    params = inspect.signature(module.forward).parameters.values()
    if not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        yield
        return
    own = vars(module).get("forward")
    forward = module.forward

    def explicit(*a: Any, **k: Any) -> Any:
        return forward(*a, **k)

    P = inspect.Parameter
    explicit.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [P(f"arg{i}", P.POSITIONAL_ONLY) for i in range(len(args))] + [P(k, P.KEYWORD_ONLY) for k in kwargs]
    )
    module.forward = explicit  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            vars(module).pop("forward", None)
        else:
            module.forward = own  # type: ignore[method-assign]


def _restore_modes(module: nn.Module, flags: dict[nn.Module, bool]) -> None:
    """Each module's train/eval flag as it was before the export; a module the forward made (BigBird
    swaps its attention for one that fits short sequences) takes its parent's."""
    parents = [(module, flags.get(module, module.training))]
    while parents:
        parent, flag = parents.pop()
        parent.training = flags.get(parent, flag)
        parents.extend((child, parent.training) for child in parent.children())


def export(module: nn.Module, args: tuple, kwargs: dict, name: str, training: bool) -> fx.GraphModule:
    """``module`` called with ``args`` and ``kwargs``, exported in train or eval mode (see the module
    docstring). The graph records the limits torch.export found on dynamic dimensions
    (``lrmp_ranges``), the output's structure (``lrmp_out_spec``) and the arguments whose dim 0 has
    the batch's rows but could not be given the batch's dimension (``lrmp_unclassified``)."""
    flags = {m: m.training for m in module.modules()}
    module.train(training)
    # torch.export logs each dimension it keeps static (a channel count of 1) as a warning; the
    # trace records them, and a call that differs gets an error naming the dimension.
    quiet = logging.getLogger("torch._export.non_strict_utils")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    rows = batch_rows(args, kwargs)
    unclassified = False
    try:
        try:
            with _traceable_experts(module), functions.recording() as seen:
                ep = _export(module, args, kwargs, rows)
        except Exception as err:
            if rows is None or rows < 2 or "batch" not in str(err):
                raise
            # An argument with the batch's rows that the code does not treat as the batch (a table
            # whose length equals the batch size): every dimension on its own, that argument unclassified.
            with _traceable_experts(module), functions.recording() as seen:
                ep, unclassified = _export(module, args, kwargs, None), True
    except TraceError:  # lrmp's own refusal, raised while exporting: it names what to do
        raise
    except Exception as err:  # torch.export raises many types; all mean "cannot trace this"
        raise TraceError(_export_failure(name, err)) from err
    finally:
        quiet.setLevel(level)
        _restore_modes(module, flags)
    functions.check(seen, name)
    gm = ep.module()
    gm.lrmp_ranges = dict(ep.range_constraints)  # type: ignore[assignment]
    gm.lrmp_unclassified = _rows_like_the_batch(gm, rows)[1:] if unclassified else []  # type: ignore[assignment]
    _inline_blocks(gm, name)
    gm.lrmp_out_spec = ep.call_spec.out_spec  # type: ignore[assignment]
    return gm


@contextlib.contextmanager
def _traceable_experts(module: nn.Module) -> Iterator[None]:
    """transformers' default mixture-of-experts path (``experts_implementation="grouped_mm"``) calls
    a custom operator of transformers' for weights that are not bfloat16, which no worker runs;
    while tracing, such a model's experts use ``"batched_mm"``, the same products in ATen operators
    (a bfloat16 model keeps ``grouped_mm``: ATen's ``_grouped_mm``)."""
    if all(p.dtype == torch.bfloat16 for p in module.parameters()):
        yield
        return
    configs = {id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None}
    switched = [c for c in configs.values() if getattr(c, "_experts_implementation", None) == "grouped_mm"]
    for config in switched:
        config._experts_implementation = "batched_mm"
    try:
        yield
    finally:
        for config in switched:
            config._experts_implementation = "grouped_mm"


@contextlib.contextmanager
def _unchanging_to() -> Iterator[None]:
    """While exporting, ``module.to(dtype)`` that changes nothing returns the module, as it does
    eagerly, without converting its parameters: Switch Transformers' router calls
    ``self.classifier.to(self.dtype)`` in its forward, and converting the parameters torch.export
    lifted fails ("Couldn't swap Linear.weight")."""
    to = nn.Module.to

    def unchanging(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if memory_format is None and all(
            (device is None or t.device == torch.device(device))
            and (dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype)
            for t in tensors
        ):
            return self
        return to(self, *args, **kwargs)

    nn.Module.to = unchanging  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.to = to  # type: ignore[method-assign]


def _export(module: nn.Module, args: tuple, kwargs: dict, rows: int | None) -> Any:
    with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices=[]):
        with _explicit_signature(module, args, kwargs), _unchanging_to():
            return torch.export.export(module, args, kwargs, dynamic_shapes=_dynamic_shapes(module, args, kwargs, rows))


def _rows_like_the_batch(gm: fx.GraphModule, rows: int | None) -> list[str]:
    """The inputs whose dim 0 has ``rows`` rows, in order."""
    vals = [(p.name, p.meta.get("val")) for p in gm.graph.nodes if p.op == "placeholder"]
    return [
        name
        for name, val in vals
        if isinstance(val, torch.Tensor)
        and val.dim() > 0
        and getattr(getattr(val.shape[0], "node", None), "hint", val.shape[0]) == rows
    ]


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
            "lrmp passes use_cache=False unless the call sets use_cache itself; leave it out, or pass False)"
        )
    else:
        hint = "torch.export could not trace it"
    return (
        f"module {name!r} cannot be traced by torch.export{where}: {type(err).__name__}: {first[:400]}\n"
        f"{hint}; or split only the submodules around that part (split=[...] takes dotted names), or "
        "describe the model as a layer spec (SpecSequential)."
    )
