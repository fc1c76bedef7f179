"""A language model's loss from ``labels=`` without its whole logits: the head and the cross-entropy in chunks.

A causal LM's loss (transformers' ``ForCausalLMLoss``, T5's ``CrossEntropyLoss``) projects every
token's hidden state onto the vocabulary, upcasts the logits to float32 and takes the cross-entropy.
At Llama-3's 128,256 tokens that is 0.5 GB of float32 logits per 1,024 tokens, and autograd keeps
more: the upcast copy, ``log_softmax``'s output, the gradient. Measured on a last stage (hidden 64,
one sequence of 2,048 tokens): 4,382 MB at vocabulary 128,256 against 572 MB at 8,192, 3.6 times
the logits' bytes (issue #59). Cut Cross Entropy, Liger's fused linear cross-entropy and torchtune's
chunked loss never hold them whole; neither does lrmp now.

Before the graph is cut, `chunk_head_losses` rewrites, in the train-mode graph, a cross-entropy over
``linear(hidden, W, b)`` (through casts and ``view(-1, V)`` only) into lrmp's operator
``lrmp::linear_cross_entropy`` (`linear_cross_entropy`): it computes the head's logits a chunk of
tokens at a time (`CHUNK_ELEMENTS` logits, 64 MB of float32), keeps only each token's log-sum-exp
for the backward, and computes them again there, a chunk at a time, for the gradients of the hidden
states, the weight and the bias. The logits the model returns become ``lrmp::deferred_linear``: the
same product, which the last stage keeps as its input instead (`deferring`, run by
`lightning_remote_mp.worker.route`) and computes only if the driver reads ``.logits`` (a metric, an
extra loss term), with their gradient flowing back as it would locally. Validation (eval mode) and
``generate()`` compute and return logits as before.

>>> import torch
>>> x, w, t = torch.randn(6, 4), torch.randn(10, 4), torch.tensor([1, 2, -100, 4, 5, 9])
>>> whole = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w), t, reduction="sum")
>>> chunked = torch.ops.lrmp.linear_cross_entropy(x, w, None, t, 2, -100, torch.float32)
>>> bool(torch.isclose(whole, chunked))
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx

from lightning_remote_mp.model.joins import MEAN, SUM, argument, op_name

log = logging.getLogger(__name__)
aten = torch.ops.aten

#: Logits computed at once (rows of a chunk x vocabulary): 64 MB in float32, a few chunks live at a time.
CHUNK_ELEMENTS = 2**24


def _chunks(rows: int, vocab: int) -> Iterator[slice]:
    step = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: each chunk's logits, their ``log_softmax`` and ``nll_loss`` summed, nothing kept but
    the inputs. Backward: each chunk's loss again, differentiated by autograd into the head's three
    gradients, which the chunks add up: the same operations, row by row, as the whole loss's."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, target, reduction, ignore_index, dtype):  # type: ignore[no-untyped-def]
        total = torch.zeros((), dtype=dtype, device=x.device)
        for rows in _chunks(x.shape[0], weight.shape[0]):
            total += _chunk_loss(x[rows], weight, bias, target[rows], ignore_index, dtype)
        count = (target != ignore_index).sum()
        ctx.save_for_backward(x, weight, bias, target, count)
        ctx.reduction, ctx.ignore_index, ctx.dtype = reduction, ignore_index, dtype
        return total if reduction == SUM else total / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, bias, target, count = ctx.saved_tensors
        scale = grad if ctx.reduction == SUM else grad / count
        x_ = x.detach().requires_grad_(ctx.needs_input_grad[0])
        w_ = weight.detach().requires_grad_(ctx.needs_input_grad[1])
        b_ = bias.detach().requires_grad_(ctx.needs_input_grad[2]) if bias is not None else None
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        sums: list[Any] = [None, None]  # the weight's and the bias's, over the chunks
        for rows in _chunks(x.shape[0], weight.shape[0]):
            with torch.enable_grad():
                xc = x_[rows].detach().requires_grad_(ctx.needs_input_grad[0])
                loss = _chunk_loss(xc, w_, b_, target[rows], ctx.ignore_index, ctx.dtype)
            inputs = [t for t in (xc, w_, b_) if t is not None and t.requires_grad]
            grads = dict(zip(map(id, inputs), torch.autograd.grad(loss, inputs, scale)))
            if grad_x is not None:
                grad_x[rows] = grads[id(xc)]
            for k, t in enumerate((w_, b_)):
                if t is not None and id(t) in grads:
                    sums[k] = grads[id(t)] if sums[k] is None else sums[k] + grads[id(t)]
        return grad_x, sums[0], sums[1], None, None, None, None


def _chunk_loss(x, weight, bias, target, ignore_index, dtype):  # type: ignore[no-untyped-def]
    """A chunk's summed loss, as transformers computes the whole one: the head, the upcast, the loss."""
    logits = torch.nn.functional.linear(x, weight, bias).to(dtype)
    return torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")


def _linear_cross_entropy(x, weight, bias, target, reduction, ignore_index, dtype):  # type: ignore[no-untyped-def]
    return _LinearCrossEntropy.apply(x, weight, bias, target, reduction, ignore_index, dtype)


def _linear_cross_entropy_meta(x, weight, bias, target, reduction, ignore_index, dtype):  # type: ignore[no-untyped-def]
    return x.new_empty((), dtype=dtype)


@dataclasses.dataclass
class Head:
    """A deferred head's product: what the last stage keeps instead of the logits, and computes
    them from (`materialize`) when they are read."""

    stand_in: torch.Tensor  # what the program returned in the logits' place: an alias of the input
    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    def shape(self, x: torch.Tensor) -> list[int]:
        return [*x.shape[:-1], self.weight.shape[0]]

    def materialize(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias).to(self.dtype)


