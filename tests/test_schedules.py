"""Schedules as data (`lightning_remote_mp.schedule`): the lists each stage runs, checked and
drawn; and on real workers, every schedule trains as local training does, while 1F1B and
zero-bubble hold at most ``stages - index`` micro-batches per stage."""

from __future__ import annotations

import copy
import json
import os
import signal
import threading
import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_remote_mp import RemoteModelParallelStrategy, schedule
from lightning_remote_mp.errors import ConfigurationError, LrmpError, WorkerLostError
from lightning_remote_mp.schedule import Action, ScheduleError

TOL = 2e-5


# --- the lists ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("stages,microbatches", [(1, 1), (1, 3), (2, 1), (2, 4), (3, 2), (4, 8), (4, 16), (5, 3)])
def test_every_schedule_is_valid_and_runs_each_action_once(name, stages, microbatches):
    lists = schedule.build(name, stages, microbatches)
    schedule.validate(lists)
    for s, row in enumerate(lists):
        assert sorted((a.kind, a.mb) for a in row if a.mb is not None) == sorted(
            (k, mb) for k in "FBW" for mb in range(microbatches)
        ), f"stage {s}"
        once = [str(a) for a in row if a.mb is None]
        assert once == ([] if name == "gpipe" else [f"{s}S"]), once  # an early call ends with the loss's scale
        assert name == "gpipe" or row[-1] == Action(s, schedule.SCALE)


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 16), (3, 2)])
def test_1f1b_and_zero_bubble_hold_at_most_stages_minus_index_microbatches(stages, microbatches):
    for name in ("1f1b", "zero_bubble"):
        peaks = [schedule.peak_in_flight(row) for row in schedule.build(name, stages, microbatches)]
        assert peaks == [min(microbatches, stages - s) for s in range(stages)], name
    assert [schedule.peak_in_flight(row) for row in schedule.build("gpipe", stages, microbatches)] == [
        microbatches
    ] * stages


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (3, 6), (4, 8), (4, 16)])
def test_zero_bubble_leaves_a_smaller_bubble_than_1f1b(stages, microbatches):
    for costs in ({"F": 1, "B": 1, "W": 1}, {"F": 2, "B": 1, "W": 1}, {"F": 1, "B": 1, "W": 0.5}):
        one = schedule.simulate(schedule.build("1f1b", stages, microbatches), costs)
        zero = schedule.simulate(schedule.build("zero_bubble", stages, microbatches), costs)
        assert zero.bubble < one.bubble and zero.makespan < one.makespan, costs


def test_actions_print_and_parse_as_torch_pipelining_writes_them():
    assert str(Action(2, "F", 0)) == "2F0" and schedule.parse("12W103") == Action(12, "W", 103)
    with pytest.raises(ScheduleError, match="'2X0' is no action"):
        schedule.parse("2X0")


def test_every_kind_a_stage_runs_is_one_letter_of_the_schedule_that_prints_and_parses():
    """F, B, W, the loss's scale and a decoding step: one vocabulary. zero_grad and the optimizer's
    step are the driver's requests, no action of a call's list (a step may follow several calls)."""
    assert list(schedule.KINDS) == ["F", "B", "W", "S", "D"]
    for kind in schedule.KINDS:
        action = Action(3, kind, 1 if kind in schedule.PER_MICROBATCH else None)
        assert schedule.parse(str(action)) == action
    assert str(Action(0, "S")) == "0S" and str(Action(1, "D", 4)) == "1D4"
    # A micro-batch where the kind runs once a call, none where it needs one, and no action at all.
    for text in ("2S0", "2F", "2Z", "2O", "2D"):
        with pytest.raises(ScheduleError, match=f"'{text}' is no action"):
            schedule.parse(text)


def _lists(*rows: str) -> list[list[Action]]:
    return [[schedule.parse(a) for a in row.split()] for row in rows]


