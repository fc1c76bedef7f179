"""The layer spec: entries, class resolution and its allowlist, residual wiring, local training."""

from __future__ import annotations

import sys

import pytest
import torch
from lrmp_testlayers import ScaleBy
from torch import nn

from lightning_remote_mp.errors import RefusedClassError, SpecError
from lightning_remote_mp.layers import WrappedLinear
from lightning_remote_mp.model.build import DEFAULT_ALLOWED_PREFIXES, is_allowed, resolve_class, resolve_layer
from lightning_remote_mp.model.entries import LayerEntry, normalize_entry
from lightning_remote_mp.model.spec import SpecSequential


def _residual_spec(layer=WrappedLinear):
    return [
        ("torch.nn.Linear", {"in_features": 4, "out_features": 8}, (16, 4)),
        (layer, {"in_features": 8, "out_features": 8, "out_variables": ["skip"]}, (16, 8)),
        (nn.Tanh, {}, (16, 8)),
        (layer, {"in_features": 8, "out_features": 8, "dependencies": ["skip"]}, [(16, 8), (16, 8)]),
        ({"layer": "torch.nn.Linear", "kwargs": {"in_features": 8, "out_features": 1}, "input_shape": (16, 8)}),
    ]


# --- local behaviour ---------------------------------------------------------------------


def test_spec_sequential_computes_the_residual_wiring():
    torch.manual_seed(0)
    net = SpecSequential(_residual_spec())
    x = torch.randn(5, 4)
    l0, l1, _, l3, l4 = net.layers
    h0 = l0(x)
    skip = nn.functional.linear(h0, l1.weight, l1.bias)
    expected = l4(nn.functional.linear(torch.tanh(skip), l3.weight, l3.bias) + skip)
    assert torch.allclose(net(x), expected, atol=1e-6)
    assert net.wiring.produced_at == {"skip": 1}
    assert net.wiring.consumed_at == {"skip": [3]}
    assert len(net) == 5 and list(net) == list(net.layers)


def test_spec_sequential_trains_locally():
    torch.manual_seed(0)
    net = SpecSequential(_residual_spec())
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True).sin()
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    before = [p.detach().clone() for p in net.parameters()]
    losses = []
    for _ in range(40):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    # Every layer's parameters moved: gradients reach through the residual branch too.
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_residual_gradient_flows_through_the_skip():
    # ScaleBy(0) after the producer cuts the main path; only the residual carries a gradient.
    net = SpecSequential(
        [
            (ScaleBy, {"init": 2.0, "out_variables": ["v"]}, (1,)),
            (ScaleBy, {"init": 0.0}, (1,)),
            (ScaleBy, {"init": 1.0, "dependencies": ["v"]}, [(1,), (1,)]),
        ]
    )
    x = torch.tensor([3.0], requires_grad=True)
    out = net(x)
    assert out.item() == pytest.approx(6.0)
    out.sum().backward()
    assert x.grad.item() == pytest.approx(2.0)
    assert net.layers[0].scale.grad.item() == pytest.approx(3.0)


def test_train_and_eval_modes_apply_locally():
    net = SpecSequential([("torch.nn.Dropout", {"p": 0.5}, (4,))])
    assert not net.is_remote and net.extra_repr() == ""
    net.eval()
    x = torch.ones(1000)
    assert torch.equal(net(x), x)
    net.train()
    assert not torch.equal(net(x), x)


# --- entries -----------------------------------------------------------------------------


def test_dotted_paths_and_classes_are_equivalent():
    by_path = SpecSequential(
        [("torch.nn.Linear", {"in_features": 3, "out_features": 2}, (1, 3)), ("lrmp_testlayers.ScaleBy", {}, (1, 2))]
    )
    by_class = SpecSequential([(nn.Linear, {"in_features": 3, "out_features": 2}, (1, 3)), (ScaleBy, {}, (1, 2))])
    for a, b in zip(by_path.layers, by_class.layers):
        assert type(a) is type(b)
    assert [e.path for e in by_class.entries] == ["torch.nn.modules.linear.Linear", "lrmp_testlayers.ScaleBy"]
    assert [e.path for e in by_path.entries] == ["torch.nn.Linear", "lrmp_testlayers.ScaleBy"]
    assert [e.name for e in by_path.entries] == ["Linear", "ScaleBy"]
    by_class.load_state_dict(by_path.state_dict())
    x = torch.randn(4, 3)
    assert torch.equal(by_path(x), by_class(x))