_DEFERRING = threading.local()


@contextlib.contextmanager
def deferring() -> Iterator[list[Head]]:
    """While the block runs, ``lrmp::deferred_linear`` returns an alias of its input instead of the
    logits, and the list it yields records each as a `Head` (a last stage's kept output)."""
    heads: list[Head] = []
    before = getattr(_DEFERRING, "heads", None)
    _DEFERRING.heads = heads
    try:
        yield heads
    finally:
        _DEFERRING.heads = before


def _deferred_linear(x, weight, bias, dtype):  # type: ignore[no-untyped-def]
    heads = getattr(_DEFERRING, "heads", None)
    if heads is None:
        return torch.nn.functional.linear(x, weight, bias).to(dtype)
    stand_in = x.view_as(x)
    heads.append(Head(stand_in, weight, bias, dtype))
    return stand_in


# Registered with torch.library's plain ``Library`` API, as ``lrmp::linear_4bit`` is (`four_bit`).
_LIBRARY = torch.library.Library("lrmp", "FRAGMENT")  # noqa: TOR901 (one library, defined once at import)
_LIBRARY.define(
    "linear_cross_entropy(Tensor x, Tensor weight, Tensor? bias, Tensor target, int reduction, int ignore_index, "
    "ScalarType dtype) -> Tensor"
)
_LIBRARY.impl("linear_cross_entropy", _linear_cross_entropy, "CompositeImplicitAutograd")
_LIBRARY.define("deferred_linear(Tensor x, Tensor weight, Tensor? bias, ScalarType dtype) -> Tensor")
_LIBRARY.impl("deferred_linear", _deferred_linear, "CompositeImplicitAutograd")

#: lrmp's own operators, which a traced program may name besides ATen's (``lrmp::NAME``).
OPERATORS = {
    "linear_cross_entropy": torch.ops.lrmp.linear_cross_entropy,
    "deferred_linear": torch.ops.lrmp.deferred_linear,
}


# --- the rewrite ----------------------------------------------------------------------------------
#: Steps between the head's product and the loss that keep each token's row of logits whole.
_ROW_PRESERVING = {"to", "_to_copy", "view", "reshape", "_unsafe_view", "contiguous", "clone", "alias"}


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def chunk_head_losses(gm: fx.GraphModule, name: str) -> int:
    """Rewrite each cross-entropy over a head's product in ``gm`` (see the module docstring); a
    returned logits output becomes ``lrmp::deferred_linear``. Returns how many were rewritten."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    done = 0
    for loss in [n for n in gm.graph.nodes if n.target is aten.cross_entropy_loss.default]:
        chain: list[fx.Node] = []
        node = loss.args[0]
        while isinstance(node, fx.Node) and op_name(node) in _ROW_PRESERVING:
            chain.append(node)
            node = node.args[0]
        head = node
        if not (isinstance(head, fx.Node) and head.target is aten.linear.default):
            continue
        x, weight = head.args[0], head.args[1]
        bias = head.args[2] if len(head.args) > 2 else head.kwargs.get("bias")
        logits, rows, hidden = _val(head), _val(loss.args[0]), _val(x)
        if not all(isinstance(v, torch.Tensor) for v in (logits, rows, hidden)) or rows.dim() != 2:
            continue
        if argument(loss, 2, "weight", None) is not None or argument(loss, 5, "label_smoothing", 0.0) != 0.0:
            continue  # class weights and smoothing: the rewrite keeps to the plain loss
        reduction = argument(loss, 3, "reduction", MEAN)
        if reduction not in (MEAN, SUM) or rows.shape[-1] != logits.shape[-1]:
            continue
        passed = {head, *chain}
        returned = [v for v in passed if output in v.users]
        others = [u for v in passed for u in v.users if u not in passed and u is not loss and u is not output]
        if len(returned) > 1 or any(u.target is not aten._assert_tensor_metadata.default for u in others):
            log.debug("module %r: the logits are read by more than the loss; the loss is computed whole", name)
            continue
        width = _val(weight).shape[-1] if isinstance(_val(weight), torch.Tensor) else None
        if not isinstance(width, int):
            continue  # the program names its sizes: a weight of a size the trace left symbolic is not a head
        graph = gm.graph
        with graph.inserting_before(loss):
            flat = graph.call_function(aten.reshape.default, (x, [-1, width]))
            flat.meta.update(_meta(head, _val(x).reshape(-1, width)))
        loss.target = torch.ops.lrmp.linear_cross_entropy.default
        loss.args = (flat, weight, bias, loss.args[1], reduction, argument(loss, 4, "ignore_index", -100), rows.dtype)
        loss.kwargs = {}
        if returned:
            (out,) = returned
            with graph.inserting_after(out):  # where the logits were: the outputs keep their order
                deferred = graph.call_function(
                    torch.ops.lrmp.deferred_linear.default, (x, weight, bias, _val(out).dtype)
                )
            deferred.meta.update(_meta(head, _val(out)))
            output.args = fx.map_arg(output.args, functools.partial(_swap, out, deferred))
        for user in dict.fromkeys(others):
            graph.erase_node(user)
        for dead in [*chain, head]:
            if not dead.users:
                graph.erase_node(dead)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _swap(old: fx.Node, new: fx.Node, node: fx.Node) -> fx.Node:
    return new if node is old else node


def _meta(like: fx.Node, val: Any) -> dict[str, Any]:
    meta = {k: v for k, v in like.meta.items() if k in ("nn_module_stack", "stack_trace", "lrmp_context")}
    if val is not None:
        meta["val"] = val
    return meta
