"""A loss from ``torch.nn.functional`` over a split model's output, written in the ``training_step``
as people write it, is computed on the last stage: the logits never reach the driver, and training
equals local training step for step (`lightning_remote_mp.driver.losses`)."""

from __future__ import annotations

import copy
import logging

import lightning as L
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

import lrmp_hf as H  # noqa: E402
from test_strategy import assert_same_losses, assert_same_weights, trainer  # noqa: E402

from lightning_remote_mp import RemoteModelParallelStrategy, SpecSequential  # noqa: E402

TOL = 2e-5
#: A vocabulary whose logits (8 x 12 x 512 floats, 196 KB a step) are large enough to stay on the last
#: stage (`lightning_remote_mp.model.spec.KEEP_BYTES`); the data's tokens use the first 64.
VOCAB = 512


class ShiftedLoss(H.FineTune):
    """A causal LM's loss outside the model, as nanoGPT-style and HF-without-``labels`` code computes
    it: logits shifted by one, flattened, ``F.cross_entropy`` with ``-100`` at the padding.

    ``how``: ``"functional"`` (``F.cross_entropy``), ``"module"`` (``nn.CrossEntropyLoss`` with fixed
    class weights), or ``"sum"`` (a sum-reduced loss over the valid-token count, as some code
    normalises)."""

    def __init__(self, model: torch.nn.Module, how: str = "functional", accuracy: bool = False) -> None:
        super().__init__(model, "lm")
        self.how, self.accuracy = how, accuracy
        weights = torch.linspace(0.5, 1.5, VOCAB)
        self.criterion = torch.nn.CrossEntropyLoss(weight=weights, ignore_index=-100)
        self.accuracies: list[float] = []

    def _loss(self, batch):
        logits = self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        vocab = logits.size(-1)
        shifted = logits[:, :-1, :].contiguous().view(-1, vocab)
        targets = batch["labels"][:, 1:].reshape(-1)
        if self.how == "module":
            loss = self.criterion(shifted, targets)
        elif self.how == "sum":
            loss = F.cross_entropy(shifted, targets, reduction="sum") / (targets != -100).sum()
        else:
            loss = F.cross_entropy(shifted, targets, ignore_index=-100)
        if self.accuracy:  # reads the logits themselves: fetched, right values
            valid = targets != -100
            self.accuracies.append(((shifted.argmax(-1) == targets) & valid).sum().item() / valid.sum().item())
        return loss


class _Traffic(L.Callback):
    """What the split module's outputs sent to the driver, and how its losses were computed."""

    def __init__(self, key: str = "model") -> None:
        self.key = key

    def on_train_batch_end(self, trainer, *args) -> None:
        self._count(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._count(trainer)

    def _count(self, trainer) -> None:
        # The module's first placement and its views (the other modes and ways it is called in).
        placed = trainer.strategy.session.placements[self.key]
        remotes = [placed.remote, *placed.views]
        self.results, self.fetched = sum(r.result_bytes for r in remotes), sum(r.fetched_bytes for r in remotes)
        self.computed = sum(r.losses.computed for r in remotes)
        self.declined = [why for r in remotes for why in r.losses.declined]
        self.programs = sum(len(r.losses._programs) for r in remotes)
        self.records = {k: v for r in remotes for k, v in r.losses._records.items()}


def _fit(model, strategy=None, callbacks=(), epochs: int = 2):
    trainer(strategy, epochs, num_sanity_val_steps=2, callbacks=list(callbacks)).fit(
        model, H.padded_data(), H.padded_data(seed=1)
    )
    return model


def remote_equals_local(make, strategy, epochs: int = 2, key: str = "model"):
    """``make()`` fitted locally and, from a copy of the same weights, with ``strategy``: equal step
    by step. Returns both, and what the remote run moved and computed where."""
    torch.manual_seed(0)
    local = make()
    remote = copy.deepcopy(local)
    _fit(local, epochs=epochs)
    traffic = _Traffic(key)
    _fit(remote, strategy, [traffic], epochs=epochs)
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_weights(local, remote, 1e-4)
    return local, remote, traffic


def on_two(pool, microbatches: int = 2) -> RemoteModelParallelStrategy:
    """The traced module ``model`` split over the first two workers of ``pool``."""
    return RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=microbatches)


