"""Splitting an unchanged ``nn.Module`` by tracing it: ``torch.export`` at its first call, then cut
into pieces that workers run as `lightning_remote_mp.model.graph_layer.GraphLayer` layers, with no user code.

1. `trace_module` exports the module in each mode it is asked for: train and eval (code may branch
   on ``self.training``; `lightning_remote_mp.model.export`), or the one a call runs in (a first
   training step, a step of ``generate()``: `lightning_remote_mp.model.calls`).
2. The graph is cut into *units* at module boundaries: each step belongs to the outermost module
   on its stack that is a leaf or an element of a ``ModuleList``/``Sequential`` (a block); steps of
   glue code join the next unit. Units that share a weight (tied embeddings) merge.
3. Each unit becomes a spec entry whose layer runs its program on the values *live* at its start
   (produced earlier, used here or later) and returns those live at its end; pipeline stages are
   contiguous runs of units, chosen by the strategy's ``balance`` as for a spec.
4. On the driver the module keeps its weights (a copy, refreshed from the workers whenever its
   ``state_dict()`` is taken) and its own ``state_dict`` keys; `lightning_remote_mp.model.calls`
   stands in for its ``forward``: it flattens the call's arguments, runs the pipeline and rebuilds
   the output (`lightning_remote_mp.model.traced`).

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> traced = trace_module(net, (torch.ones(3, 4),), {}, "net")
>>> [entry.name for entry in traced.entries]
['0', '1', '2']
>>> torch.allclose(traced.run_locally(torch.ones(5, 4)), net(torch.ones(5, 4)))
True
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from lightning_remote_mp.errors import TraceError
from lightning_remote_mp.model import repeats
from lightning_remote_mp.model.bnb_layers import stand_ins
from lightning_remote_mp.model.export import export
from lightning_remote_mp.model.gradient_checkpointing import checkpointed_regions, covers
from lightning_remote_mp.model.graph_layer import LAYER_PATH, GraphLayer
from lightning_remote_mp.model.head_loss import chunk_head_losses
from lightning_remote_mp.model.joins import split_means
from lightning_remote_mp.model.operators import allowed_operator
from lightning_remote_mp.model.program import MARKERS, TRACED_PYTHON_NAMES
from lightning_remote_mp.model.refusals import refused, with_user_line
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.model.traced import Ends, Interface, TracedEntry, TracedSequential

log = logging.getLogger(__name__)
_MARKER_NAMES = {value: (tag, name) for tag, table in MARKERS.items() for name, value in table.items()}
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
_MATMULS = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "linear",
    "linear_4bit",
    "conv1d",
    "conv2d",
    "conv3d",
    "convolution",
}
#: The name a traced unit's layer travels under (`lightning_remote_mp.graph`).


# --- exporting ------------------------------------------------------------------------------


# --- cutting into units ---------------------------------------------------------------------
def _owner(node: fx.Node, root: nn.Module) -> str | None:
    """The block a step belongs to: the outermost module on its stack that is a leaf or an element
    of a container; ``None`` for glue code of a non-block module."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in stack.values():
        if not isinstance(path, str) or not path:
            continue
        try:
            module = root.get_submodule(path)
        except AttributeError:
            continue
        parent = root.get_submodule(path.rpartition(".")[0]) if "." in path else root
        if not any(True for _ in module.children()) or isinstance(parent, _CONTAINERS):
            return path
    return None


