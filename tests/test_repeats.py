"""A deep model traced at four of its repeated blocks (issue #60): the programs equal the whole
model's trace, unit for unit; a model whose blocks or whose loop over them could differ by position
is traced whole; a program checked once serves every unit alike (`program.load_program`)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_remote_mp.model import repeats
from lightning_remote_mp.model.graph_layer import GraphLayer
from lightning_remote_mp.model.program import load_program, program_key, run
from lightning_remote_mp.model.trace import trace_module

transformers = pytest.importorskip("transformers")


def _traced_both(monkeypatch, module: nn.Module, kwargs: dict, caplog) -> tuple:
    with caplog.at_level(logging.DEBUG, logger="lightning_remote_mp.model.trace"):
        caplog.clear()
        shallow = trace_module(module, (), kwargs, "model")
        said = caplog.text
    monkeypatch.setattr(repeats, "MIN_RUN", 10**6)
    whole = trace_module(module, (), kwargs, "model")
    monkeypatch.undo()
    return shallow, whole, said


def assert_same_units(a, b) -> None:
    assert [e.label for e in a.entries] == [e.label for e in b.entries]
    for x, y in zip(a.entries, b.entries):
        for mode in ("train", "eval"):
            p, q = x.kwargs["programs"][mode], y.kwargs["programs"][mode]
            assert program_key(p) == program_key(q), (x.label, mode)
            assert list(p["tensors"].values()) == list(q["tensors"].values()), x.label
        assert {k: v for k, v in x.kwargs.items() if k != "programs"} == {
            k: v for k, v in y.kwargs.items() if k != "programs"
        }, x.label
        assert x.input_shapes == y.input_shapes
    assert a.state_names == b.state_names


def causal_lm(family: str, layers: int, config: str = "", **kw) -> nn.Module:
    """A tiny ``<family>ForCausalLM`` of ``layers`` decoder layers (hidden 32, 4 heads, 2 key/value
    heads), its config a ``<family>Config`` or the class named ``config``."""
    sizes = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    config = getattr(transformers, config or f"{family}Config")(**{**sizes, **kw}, num_hidden_layers=layers)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(config)


def llama(layers: int, **kw) -> nn.Module:
    return causal_lm("Llama", layers, **kw)


@pytest.mark.parametrize("case", ["llama", "llama with checkpointing", "mixtral", "qwen2"])
def test_a_deep_model_traced_at_four_layers_equals_its_whole_trace(case, monkeypatch, caplog):
    """Qwen2's loop reads ``config.layer_types[i]`` at each layer's position: alike in the run."""
    if case == "mixtral":
        model = causal_lm("Mixtral", 6, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    else:
        model = causal_lm("Qwen2" if case == "qwen2" else "Llama", 7)
    if "checkpointing" in case:
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 128, (2, 10))
    shallow, whole, said = _traced_both(
        monkeypatch, model, {"input_ids": ids, "labels": ids, "use_cache": False}, caplog
    )
    assert "copied from model.layers.2" in said
    assert_same_units(shallow, whole)
    assert len(shallow.entries) > len(model.model.layers)


def test_a_model_that_returns_every_layer_s_hidden_state_is_traced_whole(monkeypatch, caplog):
    model = llama(6)
    ids = torch.randint(0, 128, (2, 10))
    kwargs = {"input_ids": ids, "output_hidden_states": True, "use_cache": False}
    shallow, whole, said = _traced_both(monkeypatch, model, kwargs, caplog)
    assert "traced one by one" in said
    assert_same_units(shallow, whole)


def test_a_loop_that_reads_the_config_at_each_position_keeps_blocks_after_a_run_whole(monkeypatch, caplog):
    """Gemma 3 reads ``config.layer_types[i]`` in its loop, and its sixth layer is a global one
    after five sliding ones: with a block of the five hidden, the sixth would read the fifth's type.
    A run that blocks follow is not made there."""
    model = causal_lm("Gemma3", 7, config="Gemma3TextConfig", head_dim=8)
    assert repeats.find_runs(model) == []
    ids = torch.randint(0, 128, (2, 10))
    shallow, whole, _ = _traced_both(monkeypatch, model, {"input_ids": ids, "labels": ids, "use_cache": False}, caplog)
    assert_same_units(shallow, whole)


class Stack(nn.Module):
    """Identical blocks, with code in the loop that treats block 4 apart: only its position says so."""

    def __init__(self, n: int = 7) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == 4:
                x = x * 2
        return x


def test_a_loop_that_can_tell_a_block_s_position_is_traced_block_by_block():
    torch.manual_seed(0)
    net, x = Stack(), torch.randn(3, 8)
    assert repeats.find_runs(net) == []
    traced = trace_module(net, (x,), {}, "net")
    with torch.no_grad():
        torch.testing.assert_close(traced.run_locally(x), net(x))


class Scaled(nn.Module):
    """A block that knows its position and computes with it at one block only."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.layer_idx = layer_idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return x * 2 if self.layer_idx == 5 else x