@pytest.mark.parametrize("how,microbatches", [("functional", 4), ("module", 1), ("sum", 2)])
def test_a_loss_over_the_logits_is_computed_on_the_last_stage_and_trains_as_locally(how, microbatches, pool):
    local, remote, traffic = remote_equals_local(
        lambda: ShiftedLoss(H.llama(vocab_size=VOCAB), how), on_two(pool, microbatches)
    )
    assert_same_losses(local.val_losses, remote.val_losses, TOL)
    assert traffic.declined == [] and traffic.computed > 0
    assert traffic.fetched == 0  # the logits never reached the driver
    assert traffic.results < 8 * H.SEQ * VOCAB * 4 / 100, traffic.results


def test_reading_the_logits_after_the_loss_fetches_them_and_training_stays_exact(pool):
    local, remote, traffic = remote_equals_local(
        lambda: ShiftedLoss(H.gpt2(vocab_size=VOCAB), accuracy=True), on_two(pool), epochs=1
    )
    assert_same_losses(local.accuracies, remote.accuracies, 1e-6)
    assert traffic.computed > 0 and traffic.fetched > 0


class LearnedTargets(ShiftedLoss):
    """A loss whose target the step learns (a prototype per token): an argument that needs a
    gradient, which the last stage cannot give, so the loss is computed on the driver (still right)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.prototypes = torch.nn.Parameter(torch.randn(H.VOCAB, VOCAB) / 10)

    def _loss(self, batch):
        logits = self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return F.mse_loss(logits, self.prototypes[batch["input_ids"]])


def test_a_loss_that_cannot_be_computed_on_the_last_stage_is_computed_on_the_driver_and_says_why(pool, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_remote_mp"):
        _, _, traffic = remote_equals_local(lambda: LearnedTargets(H.llama(vocab_size=VOCAB)), on_two(pool), epochs=1)
    # Training steps fetch the logits; validation, where the prototypes need no gradient, need not.
    assert traffic.fetched > 0 and traffic.computed > 0
    assert traffic.declined and all("needs a gradient" in why for why in traffic.declined)
    assert any("computed on the driver" in r.getMessage() for r in caplog.records), caplog.text


def test_replicas_and_accumulated_clipped_steps_with_the_loss_on_the_last_stage(pool):
    """Two replicas of two stages, two batches a step, gradients clipped: the loss's parts come from
    both replicas' last stages and their gradients go back to each."""
    torch.manual_seed(0)
    local = ShiftedLoss(H.llama(vocab_size=VOCAB))
    remote = copy.deepcopy(local)
    options = dict(accumulate_grad_batches=2, gradient_clip_val=0.5)
    trainer(None, 2, **options).fit(local, H.padded_data(n=32))
    traffic = _Traffic()
    strategy = RemoteModelParallelStrategy(hosts=[pool[:2], pool[2:4]], split=["model"], microbatches=2)
    trainer(strategy, 2, callbacks=[traffic], **options).fit(remote, H.padded_data(n=32))
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_weights(local, remote, 1e-4)
    assert traffic.computed == len(remote.losses) and traffic.fetched == 0


class Wide(torch.nn.Module):
    """A small net whose output (8 rows x 2048 a batch, 64 KB) stays on the last stage."""

    def __init__(self, probabilities: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh())
        self.head = torch.nn.Sequential(torch.nn.Linear(32, 2048), *([torch.nn.Sigmoid()] if probabilities else []))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


#: Each loss of `lightning_remote_mp.driver.outputs.LOSSES`, with targets of the kind it takes.
TARGETS = {
    "cross_entropy": lambda g: torch.randint(0, 2048, (32,), generator=g),
    "nll_loss": lambda g: torch.randint(0, 2048, (32,), generator=g),
    "mse_loss": lambda g: torch.randn(32, 2048, generator=g),
    "l1_loss": lambda g: torch.randn(32, 2048, generator=g),
    "smooth_l1_loss": lambda g: torch.randn(32, 2048, generator=g),
    "huber_loss": lambda g: torch.randn(32, 2048, generator=g),
    "binary_cross_entropy": lambda g: torch.rand(32, 2048, generator=g),
    "binary_cross_entropy_with_logits": lambda g: torch.rand(32, 2048, generator=g),
    "soft_margin_loss": lambda g: torch.randint(0, 2, (32, 2048), generator=g).float() * 2 - 1,
}


class EachLoss(L.LightningModule):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.model = Wide(probabilities=name == "binary_cross_entropy")
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, target = batch
        loss = getattr(F, self.name)(self.model(x), target)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def each_loss_remote_and_local(name: str, targets: torch.Tensor, microbatches: int, pool) -> _Traffic:
    """``EachLoss(name)`` trained for an epoch of 8-row batches locally and on two workers: equal
    step by step. Returns what the remote run moved and computed where."""
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(len(targets), 16, generator=g), targets)
    torch.manual_seed(0)
    local = EachLoss(name)
    remote = copy.deepcopy(local)
    trainer(None, 1).fit(local, torch.utils.data.DataLoader(data, batch_size=8))
    traffic = _Traffic()
    strategy = on_two(pool, microbatches)
    trainer(strategy, 1, callbacks=[traffic]).fit(remote, torch.utils.data.DataLoader(data, batch_size=8))
    assert_same_losses(local.losses, remote.losses, 1e-5)
    assert_same_weights(local, remote, 1e-5)
    return traffic


