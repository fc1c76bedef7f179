"""Why a traced model's operator is refused, said where the user can act on it: the operator, the
module that calls it (``model.layers.3.self_attn.rotary_emb``), the user's source line that calls
it, and advice that can work (allow it on the workers, its equivalent, a family's known fix).

torch.export records a step's source only down to the forward of the module it is in, so a helper
function's line (``rotate_half``'s ``torch.stack``) is found by running the module once more, on
the error's path only, and catching the operator as it is called.
"""

from __future__ import annotations

import contextlib
import re
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_remote_mp.errors import TraceError
from lightning_remote_mp.model.operators import refused_why

#: Operators of well-known libraries that a worker does not run, and the traced alternative.
_KNOWN_WAYS_AROUND = {
    "transformers::grouped_mm_fallback": (
        "this is transformers' mixture-of-experts path experts_implementation='grouped_mm' (the default) in "
        "float32, whose grouped matrix product is such an operator: give the model's config "
        "experts_implementation='batched_mm', which traces to ATen operators, or "
    ),
}
#: The most parameter bytes of a module run again to find a refused operator's line (a forward of
#: a bigger model on the driver costs more than the line is worth; a meta model costs nothing).
RERUN_LIMIT = 1 << 30


class RefusedOperator(TraceError):
    """A traced step calls an operator workers do not run (``operator``: its schema's name)."""

    def __init__(self, message: str, operator: str, where: str) -> None:
        super().__init__(message)
        self.operator, self.where = operator, where


def refused(node: fx.Node, name: str) -> RefusedOperator:
    """The error for step ``node`` of module ``name``, whose operator no worker runs."""
    target = node.target
    op = isinstance(target, torch._ops.OpOverload)
    shown = str(target._schema.name if op else getattr(target, "__name__", target))
    aten = shown.startswith("aten::")
    why = refused_why(shown.removeprefix("aten::")) if aten else None
    if why is not None:
        allow = f"it is never run from the wire: it {why}; "
    elif aten:
        allow = (
            f"if it is safe on your workers, allow it: lrmp-worker --allow-op {shown} on each, and "
            f"LRMP_ALLOW_OPERATORS={shown} where the driver runs; or "
        )
    else:
        allow = (
            "custom operators (Python code registered as an operator) and control-flow operators (torch.cond, "
            "torch.while_loop) are not supported; "
        )
    where = _where(node)
    message = (
        f"module {name!r}: the traced graph calls {shown}{_module(node, name)}{where}, which workers do not run: "
        "they run the ATen operators of lightning_remote_mp.model.operators, and torch.no_grad() and "
        "torch.autocast blocks; "
        + allow
        + _KNOWN_WAYS_AROUND.get(shown, "")
        + "split around that module (split= takes dotted names) or describe it as a layer spec."
    )
    return RefusedOperator(message, shown, where)


def _module(node: fx.Node, name: str) -> str:
    """`` in model.layers.3.self_attn (LlamaAttention)``: the innermost module the step is in."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    kind = str(getattr(cls, "__name__", cls)).rpartition(".")[2]
    return f" in {'.'.join(p for p in (name, str(path)) if p)} ({kind})"


def _where(node: fx.Node) -> str:
    """The user's source line a step came from (the innermost frame outside torch), if recorded."""
    trace = node.meta.get("stack_trace") or ""
    lines = [f for f in re.findall(r'File "([^"]+)", line (\d+)', trace) if _user_file(f[0])]
    return f" (at {lines[-1][0]}:{lines[-1][1]})" if lines else ""


def _user_file(path: str) -> bool:
    return "/torch/" not in path and "<" not in path and "/lightning_remote_mp/" not in path


@contextlib.contextmanager
def with_user_line(module: nn.Module, args: tuple, kwargs: dict) -> Iterator[None]:
    """Inside, a `RefusedOperator` gets the line of the user's code that calls the operator: the
    module is run once more, catching the operator as it is called (`RERUN_LIMIT`)."""
    try:
        yield
    except RefusedOperator as err:
        line = _user_line(module, args, kwargs, err.operator)
        if line is None or line in err.where:
            raise
        message, at = str(err), f" (at {line})"
        if err.where:
            message = message.replace(err.where, at, 1)
        else:
            message = message.replace(", which workers", at + ", which workers", 1)
        raise RefusedOperator(message, err.operator, at) from None


def _user_line(module: nn.Module, args: tuple, kwargs: dict, operator: str) -> str | None:
    size = sum(p.numel() * p.element_size() for p in module.parameters() if not p.is_meta)
    if size > RERUN_LIMIT:
        return None
    name = operator.partition("::")[2].removeprefix("special_")
    finder = _Finder(operator, name)
    try:
        with torch.no_grad(), finder, _Functions(finder):
            module(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the first error stands; this only looks for a line
        pass
    return finder.line


class _Finder(TorchDispatchMode):
    """Records the innermost user frame at the first call of the operator (by its ATen name)."""

    def __init__(self, operator: str, name: str) -> None:
        super().__init__()
        self.operator, self.name, self.line = operator, name, None

    def saw(self) -> None:
        if self.line is None:
            frames = [f for f in traceback.extract_stack() if _user_file(f.filename)]
            if frames:
                self.line = f"{frames[-1].filename}:{frames[-1].lineno}"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if str(func._schema.name) == self.operator:
            self.saw()
        return func(*args, **(kwargs or {}))


class _Functions(TorchFunctionMode):
    """The same, by the Python function's name (``torch.stack``, ``Tensor.T``): composite operators
    are decomposed before dispatch, so only their function call shows them."""

    def __init__(self, finder: _Finder) -> None:
        super().__init__()
        self.finder = finder

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name == self.finder.name or name.removesuffix("_") == self.finder.name:
            self.finder.saw()
        return func(*args, **(kwargs or {}))