def test_dict_entries_and_defaults():
    entry = normalize_entry({"layer": "torch.nn.ReLU"}, 0)
    assert entry == LayerEntry(layer="torch.nn.ReLU", kwargs={}, input_shape=())
    entry = normalize_entry(
        {"layer": nn.Linear, "kwargs": {"in_features": 2, "out_features": 3}, "input_shape": [5, 2]}, 3
    )
    assert entry.input_shape == (5, 2) and entry.input_shapes == ((5, 2),)
    multi = normalize_entry(("torch.nn.Identity", None, [[2, 3], (2, 3)]), 0)
    assert multi.input_shape == ((2, 3), (2, 3)) and multi.kwargs == {}
    net = SpecSequential([{"layer": "torch.nn.Linear", "kwargs": {"in_features": 2, "out_features": 3}}])
    assert net(torch.ones(1, 2)).shape == (1, 3)


def test_kwargs_are_copied_not_shared():
    kwargs = {"in_features": 2, "out_features": 2}
    entry = normalize_entry(("torch.nn.Linear", kwargs, (1, 2)), 0)
    kwargs["out_features"] = 99
    assert entry.kwargs["out_features"] == 2


@pytest.mark.parametrize(
    "bad,match",
    [
        (5, "expected \\(layer, kwargs, input_shape\\)"),
        ("torch.nn.Linear", "expected \\(layer, kwargs, input_shape\\)"),
        (("torch.nn.Linear", {}), "expected \\(layer, kwargs, input_shape\\)"),
        (("torch.nn.Linear", {}, (1,), "extra"), "expected \\(layer, kwargs, input_shape\\)"),
        ((42, {}, (1,)), "layer must be an nn.Module subclass or a dotted path"),
        ((dict, {}, (1,)), "layer must be an nn.Module subclass"),
        ((nn.Linear(2, 2), {}, (1,)), "layer must be an nn.Module subclass"),
        ((torch.relu, {}, (1,)), "layer must be an nn.Module subclass"),
        (("Linear", {}, (1,)), "not a dotted import path"),
        (("torch..nn.Linear", {}, (1,)), "not a dotted import path"),
        (("torch.nn.Linear()", {}, (1,)), "not a dotted import path"),
        (("os.system('touch x')", {}, (1,)), "not a dotted import path"),
        (("torch.class.Foo", {}, (1,)), "not a dotted import path"),
        ((" torch.nn.Linear", {}, (1,)), "not a dotted import path"),
        (("torch.nn.Linear", [("in_features", 2)], (1,)), "kwargs must be a dict with string keys"),
        (("torch.nn.Linear", {1: 2}, (1,)), "kwargs must be a dict with string keys"),
        (("torch.nn.Linear", {}, "1x2"), "input_shape must be"),
        (("torch.nn.Linear", {}, (1.0, 2)), "input_shape must be"),
        (("torch.nn.Linear", {}, (True, 2)), "input_shape must be"),
        (("torch.nn.Linear", {}, 4), "input_shape must be"),
        (("torch.nn.Linear", {}, (2, -1)), "negative size"),
        (("torch.nn.Linear", {}, [(2, 3), (2, -3)]), "negative size"),
        (("torch.nn.Linear", {}, [(2, 3), "x"]), "input_shape must be"),
        ({"layer": "torch.nn.Linear", "kwarg": {}}, "a dict entry takes keys"),
        ({"kwargs": {}, "input_shape": (1,)}, "a dict entry takes keys"),
    ],
)
def test_malformed_entries_name_their_index(bad, match):
    good = ("torch.nn.Identity", {}, (1,))
    with pytest.raises(SpecError, match=match) as info:
        SpecSequential([good, good, bad])
    assert str(info.value).startswith("spec entry 2:")


def test_empty_spec():
    with pytest.raises(SpecError, match="empty"):
        SpecSequential([])


def test_constructor_failure_names_layer_and_kwargs():
    with pytest.raises(SpecError, match=r"layer 1 \(Linear\): constructing it with \{'in_features': 2\} failed"):
        SpecSequential([("torch.nn.Identity", {}, (1,)), ("torch.nn.Linear", {"in_features": 2}, (1, 2))])