def test_a_block_that_computes_with_its_own_position_is_traced_block_by_block():
    torch.manual_seed(0)
    net, x = nn.Sequential(*(Scaled(i) for i in range(8))), torch.randn(3, 8)
    assert repeats.find_runs(net) == []
    traced = trace_module(net, (x,), {}, "net")
    with torch.no_grad():
        torch.testing.assert_close(traced.run_locally(x), net(x))


def test_a_sequential_of_identical_blocks_is_traced_at_four_of_them():
    torch.manual_seed(0)
    net, x = nn.Sequential(*(nn.Linear(8, 8) for _ in range(9))), torch.randn(3, 8)
    assert [(r.path, r.kept, r.copied) for r in repeats.find_runs(net)] == [
        ("", ("0", "1", "2", "8"), ("3", "4", "5", "6", "7"))
    ]
    traced = trace_module(net, (x,), {}, "net")
    assert [e.label for e in traced.entries] == [str(i) for i in range(9)]
    with torch.no_grad():
        torch.testing.assert_close(traced.run_locally(x), net(x))


def test_blocks_that_differ_by_more_than_their_position_are_not_one_run():
    net = nn.Sequential(*(nn.Linear(8, 8) for _ in range(9)))
    net[3].scale = 2.0  # an attribute only block 3 has: its code could use it
    assert [r.keys for r in repeats.find_runs(net)] == [("4", "5", "6", "7", "8")]
    net[6].bias.requires_grad_(False)
    assert repeats.find_runs(net) == []


def test_a_program_is_checked_once_and_serves_every_layer_with_its_own_weights():
    def program(prefix: str, scale: object) -> dict:
        return {
            "inputs": [f"{prefix}x"],
            "tensors": {f"{prefix}w": f"{prefix}weight"},
            "steps": [
                [f"{prefix}y", ["aten", "mm", "default"], [{"ref": f"{prefix}x"}, {"ref": f"{prefix}w"}], {}],
                [f"{prefix}z", ["aten", "mul", "Scalar"], [{"ref": f"{prefix}y"}, scale], {}],
            ],
            "outputs": [f"{prefix}z"],
        }

    a, b = load_program(program("a_", 3), "a"), load_program(program("b_", 3), "b")
    assert a.steps is b.steps and a.fn.__code__ is b.fn.__code__  # checked and compiled once
    assert b.tensors == {"b_w": "b_weight"}
    other = load_program(program("c_", 3.0), "c")  # 3.0 is not 3: another program
    assert other.steps is not a.steps
    layers = [
        GraphLayer({"train": program(p, 3)}, {f"{p}weight": {"shape": [2, 2], "dtype": torch.float32}})
        for p in ("a_", "b_")
    ]
    with torch.no_grad():
        layers[0].a_weight.copy_(torch.eye(2))
        layers[1].b_weight.copy_(2 * torch.eye(2))
    x = torch.ones(1, 2)
    assert layers[0]((x,))[0].tolist() == [[3.0, 3.0]] and layers[1]((x,))[0].tolist() == [[6.0, 6.0]]


def test_layers_whose_programs_differ_by_their_cache_position_share_one_check():
    """A decode step's program of layer 7 is layer 3's but for the position its key/value cache
    operator names: checked once, each running with its own position."""
    from lightning_remote_mp.model import kv_cache

    def program(layer: int) -> dict:
        return {
            "inputs": ["k", "v", "n"],
            "scalar_inputs": ["n"],
            "steps": [["kv", ["lrmp", "kv_cache", "default"], [{"ref": "k"}, {"ref": "v"}, layer, {"ref": "n"}], {}]],
            "outputs": ["kv"],
        }

    three, seven = load_program(program(3), "layer 3"), load_program(program(7), "layer 7")
    assert three.steps is seven.steps
    store = kv_cache.KVStore(capacity=4)
    k = torch.ones(1, 1, 2, 2)
    with kv_cache.active(store):
        run(three, (k, k, 2), {}, torch.device("cpu"))
        run(seven, (2 * k, k, 2), {}, torch.device("cpu"))
    assert store.length(3) == 2 and store.length(7) == 2
