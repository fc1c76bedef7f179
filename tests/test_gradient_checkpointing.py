"""transformers' gradient checkpointing on a traced model (issue #59): each checkpointed decoder layer
recomputed at backward on its worker, as locally, lowering its peak; what lrmp cannot honour refused,
never dropped. Remote == local with generation in validation: `test_generate`, and QLoRA's
default: `test_qlora`.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("transformers")

import lrmp_hf as H  # noqa: E402
from test_strategy import trainer  # noqa: E402

from lightning_remote_mp import RemoteModelParallelStrategy  # noqa: E402
from lightning_remote_mp.errors import TraceError  # noqa: E402
from lightning_remote_mp.model.trace import trace_module  # noqa: E402


def _units(module: torch.nn.Module) -> dict[str, bool]:
    ids = torch.randint(0, H.VOCAB, (2, 8))
    traced = trace_module(module, (ids,), {"labels": ids, "use_cache": False}, "model")
    return {e.label: bool(e.kwargs.get("checkpoint")) for e in traced.entries}


@pytest.mark.parametrize("how", ["default", "reentrant", "every_2nd_layer"])
def test_the_units_of_checkpointed_layers_and_only_those_recompute(how):
    model = H.llama(num_hidden_layers=4)
    kwargs = {
        "default": {},
        "reentrant": {"gradient_checkpointing_kwargs": {"use_reentrant": True}},
        "every_2nd_layer": {"every_n_layers": 2},
    }[how]
    model.gradient_checkpointing_enable(**kwargs)
    units = _units(model)
    layers = [f"model.layers.{i}" for i in range(4)]
    want = {i: True for i in layers} if how != "every_2nd_layer" else {i: i[-1] in "02" for i in layers}
    assert {k: v for k, v in units.items() if k in layers} == want
    assert not any(v for k, v in units.items() if k not in layers)  # embeddings, norm, head: as locally
    model.gradient_checkpointing_disable()
    assert not any(_units(model).values())


class Blocks(torch.nn.Module):
    def __init__(self, checkpointed) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.checkpointed = checkpointed

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = self.checkpointed(block, x) if i == 1 else block(x)
        return x


def test_code_that_checkpoints_a_module_itself_is_honoured_and_a_plain_function_refused():
    def checkpointed(block, x):
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)

    traced = trace_module(Blocks(checkpointed), (torch.ones(2, 8),), {}, "net")
    assert [bool(e.kwargs.get("checkpoint")) for e in traced.entries] == [False, True, False]

    def a_function(block, x):
        return torch.utils.checkpoint.checkpoint(lambda y: block(y) * 2, x, use_reentrant=False)

    with pytest.raises(TraceError, match="not one of its modules or a method of one"):
        trace_module(Blocks(a_function), (torch.ones(2, 8),), {}, "net")

    from torch.utils.checkpoint import checkpoint  # bound before the trace: lrmp cannot see the call

    with pytest.raises(TraceError, match="imported before the trace"):
        trace_module(Blocks(lambda block, x: checkpoint(block, x, use_reentrant=False)), (torch.ones(2, 8),), {}, "n")


class LongSequences(H.FineTune):
    def training_step(self, batch, batch_idx):
        return self.model(batch, labels=batch).loss


def _peak_rise(workers, module: H.FineTune, data) -> list[float]:
    """Each worker's peak ``RssAnon`` while ``module`` trains, above what it held before, in MB."""
    pids = [p.pid for p in workers.procs]
    base = [_rss_anon(p) for p in pids]
    peak, done = list(base), threading.Event()

    def sample() -> None:
        while not done.is_set():
            for i, p in enumerate(pids):
                peak[i] = max(peak[i], _rss_anon(p))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        strategy = RemoteModelParallelStrategy(hosts=workers.addresses, split=["model"])
        trainer(strategy, 1).fit(module, data)
    finally:
        done.set()
        sampler.join()
    return [(p - b) / 2**20 for p, b in zip(peak, base)]


def test_checkpointing_lowers_each_workers_peak_by_its_layers_activations(start_workers):
    """Two rows of 2,048 tokens through 8 Llama layers, 4 a stage: with checkpointing each stage keeps
    its layers' inputs, and one layer's activations at a time at its backward."""
    data = torch.utils.data.DataLoader(torch.randint(0, H.VOCAB, (2, 2048)), batch_size=2)
    rises = {}
    for on in (False, True):
        torch.manual_seed(0)
        model = H.llama(num_hidden_layers=8, hidden_size=128, intermediate_size=512, max_position_embeddings=2048)
        if on:
            model.gradient_checkpointing_enable()
        rises[on] = _peak_rise(start_workers(2), LongSequences(model), data)
    for stage, (off, on) in enumerate(zip(rises[False], rises[True])):
        # Measured 501 -> 322 MB on stage 0 (a fresh worker's first step costs ~250 MB besides the layers).
        # Dropped, as at 0f607a1, checkpointing changed the peaks by noise (issue #59: +16 and +44 MB).
        assert off - on > 0.25 * off, f"stage {stage}: {off:.0f} MB without checkpointing, {on:.0f} MB with it"


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_checkpointing_that_offloads_says_the_workers_keep_the_inputs_on_their_device(caplog):
    model = H.llama(num_hidden_layers=2)
    model.activation_checkpointing_enable(offload=True)
    with caplog.at_level("WARNING", logger="lightning_remote_mp"):
        units = _units(model)
    assert units["model.layers.0"] and units["model.layers.1"]
    assert "keep what it saves on their own device" in caplog.text
