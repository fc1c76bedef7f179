"""The HuggingFace zoo: the models people fine-tune, unchanged, with transformers' default configs,
padded batches and the loss inside the model (``labels=``), traced with ``split=["model"]`` and
trained through real Trainers on real workers: remote training equals local training, step by step.

What each family needs is nothing beyond ``split=["model"]``; Mixtral takes the experts
implementation that torch.export traces to ATen operators (see `lrmp_hf.mixtral`).
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

pytest.importorskip("transformers")

import lrmp_hf as H  # noqa: E402
from test_strategy import assert_same_losses, assert_same_weights, trainer  # noqa: E402

from lightning_remote_mp import RemoteModelParallelStrategy, TraceError  # noqa: E402

TOL = 2e-5  # losses; weights within 1e-4 (the bar), checked at TOL too where they hold it


def fit(model: H.FineTune, strategy=None, epochs: int = 2, **kwargs) -> H.FineTune:
    data = H.image_data if model.task == "image" else H.padded_data
    kwargs.setdefault("num_sanity_val_steps", 2)  # validation before the first step, as Lightning does
    trainer(strategy, epochs, **kwargs).fit(model, data(), data(seed=1))
    return model


def remote_equals_local(make, strategy, weights_tol: float = 1e-4, **kwargs) -> tuple[H.FineTune, H.FineTune]:
    torch.manual_seed(0)
    local = make()
    remote = copy.deepcopy(local)
    fit(local, **kwargs)
    fit(remote, strategy, **kwargs)
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_losses(local.val_losses, remote.val_losses, TOL)
    assert_same_weights(local, remote, weights_tol)
    return local, remote


FAMILIES = {
    "gpt2": (H.gpt2, "lm"),
    "llama": (H.llama, "lm"),
    "qwen2": (H.qwen2, "lm"),
    "mixtral": (H.mixtral, "lm"),
    "bert": (H.bert, "classify"),
    "t5": (H.t5, "lm"),
    "vit": (H.vit, "image"),
    "lora_llama": (H.lora_llama, "lm"),
}


@pytest.mark.parametrize("microbatches", [1, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_fine_tunes_remotely_as_it_does_locally(family, microbatches, pool):
    build, task = FAMILIES[family]
    optimizer = "AdamW" if family in ("llama", "lora_llama") else "SGD"
    local, remote = remote_equals_local(
        lambda: H.FineTune(build(), task, lr=0.01 if optimizer == "AdamW" else 0.05, optimizer=optimizer),
        RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=microbatches),
    )
    embeddings = getattr(remote.model, "get_input_embeddings", None)
    head = getattr(remote.model, "get_output_embeddings", lambda: None)()
    if head is not None and local.model.get_output_embeddings().weight is local.model.get_input_embeddings().weight:
        assert head.weight is embeddings().weight  # the trained module on the driver keeps its tie


def test_tied_weights_trained_across_stages_keep_their_tie_in_checkpoints(pool, tmp_path):
    """GPT-2 ties its head to its input embedding, and the two land on different stages: each holds
    a copy, the copies sum their gradients, and the checkpoint holds the tie as a local one does."""
    torch.manual_seed(0)
    local = H.FineTune(H.gpt2(), "lm")
    remote = copy.deepcopy(local)
    fit(local, epochs=1)
    strategy = RemoteModelParallelStrategy(hosts=pool[:3], split=["model"], microbatches=2)
    run = trainer(strategy, 1, num_sanity_val_steps=0, enable_checkpointing=False)
    run.fit(remote, H.padded_data(), H.padded_data(seed=1))
    assert_same_losses(local.losses, remote.losses, TOL)
    run.save_checkpoint(tmp_path / "tied.ckpt")
    saved = torch.load(tmp_path / "tied.ckpt", weights_only=True)["state_dict"]
    assert saved.keys() == {f"model.{k}" for k in local.model.state_dict()}
    torch.testing.assert_close(saved["model.lm_head.weight"], saved["model.transformer.wte.weight"], rtol=0, atol=0)
    torch.testing.assert_close(saved["model.lm_head.weight"], local.model.lm_head.weight, rtol=0, atol=1e-5)


def test_t5_stages_may_start_anywhere_its_shared_embedding_is_held_by_three(pool):
    """T5's one embedding is used by the encoder, the decoder and the head: three stages hold it."""
    remote_equals_local(
        lambda: H.FineTune(H.t5(), "lm"),
        RemoteModelParallelStrategy(
            hosts=pool[:3], split=["model"], microbatches=2, balance={"model": ["encoder.block.1", "decoder.block.0"]}
        ),
    )


def test_replicas_of_a_tied_llama_equal_one_local_run(pool):
    """Two replicas of two stages: each stage's replicas sum their gradients, and in each replica the
    two stages holding the tied embedding sum theirs."""
    remote_equals_local(
        lambda: H.FineTune(H.llama(), "lm"),
        RemoteModelParallelStrategy(hosts=[pool[:2], pool[2:4]], split=["model"], microbatches=2),
    )


def test_lora_trains_only_the_adapters_and_checkpoints_like_peft(pool, tmp_path):
    torch.manual_seed(0)
    model = H.FineTune(H.lora_llama(), "lm", optimizer="AdamW", lr=0.01)
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=2)
    run = trainer(strategy, 1, num_sanity_val_steps=0)
    run.fit(model, H.padded_data())
    after = model.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if "lora_" not in k)  # the base weights stayed
    assert all(not torch.equal(after[k], v) for k, v in before.items() if "lora_B" in k)  # the adapters trained
    run.save_checkpoint(tmp_path / "lora.ckpt")
    checkpoint = torch.load(tmp_path / "lora.ckpt", weights_only=True)
    assert checkpoint["state_dict"].keys() == {f"model.{k}" for k in model.model.state_dict()}
    state = checkpoint["optimizer_states"][0]["state"]
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(state) == len(trainable)  # optimizer state for the adapters only, none for frozen weights


