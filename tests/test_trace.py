"""Unchanged nn.Modules split by tracing (``split=[...]``): real workers that hold none of the
models' code, real Trainers, each run compared step by step with the same model trained locally."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lrmp_traced import CausalLM, DataDependent, ResNet, Trained
from lrmp_zoo import image_data, token_data
from test_strategy import assert_same_losses, assert_same_weights, trainer
from test_worker import Client
from test_zoo import TOL, fit, remote_equals_local
from torch import nn

from lightning_remote_mp import RemoteModelParallelStrategy
from lightning_remote_mp.errors import RefusedOperatorError, SpecError, TraceError
from lightning_remote_mp.model.graph_layer import GraphLayer
from lightning_remote_mp.model.program import load_program
from lightning_remote_mp.model.trace import find_modules, trace_module
from lightning_remote_mp.wire import protocol


def _entries_sent(strategy: RemoteModelParallelStrategy, key: str = "model") -> list:
    return [e.to_wire() for e in strategy._traced[0].traced.entries]


class _KeepEntries(L.Callback):
    """Keeps what was sent to the workers (the strategy forgets it at teardown)."""

    def __init__(self) -> None:
        self.entries: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not self.entries and isinstance(trainer.strategy, RemoteModelParallelStrategy):
            self.entries = _entries_sent(trainer.strategy)


@pytest.mark.parametrize("stages", [2, 4])
def test_unchanged_causal_lm_trains_as_it_does_locally(twin, pool, stages):
    """An embedding, learned positions, nn.TransformerEncoder with a causal mask and a head, traced
    as it is: the mask and the residual stream cross stages; four micro-batches."""
    keep = _KeepEntries()
    remote_equals_local(
        lambda: Trained(CausalLM(layers=2)),
        token_data,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:stages], microbatches=4, split=["model"]),
        callbacks=[keep],
    )
    # What the workers got: programs for lrmp's own GraphLayer, nothing of the user's code (the
    # shared workers allow only torch.nn, lrmp and lrmp_testlayers: they could not build it anyway).
    assert {e["layer"] for e in keep.entries} == {"lightning_remote_mp.graph.GraphLayer"}
    assert "lrmp_traced" not in repr(keep.entries)


def test_cnn_with_batchnorm_and_downsampling_blocks_follows_train_and_eval_switches(twin, pool):
    """A ResNet-style CNN (BasicBlocks, a strided 1x1 projection of the skip): BatchNorm must use
    batch statistics in training and running statistics in the sanity check and validation."""
    local, remote = remote_equals_local(
        lambda: Trained(ResNet(), optimizer="Adam", lr=0.01),
        image_data,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:2], split=["model"]),
    )
    assert remote.model.training  # the module's own flags, restored after validation
    stats = remote.model.layer1[1].downsample[1]
    assert int(stats.num_batches_tracked) == 2 * 3  # 2 epochs of 3 batches, none from validation
    assert "forward" not in vars(remote.model)  # the module has its own forward back
    # A later run (validate after fit) uses the same trace: tracing costs seconds.
    first = remote.model._lrmp_trace.first
    local.val_losses.clear()
    remote.val_losses.clear()
    trainer(None, 1).validate(local, image_data(seed=2))
    trainer(RemoteModelParallelStrategy(hosts=pool[:2], split=["model"]), 1).validate(remote, image_data(seed=2))
    assert remote.model._lrmp_trace.first is first
    assert_same_losses(local.val_losses, remote.val_losses, TOL)


def test_a_first_training_call_traces_train_mode_alone_and_validation_then_eval(twin, pool, monkeypatch):
    """A call exports the modes it runs in (issue #60): ``fit`` without a sanity check exports the
    training program alone at its first step, and the first validation the eval program, placed
    over the same stages and tensors (BatchNorm's count of batches, which only training reads,
    included); the run trains and validates as locally."""
    from lightning_remote_mp.model import calls

    modes = []
    trace = calls.trace_module

    def recording(module, args, kwargs, name, **kw):
        modes.append(kw["modes"])
        return trace(module, args, kwargs, name, **kw)

    monkeypatch.setattr(calls, "trace_module", recording)
    local, remote = remote_equals_local(
        lambda: Trained(ResNet(), optimizer="Adam", lr=0.01),
        image_data,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:2], split=["model"]),
        num_sanity_val_steps=0,
    )
    assert modes == [("train",), ("eval",)], modes
    assert len(remote.val_losses) == 2 * 3  # validated every epoch
    assert int(remote.model.layer1[0].bn1.num_batches_tracked) == 2 * 3  # 2 epochs of 3 batches


def test_local_workers_that_cannot_start_fail_the_first_call_naming_the_worker():
    """Local workers start while the module traces, and are greeted when its units are placed: one
    that cannot start (a device this machine lacks) fails the first call with its own words, and
    the run leaves no process behind."""
    from lightning_remote_mp.errors import WorkerStartError

    strategy = RemoteModelParallelStrategy(split=["model"], local_workers={"devices": ["cpu", "cuda:9"]})
    with pytest.raises(WorkerStartError, match="local lrmp-worker 1 .* exited with code") as failed:
        fit(Trained(ResNet()), image_data, strategy, epochs=1, num_sanity_val_steps=0)
    assert "cuda" in str(failed.value), failed.value  # the worker's own words
    assert strategy._starting is None and strategy._workers is None


def _gpt2(transformers):
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=32, use_cache=False, tie_word_embeddings=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama(transformers):
    """Rotary position embeddings computed in a torch.no_grad() block: a block torch.export wraps."""
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, use_cache=False, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_huggingface_decoders_unchanged(twin, pool, build):
    transformers = pytest.importorskip("transformers")
    remote_equals_local(
        lambda: Trained(build(transformers), optimizer="AdamW", lr=1e-3, output="logits"),
        token_data,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2, split=["model"]),
    )


def test_checkpoints_keep_the_modules_own_keys_and_resume_on_fresh_workers(tmp_path, twin, pool):
    torch.manual_seed(3)
    base = Trained(ResNet(), optimizer="Adam", lr=0.01)
    straight, remote, resumed = twin(base), twin(base), twin(base)
    fit(straight, image_data, epochs=4, num_sanity_val_steps=0)
    cb = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1)
    fit(
        remote,
        image_data,
        RemoteModelParallelStrategy(hosts=pool[:2], split=["model"]),
        epochs=2,
        enable_checkpointing=True,
        callbacks=[cb],
        num_sanity_val_steps=0,
    )
    ckpt = torch.load(os.path.join(tmp_path, "last.ckpt"), weights_only=True)
    assert ckpt["state_dict"].keys() == base.state_dict().keys()
    plain = ResNet()  # a plain local model, no workers: the checkpoint loads as it is
    plain.load_state_dict({k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()})
    assert len(ckpt["optimizer_states"][0]["state"]) == len(list(base.parameters()))
    # Resume on fresh workers (the state reaches them when the module is traced at its first call).
    fit(
        resumed,
        image_data,
        RemoteModelParallelStrategy(hosts=pool[2:], split=["model"]),
        epochs=4,
        num_sanity_val_steps=0,
        ckpt_path=os.path.join(tmp_path, "last.ckpt"),
    )
    assert_same_losses(straight.losses[-6:], resumed.losses, TOL)
    assert_same_weights(straight, resumed, TOL)


class _KeepStages(L.Callback):
    def __init__(self) -> None:
        self.stages: list = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.predicted = list(trainer.strategy.session.predicted_stage_seconds.values())
        remote = trainer.strategy.session.placements["model"].remote
        self.stages = [(rs.stage.start, rs.stage.stop) for rs in remote.stages]
        self.units = [e.name for e in trainer.strategy._traced[0].traced.entries]


def test_balance_starts_stages_at_named_submodules(pool):
    torch.manual_seed(0)
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], balance={"model": ["encoder.layers.1"]})
    keep = _KeepStages()
    trainer(strategy, 1, callbacks=[keep], limit_train_batches=1).fit(Trained(CausalLM(layers=2)), token_data())
    assert keep.units == ["embed", "encoder.layers.0", "encoder.layers.1", "norm", "head"]
    assert keep.stages == [(0, 2), (2, 5)]


def test_balance_by_time_times_traced_units_on_the_workers(pool):
    torch.manual_seed(0)
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], balance="time")
    keep = _KeepStages()
    trainer(strategy, 1, callbacks=[keep], limit_train_batches=2).fit(Trained(CausalLM(layers=2)), token_data())
    assert len(keep.stages) == 2 and keep.stages[0][0] == 0 and keep.stages[-1][1] == 5
    (predicted,) = keep.predicted  # the stage times the measured unit times predict
    assert len(predicted) == 2 and all(t > 0 for t in predicted)


@pytest.fixture(scope="module")
def traced_lm():
    torch.manual_seed(0)
    model = CausalLM(layers=2)
    return model, trace_module(model, (torch.randint(0, 32, (2, 16)),), {}, "lm")


def test_stage_starts_must_name_units_in_order(traced_lm):
    _, traced = traced_lm
    assert traced.counts_at(["encoder.layers"], 2) == [1, 4]  # a prefix names the first unit under it
    for names, match in [
        (["nope"], "cannot start a stage at 'nope'"),
        (["embed"], "cannot start a stage at 'embed'"),  # stage 0 starts there already
        (["head", "norm"], "cannot start a stage at 'norm'"),  # out of order
        (["norm"], "give 2 names"),
    ]:
        with pytest.raises(TraceError, match=match):
            traced.counts_at(names, 3 if len(names) == 2 or match == "give 2 names" else 2)


def test_a_model_that_cannot_be_traced_names_its_source_line(pool):
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"])
    model = Trained(DataDependent())
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 4, (8,))), batch_size=4
    )
    with pytest.raises(TraceError) as info:
        trainer(strategy, 1).fit(model, data)
    message = str(info.value)
    assert "'model'" in message and "lrmp_traced.py" in message and "if h.sum() > 0" in message, message
    assert "SpecSequential" in message  # the way out


def test_split_names_are_checked(pool):
    with pytest.raises(TraceError, match="does not have"):
        trainer(RemoteModelParallelStrategy(hosts=pool[:2], split=["nope"]), 1).fit(Trained(CausalLM()), token_data())


def test_tied_weights_keep_their_units_and_are_named_shared():
    torch.manual_seed(0)
    model = CausalLM(layers=1)
    model.head.weight = model.embed.weight  # input and output embeddings tied, as GPT-2 does by default
    traced = trace_module(model, (torch.randint(0, 32, (2, 16)),), {}, "lm")
    names = [e.name for e in traced.entries]
    assert names[0] == "embed" and names[-1] == "head", names
    [tie] = traced.shared()
    assert tie[0].startswith("0.") and tie[-1].startswith(f"{len(names) - 1}."), tie
    embed, head = (traced.layers[int(n.partition(".")[0])] for n in (tie[0], tie[-1]))
    assert getattr(embed, tie[0].partition(".")[2]) is model.embed.weight  # the driver keeps one tensor
    assert getattr(head, tie[-1].partition(".")[2]) is model.embed.weight
    ids = torch.randint(0, 32, (3, 9))
    assert torch.allclose(traced.run_locally(ids), model(ids))


def test_calls_must_match_the_traced_call(traced_lm):
    model, traced = traced_lm
    call = traced.interface
    ids = torch.randint(0, 32, (5, 7))  # another batch size and length: fine
    assert torch.equal(traced.run_locally(*call.inputs((ids,), {})), model(ids))
    with pytest.raises(TraceError, match=r"this call passes 'ids' \(traced without it\), passes 0 positional"):
        call.inputs((), {"ids": torch.zeros(2, 16, dtype=torch.long)})
    with pytest.raises(TraceError, match="dimension 1 of input 0 must be at most 16"):  # the learned positions' length
        call.inputs((torch.zeros(2, 17, dtype=torch.long),), {})


class _WithLabels(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.lin(x)
        loss = None if labels is None else nn.functional.cross_entropy(logits, labels)
        return {"logits": logits} if loss is None else {"loss": loss, "logits": logits}


def test_a_call_without_the_traced_labels_names_them_and_the_fix():
    """Trained with labels=, validated without: the HuggingFace pattern. The error names the argument."""
    traced = trace_module(_WithLabels(), (torch.randn(4, 4),), {"labels": torch.tensor([0, 1, 2, 0])}, "model")
    with pytest.raises(TraceError) as info:
        traced.interface.inputs((torch.randn(4, 4),), {})
    assert "this call passes no 'labels' (traced with it)" in str(info.value)
    assert "pass labels= in validation_step too" in str(info.value)


BAD_PROGRAMS = {
    "custom operator": ["mylib", "evil", "default"],
    "file reader": ["aten", "from_file", "default"],
    "dunder": ["aten", "__class__", "default"],
    "python builtin": ["python", "eval"],
    # ATen operators that read or write past a tensor's memory, or change the process's state:
    "unchecked view": ["aten", "_reshape_alias", "default"],
    "storage swap": ["aten", "set_", "source_Tensor_storage_offset"],
    "unchecked sparse": ["aten", "_sparse_coo_tensor_unsafe", "default"],
    "global grad mode": ["aten", "set_grad_enabled", "default"],
    "backward": ["aten", "max_pool2d_with_indices_backward", "default"],
    "prims": ["prims", "view_of", "default"],
}


@pytest.mark.parametrize("target", BAD_PROGRAMS.values(), ids=BAD_PROGRAMS.keys())
def test_a_received_graph_with_a_disallowed_operator_is_refused_and_the_worker_survives(pool, target):
    program = {"inputs": ["x"], "steps": [["y", target, [{"ref": "x"}], {}]], "outputs": ["y"]}
    with pytest.raises(RefusedOperatorError):
        load_program(program, "here")  # the driver's own check
    client = Client(pool[3])
    try:
        client.request(protocol.HELLO, {"driver": "pytest"})
        body = {
            "key": "g",
            "stage": 0,
            "stages": 1,
            "start": 0,
            "exports": [],
            "sources": [[-1, []]],
            "targets": [[-1, []]],
            "peers": {},
            "state": {},
            "entries": [
                ["lightning_remote_mp.graph.GraphLayer", {"programs": {"train": program}, "tensors": {}}, [2, 2]]
            ],
        }
        reply = client.request(protocol.SETUP, body)
        assert reply.kind == protocol.ERROR and reply.body["type"] == "RefusedOperatorError", reply.body
        assert client.request(protocol.GET_STATE).body == {}  # it answers, and kept nothing
    finally:
        client.close()


@pytest.mark.parametrize(
    "step",
    [
        ["a", ["python", "pow"], [3, 10**8], {}],  # Python integers that never end
        ["a", ["python", "mul"], ["a", 10**10], {}],  # a string of 10 GB
        ["a", ["aten", "_to_copy", "default"], [{"ref": "x"}], {"device": "meta"}],  # a device of its own choosing
        ["a", ["aten", "empty", "memory_format"], [[4]], {"device": "cuda:3"}],
    ],
    ids=["bigint", "string", "meta device", "other gpu"],
)
def test_programs_cannot_hang_the_worker_or_pick_its_device(step):
    program = {"inputs": ["x"], "steps": [step], "outputs": ["a"]}
    with pytest.raises((SpecError, RefusedOperatorError)):
        GraphLayer({"train": load_program(program, "here") and program}, {})((torch.ones(2),))


def test_fresh_tensors_hold_zeros_not_freed_memory():
    secret = torch.full((1024,), 7.0)
    del secret
    layer = GraphLayer(
        {"train": {"inputs": [], "steps": [], "outputs": []}}, {"w": {"shape": [1024], "dtype": "float32"}}
    )
    empty = {"inputs": [], "steps": [["e", ["aten", "empty", "memory_format"], [[1024]], {}]], "outputs": ["e"]}
    assert not layer.w.any() and not GraphLayer({"train": empty}, {})(())[0].any()


def test_graph_layer_runs_what_it_was_given():
    program = {
        "inputs": ["x", "n"],
        "scalar_inputs": ["n"],
        "tensors": {"w": "weight"},
        "steps": [
            ["y", ["aten", "mul", "Tensor"], [{"ref": "x"}, {"ref": "w"}], {}],
            ["m", ["python", "mul"], [{"ref": "n"}, 2], {}],
            ["z", ["aten", "arange", "default"], [{"ref": "m"}], {"dtype": torch.float32, "device": {"device": True}}],
        ],
        "outputs": ["y", "m", "z"],
        "scalar_outputs": ["m"],
    }
    layer = GraphLayer({"train": program}, {"weight": {"shape": [3], "dtype": "float32", "parameter": True}})
    with torch.no_grad():
        layer.weight.fill_(2.0)
    y, m, z = layer((torch.ones(3), torch.tensor(2)))
    assert y.tolist() == [2.0, 2.0, 2.0] and y.requires_grad
    assert int(m) == 4 and z.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_programs_names_and_constants_never_enter_the_source_it_runs_as(tmp_path):
    """A program runs as generated Python (`program_code.compiled`): its value names, weight names, keyword
    names and constants come from the wire, and none of them may reach the compiler."""
    planted = tmp_path / "planted"
    code = f"__import__('os').system('touch {planted}')"
    x, w, y = f"x'); {code} #", f"w\n{code}", f'y"""; {code}; """'
    program = {
        "inputs": [x],
        "tensors": {w: "weight"},
        "steps": [
            [y, ["aten", "mul", "Tensor"], [{"ref": x}, {"ref": w}], {}],
            ["z", ["aten", "div", "Tensor_mode"], [{"ref": y}, 2.0], {"rounding_mode": "floor"}],
        ],
        "outputs": ["z", y],
    }
    layer = GraphLayer({"train": program}, {"weight": {"shape": [2], "dtype": "float32"}})
    layer.weight.fill_(3.0)
    z, y_out = layer((torch.tensor([1.0, 2.0]),))
    assert z.tolist() == [1.0, 3.0] and y_out.tolist() == [3.0, 6.0] and not planted.exists()
    source = layer.programs["train"].fn.source
    assert not any(text in source for text in ("import", "'", '"', "floor", "weight", "#")), source


def test_replicas_gradient_clipping_and_accumulation(twin, pool):
    """Two data-parallel replicas of a two-stage traced pipeline (their gradients all-reduced by
    torch.distributed), micro-batches, clipping over every stage's gradients, accumulation."""
    remote_equals_local(
        lambda: Trained(CausalLM(layers=1)),
        token_data,
        twin,
        RemoteModelParallelStrategy(hosts=[pool[:2], pool[2:]], microbatches=2, split=["model"]),
        gradient_clip_val=0.5,
        accumulate_grad_batches=2,
    )


def test_steps_of_a_no_grad_block_run_without_grad():
    step = ["y", ["aten", "mul", "Tensor"], [{"ref": "x"}, {"ref": "x"}], {}]
    program = {"inputs": ["x"], "steps": [step, ["z", *step[1:], {"grad": False}]], "outputs": ["y", "z"]}
    y, z = GraphLayer({"train": program}, {})((torch.ones(2, requires_grad=True),))
    assert y.requires_grad and not z.requires_grad
    with pytest.raises(SpecError, match="malformed step context"):
        load_program({**program, "steps": [[*step, {"run": "os.system"}]]}, "here")


class _TwoParts(Trained):
    """Two split modules under one optimizer: the second is placed (at its first call) after the
    optimizer was mirrored for the first."""

    def __init__(self) -> None:
        super().__init__(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)))
        self.head = torch.nn.Sequential(
            torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.model(x))


