"""The regions a traced model recomputes at backward: transformers' gradient checkpointing, honoured.

``model.gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` in transformers 5,
on by default in peft's ``prepare_model_for_kbit_training``) sets ``gradient_checkpointing`` on each
decoder layer (a ``GradientCheckpointingLayer``), whose forward then runs under
``torch.utils.checkpoint.checkpoint`` when it trains with gradients. ``torch.export`` inlines that
call: the graph does not show it, so on the workers it would be silently dropped.

`checkpointed_regions` finds the layers where it is on, turns it off while the module is exported
(so that the train-mode trace is the plain forward, and a ``generate()`` trace keeps its cache: in
transformers checkpointing applies to training only), and hands back the layers' paths. The units
those layers own are marked (`GraphLayer`'s ``checkpoint``): a worker runs each such unit under
``torch.utils.checkpoint.checkpoint`` in training with gradients, so it keeps the unit's inputs and
recomputes the rest at its backward, region by region as locally, not the whole stage (the
strategy's own ``checkpoint=`` option does that). The gradients are the same either way
(``use_reentrant`` only changes how torch does it): a worker always uses the non-reentrant
implementation, which needs no input to require grad.

Code that calls ``torch.utils.checkpoint.checkpoint`` itself is recorded the same way, while
exporting, when the function it checkpoints is a module or a method of one. A region lrmp cannot
place (a plain function, or a ``checkpoint`` imported by name before the trace, which it cannot
intercept) is refused with an error when torch starts to checkpoint it, never dropped.

>>> import torch
>>> class Net(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
...     def forward(self, x):
...         return torch.utils.checkpoint.checkpoint(self.blocks[0], self.blocks[1](x), use_reentrant=False)
>>> net = Net()
>>> with checkpointed_regions(net, "net") as regions:
...     _ = net(torch.ones(1, 4))
>>> sorted(regions)
['blocks.0']
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch.utils.checkpoint as _torch_checkpoint
from torch import nn

from lightning_remote_mp.errors import TraceError

log = logging.getLogger(__name__)

#: transformers' base class of the layers it checkpoints (transformers >= 4.52), found by name: the
#: driver need not have transformers installed.
_LAYER_CLASS = "GradientCheckpointingLayer"


def _is_checkpointing_layer(module: nn.Module) -> bool:
    return any(cls.__name__ == _LAYER_CLASS for cls in type(module).__mro__)


@contextlib.contextmanager
def checkpointed_regions(module: nn.Module, name: str) -> Iterator[set[str]]:
    """While the block runs (an export), ``module``'s checkpointed layers run as plain layers, and
    the set it yields holds their paths (dotted, relative to ``module``), with those of modules that
    code passed to ``torch.utils.checkpoint.checkpoint`` meanwhile."""
    paths = {m: path for path, m in module.named_modules()}
    flagged = [(path, m) for path, m in module.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    layers = [(path, m) for path, m in flagged if _is_checkpointing_layer(m)]
    if flagged and not layers:
        raise TraceError(
            f"module {name!r} has gradient checkpointing on ({flagged[0][0] or 'the module itself'}"
            f"{' and more' if len(flagged) > 1 else ''}) in a form lrmp cannot see the regions of: transformers "
            f"before 4.52 checkpoints inside the model's own forward. Upgrade transformers, or call "
            "gradient_checkpointing_disable() (the strategy's checkpoint='always' recomputes each stage instead)"
        )
    regions = {path for path, _ in layers}
    original = _torch_checkpoint.checkpoint
    functions = {_unwrapped(getattr(m, "_gradient_checkpointing_func", original)) for _, m in layers}
    other = [f for f in functions if f is not original]
    if other:  # transformers' offload=True wraps torch's checkpoint in save_on_cpu
        log.warning(
            "module %r: its layers checkpoint through %s, not torch.utils.checkpoint.checkpoint alone "
            "(transformers' activation_checkpointing_enable(offload=True)?): the workers recompute each "
            "layer, but keep what it saves on their own device",
            name,
            getattr(other[0], "__qualname__", other[0]),
        )

    @functools.wraps(original)
    def recorded(function: Any, *args: Any, **kwargs: Any) -> Any:
        owner = _module_of(function)
        if owner not in paths:
            raise TraceError(
                f"module {name!r} calls torch.utils.checkpoint.checkpoint on {function!r}, which is not one of its "
                "modules or a method of one: lrmp recomputes regions a module at a time. Checkpoint a submodule "
                "(checkpoint(self.block, x)), or leave checkpointing out of the traced module"
            )
        regions.add(paths[owner])
        kwargs = {k: v for k, v in kwargs.items() if k not in _CHECKPOINT_OPTIONS}
        return function(*args, **kwargs)

    def unseen(*args: Any, **kwargs: Any) -> Any:
        raise TraceError(
            f"module {name!r} checkpoints a region through a torch.utils.checkpoint.checkpoint imported before "
            "the trace (`from torch.utils.checkpoint import checkpoint`), which lrmp cannot see: its recomputation "
            "would be dropped on the workers. Call it as torch.utils.checkpoint.checkpoint(module, ...), use "
            "transformers' gradient_checkpointing_enable(), or the strategy's checkpoint= option"
        )

    swaps: list[tuple[Any, str, Any]] = [(_torch_checkpoint, "checkpoint", recorded)]
    # torch's two implementations, which ``checkpoint`` looks up when it runs: reached only by a call
    # that ``recorded`` did not see.
    if hasattr(_torch_checkpoint, "_checkpoint_without_reentrant_generator"):
        swaps.append((_torch_checkpoint, "_checkpoint_without_reentrant_generator", unseen))
    if hasattr(_torch_checkpoint, "CheckpointFunction"):
        swaps.append((_torch_checkpoint.CheckpointFunction, "apply", unseen))
    for _, layer in layers:
        layer.gradient_checkpointing = False
    with contextlib.ExitStack() as undo:
        for owner, attr, value in swaps:
            undo.enter_context(_swapped(owner, attr, value))
        try:
            yield regions
        finally:
            for _, layer in layers:
                layer.gradient_checkpointing = True


@contextlib.contextmanager
def _swapped(owner: Any, attr: str, value: Any) -> Iterator[None]:
    own = attr in vars(owner)
    before = vars(owner).get(attr)  # the raw attribute (a classmethod stays one)
    setattr(owner, attr, value)
    try:
        yield
    finally:
        if own:
            setattr(owner, attr, before)
        else:
            delattr(owner, attr)  # inherited (autograd.Function's apply): inherited again


#: ``torch.utils.checkpoint.checkpoint``'s own keywords, not the function's.
_CHECKPOINT_OPTIONS = ("use_reentrant", "context_fn", "determinism_check", "debug", "preserve_rng_state", "early_stop")


def _unwrapped(function: Any) -> Any:
    while isinstance(function, functools.partial):
        function = function.func
    return function


def _module_of(function: Any) -> Any:
    """The module a checkpointed function runs: the module itself, a bound method of it, or a
    ``functools.partial`` of its forward with the module first (transformers 5's layers)."""
    while isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], nn.Module):
            return function.args[0]
        function = function.func
    if isinstance(function, nn.Module):
        return function
    return getattr(function, "__self__", None)


def covers(regions: set[str], owner: str) -> bool:
    """Whether the unit of block ``owner`` runs inside a checkpointed region: the region is the block,
    or holds it. (A region inside a block checkpoints the whole block's unit: it is what a worker
    can recompute, and it keeps less than locally.)"""
    return any(
        not r or owner == r or owner.startswith(r + ".") or (owner and r.startswith(owner + ".")) for r in regions
    )