@pytest.mark.parametrize("name", list(TARGETS))
def test_every_functional_loss_is_computed_on_the_last_stage_as_locally(name, pool):
    traffic = each_loss_remote_and_local(name, TARGETS[name](torch.Generator().manual_seed(0)), 3, pool)
    assert traffic.declined == [] and traffic.computed == 4 and traffic.fetched == 0


def lm_spec(vocab: int = VOCAB, width: int = 32) -> list:
    """A small language model as a layer spec: embedding, a block, and a head over the vocabulary."""
    return [
        ("torch.nn.Embedding", {"num_embeddings": vocab, "embedding_dim": width}, (8, H.SEQ)),
        ("torch.nn.Linear", {"in_features": width, "out_features": width}, (8, H.SEQ, width)),
        ("torch.nn.GELU", {}, (8, H.SEQ, width)),
        ("torch.nn.LayerNorm", {"normalized_shape": width}, (8, H.SEQ, width)),
        ("torch.nn.Linear", {"in_features": width, "out_features": vocab}, (8, H.SEQ, width)),
    ]


class SpecLM(L.LightningModule):
    """A layer-spec LM whose step computes a shifted cross-entropy over its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = SpecSequential(lm_spec())
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def _loss(self, batch):
        logits = self.net(batch["input_ids"])
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(self._loss(batch).item())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def test_a_layer_spec_keeps_its_large_output_after_its_first_call_and_trains_as_locally(pool):
    """A spec's output size is known once it has run: the first call's logits come back with the
    result, every later call's stay on the last stage, and the loss is computed there."""
    local, remote, traffic = remote_equals_local(
        SpecLM, RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2), key="net"
    )
    assert_same_losses(local.val_losses, remote.val_losses, TOL)
    calls = len(remote.losses) + len(remote.val_losses)
    assert traffic.declined == [] and traffic.computed == calls - 1 and traffic.fetched == 0


def test_bf16_mixed_computes_the_loss_in_float32_on_the_last_stage_as_autocast_does(pool):
    torch.manual_seed(0)
    local = ShiftedLoss(H.llama(vocab_size=VOCAB))
    remote = copy.deepcopy(local)
    trainer(None, 1, precision="bf16-mixed").fit(local, H.padded_data())
    traffic = _Traffic()
    strategy = on_two(pool)
    trainer(strategy, 1, precision="bf16-mixed", callbacks=[traffic]).fit(remote, H.padded_data())
    assert_same_losses(local.losses, remote.losses, 1e-3)
    assert_same_weights(local, remote, 1e-3)
    assert traffic.declined == [] and traffic.computed == len(remote.losses)


class Tutorial(ShiftedLoss):
    """The loss as tutorials write it, sizes spelled out (``view(B * T, C)``), after an accuracy read
    under ``no_grad`` (as a torchmetrics update reads): the view works for any micro-batch, and the
    read keeps the logits linked to the workers for the loss that follows."""

    def _loss(self, batch):
        logits = self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        B, T, C = logits.shape
        targets = batch["labels"].view(B * T)
        if self.accuracy:
            with torch.no_grad():
                self.accuracies.append((logits.argmax(-1).view(B * T) == targets).float().mean().item())
        return F.cross_entropy(logits.view(B * T, C), targets)


@pytest.mark.parametrize("accuracy", [False, True])
def test_sizes_spelled_out_and_a_no_grad_read_first_train_as_locally(accuracy, pool):
    local, remote, traffic = remote_equals_local(
        lambda: Tutorial(H.llama(vocab_size=VOCAB), accuracy=accuracy), on_two(pool), epochs=1
    )
    if accuracy:
        assert_same_losses(local.accuracies, remote.accuracies, 1e-6)
    assert traffic.declined == []
    assert (traffic.fetched > 0) == accuracy and (traffic.computed > 0) != accuracy


class VaryingLengths(torch.utils.data.Dataset):
    """Batches padded to their own longest row, as ``DataCollatorWithPadding`` makes them."""

    def __init__(self) -> None:
        self.data = H.Padded(n=48)

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        length = 5 + i  # a new sequence length every batch
        rows = [self.data[8 * i + j] for j in range(8)]
        return {k: torch.stack([r[k][:length] for r in rows]) for k in ("input_ids", "attention_mask", "labels")}