def _vectors(n: int = 32, batch: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() * 2), batch_size=batch)


def test_two_split_modules_under_one_optimizer_both_train(twin, pool):
    remote_equals_local(_TwoParts, _vectors, twin, RemoteModelParallelStrategy(hosts=pool[:2], split=["model", "head"]))


def test_a_batch_split_along_a_dim_that_is_not_the_batch_is_refused():
    torch.manual_seed(0)
    seq_first = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 1)
    x = torch.randn(6, 4, 8)  # (time, batch, features): nn.Transformer's default layout
    traced = trace_module(seq_first, (x,), {}, "encoder")
    with pytest.raises(TraceError, match="dim 0 is not the batch"):
        traced.check_batch_split(traced.interface.inputs((x,), {}))
    batch_first = CausalLM(layers=1)
    ids = torch.randint(0, 32, (4, 16))
    fine = trace_module(batch_first, (ids,), {}, "lm")
    fine.check_batch_split(fine.interface.inputs((ids,), {}))


def test_a_weight_shared_with_code_outside_the_split_module_is_refused():
    model = Trained(CausalLM(layers=1))
    model.pre = torch.nn.Linear(32, 32)
    model.pre.weight = model.model.head.weight
    with pytest.raises(TraceError, match="pre.weight is a weight of split module 'model' that is also used outside"):
        find_modules(model, ["model"])


