"""A traced module called in several ways (issue #36): each set of arguments is a program of its
own, traced at its first call and placed on the stages and tensors of the first call's program, so
that every way trains the same weights (`lightning_remote_mp.model.calls.TracedForward`). Checked
on a tiny HuggingFace Llama, padded batches, with real workers and Trainers against local training."""

from __future__ import annotations

import pytest
import torch
from lrmp_hf import FineTune, llama, padded_data
from test_zoo import remote_equals_local

from lightning_remote_mp import RemoteModelParallelStrategy
from lightning_remote_mp.errors import TraceError

pytest.importorskip("transformers")


class TwoWays(FineTune):
    """``labels=`` in training (the loss on the last stage), no ``labels`` in validation (the loss
    computed here from the logits), as HF fine-tuning scripts often do; ``both``: each training step
    also calls the model the second way and adds a term from its logits, so that both ways' gradients
    reach the same weights in one step."""

    def __init__(self, model: torch.nn.Module, both: bool = False, optimizer: str = "SGD") -> None:
        super().__init__(model, optimizer=optimizer, lr=0.05 if optimizer == "SGD" else 0.01)
        self.both = both

    def _logits_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.both:  # the keywords in the other order: the same way of calling it
            return self._logits_loss_of(
                self.model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch
            )
        return self._logits_loss_of(
            self.model(attention_mask=batch["attention_mask"], input_ids=batch["input_ids"]).logits, batch
        )

    @staticmethod
    def _logits_loss_of(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        if self.both:
            loss = loss + 0.5 * self._logits_loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._logits_loss(batch)
        self.val_losses.append(loss.item())


@pytest.mark.parametrize(
    ("both", "microbatches", "optimizer"), [(False, 1, "AdamW"), (False, 4, "SGD"), (True, 2, "SGD")]
)
def test_trained_with_labels_and_validated_without_them_trains_as_locally(twin, pool, both, microbatches, optimizer):
    """AdamW: its state comes back at the end, from the first way's stages only."""
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], microbatches=microbatches, split=["model"])
    local, remote = remote_equals_local(
        lambda: TwoWays(llama(), both=both, optimizer=optimizer), padded_data, twin, strategy
    )
    assert len(remote.val_losses) == 2 + 2 * 2  # the sanity check (before any labels= call), then each epoch
    assert (
        local.trainer.optimizers[0].state_dict()["state"].keys()
        == remote.trainer.optimizers[0].state_dict()["state"].keys()
    )


def test_a_fifth_way_of_calling_is_refused_naming_the_argument_that_differs(pool):
    import lightning as L

    class Calls(FineTune):
        def validation_step(self, batch, batch_idx):
            ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            ways = [
                {"attention_mask": mask},
                {"attention_mask": mask, "labels": labels},
                {"attention_mask": mask, "labels": labels, "position_ids": positions},
                {"attention_mask": mask, "position_ids": positions},
                {},
            ]
            self.model(ids, **ways[batch_idx])

    trainer = L.Trainer(
        strategy=RemoteModelParallelStrategy(hosts=pool[:2], split=["model"]),
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(TraceError) as refused:
        trainer.validate(Calls(llama()), padded_data(n=40, batch=8))
    message = str(refused.value)
    assert "module 'model' was traced at its first call; this call passes no 'attention_mask'" in message, message
    assert "already has 4 programs" in message, message