def test_the_mixture_of_experts_default_path_trains_as_locally(pool):
    """transformers' default experts implementation (``grouped_mm``, a custom operator in float32)
    is traced as ``batched_mm``, the same products in ATen operators; the config is left as it was."""
    local, remote = remote_equals_local(
        lambda: H.FineTune(H.mixtral(experts_implementation="grouped_mm"), "lm"),
        RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=2),
    )
    assert remote.model.config._experts_implementation == "grouped_mm"


def test_an_output_that_cannot_be_joined_is_refused_naming_it(pool):
    """Mixtral with router logits returns an auxiliary loss, a mean over the batch's tokens with no
    count lrmp can split it by: with micro-batches it is refused, never averaged wrongly."""
    model = H.FineTune(H.mixtral(output_router_logits=True), "lm")
    with pytest.raises(TraceError, match="aux_loss"):
        fit(model, RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=2), epochs=1)


class ReadsLogits(H.FineTune):
    """Reads the logits too: a token accuracy logged every step and, optionally, a second loss
    computed from them here (a penalty on their size), whose gradient must reach the workers."""

    def __init__(self, model: torch.nn.Module, penalty: float = 0.0) -> None:
        super().__init__(model, "lm")
        self.penalty = penalty
        self.accuracies: list[float] = []
        self.outputs: list = []

    def training_step(self, batch, batch_idx):
        out = self.model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        valid = batch["labels"][:, 1:] != -100
        hits = (out.logits[:, :-1].argmax(-1) == batch["labels"][:, 1:]) & valid
        self.accuracies.append((hits.sum() / valid.sum()).item())
        loss = out.loss + self.penalty * out.logits.pow(2).mean() if self.penalty else out.loss
        self.losses.append(loss.item())
        self.outputs.append(out)  # read after fit, once the workers are gone
        return loss


class _PipelineBytes(L.Callback):
    """What the split module's outputs sent to the driver over the fit: with the results, and fetched."""

    def on_train_end(self, trainer, pl_module) -> None:
        remote = trainer.strategy.session.placements["model"].remote
        self.results, self.fetched = remote.result_bytes, remote.fetched_bytes


def test_the_logits_stay_on_the_last_stage_unless_the_step_reads_them(pool):
    """With the loss inside the model, a step that reads only the loss moves no logits to the driver:
    each micro-batch's result is its loss's sum and count, a few bytes."""
    torch.manual_seed(0)
    counted = _PipelineBytes()
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=2)
    trainer(strategy, 1, num_sanity_val_steps=0, callbacks=[counted]).fit(H.FineTune(H.llama(), "lm"), H.padded_data())
    logits_per_step = 8 * H.SEQ * H.VOCAB * 4
    assert counted.fetched == 0
    assert counted.results < logits_per_step / 100, counted.results


def test_logits_read_in_the_step_and_a_loss_of_them_train_as_locally(pool):
    torch.manual_seed(0)
    local = ReadsLogits(H.llama(), penalty=0.01)
    remote = copy.deepcopy(local)
    trainer(None, 2, num_sanity_val_steps=0).fit(local, H.padded_data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=4)
    trainer(strategy, 2, num_sanity_val_steps=0).fit(remote, H.padded_data())
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_losses(local.accuracies, remote.accuracies, 1e-6)
    assert_same_weights(local, remote, 1e-4)
    # Outputs kept by the last stage and still referenced were fetched before the session ended.
    for a, b in zip(local.outputs, remote.outputs):
        torch.testing.assert_close(b.logits.detach(), a.logits.detach(), atol=1e-4, rtol=0)


class KeepsOutputs(H.FineTune):
    """Keeps each step's outputs without reading them: they are read after fit."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, "lm")
        self.outputs: list = []

    def training_step(self, batch, batch_idx):
        out = self.model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        self.outputs.append(out)
        self.losses.append(out.loss.item())
        return out.loss


def test_outputs_kept_and_never_read_during_fit_are_there_after_it(pool):
    torch.manual_seed(0)
    local = KeepsOutputs(H.qwen2())
    remote = copy.deepcopy(local)
    trainer(None, 1, num_sanity_val_steps=0).fit(local, H.padded_data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=2)
    trainer(strategy, 1, num_sanity_val_steps=0).fit(remote, H.padded_data())
    for a, b in zip(local.outputs, remote.outputs, strict=True):
        torch.testing.assert_close(b.logits.detach(), a.logits.detach(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "mixtral", "bert", "t5", "vit"])
def test_a_family_trains_under_zero_bubble_as_locally(family, pool, caplog):
    """Each family's ``labels=`` loss starts the backward on the last stage (`lightning_remote_mp.schedule`):
    weights tied across stages (GPT-2), experts (Mixtral), an encoder and a decoder (T5), a classifier
    (BERT), images (ViT)."""
    build, task = FAMILIES[family]
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=4, schedule="zero_bubble")
    with caplog.at_level("INFO", logger="lightning_remote_mp"):
        remote_equals_local(lambda: H.FineTune(build(), task), strategy)
    assert "schedule 'zero_bubble' over 2 stages, 4 micro-batches" in caplog.text
