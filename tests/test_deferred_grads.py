"""Split backward on the worker's real stage executor: weight gradients of linear layers wait for
the call's last micro-batch, then equal what plain autograd gives."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_remote_mp.errors import ConfigurationError
from lightning_remote_mp.layers import WrappedLinear
from lightning_remote_mp.worker.deferred_grads import CPU_MIN_MACS, MIN_MACS_ENV, DeferredWeightGrads, auto_min_macs
from lightning_remote_mp.worker.stage import StageExecutor

WIDTH = 8

# Layers 3-8 of a residual model: a Linear, a WrappedLinear publishing "skip", a Linear without
# bias, a Tanh, a WrappedLinear adding "skip" back, and a 3-d aware Linear at the end.
ENTRIES = [
    ["torch.nn.Linear", {"in_features": WIDTH, "out_features": WIDTH}, [4, WIDTH]],
    [
        "lightning_remote_mp.layers.WrappedLinear",
        {"in_features": WIDTH, "out_features": WIDTH, "out_variables": ["skip"]},
        [4, WIDTH],
    ],
    ["torch.nn.Linear", {"in_features": WIDTH, "out_features": WIDTH, "bias": False}, [4, WIDTH]],
    ["torch.nn.Tanh", {}, [4, WIDTH]],
    [
        "lightning_remote_mp.layers.WrappedLinear",
        {"in_features": WIDTH, "out_features": WIDTH, "dependencies": ["skip"]},
        [[4, WIDTH], [4, WIDTH]],
    ],
    ["torch.nn.Linear", {"in_features": WIDTH, "out_features": 3}, [4, WIDTH]],
]


def executor(split: bool | str, seed: int = 0) -> StageExecutor:
    torch.manual_seed(seed)
    stage = StageExecutor(
        "net", 1, 3, ENTRIES, [], torch.device("cpu"), ["torch.nn", "lightning_remote_mp"], split_backward=split
    )
    torch.manual_seed(seed + 1)
    # As the driver's weights arrive at setup: new parameter objects replace the built ones.
    stage.load_state_dict({k: torch.randn_like(v) for k, v in stage.state_dict().items()}, assign=True)
    return stage


def run_call(stage: StageExecutor, call: int, xs: list[torch.Tensor], grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Forward every micro-batch, then backward them in order; returns the input gradients."""
    for mb, x in enumerate(xs):
        stage.forward((call, mb), x, {}, grad=True, needs_grad={"x": True})
    out = []
    for mb, g in enumerate(grads):
        grad_x, _ = stage.backward((call, mb), g, {})
        out.append(grad_x)
        stage.flush_weight_grads(call)
    return out


def grads_of(stage: StageExecutor) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in stage.named_parameters()}


@pytest.mark.parametrize("shape", [(5, WIDTH), (5, 2, WIDTH)])
def test_split_backward_gives_autograd_gradients_once_the_last_micro_batch_is_through(shape):
    plain, split = executor(False), executor(True)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(*shape, generator=g) for _ in range(3)]
    outs = [torch.randn(*shape[:-1], 3, generator=g) for _ in range(3)]

    expected_x = run_call(plain, 1, xs, outs)
    for mb, x in enumerate(xs):
        split.forward((1, mb), x, {}, grad=True, needs_grad={"x": True})
    got_x = []
    for mb, grad_out in enumerate(outs):
        got_x.append(split.backward((1, mb), grad_out, {})[0])
        flushed = split.flush_weight_grads(1)
        # Input gradients leave at once; weight gradients wait for the call's last micro-batch.
        assert flushed == (mb == 2)
        weights = [p.grad for n, p in split.named_parameters() if n.endswith("weight")]
        assert all((w is None) == (mb < 2) for w in weights), f"after micro-batch {mb}"

    for a, b in zip(expected_x, got_x):
        torch.testing.assert_close(b, a)
    expected, got = grads_of(plain), grads_of(split)
    assert expected.keys() == got.keys() and all(v is not None for v in expected.values())
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], msg=name)


