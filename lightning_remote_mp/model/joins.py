"""How the parts of a batch's outputs join back into the whole batch's.

Micro-batches and replicas each compute a traced module on a part of the batch. An output that
carries the batch in dim 0 (logits, hidden states) joins by concatenation. A loss does not: the
mean over a batch is not the mean of its parts' means when the parts count differently (padding
tokens labelled ``-100`` spread unevenly over the parts; a short last micro-batch). So before the
graph is cut, `split_means` rewrites every mean-reduced loss the module returns into its sum and
its count: the parts' sums and counts add up, and the driver divides the two totals, which is the
whole batch's mean, with the whole batch's gradients (torchtitan#1733 shows the trap).

Each pipeline output then has a `Join`:

- ``"batch"``: concatenated along dim 0;
- ``"sum"``: added up (a sum-reduced loss, a count);
- ``"whole"``: anything else that does not carry the batch: it cannot be joined exactly, so a
  module that returns one is refused when a batch is split (micro-batches or replicas), naming it.

>>> import torch
>>> net = torch.nn.Linear(4, 3)
>>> def loss(x, y):
...     return torch.nn.functional.cross_entropy(net(x), y, ignore_index=-100)
>>> x, y = torch.randn(6, 4), torch.tensor([0, 1, -100, 2, -100, -100])
>>> whole = loss(x, y)
>>> parts = [torch.nn.functional.cross_entropy(net(x[a:b]), y[a:b], reduction="sum") for a, b in ((0, 3), (3, 6))]
>>> counts = [(y[a:b] != -100).sum() for a, b in ((0, 3), (3, 6))]
>>> bool(torch.isclose(sum(parts) / sum(counts), whole)), bool(torch.isclose((loss(x[:3], y[:3]) + loss(x[3:], y[3:])) / 2, whole))
(True, False)
"""  # noqa: E501

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import fx

from lightning_remote_mp.errors import ConfigurationError

aten = torch.ops.aten

#: How one pipeline output joins across the parts of a batch (see the module docstring).
Join = Literal["batch", "sum", "whole"]

MEAN, SUM = 1, 2  # ATen's reduction enum: none, mean, sum

#: Losses that take ``reduction`` (with its position in the schema), and how their mean counts:
#: ``"targets"`` (the targets not ignored, weighted by their class weight, as torch divides) or
#: ``"elements"`` (every element of the input).
_LOSSES: dict[str, tuple[int, str]] = {
    "cross_entropy_loss": (3, "targets"),
    "nll_loss": (3, "targets"),
    "nll_loss2d": (3, "targets"),
    "nll_loss_nd": (3, "targets"),
    "mse_loss": (2, "elements"),
    "l1_loss": (2, "elements"),
    "smooth_l1_loss": (2, "elements"),
    "huber_loss": (2, "elements"),
    "binary_cross_entropy": (3, "elements"),
    "binary_cross_entropy_with_logits": (4, "elements"),
    "soft_margin_loss": (2, "elements"),
    # lrmp's chunked head and cross-entropy (`lightning_remote_mp.model.head_loss`), made after `split_means`.
    "linear_cross_entropy": (4, "targets"),
}
#: Steps that pass a scalar on unchanged, as far as joining goes.
_PASSING = {"to", "_to_copy", "clone", "contiguous", "view", "reshape", "alias", "detach", "squeeze", "unsqueeze"}


def op_name(node: Any) -> str:
    """An ATen step's operator name without its namespace (``cross_entropy_loss``), ``""`` otherwise."""
    target = getattr(node, "target", None)
    schema = getattr(target, "_schema", None)
    return schema.name.partition("::")[2] if schema is not None else ""


def argument(node: fx.Node, position: int, name: str, default: Any) -> Any:
    """A step's argument at ``position`` or keyword ``name``, ``default`` where the call left it out."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _insert(graph: fx.Graph, like: fx.Node, op: Callable[..., Any], *args: Any) -> fx.Node:
    """A step calling ``op`` on ``args`` after ``like``, in ``like``'s module and context, with its
    value's metadata computed the way torch.export computed the others' (on fake tensors)."""
    with graph.inserting_after(like):
        node = graph.call_function(op, args)
    node.meta.update({k: v for k, v in like.meta.items() if k in ("nn_module_stack", "stack_trace", "lrmp_context")})
    fake = like.meta.get("val")
    mode = getattr(fake, "fake_mode", None)
    values = fx.map_arg(args, lambda n: n.meta.get("val"))
    if mode is not None:
        with mode:
            node.meta["val"] = op(*values)
    return node


def _count(graph: fx.Graph, loss: fx.Node, counts: str) -> fx.Node:
    """The number a mean-reduced ``loss`` divides its sum by, as torch computes it: the targets not
    ignored (each weighted by its class weight when the loss has weights), or the input's elements."""
    source, target = loss.args[0], loss.args[1]
    if counts == "elements" or not isinstance(target, fx.Node) or target.meta["val"].is_floating_point():
        # Probabilities as targets, or an element-wise loss: every element (every sample) counts.
        ones = _insert(graph, loss, aten.ones_like.default, source if counts == "elements" else target)
        if counts != "elements" and source.meta["val"].dim() == target.meta["val"].dim():  # type: ignore[union-attr]
            ones = _insert(graph, ones, aten.select.int, ones, 1, 0)  # (N, C, ...) probabilities: one per sample
        return _insert(graph, ones, aten.sum.default, ones)
    ignore = argument(loss, 4, "ignore_index", -100)
    weight = argument(loss, 2, "weight", None)
    valid = _insert(graph, loss, aten.ne.Scalar, target, ignore)
    if weight is None:
        return _insert(graph, valid, aten.sum.default, valid)
    safe = _insert(graph, valid, aten.where.ScalarOther, valid, target, 0)
    per_target = _insert(graph, safe, aten.index.Tensor, weight, [safe])
    kept = _insert(graph, per_target, aten.mul.Tensor, per_target, valid)
    return _insert(graph, kept, aten.sum.default, kept)


