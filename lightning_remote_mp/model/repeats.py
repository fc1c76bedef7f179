"""Repeated blocks: a deep model exported at four blocks of each run of identical ones, the other
blocks' units copied (issue #60).

A Llama-3-70B has 80 decoder layers that are one program with other weights. ``torch.export`` spends
the same time on each (0.12 s a layer and mode for a hidden-64 Llama on this project's 2-core
machine: 20 s of the first step's 31 s at 80 layers, and 40 s of the first ``generate()``'s 46 s). As
torch's regional compilation compiles one decoder layer for all, lrmp traces a few:

1. `find_runs` finds each container (``nn.ModuleList``, ``nn.Sequential``) holding a run of at least
   `MIN_RUN` consecutive blocks alike: the same classes, parameter and buffer shapes, dtypes and
   flags, hooks, and plain attributes, but for an attribute that is the block's own position in
   the container (``layer_idx``); and whose owner only walks it in order, or reads no more of a
   block's position than its config's lists at it, which are then alike too (`_walked_in_order`).
2. `shallow` hides all but the run's first three blocks and its last from the container while the
   model is exported: ``for layer in self.layers`` runs four layers, each under its own name. The
   trace cuts that graph into units as any other (`lightning_remote_mp.model.trace`).
3. `with_copies` checks that the second and third blocks' units are alike: the same programs but for
   their names (`program.program_key`), each reading its own block's weights, taking the same values
   from before the run and the block before's output in the same places, nothing they compute read
   past the block after (a model that collects every layer's hidden state). lrmp's key/value cache
   operator may name the block's own position. Then it adds, after the third, a copy of its unit
   for each block hidden, with that block's weights, name and position: the units of a whole
   export (``tests/test_repeats.py`` compares them), made without tracing or cutting the copies.

Where a check fails, or the shallow export does (code that indexes the container itself), the
trace exports the whole model instead and says why at INFO. A program's steps are checked on the
driver and on the workers as any other (`lightning_remote_mp.model.program`), once per distinct
program (`program.load_program` keeps what it checked, by content).
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

from lightning_remote_mp.model.program import kv_cache_position, kv_cache_positions, program_key, with_kv_cache_position

log = logging.getLogger(__name__)

#: The fewest consecutive blocks alike that are exported at four of them: five saves one export of a
#: block, and costs the comparison of two.
MIN_RUN = 5
_CONTAINERS = (nn.ModuleList, nn.Sequential)
_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


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

    def describe(self) -> str:
        copied = f"{self.block(self.copied[0])}..{self.block(self.copied[-1])}" if self.copied else "none"
        return f"{copied} copied from {self.block(self.kept[2])}"


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


def _forward_tree(cls: type[nn.Module]) -> ast.AST | None:
    """``cls.forward``'s source as a syntax tree; ``None`` where it cannot be read."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return None