class FixedTable(nn.Module):
    """Takes a table whose rows the code fixes (4), and which has the batch's rows at the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + table.reshape(2, 12).sum()


def test_an_argument_with_the_batchs_rows_that_the_code_fixes_is_refused_when_a_batch_is_split():
    traced = trace_module(FixedTable(), (torch.randn(4, 6), torch.randn(4, 6)), {}, "m")
    assert traced.interface.batched_in == [True, False] and traced.interface.unclassified == ["table"]
    with pytest.raises(TraceError, match=r"argument\(s\) 'table' have as many rows in dim 0 as the batch"):
        traced.check_batch_split((torch.randn(4, 6), torch.randn(4, 6)))


def test_every_input_with_the_batchs_rows_is_micro_batched_by_what_the_code_does():
    """A padded batch: the mask and the labels have the batch's rows, and the code treats them as the
    batch, so each micro-batch gets its own rows of them (a mask used to reach every micro-batch whole)."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(32, 8)
            self.head = nn.Linear(8, 32)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids) * mask.unsqueeze(-1)
            return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten(), ignore_index=-100)

    ids, mask = torch.randint(0, 32, (4, 5)), torch.tensor([[1] * 5, [1] * 3 + [0] * 2, [1] * 5, [1, 0, 0, 0, 0]])
    labels = ids.masked_fill(mask == 0, -100)
    model = Masked()
    traced = trace_module(model, (ids, mask, labels), {}, "masked")
    assert traced.interface.batched_in == [True, True, True]
    [loss] = [leaf for leaf in traced.interface.out_leaves if leaf[0] == "ratio"]  # a sum over a count
    sums = [traced.run_locally(ids[a:b], mask[a:b], labels[a:b]) for a, b in ((0, 1), (1, 4))]
    total, count = (sum(s[i] for s in sums) for i in (loss[1], loss[2]))
    torch.testing.assert_close(total / count, model(ids, mask, labels))