def test_gradients_accumulate_over_calls_and_frozen_parameters_stay_untouched():
    plain, split = executor(False), executor(True)
    for stage in (plain, split):
        stage.layers["3"].weight.requires_grad_(False)  # frozen, as a driver's requires_grad=False sends it
    g = torch.Generator().manual_seed(4)
    for call in (1, 2):  # two backwards before a step: gradient accumulation
        xs = [torch.randn(4, WIDTH, generator=g) for _ in range(2)]
        outs = [torch.randn(4, 3, generator=g) for _ in range(2)]
        run_call(plain, call, xs, outs)
        run_call(split, call, xs, outs)
    expected, got = grads_of(plain), grads_of(split)
    assert got["3.weight"] is None and expected["3.weight"] is None
    for name in expected:
        if expected[name] is not None:
            torch.testing.assert_close(got[name], expected[name], msg=name)


def test_autocast_and_no_grad_take_the_plain_path():
    layer = nn.Linear(4, 4)
    deferred = DeferredWeightGrads(layer)
    with deferred.recording(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.ones(2, 4)).float().sum().backward()
    assert layer.weight.grad is not None and not deferred.waiting  # autograd did it, nothing deferred
    with torch.no_grad(), deferred.recording():
        layer(torch.ones(2, 4))
    assert not deferred.waiting


def _compare(make: Callable[[], nn.Module], x: torch.Tensor, dtype: torch.dtype = torch.float32) -> bool:
    """Train a step of ``make()`` both ways and compare every gradient; returns whether anything
    was deferred."""
    torch.manual_seed(7)
    plain = make().to(dtype)
    split = make().to(dtype)
    split.load_state_dict(plain.state_dict())
    plain(x).abs().sum().backward()
    deferred = DeferredWeightGrads(split)
    with deferred.recording():
        y = split(x)
    with deferred.filing_backward():
        y.abs().sum().backward()
    flushed = deferred.flush()
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    return flushed


def test_a_weight_shared_with_another_op_gets_both_contributions():
    class Shared(WrappedLinear):
        def __init__(self) -> None:
            super().__init__(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x) ** 2 + (self.weight**3).sum()  # the weight also used outside F.linear

    assert _compare(Shared, torch.randn(3, 4))