@pytest.mark.parametrize(
    "rows, match",
    [
        (("0F0 0B0 0W0 0B0", "1F0 1B0 1W0"), "0B0 comes twice on stage 0's list"),
        (("0F0 0B0", "1F0 1B0 1W0"), "stage 0 never runs 0W0"),
        (("0F0 0W0 0B0", "1F0 1B0 1W0"), "stage 0 runs micro-batch 0 out of F, B, W order"),
        (("0F0 0B0 0W0", "0F0 1B0 1W0"), "0F0 is on stage 1's list"),
        # Stage 0 waits for 1B0 before its 0F1, which stage 1 needs before its 1B0: neither ever runs.
        (
            ("0F0 0B0 0W0 0F1 0B1 0W1", "1F0 1F1 1B0 1W0 1B1 1W1"),
            "waits forever: 0B0 waits for 0F0 and 1B0, 1F1 waits for 0F1",
        ),
        # The loss's scale, once a call.
        (("0F0 0B0 0S 0W0", "1F0 1B0 1W0 1S"), "stage 0 runs 0S before 0W0: the loss's scale multiplies every"),
        (("0F0 0S", "1F0 1S"), "stage 0 never runs 0B0"),
        (("0D0 0F0", "1D0"), "stage 0 runs 0F0 in a decoding step's list, which runs D's alone"),
        (("0D0 0D1", "1D1"), "stage 1 never runs 1D0"),
        (("0D0", "1D0 1S"), "stage 1 runs 1S in a decoding step's list, which runs D's alone"),
    ],
)
def test_the_validator_names_what_is_wrong_and_draws_the_grid(rows, match):
    with pytest.raises(ScheduleError, match=match) as err:
        schedule.validate(_lists(*rows))
    assert "step  stage 0  stage 1" in str(err.value)


@pytest.mark.parametrize("name", schedule.SCHEDULES)
def test_the_grid_the_driver_logs_is_the_call_as_its_stages_run_it(name):
    """Under GPipe the backward starts at the driver; under the others at the loss on the last
    stage, and each stage's list ends with the loss's scale."""
    text = schedule.checked(name, 2, 4)
    assert ("1S" in text and "0S" in text) == (name != "gpipe"), text
    assert "1B3" in text and "0W3" in text


def test_a_backward_that_starts_at_the_driver_cannot_run_1f1b_and_the_validator_says_why():
    """Under 1F1B the last stage runs B0 before F1: a backward that waits for the driver's gradient
    (which comes once every forward has returned) never could; GPipe's can, and 1F1B's that starts
    at the loss on the last stage."""
    with pytest.raises(ScheduleError, match="waits forever: .*1B0 waits for 1F0 and 1F1"):
        schedule.validate(schedule.build("1f1b", 2, 2, scale=False))
    schedule.validate(schedule.build("gpipe", 2, 2, scale=False))
    schedule.validate(schedule.build("1f1b", 2, 2, scale=True))


def test_a_decoding_step_runs_each_micro_batch_through_the_stages_in_turn():
    lists = [schedule.decoding(3, s, 2) for s in range(3)]
    schedule.validate(lists)
    assert [" ".join(map(str, row)) for row in lists] == ["0D0 0D1", "1D0 1D1", "2D0 2D1"]
    assert schedule.format_grid(lists).splitlines()[1:] == [
        "   0      0D0",
        "   1      0D1      1D0",
        "   2               1D1      2D0",
        "   3                        2D1",
    ]


def test_a_schedule_that_is_not_one_is_refused_naming_the_choices():
    with pytest.raises(ConfigurationError, match="schedule must be one of 'gpipe', '1f1b', 'zero_bubble', got '1F1B'"):
        RemoteModelParallelStrategy(schedule="1F1B")
    with pytest.raises(ConfigurationError, match="stage < stages"):
        schedule.actions("1f1b", 2, 2, 4)


# --- on workers -------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")

import lrmp_hf as H  # noqa: E402
from test_last_stage_loss import remote_equals_local  # noqa: E402
from test_strategy import assert_same_losses, assert_same_weights, trainer  # noqa: E402


def scheduled(hosts, name: str, microbatches: int = 4, **kwargs) -> RemoteModelParallelStrategy:
    return RemoteModelParallelStrategy(hosts=hosts, split=["model"], microbatches=microbatches, schedule=name, **kwargs)


@pytest.mark.parametrize("name", schedule.SCHEDULES)
def test_every_schedule_trains_a_traced_lm_with_labels_as_locally(name, pool):
    """Llama with tied embeddings (a weight on both stages), padded batches, ``labels=``."""
    local, remote, _ = remote_equals_local(lambda: H.FineTune(H.llama(), "lm"), scheduled(pool[:2], name))
    assert_same_losses(local.val_losses, remote.val_losses, TOL)