@pytest.mark.parametrize(
    "path,match",
    [
        ("torch.nn.NoSuchLayer", "has no attribute 'NoSuchLayer'"),
        ("torch.nn.Linear.Nested", "has no attribute 'Linear.Nested'"),
        ("no_such_package_lrmp.Layer", "no module of this path can be imported"),
        ("torch.optim.SGD", "is not a torch.nn.modules.module.Module subclass"),
        ("torch.nn.functional.relu", "is not a torch.nn.modules.module.Module subclass"),
    ],
)
def test_unresolvable_paths(path, match):
    with pytest.raises(SpecError, match=match):
        SpecSequential([(path, {}, (1,))])


# --- wiring --------------------------------------------------------------------------------


def test_dependency_never_produced():
    with pytest.raises(SpecError) as info:
        SpecSequential(
            [
                (ScaleBy, {"out_variables": ["a"]}, (1,)),
                (WrappedLinear, {"in_features": 1, "out_features": 1, "dependencies": ["a", "nope"]}, (1, 1)),
            ]
        )
    msg = str(info.value)
    assert msg.startswith("layer 1 (WrappedLinear) depends on 'nope', which no earlier layer produces")
    assert ">>   1 WrappedLinear  needs ['a', 'nope']" in msg
    assert "     0 ScaleBy  makes ['a']" in msg


def test_dependency_produced_after_use():
    with pytest.raises(SpecError, match=r"^layer 0 \(ScaleBy\) depends on 'v', which no earlier layer produces"):
        SpecSequential(
            [(ScaleBy, {"dependencies": ["v"]}, (1,)), (ScaleBy, {"out_variables": ["v"]}, (1,))],
        )


def test_a_layer_cannot_consume_what_it_produces():
    with pytest.raises(SpecError, match=r"layer 0 \(ScaleBy\) depends on 'v'"):
        SpecSequential([(ScaleBy, {"dependencies": ["v"], "out_variables": ["v"]}, (1,))])


def test_duplicate_variable_names():
    with pytest.raises(SpecError) as info:
        SpecSequential(
            [
                (ScaleBy, {"out_variables": ["v"]}, (1,)),
                ("torch.nn.Identity", {}, (1,)),
                (WrappedLinear, {"in_features": 1, "out_features": 1, "out_variables": ["v"]}, (1, 1)),
            ]
        )
    assert str(info.value).startswith(
        "layer 2 (WrappedLinear) produces 'v', already produced by layer 0 (ScaleBy); variable names must be unique"
    )
    with pytest.raises(SpecError, match=r"layer 0 \(ScaleBy\) lists 'w' twice in out_variables"):
        SpecSequential([(ScaleBy, {"out_variables": ["w", "w"]}, (1,))])


@pytest.mark.parametrize("name", ["", 3, None])
def test_variable_names_must_be_non_empty_strings(name):
    with pytest.raises(SpecError, match=r"layer 1 \(ScaleBy\): variable names must be non-empty strings"):
        SpecSequential([("torch.nn.Identity", {}, (1,)), (ScaleBy, {"out_variables": [name]}, (1,))])


def test_input_shape_list_must_match_dependencies():
    produce = (ScaleBy, {"out_variables": ["a", "b"]}, (4,))
    with pytest.raises(SpecError, match=r"layer 1 \(ScaleBy\) takes 1 input plus dependencies \['a', 'b'\], but its"):
        SpecSequential([produce, (ScaleBy, {"dependencies": ["a", "b"]}, [(4,), (4,)])])
    with pytest.raises(SpecError, match=r"layer 1 \(ScaleBy\) takes 1 input plus dependencies \['a'\].* lists 3"):
        SpecSequential([produce, (ScaleBy, {"dependencies": ["a"]}, [(4,), (4,), (4,)])])
    with pytest.raises(SpecError, match=r"layer 0 \(Identity\) takes 1 input plus dependencies \[\].* lists 2 shapes"):
        SpecSequential([("torch.nn.Identity", {}, [(4,), (4,)]), produce])
    # Matching lists, and a single shape for a layer with dependencies, are fine.
    SpecSequential([produce, (ScaleBy, {"dependencies": ["a", "b"]}, [(4,), (4,), (4,)])])
    SpecSequential([produce, (ScaleBy, {"dependencies": ["a", "b"]}, (4,))])