def test_a_filed_output_gradient_that_autograd_also_hands_on_is_not_changed_later():
    """``linear(x) + w``, with ``w`` also used before it: the addition hands one gradient tensor to
    the linear's backward (which files it) and to ``w``'s input buffer, where autograd adds the
    other use's gradient into it in place when nothing else references that tensor. The filed
    gradient must stay as it was handed over: the flushed weight gradient equals plain autograd's."""

    class Reused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 6)
            self.a = nn.Parameter(torch.randn(5, 6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = x[:, :5] @ self.a  # x has 4 columns: w is (3, 5) @ (5, 6) with x padded below
            r = w * 2  # created before the addition: its backward runs after the linear's
            return torch.cat([self.lin(x[:, :4]) + w, r])

    torch.manual_seed(3)
    plain, split = Reused(), Reused()
    split.load_state_dict(plain.state_dict())
    xs, gs = [torch.randn(3, 5) for _ in range(2)], [torch.randn(6, 6) for _ in range(2)]
    for x, g in zip(xs, gs):
        (plain(x) * g).sum().backward()
    deferred = DeferredWeightGrads(split)
    for x, g in zip(xs, gs):
        with deferred.recording():
            y = split(x)
        with deferred.filing_backward():
            (y * g).sum().backward()
    assert deferred.flush()
    for (name, p), q in zip(plain.named_parameters(), split.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layers_keep_exact_gradients(reentrant):
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(lambda t: self.b(torch.relu(self.a(t))), x, use_reentrant=reentrant)

    _compare(Block, torch.randn(3, 4, requires_grad=True))


class _GradientPenalty(nn.Module):
    """Runs autograd inside its forward (as force fields or gradient penalties do)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().requires_grad_(True) if not x.requires_grad else x
        energy = self.b(torch.tanh(self.a(x))).pow(2).sum()
        (force,) = torch.autograd.grad(energy, x, create_graph=True)
        return force + self.a(x)


def test_autograd_inside_a_forward_sees_plain_weight_gradients():
    _compare(_GradientPenalty, torch.randn(3, 4, requires_grad=True))


def test_complex_linear_layers_keep_exact_gradients():
    _compare(lambda: nn.Linear(4, 4), torch.randn(3, 4, dtype=torch.cfloat), dtype=torch.cfloat)


def test_gradient_hooks_on_a_weight_see_its_gradient_during_backward():
    mask = torch.zeros(4, 4)
    mask[0] = 1

    class Masked(nn.Linear):
        def __init__(self) -> None:
            super().__init__(4, 4)
            self.weight.register_hook(lambda g: g * mask)  # prunes all but the first row

    _compare(Masked, torch.randn(3, 4))


def test_plain_linear_layers_defer_without_a_torch_function_mode():
    """A stage whose only 2-d weights are plain nn.Linear (and nn.Embedding) layers defers through
    their forward; anything that may call F.linear on a weight of its own needs the mode."""

    class Embedded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.norm, self.head = nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 4)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.embed(ids)))

    assert not DeferredWeightGrads(Embedded())._intercept
    assert not DeferredWeightGrads(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))._intercept
    assert DeferredWeightGrads(nn.Sequential(WrappedLinear(4, 4)))._intercept
    assert DeferredWeightGrads(nn.MultiheadAttention(4, 2))._intercept
    assert _compare(lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4))


def test_a_plain_linear_weight_also_used_functionally_keeps_exact_gradients():
    """A layer with no 2-d weight of its own may still call F.linear on a child Linear's weight: the
    direct path defers the child's own call, plain autograd takes the other, and the sum is exact."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + torch.nn.functional.linear(x.flip(0), self.lin.weight)

    assert not DeferredWeightGrads(Tied())._intercept
    assert _compare(Tied, torch.randn(3, 4))


@pytest.mark.parametrize("layer", [nn.Linear, WrappedLinear], ids=["direct", "torch-function-mode"])
def test_only_products_of_at_least_min_macs_defer(layer):
    """A call defers when rows x in x out reaches ``min_macs``; a smaller one takes plain autograd
    (its weight gradient is there right after backward), on either path."""
    torch.manual_seed(0)
    module = nn.Sequential(layer(4, 8))
    deferred = DeferredWeightGrads(module, min_macs=10 * 4 * 8)
    weight = module[0].weight

    def step(rows: int) -> None:
        with deferred.recording():
            y = module(torch.randn(rows, 4))
        with deferred.filing_backward():
            y.sum().backward()

    step(9)  # 288 multiply-adds: below
    assert weight.grad is not None and not deferred.waiting
    small = weight.grad.clone()
    step(10)  # 320: at the threshold
    torch.testing.assert_close(weight.grad, small)  # this call's gradient waits
    assert deferred.waiting and deferred.flush()
    assert not torch.equal(weight.grad, small)


def test_split_backward_auto_defers_on_a_cpu_worker_only_what_repays_it(monkeypatch):
    """``"auto"``: a CPU stage defers the calls of at least `CPU_MIN_MACS` multiply-adds, and the
    worker's environment may move the threshold. The gradients are the same either way."""
    monkeypatch.delenv(MIN_MACS_ENV, raising=False)
    assert auto_min_macs(torch.device("cpu")) == CPU_MIN_MACS == 2**21
    assert auto_min_macs(torch.device("cuda")) == 0  # not measured on a GPU: every call defers there
    monkeypatch.setenv(MIN_MACS_ENV, "1000")
    assert auto_min_macs(torch.device("cuda")) == 1000
    for bad in ("lots", "-1"):
        monkeypatch.setenv(MIN_MACS_ENV, bad)
        with pytest.raises(ConfigurationError, match=f"{MIN_MACS_ENV} must be a count of multiply-adds"):
            auto_min_macs(torch.device("cpu"))
    monkeypatch.delenv(MIN_MACS_ENV)

    plain, auto = executor(False), executor("auto")
    # The stage's largest product is WIDTH x WIDTH per row: 64 rows stay below the threshold, and
    # the batch whose rows reach it defers every linear call of the stage whose output has WIDTH.
    rows = CPU_MIN_MACS // (WIDTH * WIDTH)
    for call, n in ((1, 64), (2, rows)):
        g = torch.Generator().manual_seed(call)
        xs, outs = [torch.randn(n, WIDTH, generator=g)], [torch.randn(n, 3, generator=g)]
        run_call(plain, call, xs, [outs[0]])
        auto.forward((call, 0), xs[0], {}, grad=True, needs_grad={"x": True})
        auto.backward((call, 0), outs[0], {})
        assert auto.flush_weight_grads(call) == (n == rows), f"{n} rows"
        # The stage's WrappedLinears need the TorchFunctionMode: the forward that deferred nothing
        # is remembered by its inputs' shapes (and runs without the mode next time), the other not.
        assert auto.deferred is not None and len(auto.deferred._small) == 1, f"{n} rows"
        expected, got = grads_of(plain), grads_of(auto)
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], msg=f"{name}, {n} rows")


def test_a_one_dimensional_weight_takes_plain_autograd():
    """``F.linear`` takes a 1-d weight (a dot product per row); the deferred products assume 2-d."""

    class Dot(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))
            self.proj = nn.Parameter(torch.randn(4, 4))  # a 2-d weight of its own: the mode intercepts

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(torch.nn.functional.linear(x, self.proj), self.w)

    assert DeferredWeightGrads(Dot())._intercept
    assert _compare(Dot, torch.randn(3, 4))  # proj defers, w does not, and both are exact