def _is_tuple_valued(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def _is_pipe_split(node: fx.Node) -> bool:
    """A ``torch.distributed.pipelining.pipe_split()`` marker: the code may be cut here."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and target._schema.name == "pippy::_pipe_split"


def _runs(gm: fx.GraphModule, root: nn.Module) -> list[tuple[str, list[fx.Node]]]:
    """Consecutive steps of one owner, in graph order. A ``pipe_split()`` (torch.distributed.
    pipelining's marker) ends every run, so code between two of them, plain functions on raw
    parameters included, is a unit of its own (its owners get ``@k``, the k-th segment)."""
    every = [n for n in gm.graph.nodes if n.op == "call_function"]
    segment, segments = 0, []
    for n in every:
        segment += _is_pipe_split(n)
        segments.append(segment)
    nodes = [n for n in every if not _is_pipe_split(n)]
    segments = [k for n, k in zip(every, segments) if not _is_pipe_split(n)]
    owners = [_owner(n, root) for n in nodes]
    if segment:  # a block's steps in different segments are different runs
        owners = [None if o is None else f"{o}@{k}" for o, k in zip(owners, segments)]
    for i, n in enumerate(nodes):  # a multi-output op's getitems stay with it
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and _is_tuple_valued(n.args[0]):
            src = n.args[0]
            if src in nodes:
                owners[i] = owners[nodes.index(src)]
    for i in reversed(range(len(nodes) - 1)):  # glue joins the next block of its segment...
        if owners[i] is None and segments[i] == segments[i + 1]:
            owners[i] = owners[i + 1]
    for i in range(len(nodes)):  # ...else the last one, or is a run of its own
        if owners[i] is None:
            alone = f"@{segments[i]}" if segment else ""
            owners[i] = owners[i - 1] if i and segments[i - 1] == segments[i] else alone
    pairs = itertools.groupby(zip(nodes, owners), key=lambda pair: pair[1])
    return [(owner, [node for node, _ in run]) for owner, run in pairs]


def _align(train: list[tuple[str, list[fx.Node]]], evals: list[tuple[str, list[fx.Node]]], name: str):
    """Pair the two variants' runs by owner; a run one variant lacks (a step that only trains) is empty
    there. Returns the owners, and the train and eval runs."""
    owners: list[str] = []
    out_train: list[list[fx.Node]] = []
    out_eval: list[list[fx.Node]] = []
    i = j = 0
    while i < len(train) or j < len(evals):
        if i < len(train) and j < len(evals) and train[i][0] == evals[j][0]:
            pair = (train[i][0], train[i][1], evals[j][1])
            i, j = i + 1, j + 1
        elif i < len(train) and not any(r[0] == train[i][0] for r in evals[j : j + 3]):
            pair = (train[i][0], train[i][1], [])
            i += 1
        elif j < len(evals) and not any(r[0] == evals[j][0] for r in train[i : i + 3]):
            pair = (evals[j][0], [], evals[j][1])
            j += 1
        else:
            raise TraceError(
                f"module {name!r}: its train-mode and eval-mode traces run its submodules in different orders "
                f"(near {train[min(i, len(train) - 1)][0]!r}); cannot cut both the same way"
            )
        owners.append(pair[0])
        out_train.append(pair[1])
        out_eval.append(pair[2])
    return owners, out_train, out_eval


def _attrs(nodes: Sequence[fx.Node]) -> set[str]:
    return {a.target for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}  # type: ignore[misc]


#: Operators that update their running statistics in place when training, though their schema marks
#: no argument as written: ``(operator name, positions of the statistics, position of the training flag)``.
_STATISTICS = {"batch_norm": ((3, 4), 5), "instance_norm": ((3, 4), 5)}


def _mutated(nodes: Sequence[fx.Node]) -> set[str]:
    """The weights and buffers (``get_attr`` targets) that these steps write to."""
    out: set[str] = set()
    for n in nodes:
        op = n.target
        if n.op != "call_function" or not isinstance(op, torch._ops.OpOverload):
            continue
        written = [
            i for i, arg in enumerate(op._schema.arguments) if arg.alias_info is not None and arg.alias_info.is_write
        ]
        stats = _STATISTICS.get(op._schema.name.partition("::")[2])
        if stats is not None and len(n.args) > stats[1] and n.args[stats[1]] is not False:
            written += list(stats[0])
        for i in written:
            if i < len(n.args) and isinstance(n.args[i], fx.Node) and n.args[i].op == "get_attr":
                out.add(n.args[i].target)  # type: ignore[arg-type]
    return out


def _merge_mutated(attrs: list[set[str]], mutated: set[str]) -> list[list[int]]:
    """Merge runs ``i..j`` wherever a buffer that some step writes (BatchNorm's running statistics
    of a module called twice) is used by runs ``i`` and ``j``: its copies on two stages would go
    apart. A weight that is only read by several runs (tied embeddings) merges nothing: each stage
    that uses it holds a copy, and the copies sum their gradients (`TracedSequential.shared`)."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for k, names in enumerate(attrs):
        for a in names & mutated:
            first.setdefault(a, k)
            last[a] = k
    reach = list(range(len(attrs)))
    for a in first:
        for k in range(first[a], last[a] + 1):
            reach[k] = max(reach[k], last[a])
    merged: list[list[int]] = []
    k = 0
    while k < len(attrs):
        end = reach[k]
        j = k
        while j <= end:
            end = max(end, reach[j])
            j += 1
        merged.append(list(range(k, end + 1)))
        k = end + 1
    return merged


# --- encoding ----------------------------------------------------------------------------------
def _target(node: fx.Node, name: str) -> list[str]:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        ns, _, op = target._schema.name.partition("::")
        if allowed_operator(target):
            return [ns, op, target._overloadname or "default"]
    elif target in TRACED_PYTHON_NAMES:
        return ["python", TRACED_PYTHON_NAMES[target]]
    raise refused(node, name)


def _encode(value: Any, name: str) -> Any:
    if isinstance(value, fx.Node):
        return {"ref": value.name}
    if isinstance(value, torch.device):
        return {"device": True}
    if isinstance(value, (torch.layout, torch.memory_format)):
        if value not in _MARKER_NAMES:
            raise TraceError(f"module {name!r}: {value} cannot travel to a worker")
        tag, item = _MARKER_NAMES[value]
        return {tag: item}
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
        return value
    if isinstance(value, tuple):
        return tuple(_encode(v, name) for v in value)
    if isinstance(value, list):
        return [_encode(v, name) for v in value]
    raise TraceError(f"module {name!r}: a traced argument of type {type(value).__name__} cannot travel to a worker")


def _is_scalar(node: fx.Node) -> bool:
    return not isinstance(node.meta.get("val"), torch.Tensor)


def _hint(value: Any) -> Any:
    """The example's value of a (symbolic) number, without guarding on it: ``int()`` of a symbolic
    size would fix it in the trace's shape environment, and later checks would see it as static."""
    node = getattr(value, "node", None)
    if node is not None:
        hint = getattr(node, "hint", None)
        return hint if hint is not None else 1
    return value


def _shape(node: fx.Node) -> tuple[int, ...]:
    val = node.meta.get("val")
    return tuple(_hint(d) for d in val.shape) if isinstance(val, torch.Tensor) else ()


def _example(node: fx.Node) -> dict[str, Any]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return {"shape": list(_shape(node)), "dtype": val.dtype}
    if isinstance(val, (bool, torch.SymBool)):
        return {"scalar": bool(_hint(val))}
    if isinstance(val, (float, torch.SymFloat)):
        return {"scalar": float(_hint(val))}
    return {"scalar": int(_hint(val))}


def _cost(nodes: Sequence[fx.Node]) -> float:
    """Estimated FLOPs: two per multiply-add of matrix products and convolutions, one per output element otherwise."""
    total = 0.0
    for n in nodes:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        out = float(torch.Size(_shape(n)).numel())
        total += out
        op = getattr(n.target, "_schema", None)
        short = op.name.partition("::")[2] if op is not None else ""
        if short in _MATMULS:
            weight = next((a for a in n.all_input_nodes if a.op == "get_attr"), None)
            inner = n.all_input_nodes[0].meta.get("val") if n.all_input_nodes else None
            if weight is not None and isinstance(weight.meta.get("val"), torch.Tensor) and short.startswith("conv"):
                w = _shape(weight)
                total += 2 * out * (torch.Size(w).numel() / max(w[0], 1))
            elif isinstance(inner, torch.Tensor) and inner.dim() > 0:
                total += 2 * out * _hint(inner.shape[-1])
    return total


# --- the traced module ------------------------------------------------------------------------


def _live(values: list[fx.Node], unit_of: dict[fx.Node, int], n_units: int) -> list[list[fx.Node]]:
    """For each boundary 0..n_units, the values produced before it and used at or after it."""
    last_use: dict[fx.Node, int] = {}
    for v in values:
        users = [n_units if u.op == "output" else unit_of.get(u, -2) for u in v.users]
        if users:
            last_use[v] = max(users)
    return [[v for v in values if unit_of[v] < k <= last_use.get(v, -1)] for k in range(n_units + 1)]


MODES = ("train", "eval")


def trace_module(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    name: str,
    modes: tuple[str, ...] = MODES,
    like: TracedSequential | None = None,
) -> TracedSequential:
    """Trace ``module`` called with ``args`` and ``kwargs`` in each of ``modes`` (train and eval, or
    the ones a call runs in) and cut it into units (see the module docstring): a deep model's
    repeated blocks at four of them (`lightning_remote_mp.model.repeats`) where they trace alike,
    else whole. ``like``: a trace of the same module in other modes, whose stages this one is to run
    on: units that share a buffer some step of either writes are kept together as there. The trace
    says its modes (``.trace_modes``)."""
    runs = repeats.find_runs(module)
    if runs:
        try:
            return _trace(module, args, kwargs, name, runs, modes, like)
        except (repeats.NotAlike, TraceError) as why:
            log.info("module %r: its repeated blocks are traced one by one: %s", name, why)
    return _trace(module, args, kwargs, name, [], modes, like)


def _trace(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    name: str,
    runs: list[repeats.Run],
    modes: tuple[str, ...],
    like: TracedSequential | None,
) -> TracedSequential:
    with _traced_on_meta(module), stand_ins(module, name) as four_bit, checkpointed_regions(module, name) as regions:
        with repeats.shallow(runs):
            graphs = {mode: export(module, args, kwargs, name, mode == "train") for mode in modes}
    counts = {mode: split_means(gm) for mode, gm in graphs.items()}  # losses joined exactly across micro-batches
    if any(c != counts[modes[0]] for c in counts.values()):
        raise TraceError(f"module {name!r} returns a mean-reduced loss in one of train and eval mode only")
    if "train" in graphs:
        chunk_head_losses(graphs["train"], name)  # a language model's training loss without its whole logits
    by_mode = {mode: _runs(gm, module) for mode, gm in graphs.items()}  # one mode: aligned with itself
    owners, *aligned = _align(by_mode[modes[0]], by_mode[modes[-1]], name)
    attrs = [_attrs(t) | _attrs(e) for t, e in zip(*aligned)]
    mutated = _mutated([n for gm in graphs.values() for n in gm.graph.nodes]) | getattr(like, "mutated", frozenset())
    groups = _merge_mutated(attrs, mutated)
    unit_nodes = {mode: [[n for i in g for n in runs[i]] for g in groups] for mode, runs in zip(modes, aligned)}
    programs: list[dict[str, Any]] = [{} for _ in groups]
    shapes: list[list[tuple[int, ...]]] = []
    examples: list[list[dict[str, Any]]] = []
    interfaces: dict[str, Ends] = {}
    crossings: dict[str, list[list[Any]]] = {}
    boundaries: dict[str, repeats.Boundaries] = {}
    with with_user_line(module, args, kwargs):  # a refused operator: the user's line that calls it
        for mode, gm in graphs.items():
            units = unit_nodes[mode]
            unit_of: dict[fx.Node, int] = {n: k for k, nodes in enumerate(units) for n in nodes}
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            unit_of.update({p: -1 for p in placeholders})
            values = placeholders + [n for nodes in units for n in nodes]
            live = _live(values, unit_of, len(units))
            output = next(n for n in gm.graph.nodes if n.op == "output")
            for v in output.all_input_nodes:
                if v.op == "get_attr":
                    raise TraceError(f"module {name!r} returns a weight as an output; workers cannot send that back")
            for k, nodes in enumerate(units):
                crossing = [v for v in live[k] + live[k + 1] if _is_tuple_valued(v)]
                if crossing:
                    raise TraceError(f"module {name!r}: the value {crossing[0].name} crosses units but is not a tensor")
                programs[k][mode] = {
                    "inputs": [v.name for v in live[k]],
                    "scalar_inputs": [v.name for v in live[k] if _is_scalar(v)],
                    "tensors": {a.name: a.target for a in _attr_nodes(nodes)},  # their local names below
                    "steps": [_step(n, name) for n in nodes],
                    "outputs": [v.name for v in live[k + 1]],
                    "scalar_outputs": [v.name for v in live[k + 1] if _is_scalar(v)],
                }
            if mode == modes[0]:
                shapes = [[_shape(v) for v in live[k]] for k in range(len(units))]
                examples = [[_example(v) for v in live[k]] for k in range(len(units))]
            interfaces[mode] = Ends([v.name for v in live[0]], [v.name for v in live[-1]])
            crossings[mode] = [[_kind(v) for v in boundary] for boundary in live]
            boundaries[mode] = repeats.Boundaries(live, unit_of)
    _check_same_interface(name, crossings, interfaces)
    pieces = [
        repeats.Unit(
            programs[k],
            sorted({a for i in g for a in attrs[i]}),
            [owners[i] for i in g],
            _label([owners[i] for i in g]),
            shapes[k],
            examples[k],
            _cost(unit_nodes[modes[0]][k]),
        )
        for k, g in enumerate(groups)
    ]
    if runs:
        pieces = repeats.with_copies(pieces, runs, boundaries)
        regions |= repeats.copied_paths(regions, runs)
        log.debug("module %r: %s", name, "; ".join(run.describe() for run in runs))
    traced = _traced(module, name, graphs, pieces, four_bit, regions, interfaces, counts, args, kwargs)
    traced.trace_modes, traced.mutated = modes, frozenset(mutated)  # type: ignore[attr-defined]
    return traced


def _traced(
    module: nn.Module,
    name: str,
    graphs: dict[str, fx.GraphModule],
    pieces: list[repeats.Unit],
    four_bit: Any,
    regions: set[str],
    interfaces: dict[str, Ends],
    counts: dict[str, Any],
    args: tuple,
    kwargs: dict,
) -> TracedSequential:
    """The units as layers of a `TracedSequential`, each weight under its local name."""
    fqns = set(module.state_dict(keep_vars=True))
    mode, first = next(iter(graphs.items()))  # the first mode's: train, where a call is traced in both
    local_names = _local_names(sorted({a for piece in pieces for a in piece.targets}))
    layers, entries, state_names, covered, quantized = [], [], {}, [], {}
    for k, piece in enumerate(pieces):
        programs = {
            mode: {**p, "tensors": {v: local_names[a] for v, a in p["tensors"].items()}}
            for mode, p in piece.programs.items()
        }
        used = sorted(local_names[a] for a in piece.targets)
        by_local = {local_names[a]: a for a in piece.targets}
        values = {loc: four_bit.tensors.get(by_local[loc]) for loc in used}  # a 4-bit weight's stand-ins
        values = {loc: _tensor_of(module, first, by_local[loc]) if t is None else t for loc, t in values.items()}
        tensors = {
            loc: {
                "shape": list(t.shape),
                "dtype": t.dtype,
                "parameter": isinstance(t, nn.Parameter),
                "requires_grad": bool(t.requires_grad),
            }
            for loc, t in values.items()
        }
        # transformers' gradient checkpointing: the unit recomputes at backward (`gradient_checkpointing`)
        recompute = any(covers(regions, owner.partition("@")[0]) for owner in piece.owners)
        layer = GraphLayer(programs, tensors, piece.examples, values=values, checkpoint=recompute)
        layers.append(layer)
        entries.append(
            TracedEntry(
                LAYER_PATH,
                {"programs": programs, "tensors": tensors, "examples": piece.examples}
                | ({"checkpoint": True} if recompute else {}),
                tuple(piece.shapes) if len(piece.shapes) != 1 else piece.shapes[0],
                label=piece.label,
            )
        )
        for loc in used:
            key = four_bit.state_key(by_local[loc]) or by_local[loc]
            if key in fqns:
                state_names[f"{k}.{loc}"] = key
            if (found := four_bit.part_of(by_local[loc])) is not None:
                quantized[f"{k}.{loc}"] = (found[0].key, found[1], found[0].format)
        covered.append(_covered(module, piece.owners))
    traced = TracedSequential(name, module, entries, layers, state_names, covered, [p.cost for p in pieces])
    call = Interface.from_graph(name, first, interfaces[mode], args, kwargs, counts[mode])
    traced.interface = call  # type: ignore[attr-defined]
    traced.quantized = quantized
    traced.batched = (call.batched_in, call.joins_out)
    return traced


@contextlib.contextmanager
def _traced_on_meta(module: nn.Module) -> Iterator[None]:
    """A module partly on the meta device (its pretrained weights, which the workers read from files)
    and partly not (a LoRA adapter made on the driver) is traced all on meta: torch.export refuses
    to mix devices. The module's own tensors are back in their places after."""
    tensors = [*module.parameters(), *module.buffers()]
    if not any(t.is_meta for t in tensors) or all(t.is_meta for t in tensors):
        yield
        return
    stand_ins: dict[int, torch.Tensor] = {}
    replaced = []
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or t.is_meta:
                    continue
                if id(t) not in stand_ins:
                    meta = torch.empty_like(t, device="meta")
                    stand_ins[id(t)] = nn.Parameter(meta, t.requires_grad) if isinstance(t, nn.Parameter) else meta
                replaced.append((table, name, t))
                table[name] = stand_ins[id(t)]
    try:
        yield
    finally:
        for table, name, t in replaced:
            table[name] = t


def _step(node: fx.Node, name: str) -> list[Any]:
    kwargs = {k: _encode(v, name) for k, v in node.kwargs.items()}
    step = [node.name, _target(node, name), _encode(list(node.args), name), kwargs]
    context = node.meta.get("lrmp_context")
    return [*step, context] if context else step


def _attr_nodes(nodes: Sequence[fx.Node]) -> list[fx.Node]:
    return list({a.name: a for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}.values())


def _kind(v: fx.Node) -> Any:
    val = v.meta.get("val")
    return (val.dtype, val.dim()) if isinstance(val, torch.Tensor) else "scalar"


def _check_same_interface(name: str, crossings: dict[str, list[list[Any]]], interfaces: dict[str, Ends]) -> None:
    if len(crossings) < 2:
        return
    if crossings["train"] != crossings["eval"]:
        k = next(i for i, (a, b) in enumerate(zip(crossings["train"], crossings["eval"])) if a != b)
        raise TraceError(
            f"module {name!r}: in train mode and in eval mode different values cross unit boundary {k}; "
            "its train and eval code paths differ too much to share one cut (a step only one mode runs "
            "produces a value a later unit takes). Split only the submodules around that part, or describe "
            "it as a layer spec."
        )
    if interfaces["train"].inputs != interfaces["eval"].inputs:
        raise TraceError(
            f"module {name!r} uses inputs {interfaces['train'].inputs} in train mode but "
            f"{interfaces['eval'].inputs} in eval mode; a traced module must use the same inputs in both"
        )


def _label(owners: Sequence[str]) -> str:
    named = [m for m in (o.partition("@")[0] for o in owners) if m]
    if not named:
        segments = [o.partition("@")[2] for o in owners if "@" in o]
        if not segments:
            return "(glue)"
        return "(code before the first pipe_split)" if segments[0] == "0" else f"(code after pipe_split {segments[0]})"
    return named[0] if len(set(named)) == 1 else f"{named[0]}..{named[-1]}"


def _local_names(targets: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    used: set[str] = set()
    for t in targets:
        base = re.sub(r"\W", "_", t.replace(".", "__"))
        if not base or not base[0].isalpha():
            base = "t_" + base
        candidate, n = base, 1
        while candidate in used:
            candidate, n = f"{base}_{n}", n + 1
        used.add(candidate)
        out[t] = candidate
    return out


def _tensor_of(module: nn.Module, gm: fx.GraphModule, target: str) -> torch.Tensor:
    for getter in (module.get_parameter, module.get_buffer):
        try:
            return getter(target)
        except AttributeError:
            pass
    value = getattr(gm, target.replace(".", "_"), None) if not hasattr(gm, target) else getattr(gm, target)
    if value is None:
        value = operator.attrgetter(target)(gm)
    return value.detach()


def _covered(root: nn.Module, owners: Sequence[str]) -> list[nn.Module]:
    modules = [root]
    for o in dict.fromkeys(owner.partition("@")[0] for owner in owners):
        if o:
            modules.extend(root.get_submodule(o).modules())
    return modules


def find_modules(root: nn.Module, names: Sequence[str]) -> dict[str, nn.Module]:
    """The submodules of ``root`` that ``split`` names (dotted paths), checked."""
    out = {}
    for name in names:
        try:
            out[name] = root.get_submodule(name)
        except AttributeError:
            children = [n for n, _ in root.named_children()]
            raise TraceError(
                f"split names {name!r}, which the LightningModule does not have; its submodules are {children}"
            ) from None
        if isinstance(out[name], SpecSequential):
            raise TraceError(f"split names {name!r}, a SpecSequential: specs are placed without tracing; leave it out")
    for a in out:
        for b in out:
            if a != b and (b.startswith(a + ".")):
                raise TraceError(f"split names both {a!r} and {b!r}, which is inside it; name one")
    _check_not_shared(root, out)
    return out


def _check_not_shared(root: nn.Module, split: Mapping[str, nn.Module]) -> None:
    """A weight of a split module must not also be used outside it: its workers would train it
    while the driver's copy, used elsewhere, went stale."""
    owner = {}
    for name, module in split.items():
        for t in (*module.parameters(), *module.buffers()):
            owner[id(t)] = name
    for path, t in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
        inside = owner.get(id(t))
        if inside is not None and not path.startswith(inside + "."):
            raise TraceError(
                f"{path} is a weight of split module {inside!r} that is also used outside it; its workers would "
                f"train it while the copy used outside went stale. Split a module that holds every use of it."
            )
