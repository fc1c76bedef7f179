"""Repeated blocks: a deep model exported at four blocks of each run of identical ones, the others
copied in the graph (issue #60).

A Llama-3-70B has 80 decoder layers that are one program with other weights. ``torch.export`` spends
the same time on each (0.12 s a layer and mode for a hidden-64 Llama on this project's 2-core
machine: 20 s of the first step's 31 s at 80 layers, and 40 s of the first ``generate()``'s 46 s). As
torch's regional compilation compiles one decoder layer for all, lrmp traces a few:

1. `find_runs` finds each container (``nn.ModuleList``, ``nn.Sequential``) holding a run of at least
   `MIN_RUN` consecutive blocks alike: the same classes, parameter and buffer shapes, dtypes and
   flags, hooks, and plain attributes, but for an attribute that is the block's own position in
   the container (``layer_idx``).
2. `shallow` hides all but the run's first three blocks and its last from the container while the
   model is exported: ``for layer in self.layers`` runs four layers, each under its own name.
3. `expand` checks that the second and third blocks traced alike: the same steps, the same
   constants, the same shape of inputs taken from the block before and from before the run, and
   nothing they compute read anywhere else (a model that collects every layer's hidden state).
   lrmp's key/value cache operator may name the block's own position. Then it copies the third
   block's steps once for each block hidden, with that block's weights and position, and the last
   block reads the last copy. What follows (cutting into units, the programs) sees the whole model.

Where a check fails, or the shallow export does (code that indexes the container itself), the
caller exports the whole model instead and says why at INFO. A program's steps are checked on the
driver and on the workers as any other (`lightning_remote_mp.model.graph`), once per distinct
program (`graph.load_program` keeps what it checked, by content).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import logging
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx, nn

log = logging.getLogger(__name__)

#: The fewest consecutive blocks alike that are exported at four of them: five saves one export of a
#: block, and costs the comparison of two.
MIN_RUN = 5
_CONTAINERS = (nn.ModuleList, nn.Sequential)
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
#: lrmp's key/value cache operator (`lightning_remote_mp.model.kv_cache`), whose third argument is
#: the attention layer's position.
_KV_CACHE = "lrmp.kv_cache.default"


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive blocks alike in one container: ``keys`` are their names in it, in order."""

    container: nn.Module
    path: str
    keys: tuple[str, ...]

    def block(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    @property
    def kept(self) -> tuple[str, ...]:
        """The blocks exported: the first three and the last."""
        return (*self.keys[:3], self.keys[-1])

    @property
    def copied(self) -> tuple[str, ...]:
        """The blocks made by copying the third's steps."""
        return self.keys[3:-1]


def _value(value: Any) -> Any:
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return tuple(value)
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, dict):  # hooks: how many
        return (type(value).__name__, len(value))
    return type(value)


def _signature(block: nn.Module) -> tuple:
    """What decides how ``block`` traces, but for its weights' values (see the module docstring)."""
    parts: list[Any] = []
    for path, m in block.named_modules(remove_duplicate=False):
        parts.append((path, type(m)))
        for name, t in (*m._parameters.items(), *m._buffers.items()):
            parts.append(
                (name, None) if t is None else (name, type(t), tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
            )
        for name, value in sorted(vars(m).items()):
            if name not in ("_parameters", "_buffers", "_modules"):
                parts.append((name, _value(value)))
    return tuple(parts)


def _alike(a: tuple, position_a: int | None, b: tuple, position_b: int | None) -> bool:
    """Two blocks' signatures are the same but for attributes that are each block's own position."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        own = (
            position_a is not None
            and position_b is not None
            and len(x) == len(y) == 2
            and x[0] == y[0]
            and type(x[1]) is int
            and type(y[1]) is int
            and (x[1], y[1]) == (position_a, position_b)
        )
        if not own:
            return False
    return True


def _walked_in_order(module: nn.Module, path: str) -> bool:
    """Whether the module holding container ``path`` uses it only by walking it in order (``for layer
    in self.layers``, or a slice of it) or calling it (a ``Sequential``), so that it cannot tell a
    block's position: ``enumerate(self.layers)``, ``self.layers[i]`` or ``len(self.layers)`` could do
    something at block 40 that none of the traced four shows."""
    if not path:
        return isinstance(module, nn.Sequential)
    owner_path, _, attr = path.rpartition(".")
    owner = module.get_submodule(owner_path)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(type(owner).forward))))
    except (OSError, TypeError, SyntaxError):
        return False
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            it = (
                node.iter.value
                if isinstance(node.iter, ast.Subscript) and isinstance(node.iter.slice, ast.Slice)
                else node.iter
            )
            allowed.add(id(it))
        elif isinstance(node, ast.Call):
            allowed.add(id(node.func))
    uses = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == attr and isinstance(n.value, ast.Name) and n.value.id == "self"
    ]
    return all(id(n) in allowed for n in uses)


def find_runs(module: nn.Module) -> list[Run]:
    """The runs of at least `MIN_RUN` consecutive blocks alike in ``module``'s containers, outermost
    first; a container inside a run's block is not searched (its copies come with the block's), nor
    one whose owner's code might tell its blocks' positions (`_walked_in_order`)."""
    runs: list[Run] = []
    inside: list[str] = []
    for path, container in module.named_modules():
        if not isinstance(container, _CONTAINERS) or any(path.startswith(p + ".") for p in inside):
            continue
        if len(container._modules) >= MIN_RUN and not _walked_in_order(module, path):
            log.debug("%s: its owner's code may tell its blocks' positions; each is traced", path or "the module")
            continue
        items = list(container._modules.items())
        start = 0
        signatures = [(_signature(m), _position(k)) for k, m in items]
        while start < len(items):
            end = start + 1
            while end < len(items) and _alike(*signatures[start], *signatures[end]):
                end += 1
            if end - start >= MIN_RUN:
                run = Run(container, path, tuple(k for k, _ in items[start:end]))
                runs.append(run)
                inside.extend(run.block(k) for k in run.keys)
            start = end
    return runs


def _position(key: str) -> int | None:
    return int(key) if key.isdigit() else None


@contextlib.contextmanager
def shallow(runs: Sequence[Run]) -> Iterator[None]:
    """While the block runs, each run's container holds only the run's kept blocks (and its other
    elements), each under its own key."""
    saved = [(run.container, run.container._modules) for run in runs]
    hidden = {id(run.container): set(run.copied) for run in runs}
    try:
        for run in runs:
            kept = {k: m for k, m in run.container._modules.items() if k not in hidden[id(run.container)]}
            run.container._modules = kept  # type: ignore[assignment]
        yield
    finally:
        for container, modules in saved:
            container._modules = modules


class NotAlike(Exception):
    """A run's blocks did not trace alike: the model is exported whole (the message says why)."""