def test_a_new_sequence_length_each_batch_reuses_one_loss_program(pool):
    torch.manual_seed(0)
    local = ShiftedLoss(H.llama(vocab_size=4096))
    remote = copy.deepcopy(local)
    data = lambda: torch.utils.data.DataLoader(VaryingLengths(), batch_size=None)  # noqa: E731
    trainer(None, 1).fit(local, data())
    traffic = _Traffic()
    strategy = on_two(pool)
    trainer(strategy, 1, callbacks=[traffic]).fit(remote, data())
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_weights(local, remote, 1e-4)
    assert traffic.declined == [] and traffic.computed == 6
    assert traffic.programs == 1


class ManualWithPerplexity(ShiftedLoss):
    """Manual optimization; after the step, a perplexity of the same logits (computed on the last
    stage, with no graph kept: its call's backward has run)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.automatic_optimization = False
        self.perplexities: list[float] = []

    def training_step(self, batch, batch_idx):
        logits = self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        flat, targets = logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1)
        loss = F.cross_entropy(flat, targets)
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.losses.append(loss.item())
        self.perplexities.append(F.cross_entropy(flat, targets).exp().item())


def test_a_loss_computed_after_the_backward_keeps_no_graph_and_trains_as_locally(pool):
    torch.manual_seed(0)
    local = ManualWithPerplexity(H.llama(vocab_size=VOCAB))
    remote = copy.deepcopy(local)
    trainer(None, 2).fit(local, H.padded_data())
    traffic = _Traffic()
    strategy = on_two(pool)
    trainer(strategy, 2, callbacks=[traffic]).fit(remote, H.padded_data())
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_losses(local.perplexities, remote.perplexities, 1e-3)
    assert_same_weights(local, remote, 1e-4)
    assert traffic.computed == 2 * len(remote.losses) and traffic.records == {}


class FlatSpecLM(SpecLM):
    """A spec whose last layer flattens batch and time: its output's dim 0 is not the input's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = SpecSequential([*lm_spec(), ("torch.nn.Flatten", {"start_dim": 0, "end_dim": 1}, (8, H.SEQ, VOCAB))])

    def _loss(self, batch):
        return F.cross_entropy(self.net(batch["input_ids"]), batch["labels"].reshape(-1))


def test_a_spec_whose_output_rows_are_not_the_batchs_rows_trains_as_locally(pool):
    _, _, traffic = remote_equals_local(
        FlatSpecLM, RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2), epochs=1, key="net"
    )
    assert traffic.declined == [] and traffic.computed > 0


def test_a_broadcasting_target_is_computed_on_the_driver(pool):
    """``(N, 2048)`` outputs against ``(N, 1)`` targets broadcast across the batch's rows in no way
    micro-batches can: computed on the driver, as locally."""
    traffic = each_loss_remote_and_local(
        "mse_loss", torch.randn(16, 1, generator=torch.Generator().manual_seed(0)), 2, pool
    )
    assert traffic.computed == 0 and traffic.declined and "broadcast" in traffic.declined[0]


class ClassesSecond(ShiftedLoss):
    """``F.cross_entropy(logits.permute(0, 2, 1), labels)``, the classes in dim 1; or, with
    ``temperature``, ``logits / T`` first, an operation that reads the logits."""

    def __init__(self, model: torch.nn.Module, temperature: float | None = None) -> None:
        super().__init__(model)
        self.temperature = temperature

    def _loss(self, batch):
        logits = self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        if self.temperature is not None:
            logits = logits / self.temperature
        return F.cross_entropy(logits.permute(0, 2, 1), batch["labels"])


@pytest.mark.parametrize("temperature", [None, 2.0])
def test_classes_in_dim_1_stay_on_the_last_stage_and_an_operation_that_reads_first_is_logged(temperature, pool, caplog):
    with caplog.at_level(logging.INFO, logger="lightning_remote_mp"):
        _, _, traffic = remote_equals_local(
            lambda: ClassesSecond(H.llama(vocab_size=VOCAB), temperature), on_two(pool), epochs=1
        )
    reads = [r.getMessage() for r in caplog.records if "reads a model output kept on the last stage" in r.getMessage()]
    if temperature is None:
        assert traffic.computed > 0 and traffic.fetched == 0 and traffic.declined == []
    else:
        assert traffic.computed == 0 and traffic.fetched > 0
        assert reads and reads[0].startswith("torch.Tensor.div"), caplog.text
