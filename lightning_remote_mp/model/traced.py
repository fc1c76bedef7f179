"""A traced module on the driver: its units as a `SpecSequential`, and how a call's arguments become
the pipeline's inputs and its outputs the module's.

`TracedSequential` holds the units (`lightning_remote_mp.model.graph_layer.GraphLayer` layers that share
their tensors with the traced module), so placement, pipelining, checkpoints and the optimizer
mirror treat them like any spec. `Interface` maps a call of the module to the pipeline's input
tensors and checks it against the traced call, and maps the pipeline's outputs back to the
module's output (a tensor, tuple, dict or a HuggingFace ``ModelOutput``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.utils import _pytree as pytree

from lightning_remote_mp.errors import TraceError
from lightning_remote_mp.model.entries import LayerEntry
from lightning_remote_mp.model.graph_layer import GraphLayer
from lightning_remote_mp.model.joins import Join, join_of
from lightning_remote_mp.model.spec import KEEP_BYTES, Keep, SpecSequential


@dataclasses.dataclass(frozen=True)
class TracedEntry(LayerEntry):
    """A spec entry for one unit, shown under the module path it covers."""

    label: str = ""

    @property
    def name(self) -> str:
        return self.label or super().name


class TracedSequential(SpecSequential):
    """The pieces of a traced module as a `SpecSequential` of `GraphLayer` units, so placement,
    pipelining, checkpoints and the optimizer mirror treat them like any spec.

    Its layers share their tensors with the traced module (nothing is copied); ``state_owner`` and
    ``state_names`` tell the driver which of the module's ``state_dict`` keys each unit's tensors are.
    """

    kind = "traced module"

    def __init__(
        self,
        name: str,
        module: nn.Module,
        entries: Sequence[TracedEntry],
        layers: Sequence[GraphLayer],
        state_names: Mapping[str, str],
        covered: Sequence[Sequence[nn.Module]],
        compute: Sequence[float],
    ) -> None:
        nn.Module.__init__(self)  # not SpecSequential's: the layers exist already
        self.init_seed = None
        self._hold(entries, layers)
        self.traced_name = name
        object.__setattr__(self, "_owner", module)  # not a submodule: its keys stay its own
        self.state_names = dict(state_names)  # "<unit>.<attribute>" -> the module's state_dict key
        self._covered = [list(c) for c in covered]
        self.compute = list(compute)

    @property
    def state_owner(self) -> nn.Module:
        return self._owner

    def layer_state(self, state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        return {wire: state_dict[prefix + key] for wire, key in self.state_names.items() if prefix + key in state_dict}

    def state_keys(self) -> dict[str, list[str]]:
        """Each unit tensor that is in the module's ``state_dict``: its keys there, the one the
        program names first, then the other names of the same tensor (a tied weight's)."""
        owner = self._owner
        aliases: dict[int, list[str]] = {}
        for key, t in (*owner.named_parameters(remove_duplicate=False), *owner.named_buffers(remove_duplicate=False)):
            aliases.setdefault(id(t), []).append(key)
        by_key = {key: names for names in aliases.values() for key in names}
        return {wire: [key, *(a for a in by_key.get(key, ()) if a != key)] for wire, key in self.state_names.items()}

    def modes(self) -> Any:
        """Per unit, the train/eval flag of the modules it covers (all of them must agree)."""
        per_unit = []
        for i, modules in enumerate(self._covered):
            flags = {m.training for m in modules}
            if len(flags) > 1:
                mixed = sorted(type(m).__name__ for m in modules if m.training)[:3]
                raise TraceError(
                    f"module {self.traced_name!r}, unit {i} ({self.entries[i].name}): some of its modules are in "
                    f"train mode ({', '.join(mixed)}...) and some in eval mode; a traced unit runs one or the "
                    "other. Switch whole blocks, or trace smaller pieces."
                )
            per_unit.append(flags.pop() if flags else True)
        first = per_unit[0]
        return first if all(f is first for f in per_unit) else per_unit

    def counts_at(self, names: Sequence[str], stages: int) -> list[int]:
        """Units per stage when stages 1, 2, ... start at the submodules ``names`` (dotted paths)."""
        if len(names) != stages - 1:
            raise TraceError(
                f"module {self.traced_name!r}: balance names {len(names)} submodules where stages 1..{stages - 1} "
                f"start, but there are {stages} stages; give {stages - 1} names"
            )
        starts = []
        for name in names:
            at = next((i for i, e in enumerate(self.entries) if e.name == name or e.name.startswith(name + ".")), None)
            if at is None or at == 0 or (starts and at <= starts[-1]):
                units = ", ".join(e.name for e in self.entries)
                raise TraceError(
                    f"module {self.traced_name!r}: balance cannot start a stage at {name!r}; stages start at one of "
                    f"its units, in order, after the first: {units}"
                )
            starts.append(at)
        bounds = [0, *starts, len(self.entries)]
        return [b - a for a, b in zip(bounds, bounds[1:])]

    def check_batch_split(self, inputs: Sequence[torch.Tensor]) -> None:
        """Before a batch is split (micro-batches, replicas): refuse outputs that cannot be joined
        exactly, and inputs whose rows the trace could not tell from the batch's, naming them; then
        run the first call's first rows here (eval mode, no grad) whole and in two halves, whose
        outputs, joined, must be the whole's: a sequence-first model (dim 0 is time) or one whose
        samples interact fails."""
        if getattr(self, "generation", None):
            return  # a step of generate(): each row's logits, run only with a generation's cache on the stages
        call: Interface = self.interface  # type: ignore[attr-defined]
        unjoinable = call.unjoinable()
        if unjoinable:
            why = _why_no_batch(self, call, inputs)
            if why is not None:
                raise TraceError(f"{why} (outputs that cannot be joined: {', '.join(map(repr, unjoinable))})")
            raise TraceError(
                f"module {self.traced_name!r} returns {', '.join(map(repr, unjoinable))}, which carries no batch "
                "dimension and is no loss lrmp can join exactly (a mean-reduced loss, a sum), so the parts of a "
                "split batch (micro-batches, replicas) cannot be joined back into it. Compute it outside the split "
                "module from outputs that carry the batch, or use microbatches=1 and a single replica."
            )
        if call.unclassified:
            raise TraceError(
                f"module {self.traced_name!r}: argument(s) {', '.join(map(repr, call.unclassified))} have as many "
                "rows in dim 0 as the batch, but the model's code does not treat dim 0 as the batch (torch.export "
                "could not give them the batch's dimension), so lrmp cannot tell whether to split them or give "
                "each micro-batch the whole. Give them another size in dim 0 than the batch, or use "
                "microbatches=1 and a single replica."
            )
        rows = next((t.shape[0] for t, b in zip(inputs, call.batched_in) if b), 0)
        if rows < 2 or self.is_meta:  # no weights here (the workers read them from files): nothing to run
            return
        take = min(rows, 4)
        whole, *parts = self.run_rows(inputs, call.batched_in, [(0, take), (0, take // 2), (take // 2, take)])
        for i, (out, join) in enumerate(zip(whole, call.joins_out)):
            if join == "whole" or not out.is_floating_point():
                continue
            items = [p[i] for p in parts]
            joined = torch.cat(items, dim=0) if join == "batch" else torch.stack(items).sum(0)
            if not torch.allclose(joined, out, rtol=1e-4, atol=1e-5):
                raise TraceError(
                    f"module {self.traced_name!r}: splitting a batch along dim 0 of its inputs changes its output "
                    f"{i}, so dim 0 is not the batch (a sequence-first model, batch_first=False?) or its samples "
                    "interact. Micro-batches and replicas split dim 0: make dim 0 the batch, or use "
                    "microbatches=1 and a single replica."
                )

    def run_rows(self, inputs: Sequence[torch.Tensor], batched: Sequence[bool], spans: Sequence[tuple[int, int]]):
        """The outputs (tuples) of rows ``a:z`` of the inputs that carry the batch (``batched``), for each
        ``(a, z)`` of ``spans``: run here in eval mode, without grad (for checks)."""
        flags = [m.training for m in self.layers]
        self.train(False)
        try:
            with torch.no_grad():
                return [
                    as_tuple(self.run_locally(*(t[a:z] if b else t for t, b in zip(inputs, batched)))) for a, z in spans
                ]
        finally:
            for m, f in zip(self.layers, flags):
                m.train(f)

    def run_locally(self, *inputs: torch.Tensor) -> Any:
        """Run the units here, in order (for checks): the traced module's first outputs."""
        values: tuple = tuple(inputs)
        for layer in self.layers:
            values = layer(values)
        return values[0] if len(values) == 1 else values


@dataclasses.dataclass
class Ends:
    inputs: list[str]  # placeholder names unit 0 takes, in order
    outputs: list[str]  # value names the last unit returns, in order


@dataclasses.dataclass
class Interface:
    """How a call's arguments map to the pipeline's inputs, and its outputs back to the module's."""

    name: str
    in_spec: Any
    constants: list[Any]  # the non-tensor leaves of the traced call (None where a tensor is)
    input_leaves: list[int]  # for each pipeline input, its leaf index
    static_dims: list[dict[int, int]]  # per pipeline input, dims the trace fixed
    ranges: list[dict[int, tuple[int, float]]]  # per pipeline input, limits the trace found on dynamic dims
    batched_in: list[bool]
    out_spec: Any
    #: Per leaf of the module's output: ``("value", i)``, the pipeline's output ``i``; ``("ratio", i, j)``,
    #: a mean-reduced loss as the sum ``i`` over the count ``j`` (`lightning_remote_mp.model.joins`);
    #: or ``("constant", value)``.
    out_leaves: list[tuple[Any, ...]]
    joins_out: list[Join]  # per pipeline output, how the parts of a batch join
    #: Arguments with the batch's rows in dim 0 that the trace could not give the batch's dimension.
    unclassified: list[str] = dataclasses.field(default_factory=list)
    #: Per pipeline output, its bytes per row of the batch in the traced call.
    row_bytes: list[int] = dataclasses.field(default_factory=list)

    @classmethod
    def from_graph(
        cls, name: str, gm: fx.GraphModule, interface: Ends, args: tuple, kwargs: dict, counts: Mapping[int, int]
    ) -> Interface:
        """The interface of the call traced as ``gm``; ``counts``: the mean-reduced losses that
        `lightning_remote_mp.model.joins.split_means` split into a sum and a count."""
        leaves, in_spec = pytree.tree_flatten((args, kwargs))
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(leaves):
            raise TraceError(f"module {name!r}: the trace has {len(placeholders)} inputs for {len(leaves)} arguments")
        index = {p.name: i for i, p in enumerate(placeholders)}
        input_leaves = [index[n] for n in interface.inputs]
        for i in input_leaves:
            if not isinstance(leaves[i], torch.Tensor):
                raise TraceError(f"module {name!r}: its argument {placeholders[i].name!r} must be a tensor to travel")
        output = next(n for n in gm.graph.nodes if n.op == "output")
        by_name = {n.name: n for n in gm.graph.nodes}
        vals = [placeholders[i].meta["val"] for i in input_leaves]
        batch = _batch_symbol(vals + [by_name[n].meta.get("val") for n in interface.outputs])
        static, ranges, batched_in = [], [], []
        for val in vals:
            static.append({d: int(s) for d, s in enumerate(val.shape) if is_concrete_int(s)})
            ranges.append(_ranges(val, getattr(gm, "lrmp_ranges", {})))
            batched_in.append(val.dim() > 0 and batch is not None and str(val.shape[0]) == batch)
        flat_out = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
        sums = [flat_out[i] for i in counts] + [flat_out[j] for j in counts.values()]
        out_leaves: list[tuple[Any, ...]] = []
        for i, v in enumerate(flat_out[: len(flat_out) - len(counts)]):  # the counts come last
            if i in counts:
                out_leaves.append(
                    ("ratio", interface.outputs.index(v.name), interface.outputs.index(flat_out[counts[i]].name))
                )
            elif isinstance(v, fx.Node):
                out_leaves.append(("value", interface.outputs.index(v.name)))
            else:
                out_leaves.append(("constant", v))
        joins_out = [join_of(by_name[n], batch, sums) for n in interface.outputs]
        constants = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        return cls(
            name,
            in_spec,
            constants,
            input_leaves,
            static,
            ranges,
            batched_in,
            gm.lrmp_out_spec,
            out_leaves,
            joins_out,
            [p.name for p in placeholders if p.name in getattr(gm, "lrmp_unclassified", ())],
            [_row_bytes(by_name[n].meta.get("val")) for n in interface.outputs],
        )

    def output_names(self) -> list[str]:
        """How the user names each leaf of the module's output: ``"loss"``, ``"logits"``, ``"[0]"``."""
        tree = pytree.tree_unflatten(list(range(len(self.out_leaves))), self.out_spec)
        names = [""] * len(self.out_leaves)
        for path, i in pytree.tree_flatten_with_path(tree)[0]:
            names[i] = pytree.keystr(path).strip(".").replace("['", "").replace("']", "") or "the output"
        return names

    def kept(self) -> Keep | None:
        """Which pipeline outputs the last stage keeps until the driver reads them
        (`lightning_remote_mp.driver.outputs`): those that carry the batch. When the module computes
        its own loss, always: a step that reads the loss alone never needs them here. Else in a call
        where they come to `lightning_remote_mp.model.spec.KEEP_BYTES` or more: a loss from
        ``torch.nn.functional`` over them is then computed where they are
        (`lightning_remote_mp.driver.losses`). Smaller outputs (a
        classifier's ten logits per row) travel with the result, where a fetch would cost a round
        trip for nothing."""
        batch = [join == "batch" for join in self.joins_out]
        if any(leaf[0] == "ratio" for leaf in self.out_leaves) or "sum" in self.joins_out:
            # Traced with a batch of one row, the batch cannot be told: such a call is never split,
            # and its large outputs (one sequence's logits) stay as well.
            large = [j == "whole" and b >= KEEP_BYTES for j, b in zip(self.joins_out, self.row_bytes)]
            keep = [a or b for a, b in zip(batch, large)]
            return Keep(keep, None) if any(keep) else None
        if not any(batch):
            return None
        return Keep(batch, list(self.row_bytes))

    def loss_output(self) -> int | None:
        """The pipeline output that is the module's loss, where it returns one: the sum of its one
        mean-reduced loss (``("ratio", i, j)``: ``i``; HF's ``labels=`` losses, ``F.cross_entropy``
        and ``F.mse_loss`` by default). A schedule starts each micro-batch's backward there
        (`lightning_remote_mp.schedule`). ``None``: no such loss, or several."""
        ratios = {leaf[1] for leaf in self.out_leaves if leaf[0] == "ratio"}
        return ratios.pop() if len(ratios) == 1 else None

    def loss_count(self) -> int | None:
        """The pipeline output that `loss_output` is divided by: a count of what the loss averages,
        which no parameter's gradient flows through."""
        ratios = {leaf[1:] for leaf in self.out_leaves if leaf[0] == "ratio"}
        return ratios.pop()[1] if len(ratios) == 1 else None

    def unjoinable(self) -> list[str]:
        """The outputs that cannot be joined exactly when a batch is split (see `Join`): named."""
        names = self.output_names()
        return [
            names[i]
            for i, leaf in enumerate(self.out_leaves)
            if leaf[0] == "value" and self.joins_out[leaf[1]] == "whole"
        ]

    def inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        """The pipeline's inputs for a call, checked against the traced call."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.in_spec:
            raise TraceError(
                f"module {self.name!r} was traced at its first call; this call "
                f"{call_difference(self.in_spec, spec)}. A traced module runs the program of its first call, "
                "so call it with the same arguments every time: pass labels= in validation_step too (the loss "
                "is then computed on the last stage as in training), or compute the loss in training_step from "
                "the output and never pass labels="
            )
        for i, (leaf, traced) in enumerate(zip(leaves, self.constants)):
            if traced is not None and (isinstance(leaf, torch.Tensor) or leaf != traced):
                raise TraceError(
                    f"module {self.name!r}: argument {i} was {traced!r} when traced and is {leaf!r} now; non-tensor "
                    "arguments are fixed by the trace"
                )
        out = []
        for k, i in enumerate(self.input_leaves):
            t = leaves[i]
            for d, size in self.static_dims[k].items():
                if t.dim() <= d or t.shape[d] != size:
                    raise TraceError(
                        f"module {self.name!r}: dimension {d} of input {k} was {size} when traced and the model's code "
                        f"depends on it; this call gives shape {tuple(t.shape)}"
                    )
            for d, (low, high) in self.ranges[k].items():
                if t.dim() > d and not low <= t.shape[d] <= high:
                    limit = f"at most {int(high)}" if low == 0 else f"at least {low}"
                    if low and high < math.inf:
                        limit = f"between {low} and {int(high)}"
                    raise TraceError(
                        f"module {self.name!r}: dimension {d} of input {k} must be {limit} for the model's code "
                        f"(torch.export found that limit); this call gives shape {tuple(t.shape)}"
                    )
            out.append(t)
        return tuple(out)

    def outputs(self, values: Sequence[Any]) -> Any:
        """The module's output from the pipeline's (joined) outputs ``values``."""
        flat = []
        for leaf in self.out_leaves:
            if leaf[0] == "value":
                flat.append(values[leaf[1]])
            elif leaf[0] == "ratio":  # the whole batch's mean: its parts' sums over their counts
                total, count = values[leaf[1]], values[leaf[2]]
                flat.append(total / count.to(total.dtype))
            else:
                flat.append(leaf[1])
        return pytree.tree_unflatten(flat, self.out_spec)


def call_difference(traced: Any, now: Any) -> str:
    """How the call shaped ``now`` (a pytree spec of ``(args, kwargs)``) differs from the ``traced`` one,
    by argument name: ``"passes no 'labels' (traced with it)"``."""
    (targs, tkwargs), (nargs, nkwargs) = (pytree.tree_unflatten([0] * s.num_leaves, s) for s in (traced, now))
    said = [f"passes no {k!r} (traced with it)" for k in tkwargs if k not in nkwargs]
    said += [f"passes {k!r} (traced without it)" for k in nkwargs if k not in tkwargs]
    if len(targs) != len(nargs):
        said.append(f"passes {len(nargs)} positional arguments (traced with {len(targs)})")
    for i, (t, n) in enumerate(zip(targs, nargs)):
        if pytree.tree_structure(t) != pytree.tree_structure(n):
            said.append(f"passes positional argument {i} shaped {pytree.tree_structure(n)} (traced with {t!r})")
    for k in tkwargs.keys() & nkwargs.keys():
        if pytree.tree_structure(tkwargs[k]) != pytree.tree_structure(nkwargs[k]):
            said.append(f"passes {k!r} shaped otherwise (traced as {pytree.tree_structure(tkwargs[k])})")
    return ", ".join(said) or f"passes arguments shaped {now} (traced with {traced})"


def _row_bytes(val: Any) -> int:
    """Bytes per row (dim 0) of a traced value, at the traced call's sizes."""
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return 0
    sizes = (int(s) if is_concrete_int(s) else int(s.node.hint or 1) for s in val.shape[1:])
    return math.prod(sizes) * val.element_size()


def as_tuple(value: Any) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _batch_symbol(vals: Sequence[Any]) -> str | None:
    """The batch: the dynamic size most of the call's tensors (inputs and outputs) have in dim 0
    (a position table's length in dim 0 of one input does not make it the batch)."""
    counts = Counter(
        str(v.shape[0]) for v in vals if isinstance(v, torch.Tensor) and v.dim() > 0 and not is_concrete_int(v.shape[0])
    )
    return max(counts, key=counts.__getitem__) if counts else None


def _ranges(val: torch.Tensor, constraints: Mapping[Any, Any]) -> dict[int, tuple[int, float]]:
    """Limits on the dynamic dims of an input that the trace found (a length at most ``n_positions``).
    A lower limit of 2 is torch.export's default for every dynamic dim, not the model's: not kept."""
    out: dict[int, tuple[int, float]] = {}
    for d, size in enumerate(val.shape):
        expr = getattr(getattr(size, "node", None), "expr", None)
        bounds = constraints.get(expr) if expr is not None else None
        if bounds is None:
            continue
        low = int(bounds.lower) if bounds.lower > 2 else 0
        high = float(bounds.upper) if bounds.upper.is_finite else math.inf
        if low > 0 or high < math.inf:
            out[d] = (low, high)
    return out


def _why_no_batch(traced: TracedSequential, call: Interface, inputs: Sequence[torch.Tensor]) -> str | None:
    """For outputs that carry no batch dimension (`Interface.unjoinable`), the two mistakes behind most
    of them, named: a tensor of the module with the batch's rows in dim 0 that fixed the batch's size,
    or an output with a multiple of the batch's rows (rows of two batches concatenated)."""
    rows = next((int(t.shape[0]) for t in inputs if t.dim() > 0), 0)
    name, stop = traced.traced_name, "; or use microbatches=1 and a single replica."
    if rows < 2:
        return None
    if not any(call.batched_in):
        if not any(dims.get(0) == rows for dims in call.static_dims):
            return None
        owner = traced.state_owner
        try:
            params = dict(inspect.signature(owner.forward).parameters)
        except (TypeError, ValueError):
            params = {}
        candidates = [(f"the default value of forward's argument {n!r}", p.default) for n, p in params.items()]
        candidates += [(f"its tensor {n!r}", t) for n, t in [*owner.named_parameters(), *owner.named_buffers()]]
        found = [(what, t) for what, t in candidates if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == rows]
        what = (
            f"{found[0][0]} (shape {tuple(found[0][1].shape)}) has as many rows and the code combines the two"
            if found
            else "a size in the code (a tensor made at a fixed shape, a view to one) is as many"
        )
        return (
            f"module {name!r}: the trace fixed the batch at {rows} rows, the size of this call's batch: {what}, so "
            "torch.export took the batch's size for a constant and no output carries a batch dimension; a split "
            "batch (micro-batches, replicas) cannot run. Let the code take the batch's size from its input (pass the "
            "tensor in the call, where it is split with the batch, or build it as x.new_zeros(x.shape[0], ...))" + stop
        )

    take = min(rows, 4)
    try:
        whole, half = traced.run_rows(inputs, call.batched_in, [(0, take), (0, take // 2)])
    except Exception:  # for a better message only: without it, the plain one stands
        return None
    names = call.output_names()
    for i, leaf in enumerate(call.out_leaves):
        if leaf[0] != "value" or call.joins_out[leaf[1]] != "whole":
            continue
        out, part = whole[leaf[1]], half[leaf[1]]
        k = out.shape[0] // take if out.dim() else 0
        if k > 1 and out.shape[0] == k * take and part.dim() and part.shape[0] == k * (take // 2):
            return (
                f"module {name!r} returns {names[i]!r} with {k} times the batch's rows in dim 0 ({k * rows} for a "
                f"batch of {rows}), so the parts of a split batch (micro-batches, replicas) cannot be joined back into "
                f"it. Return the {k} parts as outputs of their own, or stack them along a new dimension "
                f"(torch.stack(parts, dim=1)) so that dim 0 is the batch" + stop
            )
    return None