def _block_of(node: fx.Node, blocks: dict[str, str]) -> str | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if isinstance(path, str) and path in blocks:
            return blocks[path]
    return None


def _size(node: fx.Node) -> bool:
    """A size computed from the inputs' shapes (torch.export computes each once, in the first block
    that needs it, and later blocks read it there): the same for every block."""
    sizes = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
    return node.op == "call_function" and isinstance(node.meta.get("val"), sizes)


def _within(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


class _Segments:
    """One run's kept blocks in a graph: each block's steps, with the glue before it."""

    def __init__(self, gm: fx.GraphModule, run: Run) -> None:
        self.run = run
        nodes = list(gm.graph.nodes)
        self.order = {n: i for i, n in enumerate(nodes)}
        blocks = {run.block(k): k for k in run.kept}
        where: dict[str, list[int]] = {k: [] for k in run.kept}
        for i, n in enumerate(nodes):
            key = _block_of(n, blocks)
            if key is not None:
                where[key].append(i)
        for key, found in where.items():
            if not found:
                raise NotAlike(f"block {run.block(key)} has no steps in the graph")
            if found != list(range(found[0], found[-1] + 1)):
                raise NotAlike(f"the steps of block {run.block(key)} are not consecutive")
        k0, k1, k2, last = run.kept
        self.first = where[k0][0]
        self.segments = {
            k0: nodes[where[k0][0] : where[k0][-1] + 1],
            k1: nodes[where[k0][-1] + 1 : where[k1][-1] + 1],
            k2: nodes[where[k1][-1] + 1 : where[k2][-1] + 1],
            last: nodes[where[k2][-1] + 1 : where[last][-1] + 1],
        }

    def canonical(self, key: str, before: str) -> list[Any]:
        """Block ``key``'s segment with every reference relative: to its own steps by position, to the
        block before's by position from its end, to its weights by their names within it, to what
        precedes the run as itself."""
        run, segment, previous = self.run, self.segments[key], self.segments[before]
        own = {n: i for i, n in enumerate(segment)}
        prior = {n: len(previous) - i for i, n in enumerate(previous)}
        block = run.block(key)

        def ref(a: fx.Node) -> Any:
            if a in own:
                return ("own", own[a])
            if _size(a):
                return ("shared", a)
            if a in prior:
                return ("before", prior[a])
            if a.op == "get_attr" and isinstance(a.target, str):
                for k in run.keys:
                    if _within(a.target, run.block(k)):
                        if k != key:
                            raise NotAlike(f"block {block} reads a weight of block {run.block(k)}")
                        return ("weight", a.target[len(block) :])
            if self.order.get(a, -1) >= self.first:
                raise NotAlike(f"block {block} reads {a.name}, computed by an earlier block than the one before it")
            return ("shared", a)

        out = []
        for n in segment:
            args = fx.node.map_arg(n.args, ref)
            if str(n.target) == _KV_CACHE and _position(key) is not None:
                args = (*args[:2], ("position+", args[2] - int(key)), *args[3:])
            stack = tuple(
                (path[len(block) :] if _within(path, block) else path, kind)
                for path, kind in (n.meta.get("nn_module_stack") or {}).values()
            )
            out.append((n.op, n.target, args, fx.node.map_arg(n.kwargs, ref), n.meta.get("lrmp_context"), stack))
        return out

    def check_reads(self, key: str, readers: Sequence[str]) -> None:
        """Nothing outside the segments ``readers`` reads block ``key``'s values."""
        allowed = {n for k in readers for n in self.segments[k]}
        for n in self.segments[key]:
            for user in n.users:
                if user not in allowed:
                    raise NotAlike(
                        f"{user.name} ({'the output' if user.op == 'output' else 'a later step'}) reads "
                        f"{n.name} of block {self.run.block(key)}: each block's values feed the next one only"
                    )


def expand(gm: fx.GraphModule, runs: Sequence[Run]) -> None:
    """Copy each run's third block for its hidden blocks (see the module docstring); `NotAlike` where
    the kept blocks did not trace alike (``gm`` is then unusable)."""
    for run in runs:
        _expand_run(gm, run)


def _expand_run(gm: fx.GraphModule, run: Run) -> None:
    seg = _Segments(gm, run)
    k0, k1, k2, last = run.kept
    if seg.canonical(k1, k0) != seg.canonical(k2, k1):
        raise NotAlike(f"blocks {run.block(k1)} and {run.block(k2)} trace to different steps")
    seg.check_reads(k1, (k1, k2))
    seg.check_reads(k2, (k2, last))
    template, before = seg.segments[k2], seg.segments[k1]
    before_index = {n: i for i, n in enumerate(before)}
    graph = gm.graph
    anchor = seg.segments[last][0]
    weights: dict[str, fx.Node] = {}
    previous, source = template, run.block(k2)
    for key in run.copied:
        block = run.block(key)
        env: dict[fx.Node, fx.Node] = {}

        def arg(
            a: fx.Node, env: dict[fx.Node, fx.Node] = env, previous: list[fx.Node] = previous, block: str = block
        ) -> fx.Node:
            if a in env:
                return env[a]
            if _size(a):
                return a
            if a in before_index:
                return previous[before_index[a]]
            if a.op == "get_attr" and isinstance(a.target, str) and _within(a.target, source):
                target = block + a.target[len(source) :]
                if target not in weights:
                    _register(gm, target, _attribute(gm, a.target))
                    with graph.inserting_before(anchor):
                        weights[target] = graph.create_node("get_attr", target)
                    weights[target].meta = dict(a.meta)
                return weights[target]
            return a

        with graph.inserting_before(anchor):
            for n in template:
                new = graph.node_copy(n, arg)
                new.meta = _renamed(n.meta, source, block)
                if str(n.target) == _KV_CACHE and _position(key) is not None:
                    new.args = (*new.args[:2], n.args[2] - int(k2) + int(key), *new.args[3:])
                env[n] = new
        previous = [env[n] for n in template]
    if run.copied:
        readers = set(seg.segments[last])
        for i, n in enumerate(template):
            for user in [u for u in n.users if u in readers]:
                user.replace_input_with(n, previous[i])


def _attribute(gm: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner), name)


