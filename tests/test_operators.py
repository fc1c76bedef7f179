"""What the models of issue #38 ("every model") needed, on real workers and real Trainers, each run
compared step by step with the same model trained locally: the operators they trace to (``stack``
of interleaved rotary embeddings, ``weight.T``, ``new_empty``...), in-place operations on a Linear's
output and on a stage's input, and the errors that name what fixed or doubled the batch."""

from __future__ import annotations

import pytest
import torch
from lrmp_traced import Trained
from test_zoo import remote_equals_local
from torch import nn

from lightning_remote_mp import RemoteModelParallelStrategy
from lightning_remote_mp.errors import RefusedOperatorError, TraceError
from lightning_remote_mp.model import operators
from lightning_remote_mp.model.graph_layer import GraphLayer
from lightning_remote_mp.model.program import load_program
from lightning_remote_mp.model.trace import trace_module

SEQ, DIM, CLASSES = 5, 8, 3


def _sequences(n: int = 24, batch: int = 8, seed: int = 0) -> torch.utils.data.DataLoader:
    """3-d inputs (batch, positions, features), a class per position."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, SEQ, DIM, generator=g)
    y = (x[..., 0] > 0).long() + (x[..., 1] > 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def _operators(module: nn.Module) -> set[str]:
    """The operators the units of ``module``'s trace call (what the workers are sent)."""
    traced = trace_module(module, (torch.randn(4, SEQ, DIM),), {}, "m")
    return {
        ".".join(step[1][1:])
        for entry in traced.entries
        for program in entry.kwargs["programs"].values()
        for step in program["steps"]
    }


class Rotary(nn.Module):
    """Rotary position embeddings on interleaved pairs, as GPT-J, CodeGen and Cohere write them:
    ``torch.stack((-x2, x1), dim=-1).flatten(-2)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], dtype=x.dtype, device=x.device)[:, None]
        inv = 1.0 / 100 ** (torch.arange(0, x.shape[-1], 2, dtype=x.dtype, device=x.device) / x.shape[-1])
        angle = (pos * inv).repeat_interleave(2, -1)
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return x * angle.cos() + rotated * angle.sin()


class Operators(nn.Module):
    """Every operator issue #38 added, in a model that learns: Falcon's ``weight.T``, interleaved rotary
    embeddings, DeepSeek-V3's ``new_empty`` filled by a copy, ``new_empty_strided``, ``swapdims``,
    ``moveaxis``, ``mT`` and ``hstack``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) * 0.3)
        self.rotary = Rotary()
        self.mix = nn.Linear(SEQ, SEQ)
        self.head = nn.Linear(2 * DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.rotary(x @ self.w.T)
        fresh = h.new_empty(h.shape)
        fresh.copy_(h.tanh())
        halves = h.new_empty_strided(h.shape, h.stride()).fill_(0.5)
        h = h + fresh * halves
        h = torch.moveaxis(self.mix(torch.swapdims(h, 1, 2)), 2, 1)  # mixes positions
        h = h + 0.01 * h @ (h.mT @ h).mT
        both = torch.hstack([h, h * h])  # (batch, 2 * positions, features)
        return self.head(both.reshape(h.shape[0], SEQ, 2 * DIM))


NEW_OPERATORS = {
    "stack.default",
    "numpy_T.default",
    "new_empty.default",
    "new_empty_strided.default",
    "mT.default",
    "moveaxis.int",
    "swapdims.default",
    "hstack.default",
}


def test_the_operators_of_rotary_embeddings_transposes_and_fresh_tensors_train_as_locally(twin, pool):
    assert NEW_OPERATORS <= _operators(Operators())  # they reach the workers as they are
    remote_equals_local(
        lambda: Trained(Operators()),
        _sequences,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2, split=["model"]),
    )


def _run(*steps: list) -> torch.Tensor:
    """The last step's value, of a program that takes ``x`` (three ones)."""
    program = {"inputs": ["x"], "steps": list(steps), "outputs": [steps[-1][0]]}
    return GraphLayer({"train": program}, {})((torch.ones(3),))[0]


X = {"ref": "x"}


@pytest.mark.parametrize(
    "steps",
    [
        [["e", ["aten", "new_empty", "default"], [X, [4096]], {}]],
        # the gaps between a strided tensor's elements, which as_strided reaches
        [
            ["e", ["aten", "new_empty_strided", "default"], [X, [2], [4000]], {}],
            ["all", ["aten", "as_strided", "default"], [{"ref": "e"}, [4001], [1]], {}],
        ],
        [
            ["e", ["aten", "empty_strided", "default"], [[2], [4000]], {}],
            ["all", ["aten", "as_strided", "default"], [{"ref": "e"}, [4001], [1]], {}],
        ],
        # what resize_ grows a tensor by (its own elements stay)
        [
            ["z", ["aten", "zeros", "default"], [[1]], {}],
            ["r", ["aten", "resize_", "default"], [{"ref": "z"}, [4096]], {}],
        ],
    ],
    ids=["new_empty", "new_empty_strided", "empty_strided", "resize_"],
)
def test_memory_a_program_allocates_holds_zeros_not_freed_memory(steps):
    secret = torch.full((8192,), 7.0)
    del secret
    assert not _run(*steps).any()