def _self_uses(tree: ast.AST, names: set[str]) -> list[ast.Attribute]:
    """Every ``self.<name>`` in ``tree``, for ``name`` in ``names``."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr in names and isinstance(n.value, ast.Name) and n.value.id == "self"
    ]


def _walked_in_order(module: nn.Module, path: str) -> set[str] | None:
    """How the module holding container ``path`` may tell its blocks apart: ``None`` where its code
    could tell a block's position (``self.layers[i]``, ``len(self.layers)``, a position used
    otherwise: it could do something at block 40 that none of the traced four shows); else the names
    of the config's lists it reads at a block's position (``self.config.layer_types[i]`` in ``for i,
    layer in enumerate(self.layers)``: Qwen2's, Gemma 2's), none where it only walks the container in
    order (``for layer in self.layers[:n]``) or calls it (a ``Sequential``)."""
    if not path:
        return set() if isinstance(module, nn.Sequential) else None
    owner_path, _, attr = path.rpartition(".")
    tree = _forward_tree(type(module.get_submodule(owner_path)))
    if tree is None:
        return None
    allowed: set[int] = set()
    lists: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            it, position = node.iter, None
            if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate" and it.args:
                target = node.target
                if not (isinstance(target, ast.Tuple) and target.elts and isinstance(target.elts[0], ast.Name)):
                    return None
                it, position = it.args[0], target.elts[0].id
            if isinstance(it, ast.Subscript) and isinstance(it.slice, ast.Slice):
                it = it.value
            allowed.add(id(it))
            if position is not None:
                read = _config_lists_at(node.body, position)
                if read is None:
                    return None
                lists |= read
        elif isinstance(node, ast.Call):
            allowed.add(id(node.func))
    return lists if all(id(n) in allowed for n in _self_uses(tree, {attr})) else None


def _config_lists_at(body: list[ast.stmt], position: str) -> set[str] | None:
    """The config lists a loop's ``body`` reads at ``position`` (``self.config.layer_types[i]``);
    ``None`` where it uses ``position`` any other way."""
    lists: set[str] = set()
    read: set[int] = set()
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.slice, ast.Name)
            and node.slice.id == position
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Attribute)
            and node.value.value.attr == "config"
        ):
            lists.add(node.value.attr)
            read.add(id(node.slice))
    uses = [n for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == position]
    return lists if all(id(n) in read for n in uses) else None


def _read_at(module: nn.Module, path: str, lists: set[str], key: str) -> tuple:
    """The values of the owner's config ``lists`` at block ``key``'s position."""
    owner = module.get_submodule(path.rpartition(".")[0]) if path else module
    config, position = getattr(owner, "config", None), _position(key)
    return tuple((name, getattr(config, name)[position]) for name in sorted(lists))


def find_runs(module: nn.Module) -> list[Run]:
    """The runs of at least `MIN_RUN` consecutive blocks alike in ``module``'s containers, outermost
    first; a container inside a run's block is not searched (its copies come with the block's), nor
    one whose owner's code might tell its blocks' positions (`_walked_in_order`)."""
    runs: list[Run] = []
    inside: list[str] = []
    for path, container in module.named_modules():
        if not isinstance(container, _CONTAINERS) or any(path.startswith(p + ".") for p in inside):
            continue
        if len(container._modules) < MIN_RUN:
            continue
        lists = _walked_in_order(module, path)
        items = list(container._modules.items())
        try:
            read = [_read_at(module, path, lists, k) for k, _ in items] if lists else [()] * len(items)
        except (AttributeError, TypeError, IndexError, KeyError):
            lists = None
        if lists is None:
            log.debug("%s: its owner's code may tell its blocks' positions; each is traced", path or "the module")
            continue
        start = 0
        signatures = [(_signature(m) + r, _position(k)) for (k, m), r in zip(items, read)]
        while start < len(items):
            end = start + 1
            while end < len(items) and _alike(*signatures[start], *signatures[end]):
                end += 1
            # A loop that reads the config at a block's position would read a later block's at the
            # position of a hidden one: blocks after the run would take other values (Gemma 3's).
            if end - start >= MIN_RUN and not (lists and end < len(items)):
                run = Run(container, path, tuple(k for k, _ in items[start:end]))
                if _positions_only_passed_on(container, run):
                    runs.append(run)
                    inside.extend(run.block(k) for k in run.keys)
                else:
                    log.debug("%s: a block's code computes with its own position; each is traced", path)
            start = end
    return runs


def _positions_only_passed_on(container: nn.Module, run: Run) -> bool:
    """Whether the blocks' code only passes their position attributes on as arguments (Llama's
    ``cache.update(k, v, self.layer_idx)``): a block that branches or computes on its own
    (``if self.layer_idx == 40:``) could do at block 40 what none of the traced four does."""
    a, b = container.get_submodule(run.keys[1]), container.get_submodule(run.keys[2])
    pa, pb = _position(run.keys[1]), _position(run.keys[2])
    classes: dict[type[nn.Module], set[str]] = {}
    for (_, ma), (_, mb) in zip(a.named_modules(), b.named_modules()):
        for name, value in vars(ma).items():
            if type(value) is int and value == pa and vars(mb).get(name) == pb and pa != pb:
                classes.setdefault(type(ma), set()).add(name)
    for cls, names in classes.items():
        tree = _forward_tree(cls)
        if tree is None:
            return False
        passed = {
            id(arg)
            for call in ast.walk(tree)
            if isinstance(call, ast.Call)
            for arg in (*call.args, *(k.value for k in call.keywords))
        }
        if any(id(n) not in passed for n in _self_uses(tree, names)):
            return False
    return True


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


@dataclasses.dataclass(frozen=True)
class Unit:
    """One unit of a trace as `lightning_remote_mp.model.trace` makes it, before its weights get
    their local names: ``programs``' ``tensors`` name the module's weights (``get_attr`` targets)."""

    programs: dict[str, dict[str, Any]]  # mode -> program data
    targets: list[str]  # the weights and buffers its programs read
    owners: list[str]  # the blocks it covers
    label: str
    shapes: list[tuple[int, ...]]
    examples: list[dict[str, Any]]
    cost: float


@dataclasses.dataclass(frozen=True)
class Boundaries:
    """A mode's values live at each unit boundary (``live[k]``: those unit ``k`` takes) and the unit
    that makes each (-1: an input of the model)."""

    live: list[list[fx.Node]]
    unit_of: dict[fx.Node, int]


def with_copies(units: list[Unit], runs: Sequence[Run], boundaries: dict[str, Boundaries]) -> list[Unit]:
    """``units`` of the model exported with its runs' kept blocks, with each hidden block's unit, a
    copy of the run's third block's, after that one; `NotAlike` where the kept blocks did not trace
    alike (see the module docstring)."""
    index = {u.label: k for k, u in enumerate(units) if len(u.owners) == 1}
    after: dict[int, list[Unit]] = {}
    for run in runs:
        found = [index.get(run.block(k), -1) for k in run.kept[1:]]
        if found[0] < 0 or found != list(range(found[0], found[0] + 3)):
            raise NotAlike(f"the blocks of {run.path or 'the module'} are not units of their own, one after another")
        first, second, last = found
        _check_alike(units[first], units[second], run)
        for mode, b in boundaries.items():
            _check_boundaries(b, first, second, last, run, mode)
        after[second] = [_copy(units[second], run, key) for key in run.copied]
    return [v for k, u in enumerate(units) for v in (u, *after.get(k, ()))]


def _relative(target: str, block: str) -> tuple[str, str]:
    return ("own", target[len(block) :]) if _within(target, block) else ("shared", target)


def _check_alike(a: Unit, b: Unit, run: Run) -> None:
    """The kept second and third blocks' units run the same steps on the same inputs, each on its own
    weights, their cache operators at their own positions."""
    ka, kb = run.kept[1], run.kept[2]
    name_a, name_b = run.block(ka), run.block(kb)
    same = (
        a.programs.keys() == b.programs.keys()
        and a.shapes == b.shapes
        and a.examples == b.examples
        and [_relative(t, name_a) for t in a.targets] == [_relative(t, name_b) for t in b.targets]
    )
    for mode in a.programs if same else ():
        pa, pb = a.programs[mode], b.programs[mode]
        same = same and program_key(pa) == program_key(pb)
        same = same and [_relative(t, name_a) for t in pa["tensors"].values()] == [
            _relative(t, name_b) for t in pb["tensors"].values()
        ]
        same = same and [p - (_position(ka) or 0) for p in kv_cache_positions(pa)] == [
            p - (_position(kb) or 0) for p in kv_cache_positions(pb)
        ]
    if not same:
        raise NotAlike(f"blocks {name_a} and {name_b} trace to different steps")


def _check_boundaries(b: Boundaries, first: int, second: int, last: int, run: Run, mode: str) -> None:
    """What the second kept block takes, the third takes in the same places (the same values from
    before the run, the block before's output where the second took its own block before's), and
    no block's value is read past the next block."""
    taken, given = b.live[second], b.live[last]
    where = f"in {mode} mode, {run.block(run.kept[2])}"
    if len(taken) != len(given):
        raise NotAlike(f"{where} takes {len(taken)} values but passes on {len(given)}")
    for x, y in zip(taken, given):
        if x is y and b.unit_of[x] < first:
            continue
        if not (b.unit_of[x] == first and b.unit_of[y] == second):
            raise NotAlike(f"{where}: {y.name} reaches past the next block; each block's values feed the next one only")
    later = [v for v in b.live[last + 1] if b.unit_of[v] in (first, second)]
    if later:
        raise NotAlike(f"{later[0].name} of block {run.block(run.kept[2])} is read after the block that follows it")


