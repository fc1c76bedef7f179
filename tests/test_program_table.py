"""A stage's programs sent once each (issue #60, `lightning_remote_mp.model.program_table`): a deep
model's decoder layers name one program of the SETUP's table, and a worker checks the table against
its digests and refuses, naming what is wrong, a table or an entry that does not add up."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import lrmp_hf as H  # noqa: E402

from lightning_remote_mp.errors import SpecError  # noqa: E402
from lightning_remote_mp.model.program import kv_cache_position, program_key  # noqa: E402
from lightning_remote_mp.model.program_table import tabled, untabled  # noqa: E402
from lightning_remote_mp.model.trace import trace_module  # noqa: E402
from lightning_remote_mp.wire import protocol  # noqa: E402
from lightning_remote_mp.wire.requests import Setup  # noqa: E402


def _setup_bytes(**fields) -> int:
    body = Setup(
        key="m", stage=0, stages=1, start=0, exports=[], sources=(), targets=(), peers={}, init_seed=0, **fields
    )
    return sum(len(bytes(f)) for f in protocol.encode(protocol.SETUP, 1, "s", body.body()))


@pytest.fixture(scope="module")
def deep():
    """A 12-layer Llama's units, traced for its prefill (each layer writes the cache at its position)."""
    from lightning_remote_mp.model.generation import generation_forward

    torch.manual_seed(0)
    model = H.llama(num_hidden_layers=12).eval()
    ids = torch.randint(0, 32, (2, 6))
    step = {"attention_mask": torch.ones_like(ids), "position_ids": torch.arange(6).expand(2, 6)}
    with generation_forward(model):
        traced = trace_module(model, (ids,), step, "model", modes=("eval",))
    return [e.to_wire() for e in traced.entries]


def test_a_deep_model_s_layers_name_one_program_and_come_back_whole(deep):
    sent, table = tabled(deep)
    assert len(table) < len(deep) - 8  # the 12 decoder layers' programs are one
    assert _setup_bytes(entries=sent, programs=table) * 2 < _setup_bytes(entries=deep)
    back = untabled(sent, table)
    for a, b in zip(deep, back):
        for mode, p in a["kwargs"]["programs"].items():
            q = b["kwargs"]["programs"][mode]
            assert program_key(p) == program_key(q)
            assert list(p["tensors"].values()) == list(q["tensors"].values())  # this unit's own weights
            assert [kv_cache_position(s) for s in p["steps"]] == [kv_cache_position(s) for s in q["steps"]]


def test_a_table_or_an_entry_that_does_not_add_up_is_refused_naming_it(deep):
    sent, table = tabled(deep)
    key = next(iter(table))
    user = next(i for i, e in enumerate(sent) if e["kwargs"]["programs"]["eval"]["program"] == key)
    tampered = copy.deepcopy(table)
    tampered[key]["steps"] = tampered[key]["steps"][:-1] + [tampered[key]["steps"][-1]] * 2
    with pytest.raises(SpecError, match="program .* of the table"):
        untabled(sent, tampered)  # the check names the table's program, whatever it says is wrong
    renamed = {"0" * 32 if k == key else k: p for k, p in table.items()}
    with pytest.raises(SpecError, match="its content has another digest"):
        untabled(sent, renamed)
    with pytest.raises(SpecError, match=f"entry {user}, eval program: names no program of the table"):
        untabled(sent, {k: p for k, p in table.items() if k != key})
    fewer = copy.deepcopy(sent)
    fewer[user]["kwargs"]["programs"]["eval"]["tensors"].pop()
    with pytest.raises(SpecError, match=f"entry {user}, eval program: gives .* tensor names for the program's"):
        untabled(fewer, table)
    layer = next(i for i, e in enumerate(sent) if e["kwargs"]["programs"]["eval"].get("positions"))
    more = copy.deepcopy(sent)
    more[layer]["kwargs"]["programs"]["eval"]["positions"].append(3)
    with pytest.raises(SpecError, match="positions too many"):
        untabled(more, table)