class _Liar(nn.Module):
    """Declares an out_variable but returns a plain tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.out_variables = ["v"]

    def forward(self, x):
        return x


class _WrongNames(nn.Module):
    def __init__(self, pairs) -> None:
        super().__init__()
        self.out_variables = ["v"]
        self.pairs = pairs

    def forward(self, x):
        return x, self.pairs


def test_out_variables_layer_returning_a_plain_tensor():
    net = SpecSequential([("torch.nn.Identity", {}, (2,)), (_Liar, {}, (2,))])
    with pytest.raises(SpecError) as info:
        net(torch.ones(2))
    msg = str(info.value)
    assert "layer 1 (_Liar) has out_variables ['v'] and must return (output, [(name, tensor), ...])" in msg
    assert msg.endswith("it returned Tensor")
    assert info.value.lrmp_layer == 1


def test_out_variables_layer_returning_wrong_variables():
    t = torch.ones(1)
    with pytest.raises(SpecError, match=r"layer 0 \(_WrongNames\) declares out_variables \['v'\] but returned \['w'\]"):
        SpecSequential([(_WrongNames, {"pairs": [("w", t)]}, (1,))])(t)
    with pytest.raises(SpecError, match=r"layer 0 \(_WrongNames\) declares out_variables \['v'\] but returned \[\]"):
        SpecSequential([(_WrongNames, {"pairs": []}, (1,))])(t)
    with pytest.raises(SpecError, match=r"layer 0 \(_WrongNames\) returned a malformed variable"):
        SpecSequential([(_WrongNames, {"pairs": [(1, t)]}, (1,))])(t)


def test_layer_failures_are_tagged_with_their_index():
    net = SpecSequential(
        [
            ("torch.nn.Identity", {}, (2,)),
            ("torch.nn.Identity", {}, (2,)),
            ("torch.nn.Linear", {"in_features": 3, "out_features": 1}, (3,)),
        ]
    )
    with pytest.raises(RuntimeError) as info:
        net(torch.ones(2))
    assert info.value.lrmp_layer == 2


# --- the worker's allowlist -----------------------------------------------------------------


@pytest.mark.parametrize(
    "path,allowed,module",
    [
        ("os.system", DEFAULT_ALLOWED_PREFIXES, "os"),
        ("subprocess.Popen", DEFAULT_ALLOWED_PREFIXES, "subprocess"),
        ("builtins.eval", DEFAULT_ALLOWED_PREFIXES, "builtins"),
        ("collections.OrderedDict", DEFAULT_ALLOWED_PREFIXES, "collections"),
        ("torch.nn.Linear", ["lightning_remote_mp.layers"], "torch.nn"),
        ("torch.nnx.Foo", ["torch.nn"], "torch.nnx"),
        ("torch.nn_evil.Foo", ["torch.nn"], "torch.nn_evil"),
        ("torch.Tensor", ["torch.nn"], "torch"),
        ("torch.nn.Linear", ["torch.n"], "torch.nn"),
        ("lrmp_testlayers_evil.ScaleBy", ["lrmp_testlayers"], "lrmp_testlayers_evil"),
        ("lightning_remote_mp.layersX.WrappedLinear", DEFAULT_ALLOWED_PREFIXES, "lightning_remote_mp.layersX"),
        ("lightning_remote_mp.model.spec.SpecSequential", DEFAULT_ALLOWED_PREFIXES, "lightning_remote_mp.model.spec"),
    ],
)
def test_allowlist_refuses(path, allowed, module):
    with pytest.raises(RefusedClassError) as info:
        resolve_class(path, nn.Module, allowed)
    msg = str(info.value)
    assert f"class {path!r} is not in this worker's allowlist" in msg
    assert f"--allow-module {module} " in msg
    with pytest.raises(RefusedClassError):
        resolve_layer(path, allowed)


def test_allowlist_refuses_before_importing(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "lrmp_marker_mod.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nimport torch\nclass Layer(torch.nn.Module):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RefusedClassError, match="--allow-module lrmp_marker_mod"):
        resolve_class("lrmp_marker_mod.Layer", nn.Module, ["torch.nn"])
    assert not marker.exists()
    assert "lrmp_marker_mod" not in sys.modules
    # Allowed, the same path imports (and the marker shows it did).
    try:
        assert resolve_class("lrmp_marker_mod.Layer", nn.Module, ["lrmp_marker_mod"]).__name__ == "Layer"
        assert marker.exists()
    finally:
        sys.modules.pop("lrmp_marker_mod", None)


@pytest.mark.parametrize(
    "path",
    [
        "torch.nn.modules.module.torch.ao.nn.quantized.Linear",
        "lightning_remote_mp.layers.torch.ao.nn.quantized.Linear",
        "lightning_remote_mp.layers.nn.Linear",
        "torch.nn.modules.linear.F.relu",
        "torch.nn",
    ],
)
def test_allowlist_cannot_be_escaped_through_imported_modules(path):
    # The path starts with an allowed prefix, but walks attributes into modules the allowed one
    # imports, reaching classes from outside the allowlist.
    with pytest.raises(RefusedClassError, match="reached through module .*--allow-module"):
        resolve_class(path, nn.Module, DEFAULT_ALLOWED_PREFIXES)


def test_allowlist_admits_what_it_lists():
    assert resolve_class("torch.nn.Linear", nn.Module, ["torch.nn"]) is nn.Linear
    assert resolve_class("torch.nn.modules.linear.Linear", nn.Module, ["torch.nn"]) is nn.Linear
    assert (
        resolve_class("lightning_remote_mp.layers.WrappedLinear", nn.Module, DEFAULT_ALLOWED_PREFIXES) is WrappedLinear
    )
    assert resolve_class("lrmp_testlayers.ScaleBy", nn.Module, ["lrmp_testlayers"]) is ScaleBy
    assert resolve_class("torch.optim.SGD", torch.optim.Optimizer, ["torch.optim"]) is torch.optim.SGD
    with pytest.raises(SpecError, match="is not a torch.optim.optimizer.Optimizer subclass"):
        resolve_class("torch.nn.Linear", torch.optim.Optimizer, ["torch.nn"])
    assert resolve_layer(nn.ReLU, ["nothing"]) is nn.ReLU  # a class object is the driver's own


def test_is_allowed_matches_whole_components():
    assert is_allowed("torch.nn.Linear", ["torch.nn"])
    assert is_allowed("torch.nn", ["torch.nn"])
    assert not is_allowed("torch.nnx.Linear", ["torch.nn"])
    assert not is_allowed("torch.Linear", ["torch.nn"])
    assert not is_allowed("torch.nn.Linear", [])
    assert is_allowed("a.b.C", ["x", "a"])


def test_loading_into_a_meta_module_keeps_the_state_quietly(recwarn):
    """Resuming a meta-device model: the weights wait for the workers, with no torch warning per parameter."""
    spec = [("torch.nn.Linear", {"in_features": 3, "out_features": 3}, (2, 3))] * 2
    state = SpecSequential(spec, init_seed=1).state_dict()
    meta = SpecSequential(spec, init_seed=0, device="meta")
    meta.load_state_dict(state)
    assert not [w for w in recwarn if "meta parameter" in str(w.message)]
    assert set(meta._pending_state) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert torch.equal(meta._pending_state["0.weight"], state["layers.0.weight"])


@pytest.mark.parametrize("seed", [True, 1.5, -1, "7"])
def test_an_init_seed_that_the_workers_would_refuse_is_refused_here(seed):
    with pytest.raises(SpecError, match=r"init_seed must be None or an integer in \[0, 2\*\*62\)"):
        SpecSequential([("torch.nn.Linear", {"in_features": 3, "out_features": 3}, (2, 3))], init_seed=seed)


def test_a_layer_declares_its_variables_on_the_instance_on_its_class_or_by_a_property():
    from lightning_remote_mp.model.wiring import variables_of

    class OnClass(nn.Module):
        dependencies = ["a"]

    class ByProperty(nn.Module):
        @property
        def out_variables(self):
            return ["b"]

    on_instance = nn.Identity()
    on_instance.dependencies = ["c"]
    assert variables_of(OnClass()) == (["a"], [])
    assert variables_of(ByProperty()) == ([], ["b"])
    assert variables_of(on_instance) == (["c"], [])
    assert variables_of(nn.Linear(2, 2)) == ([], [])

    class Delegating(nn.Module):  # as torch.compile's wrapper: what it lacks, its module has
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def __getattr__(self, name: str):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.inner, name)

    assert variables_of(Delegating(on_instance)) == (["c"], [])