def test_a_forward_too_small_to_defer_skips_the_torch_function_mode_next_time():
    """Under the mode (a WrappedLinear here) every op of the forward costs a Python call. A forward
    that deferred nothing is remembered by its inputs' signature, and the next one with the same
    signature runs without the mode; a larger one still defers, and every gradient stays exact."""
    torch.manual_seed(0)

    class Spy(nn.Module):
        """Records whether a TorchFunctionMode is active while it runs."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[bool] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append(torch._C._len_torch_function_stack() > 0)
            return torch.tanh(x)

    spy = Spy()
    module = nn.Sequential(WrappedLinear(4, 8), spy, WrappedLinear(8, 2))
    plain = copy.deepcopy(module)
    deferred = DeferredWeightGrads(module, min_macs=10 * 4 * 8)
    assert deferred._intercept

    def step(x: torch.Tensor) -> bool:
        with deferred.recording(x.shape):
            y = module(x)
        with deferred.filing_backward():
            y.sum().backward()
        plain(x).sum().backward()
        flushed = deferred.flush()
        for (name, p), q in zip(plain.named_parameters(), module.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=name)
        return flushed

    g = torch.Generator().manual_seed(1)
    assert not step(torch.randn(3, 4, generator=g))  # small: under the mode, nothing deferred
    assert not step(torch.randn(3, 4, generator=g))  # the same shapes: no mode
    assert step(torch.randn(16, 4, generator=g))  # large: the mode, and the first layer defers
    assert not step(torch.randn(3, 4, generator=g))
    assert spy.seen == [True, False, True, False]
    deferred.parameters_replaced()  # new parameters: nothing is known about them
    assert not step(torch.randn(3, 4, generator=g)) and spy.seen[-1] is True


# Layers that write in place: into the stage's input (a received activation, a leaf that requires
# grad on the worker), and into a Linear's output, a view for 3-d inputs (issue #38's UnflattenM).
IN_PLACE = [
    ["torch.nn.ELU", {"inplace": True}, [4, WIDTH]],
    ["torch.nn.Linear", {"in_features": WIDTH, "out_features": WIDTH}, [4, WIDTH]],
    ["torch.nn.ELU", {"inplace": True}, [4, WIDTH]],
    ["torch.nn.Linear", {"in_features": WIDTH, "out_features": 3}, [4, WIDTH]],
]


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("split", [False, True, "auto"])
def test_layers_that_write_in_place_into_the_stages_input_and_a_linears_output(split, recompute):
    """As locally, where the input is the previous layer's output; ELU, unlike ReLU, changes what it
    is applied to twice, so a recomputed forward that started from an input written into shows."""
    torch.manual_seed(0)
    stage = StageExecutor("net", 1, 0, IN_PLACE, [], torch.device("cpu"), ["torch.nn"], split_backward=split)
    local = nn.Sequential(nn.ELU(inplace=True), nn.Linear(WIDTH, WIDTH), nn.ELU(inplace=True), nn.Linear(WIDTH, 3))
    local.load_state_dict(stage.state_dict())
    g = torch.Generator().manual_seed(3)
    x, grad_out = torch.randn(5, 2, WIDTH, generator=g), torch.randn(5, 2, 3, generator=g)

    out = stage.forward((1, 0), x.clone(), {}, grad=True, needs_grad={"x": True}, recompute=recompute)
    grad_x, _ = stage.backward((1, 0), grad_out, {})
    stage.flush_weight_grads(1)
    leaf = x.clone().requires_grad_(True)
    y = local(leaf * 1.0)  # a layer's output, not a leaf
    y.backward(grad_out)

    torch.testing.assert_close(out["y"], y.detach())
    torch.testing.assert_close(grad_x, leaf.grad)
    for (name, p), q in zip(local.named_parameters(), stage.layers.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