def test_resize_keeps_a_tensors_elements_and_zeroes_what_it_grows_by():
    assert _run(["r", ["aten", "resize_", "default"], [X, [5]], {}]).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("target", "match"),
    [
        (["aten", "_unsafe_view", "default"], "not on this worker's operator allowlist.*--allow-op aten::_unsafe_view"),
        (["aten", "resize_as_", "default"], "never run from the wire: it changes or allocates a tensor's memory"),
    ],
)
def test_operators_beside_the_new_ones_stay_refused(target, match):
    with pytest.raises(RefusedOperatorError, match=match):
        load_program({"inputs": ["x"], "steps": [["y", target, [X, X], {}]], "outputs": ["y"]}, "here")


def _denied() -> list[str]:
    """Every overload of this torch's ATen operators that the denylist names."""
    out = []
    for full in sorted(torch._C._dispatch_get_all_op_names()):
        namespace, _, rest = full.partition("::")
        name, _, overload = rest.partition(".")
        if (
            namespace == "aten"
            and operators.refused_why(name)
            and not operators.allowed_operator(getattr(getattr(torch.ops.aten, name), overload or "default"))
        ):
            out.append(f"{name}.{overload or 'default'}")
    return out


def test_every_operator_the_denylist_names_is_refused_by_the_worker_saying_why():
    denied = _denied()
    assert {"from_file.default", "pin_memory.default", "bincount.default", "empty_permuted.default"} <= set(denied)
    assert any(d.startswith("sparse_coo_tensor") for d in denied) and any(d.startswith("fbgemm_") for d in denied)
    for target in denied:
        name, overload = target.split(".")
        program = {"inputs": ["x"], "steps": [["y", ["aten", name, overload], [X], {}]], "outputs": ["y"]}
        with pytest.raises(RefusedOperatorError, match=f"aten.{name}.{overload} is never run from the wire: it "):
            load_program(program, "here")


def test_operators_are_derived_from_torch_schemas_and_the_owner_can_allow_more():
    # Public ATen operators that take and return only tensors, numbers and the like run: these were
    # refused when the list was written by hand.
    x = torch.arange(6.0).reshape(2, 3)
    for name, args, expected in [
        ("vstack", [[x, x]], torch.vstack([x, x])),
        ("logcumsumexp", [x, 1], torch.logcumsumexp(x, 1)),
        ("special_expm1", [x], torch.special.expm1(x)),
        ("column_stack", [[x, x]], torch.column_stack([x, x])),
    ]:
        assert operators.allowed_operator(getattr(torch.ops.aten, name).default), name
        program = {"inputs": ["x"], "steps": [["y", ["aten", name, "default"], _refs(args), {}]], "outputs": ["y"]}
        torch.testing.assert_close(GraphLayer({"train": program}, {})((x,))[0], expected)
    # A private one runs only when the worker's owner allows it (lrmp-worker --allow-op).
    view = torch.ops.aten._unsafe_view.default
    assert not operators.allowed_operator(view)
    try:
        assert operators.allow(["aten::_unsafe_view"]) == {"_unsafe_view"}
        assert operators.allowed_operator(view)
    finally:
        operators.EXTRA.discard("_unsafe_view")
    with pytest.raises(ValueError, match="aten::from_file is never run from the wire: it reads a file"):
        operators.allow(["aten::from_file"])


def _refs(args: list) -> list:
    """``args`` with the input tensor as a reference to the program's input."""
    return [
        [X if isinstance(a, torch.Tensor) else a for a in v]
        if isinstance(v, list)
        else X
        if isinstance(v, torch.Tensor)
        else v
        for v in args
    ]