def _register(gm: nn.Module, target: str, like: Any) -> None:
    """A copied block's weight in ``gm``, where its graph names it: the kept block's tensor stands in
    (the trace reads the weights themselves from the model)."""
    owner = gm
    *path, name = target.split(".")
    for part in path:
        if part not in owner._modules:
            owner.add_module(part, nn.Module())
        owner = owner._modules[part]  # type: ignore[assignment]
    if isinstance(like, nn.Parameter):
        owner.register_parameter(name, like)
    elif isinstance(like, torch.Tensor):
        owner.register_buffer(name, like)
    else:
        setattr(owner, name, like)


def _renamed(meta: dict[str, Any], source: str, block: str) -> dict[str, Any]:
    """A copied step's metadata, its module stack under the copy's block."""
    out = dict(meta)
    stack = meta.get("nn_module_stack")
    if stack:
        out["nn_module_stack"] = {
            key: (block + path[len(source) :] if isinstance(path, str) and _within(path, source) else path, kind)
            for key, (path, kind) in stack.items()
        }
    return out


def copied_paths(paths: set[str], runs: Sequence[Run]) -> set[str]:
    """``paths`` (checkpointed regions, say) with those inside a run's third block repeated in each copy."""
    out = set(paths)
    for run in runs:
        source = run.block(run.kept[2])
        for path in paths:
            if _within(path, source):
                out.update(run.block(k) + path[len(source) :] for k in run.copied)
    return out