def test_a_tied_lm_over_three_stages_trains_under_zero_bubble_as_locally(pool):
    """The step sums the tied embedding's gradient over stages 0 and 2, so the loss's gradient goes
    at once up the pipeline: stage 2 applies its own and passes the rest on, stage 1 passes stage 0's
    on only once it applied its own (its W's come late under zero-bubble), and stage 0 answers."""
    remote_equals_local(lambda: H.FineTune(H.llama(num_hidden_layers=3), "lm"), scheduled(pool[:3], "zero_bubble"))


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble"])
def test_three_stages_with_values_that_skip_a_stage_and_lora_train_as_locally(name, pool):
    """Llama's rotary tables are made on stage 0 and read by every layer: they cross stage 1 to
    reach stage 2. Only LoRA's adapters train."""
    remote_equals_local(
        lambda: H.FineTune(H.lora_llama(num_hidden_layers=3), "lm"), scheduled(pool[:3], name, microbatches=3)
    )


class Accumulated(H.FineTune):
    """Each step's gradients over two batches, clipped, with AdamW: every scale on the loss."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _fit_accumulated(model, strategy=None):
    trainer(strategy, 2, accumulate_grad_batches=2, gradient_clip_val=0.5).fit(model, H.padded_data(n=32))
    return model


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble"])
def test_accumulated_clipped_steps_and_replicas_train_as_locally(name, pool):
    """Lightning divides the loss by 2 and clips after the second backward: the gradient of the loss
    reaches the stages as a scale of what they computed early, and ``.grad`` holds both batches'
    sums before the clip reads it. Two replicas of two stages each."""
    torch.manual_seed(0)
    local = Accumulated(H.llama(), "lm")
    remote = copy.deepcopy(local)
    _fit_accumulated(local)
    _fit_accumulated(remote, scheduled([pool[:2], pool[2:4]], name))
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_weights(local, remote, 1e-4)


class Residual(torch.nn.Module):
    """An MLP whose input is added back two blocks later (so it crosses a stage) and whose forward
    returns its loss, as a model with ``labels=`` does."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        skip = x
        for i, block in enumerate(self.blocks):
            x = torch.relu(block(x))
            if i == 2:
                x = x + skip
        return F.mse_loss(self.head(x).squeeze(-1), y)


class Regression(L.LightningModule):
    """``model`` is split; ``pre`` stays on the driver and learns from the input gradient stage 0 sends back."""

    def __init__(self, skip_step: int | None = None) -> None:
        super().__init__()
        self.pre = torch.nn.Linear(16, 16)
        self.model = Residual()
        self.losses: list[float] = []
        self.skip_step = skip_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.model(self.pre(x), y)
        self.losses.append(loss.item())
        # A step that returns no loss: Lightning runs no backward (the early gradients are dropped).
        return None if batch_idx == self.skip_step else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _regression_data():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 16, generator=g), torch.randn(40, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=10)


@pytest.mark.parametrize("name", ["1f1b", "zero_bubble"])
def test_a_residual_model_whose_loss_is_inside_trains_as_locally_and_a_skipped_step_leaves_nothing(name, pool):
    torch.manual_seed(0)
    local = Regression(skip_step=1)
    remote = copy.deepcopy(local)
    trainer(None, 2).fit(local, _regression_data())
    trainer(scheduled(pool[:3], name, microbatches=5), 2).fit(remote, _regression_data())
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_weights(local, remote, 1e-5)


class _Heaviside(torch.nn.Module):
    """An MLP whose forward returns its loss, with a term in layer ``where`` whose backward does not
    exist: ``heaviside`` (an operator workers run) has no derivative."""

    def __init__(self, where: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.where = where

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if i == self.where:
                x = x + 0 * torch.heaviside(x, torch.ones_like(x))
        return F.mse_loss(x.sum(-1), y)


class _Steps(L.LightningModule):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(*batch)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.1)


@pytest.mark.parametrize(
    "where, replicas", [(0, 1), (3, 1), (0, 2), (3, 2)], ids=["stage 0", "last stage", "stage 0 x2", "last stage x2"]
)
def test_a_backward_that_fails_on_a_stage_under_1f1b_is_raised_and_no_stage_steps(where, replicas, pool):
    """The stages run the backward from the loss on their own and the driver does not wait for it:
    its failure on one stage is raised by the driver's next message, naming the call, and no stage
    steps on the gradients (the other stage's step waits behind the failed one's loss gradient, or
    never leaves it), so the weights brought back are the first ones, as locally. With replicas,
    whose step sums over workers, the loss's gradient goes at once up the pipeline instead, and the
    driver waits for stage 0's answer before the step: none is sent."""
    torch.manual_seed(0)
    local = _Steps(_Heaviside(where))
    remote = copy.deepcopy(local)
    with pytest.raises(RuntimeError, match="heaviside"):
        trainer(None, 1).fit(local, _regression_data())
    hosts = pool[:2] if replicas == 1 else [pool[:2], pool[2:4]]
    strategy = scheduled(hosts, "1f1b", microbatches=1)  # the loss comes back before the backward fails
    with pytest.raises(LrmpError) as info:
        trainer(strategy, 1).fit(remote, _regression_data())
    text = str(info.value)
    # Raised by the first message that meets it: the results of call 1, if they are still coming, or later.
    assert "heaviside" in text and f"stage {min(where, 1)}" in text, text
    assert_same_weights(local, remote, 0.0)
    assert strategy.session is None