class Shift(nn.Module):
    """Adds a constant to its input in place, as torch's test_unflatten.py's ``UnflattenM`` does to a
    Linear's output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1.0)


class InPlace(nn.Module):
    """A Linear whose output is shifted in place (its stage's own value), then a stage that begins by
    shifting its input in place (a received activation)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(DIM, 12), Shift())
        self.second = nn.Sequential(Shift(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@pytest.mark.parametrize("split_backward", ["auto", False])
def test_in_place_operations_on_a_linears_output_and_on_a_stages_input_train_as_locally(twin, pool, split_backward):
    """With ``"auto"`` every linear call defers here (the tests' workers defer every call): its output,
    a view for 3-d inputs, is modified in place. Stage 1 starts at ``second``, whose first step writes
    into the activation it received; the input gradient it sends back trains stage 0."""
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:2], microbatches=2, split=["model"], balance={"model": ["second"]}, split_backward=split_backward
    )
    remote_equals_local(lambda: Trained(InPlace()), _sequences, twin, strategy)


class DefaultTable(nn.Module):
    """A default argument whose rows happen to be the batch's: torch.export fixes the batch's size."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, offsets: torch.Tensor = torch.zeros(6, SEQ, DIM)) -> torch.Tensor:  # noqa: B008
        return self.lin(x) + offsets


class Doubled(nn.Module):
    """Returns two batches' rows along dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.cat([h, -h])


@pytest.mark.parametrize(
    "module, match",
    [
        (
            DefaultTable,
            r"the trace fixed the batch at 6 rows, .*: the default value of forward's argument 'offsets' "
            r"\(shape \(6, 5, 8\)\) has as many rows",
        ),
        (Doubled, r"returns 'the output' with 2 times the batch's rows in dim 0 \(12 for a batch of 6\)"),
    ],
    ids=["default argument", "doubled rows"],
)
def test_an_output_without_the_batchs_rows_says_what_fixed_or_doubled_them(module, match):
    x = torch.randn(6, SEQ, DIM)
    traced = trace_module(module(), (x,), {}, "m")
    with pytest.raises(TraceError, match=match) as info:
        traced.check_batch_split(traced.interface.inputs((x,), {}))
    assert "carries no batch dimension and is no loss" not in str(info.value)


def test_gpt_j_fine_tunes_remotely_as_it_does_locally(pool):
    """GPT-J (its rotary embeddings interleave pairs with ``stack``), with ``labels=`` and padded batches."""
    pytest.importorskip("transformers")
    import lrmp_hf as H
    from test_hf_zoo import remote_equals_local as hf_remote_equals_local

    def gpt_j() -> torch.nn.Module:
        t = H._transformers()
        config = t.GPTJConfig(
            vocab_size=H.VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, rotary_dim=8, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        return t.GPTJForCausalLM(config)

    hf_remote_equals_local(
        lambda: H.FineTune(gpt_j(), "lm"), RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2, split=["model"])
    )


class Derived(nn.Module):
    """Operators admitted by their schemas, not by name: ``logcumsumexp``, ``special_expm1`` and
    ``vstack``, between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.logcumsumexp(self.inp(x), dim=1) * 0.1
        h = torch.special.expm1(h.tanh())
        h = torch.vstack([h, h])[: x.shape[0]]
        return self.out(h)


def test_a_model_with_operators_derived_from_their_schemas_trains_as_locally(twin, pool):
    assert {"logcumsumexp.default", "special_expm1.default", "vstack.default"} <= _operators(Derived())
    remote_equals_local(
        lambda: Trained(Derived()),
        _sequences,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2, split=["model"]),
    )


def _counts(x: torch.Tensor) -> torch.Tensor:
    return torch.bincount(x.long().flatten().clamp(0, 3), minlength=4).float()  # the refused call


class Counts(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + _counts(x).sum()


class CountsInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.counts = nn.Linear(DIM, DIM), Counts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.counts(self.inp(x))


def test_a_refused_operator_is_named_at_the_users_line_and_module_with_advice_that_can_work():
    """torch.export records a step's source only down to its module's forward; the error names the
    helper function's own line, the module path, and why the operator is refused."""
    import inspect

    line = inspect.getsourcelines(_counts)[1] + 1
    with pytest.raises(TraceError) as refused:
        trace_module(CountsInside(), (torch.randn(4, SEQ, DIM),), {}, "model")
    message = str(refused.value)
    assert f"calls aten::bincount in model.counts (Counts) (at {__file__}:{line})" in message, message
    assert "never run from the wire: it allocates as many bins as the largest value in its input" in message


class ExampleCode(nn.Module):
    """torch.distributed.pipelining's ``ExampleCode`` (test/distributed/pipelining/model_registry.py):
    raw parameters multiplied in plain code, a buffer that crosses the cut, and a ``pipe_split()``
    where torch cuts it."""

    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.mm_param0 = nn.Parameter(torch.randn(d, d) * 0.3)
        self.mm_param1 = nn.Parameter(torch.randn(d, d) * 0.3)
        self.cval = nn.Buffer(torch.randn(d))
        self.lin0, self.lin1 = nn.Linear(d, d), nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split

        x = torch.relu(torch.mm(x, self.mm_param0))
        a_constant = self.cval.clone()
        x = self.lin0(x)
        pipe_split()
        x = torch.relu(x) + a_constant
        x = torch.mm(x, self.mm_param1)
        return self.lin1(torch.relu(x))