def _copy(unit: Unit, run: Run, key: str) -> Unit:
    """The third kept block's unit for block ``key``: its weights, its owners, its name and its cache
    operators' positions."""
    source, block = run.block(run.kept[2]), run.block(key)
    shift = (_position(key) or 0) - (_position(run.kept[2]) or 0)

    def renamed(path: str) -> str:
        return block + path[len(source) :] if _within(path, source) else path

    def shifted(step: list[Any]) -> list[Any]:
        position = kv_cache_position(step)
        return step if position is None else with_kv_cache_position(step, position + shift)

    programs = {
        mode: {
            **p,
            "tensors": {v: renamed(t) for v, t in p["tensors"].items()},
            "steps": [shifted(step) for step in p["steps"]] if shift else p["steps"],
        }
        for mode, p in unit.programs.items()
    }
    return dataclasses.replace(
        unit,
        programs=programs,
        targets=[renamed(t) for t in unit.targets],
        owners=[renamed(o) for o in unit.owners],
        label=renamed(unit.label),
    )


def _within(path: str, block: str) -> bool:
    return path == block or path.startswith(block + ".")


def copied_paths(paths: set[str], runs: Sequence[Run]) -> set[str]:
    """``paths`` (checkpointed regions, say) with those inside a run's third block repeated in each copy."""
    out = set(paths)
    for run in runs:
        source = run.block(run.kept[2])
        for path in paths:
            if _within(path, source):
                out.update(run.block(k) + path[len(source) :] for k in run.copied)
    return out