class AlsoReadsTheLogits(H.FineTune):
    def _loss(self, batch):
        out = self.model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        return out.loss + 0.1 * out.logits.float().pow(2).mean()


def test_a_step_that_differentiates_another_output_under_1f1b_is_refused_with_the_way_out(pool):
    with pytest.raises(LrmpError, match=r"also depends on .*schedule='gpipe'"):
        trainer(scheduled(pool[:2], "1f1b"), 1).fit(AlsoReadsTheLogits(H.llama(), "lm"), H.padded_data())


class _WithCount(torch.nn.Module):
    """`Residual`'s loss, and a float count of the targets above zero: an output without a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.net = Residual()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.net(x, y), (y > 0).sum().float()


class _ReadsTheCount(_Steps):
    def training_step(self, batch, batch_idx):
        loss, count = self.model(*batch)
        return loss + 0.01 * count


def test_a_step_that_also_reads_an_output_without_a_graph_trains_under_1f1b_as_locally(pool):
    """The count passes no gradient on, locally as remotely: no refusal (the last stage's results
    say which outputs have a graph), and the same weights."""
    torch.manual_seed(0)
    local = _ReadsTheCount(_WithCount())
    remote = copy.deepcopy(local)
    trainer(None, 2).fit(local, _regression_data())
    trainer(scheduled(pool[:2], "1f1b", microbatches=2), 2).fit(remote, _regression_data())
    assert_same_weights(local, remote, 1e-5)


class SpecNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from lightning_remote_mp import SpecSequential

        spec = [("torch.nn.Linear", {"in_features": 8, "out_features": 8}, (8, 8))] * 2
        self.net = SpecSequential(spec)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).sum(-1), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def test_a_layer_spec_whose_loss_is_outside_is_refused_under_1f1b_at_its_first_step(pool):
    """1F1B starts each micro-batch's backward at the model's loss; a loss computed in training_step
    comes only after the whole forward, so the schedule's memory bound could not hold: the first
    training step says so (never a silent GPipe), and the same model trains under GPipe."""
    g = torch.Generator().manual_seed(4)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, generator=g)), batch_size=8
    )
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2, schedule="1f1b")
    with pytest.raises(ConfigurationError) as refused:
        trainer(strategy, 2).fit(SpecNet(), data)
    message = str(refused.value)
    assert "schedule='1f1b' starts each micro-batch's backward on the last stage" in message, message
    assert "this model returns no loss" in message and "Use schedule='gpipe'" in message


@pytest.mark.parametrize("name", schedule.SCHEDULES)
def test_the_timeline_shows_each_stage_running_its_list(name, pool, tmp_path):
    """The workers' own spans: each stage's forwards and backwards in the schedule's order, so a
    stage never holds more micro-batches than the schedule allows."""
    path = tmp_path / "trace.json"
    strategy = scheduled(pool[:3], name, microbatches=6, timeline=str(path), split_backward=True)
    trainer(strategy, 1).fit(H.FineTune(H.llama(num_hidden_layers=3), "lm"), H.padded_data(n=12, batch=12))
    events = json.loads(path.read_text())["traceEvents"]
    rows = {
        e["pid"]: int(e["args"]["name"].split(" stage ")[1].split()[0])
        for e in events
        if e["ph"] == "M" and e["name"] == "process_name" and " stage " in e["args"]["name"]
    }
    for pid, stage in rows.items():
        spans = sorted((e["ts"], e["name"]) for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == 1)
        order = [n for _, n in spans if n[0] in "FB" and n[1:].isdigit()]
        planned = [f"{a.kind}{a.mb}" for a in schedule.actions(name, 3, stage, 6) if a.kind in "FB"]
        if name == "gpipe":  # the driver's backward comes after every forward
            assert order[:6] == planned[:6], stage
        else:
            assert order == planned, f"stage {stage} ran {order}"
        held = peak = 0
        for n in order:
            held += 1 if n[0] == "F" else -1
            peak = max(peak, held)
        assert peak == (6 if name == "gpipe" else 3 - stage), f"stage {stage}"


class _KillMidStep(L.Callback):
    """Kills the worker ``pid`` shortly after the second step starts: while its forward runs, with
    the early backwards of 1F1B in flight."""

    def __init__(self, pid: int) -> None:
        self.pid, self.at = pid, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1 and self.at is None:
            self.at = time.monotonic()
            threading.Timer(0.05, os.kill, (self.pid, signal.SIGKILL)).start()


def test_a_worker_killed_during_a_1f1b_step_is_named_within_the_heartbeat_timeout(pool, start_workers):
    victim = start_workers(1)
    address, pid = victim.addresses[0], victim.procs[0].pid
    kill = _KillMidStep(pid)
    strategy = scheduled([pool[0], address], "1f1b", heartbeat_timeout=2.0)
    with pytest.raises(LrmpError) as info:
        trainer(strategy, 3, callbacks=[kill]).fit(H.FineTune(H.llama(), "lm"), H.padded_data())
    assert kill.at is not None, "the worker was never killed"
    # The driver's heartbeats name it (WorkerLostError), or stage 0, failing to send it a micro-batch, does.
    assert address in str(info.value) and "stage 1" in str(info.value), str(info.value)
    if isinstance(info.value, WorkerLostError):
        assert info.value.address == address and info.value.stage == 1
    assert time.monotonic() - kill.at < 2.0 + 10, "named too late"


class _Messages(L.Callback):
    """ZeroMQ messages the driver sent and received in each training step after the first."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []

    def _totals(self, trainer) -> tuple[int, int, int]:
        conns = trainer.strategy.session.conns
        return (
            sum(c.sent_messages for c in conns),
            sum(c.received_messages for c in conns),
            sum(c.sent_requests for c in conns),
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.start = self._totals(trainer) if trainer.strategy.session is not None else None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.start is not None and batch_idx + trainer.current_epoch > 0:  # the first step places the model
            self.steps.append(tuple(now - then for now, then in zip(self._totals(trainer), self.start)))


def test_a_step_costs_the_driver_one_message_each_way_under_1f1b_and_two_under_gpipe(pool):
    """Micro-batches travel bundled, and the optimizer's step and zero_grad travel with them
    (`Carry`). Under GPipe the driver sends one forward and one backward per step, and receives the
    results and the DONEs. Under 1F1B the stages run the backward from the model's loss on their
    own, and the loss's gradient goes with the next forward (`LossGrad`): the driver sends the
    forward and receives the losses, nothing else. Not where the step sums a tied embedding's
    gradient over the stages: there the loss's gradient goes at once, up from the last stage, and
    the driver waits for stage 0's answer before the step, as under GPipe; in no more requests than
    deferred. Before carried requests a step cost 8 messages out (2 zero_grads, 2 sums, 2 steps besides)."""
    counts = {}
    for name, tied, m in [("gpipe", True, 4), ("1f1b", True, 4), ("1f1b", False, 4)]:
        messages = _Messages()
        trainer(scheduled(pool[:2], name, microbatches=m), 1, callbacks=[messages]).fit(
            H.FineTune(H.llama(tie_word_embeddings=tied), "lm"), H.padded_data(n=24)
        )
        counts[(name, tied, m)] = set(messages.steps)  # 2 steps each
    deferred = {("1f1b", False, 4)}
    assert all({(s, r) for s, r, _ in c} == {(1, 1) if k in deferred else (2, 2)} for k, c in counts.items()), counts
    # Requests in those messages. GPipe: each micro-batch's forward and backward, and the two quiet
    # requests that go straight (stage 0's step, stage 1's zero_grad); the other two travel along the
    # pipeline, and the call's answer shows they ran there, so they are not sent straight as well (they
    # were: 2m + 4). 1F1B: each micro-batch's forward, and stage 0's zero_grad and step; and stage 0's
    # loss gradient, deferred, or the last stage's, in the message that sends them up the pipeline.
    assert all(
        {q for _, _, q in c} == {m + 3 if k[0] == "1f1b" else 2 * m + 2} for k, c in counts.items() for m in [k[2]]
    ), counts