class RawCode(nn.Module):
    """Plain code on raw parameters only, with two ``pipe_split()`` markers, then a Linear: without
    the markers it would be one unit (its code is glue that joins the Linear)."""

    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.p0 = nn.Parameter(torch.randn(d, d) * 0.3)
        self.p1 = nn.Parameter(torch.randn(d, d) * 0.3)
        self.lin = nn.Linear(d, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.pipelining import pipe_split

        x = torch.mm(x, self.p0).tanh()
        pipe_split()
        x = torch.mm(x, self.p1).tanh() + x
        pipe_split()
        return self.lin(x)


def _flat(n: int = 24, batch: int = 8, seed: int = 0) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=batch)


@pytest.mark.parametrize(
    ("model", "units"),
    [
        (ExampleCode, ["lin0", "lin1"]),
        (RawCode, ["(code before the first pipe_split)", "(code after pipe_split 1)", "lin"]),
    ],
)
@pytest.mark.parametrize("microbatches", [1, 4])
def test_code_cut_where_torch_pipe_split_marks_it_trains_as_locally(twin, pool, model, units, microbatches):
    traced = trace_module(model(), (torch.randn(4, DIM),), {}, "model")
    assert [e.name for e in traced.entries] == units
    remote_equals_local(
        lambda: Trained(model()),
        _flat,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:2], microbatches=microbatches, split=["model"]),
    )


class Recasts(nn.Module):
    """Casts a submodule to the dtype it has inside ``forward``, as Switch Transformers' router does
    (``self.classifier = self.classifier.to(self.dtype)``): eagerly a no-op."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.head = self.head.to(torch.float32)
        return self.head(torch.tanh(self.first(x)))


def test_a_module_cast_to_its_own_dtype_inside_forward_trains_as_locally(twin, pool):
    remote_equals_local(
        lambda: Trained(Recasts()), _flat, twin, RemoteModelParallelStrategy(hosts=pool[:2], split=["model"])
    )


def _binding_cases() -> list[tuple[object, tuple, dict]]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    q, k = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    mask = torch.rand(3, 3, generator=g) > 0.3
    aten = torch.ops.aten
    return [
        (aten.add.Tensor, (x, y), {"alpha": 2}),
        (aten.add.Tensor, (x, 3), {}),
        (aten.mul.Tensor, (x, 0.5), {}),
        (aten.neg.default, (x,), {}),
        (aten.rsqrt.default, (x.abs() + 1,), {}),
        (aten.pow.Tensor_Scalar, (x, 2), {}),
        (aten.mean.dim, (x, [-1], True), {"dtype": torch.float64}),
        (aten.linear.default, (x, torch.randn(5, 4, generator=g), torch.randn(5, generator=g)), {}),
        (aten.silu.default, (x,), {}),
        (aten.scaled_dot_product_attention.default, (q, k, k, mask, 0.0, False), {"scale": 0.3, "enable_gqa": True}),
        (aten.embedding.default, (torch.randn(6, 4, generator=g), torch.tensor([[0, 5, 2]]), -1, False, False), {}),
        (aten.cat.default, ([x, y], 1), {}),
        (aten.view.default, (x, [6, 4]), {}),
        (aten.reshape.default, (x.transpose(0, 1), [6, 4]), {}),
        (aten.transpose.int, (x, 0, 2), {}),
        (aten.unsqueeze.default, (x, -1), {}),
        (aten.expand.default, (x[:, :1], [2, 5, 4]), {"implicit": False}),
        (aten.to.dtype, (x, torch.float64, False, True), {}),
        (aten.to.dtype, (x, torch.float32, False, False, torch.preserve_format), {}),  # past the binding's positions
    ]


@pytest.mark.parametrize("op, args, kwargs", _binding_cases(), ids=lambda v: str(v) if hasattr(v, "_schema") else "")
def test_the_faster_bindings_a_program_calls_give_what_the_operators_give(op, args, kwargs):
    """The operators a transformer calls most run through torch's Python bindings (`program._BINDINGS`):
    a program step of each gives what the operator itself gives, the same values, dtype, shape and
    strides, with every positional and keyword argument the step may carry."""
    from lightning_remote_mp.model.program_code import _BINDINGS, Step

    step = Step("out", op, args, kwargs, ())
    binding, most = _BINDINGS[op]
    assert step.call is (binding if len(args) <= most else op._op)
    got, want = step.call(*args, **kwargs), op(*args, **kwargs)
    assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