def split_means(gm: fx.GraphModule) -> dict[int, int]:
    """Rewrite each mean-reduced loss the graph returns (directly, or through steps that pass it on
    unchanged) into its sum-reduced form, and return its count as an extra output at the end.
    Returns ``{output position: position of its count}``; the output at that position is now a sum.

    A ``mean`` over every element of a value the graph returns is rewritten the same way."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    counts: dict[int, int] = {}
    extra: list[fx.Node] = []
    for i, leaf in enumerate(flat):
        core = _through_passing(leaf)
        if not isinstance(core, fx.Node) or len(core.users) != 1 and core is not leaf:
            continue
        name = op_name(core)
        count: fx.Node | None = None
        if name in _LOSSES:
            position, kind = _LOSSES[name]
            if argument(core, position, "reduction", MEAN) != MEAN:
                continue
            args = list(core.args) + [None] * max(0, position + 1 - len(core.args))
            args[position] = SUM
            kwargs = {k: v for k, v in core.kwargs.items() if k != "reduction"}
            core.args, core.kwargs = tuple(_defaults(core, args)), kwargs
            count = _count(gm.graph, core, kind)
        elif name == "mean" and core.target == aten.mean.default:
            source = core.args[0]
            core.target = aten.sum.default
            ones = _insert(gm.graph, core, aten.ones_like.default, source)
            count = _insert(gm.graph, ones, aten.sum.default, ones)
        if count is not None:
            counts[i] = len(flat) + len(extra)
            extra.append(count)
    if extra:
        output.args = (tuple(flat) + tuple(extra),)
        gm.graph.lint()
        gm.recompile()
    return counts


def _defaults(node: fx.Node, args: list[Any]) -> list[Any]:
    """Positional arguments with the schema's defaults where the call left them out (``None`` above)."""
    schema = node.target._schema  # type: ignore[union-attr]
    return [
        spec.default_value if arg is None and spec.has_default_value() else arg
        for arg, spec in zip(args, schema.arguments)
    ]


def _through_passing(node: Any) -> Any:
    """The step a scalar output comes from, past steps that pass it on unchanged (casts, copies)."""
    while isinstance(node, fx.Node) and op_name(node) in _PASSING and node.args:
        node = node.args[0]
    return node


def join_of(node: fx.Node, batch: str | None, sums: Sequence[fx.Node] = ()) -> Join:
    """How the pipeline output ``node`` joins: ``"batch"`` if dim 0 is the batch (``batch``, its
    symbol), ``"sum"`` for a sum over the batch (``sums``: those `split_means` made, and any
    sum-reduced loss or sum over every element), else ``"whole"``."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dim() > 0 and batch is not None and str(val.shape[0]) == batch:
        return "batch"
    core = _through_passing(node)
    if node in sums or core in sums:
        return "sum"
    name = op_name(core) if isinstance(core, fx.Node) else ""
    if name in _LOSSES and argument(core, _LOSSES[name][0], "reduction", MEAN) == SUM:
        return "sum"
    if isinstance(core, fx.Node) and core.target == aten.sum.default:
        return "sum"
    if isinstance(core, fx.Node) and core.target in (aten.div.Tensor, aten.div.Scalar, operator.truediv):
        # A sum over a number the batch does not change (HF's loss over ``num_items_in_batch``).
        a, b = core.args[0], core.args[1]
        fixed = not isinstance(b, fx.Node) or b.op in ("get_attr", "placeholder") and join_of(b, batch) == "whole"
        if isinstance(a, fx.Node) and fixed and join_of(a, batch, sums) == "sum":
            return "sum"
    return "whole"


def join_parts(parts: list[Any], joins: Sequence[Join] | None, what: str, key: str) -> Any:
    """The parts' results (micro-batches, replicas) of split module ``key`` back into one batch's:
    for a tuple, element by element, each as its `Join` says (concatenated, or added up).

    >>> join_parts([(torch.ones(2, 1), torch.tensor(3.0)), (torch.zeros(1, 1), torch.tensor(4.0))], ["batch", "sum"], "output", "net")
    (tensor([[1.],
            [1.],
            [0.]]), tensor(7.))
    """  # noqa: E501
    if not isinstance(parts[0], tuple):
        if any(p is None for p in parts):
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    if len(parts) == 1:
        return parts[0]
    kinds = joins or ["batch"] * len(parts[0])
    out = []
    for i, join in enumerate(kinds):
        items = [p[i] for p in parts]
        if all(t is None for t in items):
            out.append(None)
        elif join == "batch":
            out.append(torch.cat(items, dim=0))
        elif join == "sum":  # a sum over the batch; or the gradient of an input every part saw whole
            out.append(torch.stack([t for t in items if t is not None]).sum(0))
        else:
            raise ConfigurationError(
                f"{key!r}: {what} {i} has no batch dimension and is no sum (a statistic of the whole "
                "batch?), so the parts of a batch (micro-batches, replicas) cannot be joined back; compute it "
                "outside the split module, or use microbatches=1 and a single replica"
            )
    return tuple(out)
