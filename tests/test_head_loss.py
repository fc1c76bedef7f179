"""A language model's loss from ``labels=`` on the last stage without its whole logits (issue #59):
the head and the cross-entropy computed in chunks there, the logits computed only when read, and
training equal to local training's.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import lrmp_hf as H  # noqa: E402
from test_strategy import assert_same_losses, assert_same_weights, trainer  # noqa: E402

from lightning_remote_mp import RemoteModelParallelStrategy  # noqa: E402
from lightning_remote_mp.model import head_loss  # noqa: E402


class ReadsLogits(H.FineTune):
    """Adds a term over the logits the model returns beside its loss: they are read, and trained through."""

    def training_step(self, batch, batch_idx):
        out = self.model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        loss = out.loss + 1e-3 * out.logits.float().pow(2).mean()
        self.losses.append(loss.item())
        return loss


@pytest.mark.parametrize("vocab", [1000, 128_256])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_the_chunked_loss_and_its_gradients_are_the_whole_losses(vocab, chunk_rows, reduction, monkeypatch):
    """Llama-3's vocabulary and a small one, chunks of one token's logits up to all of them, ``-100``
    targets: the value and the gradients of the hidden states, the head's weight and its bias."""
    monkeypatch.setattr(head_loss, "CHUNK_ELEMENTS", chunk_rows * vocab)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=g, requires_grad=True)
    w = (torch.randn(vocab, 16, generator=g) / 4).requires_grad_()
    b = torch.randn(vocab, generator=g).requires_grad_()
    t = torch.randint(0, vocab, (37,), generator=g).masked_fill(torch.rand(37, generator=g) < 0.3, -100)
    r = {"mean": 1, "sum": 2}[reduction]
    chunked = torch.ops.lrmp.linear_cross_entropy(x, w, b, t, r, -100, torch.float32)
    grads = torch.autograd.grad(chunked, (x, w, b))
    whole = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w, b), t, reduction=reduction)
    for got, want in zip((chunked, *grads), (whole, *torch.autograd.grad(whole, (x, w, b)))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # sums in another order


def test_a_bfloat16_head_upcasts_as_transformers_does():
    x, w = torch.randn(9, 8, dtype=torch.bfloat16), torch.randn(50, 8, dtype=torch.bfloat16)
    t = torch.randint(0, 50, (9,))
    chunked = torch.ops.lrmp.linear_cross_entropy(x, w, None, t, 2, -100, torch.float32)
    whole = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float(), t, reduction="sum")
    assert chunked.dtype == torch.float32 and torch.equal(chunked, whole)


@pytest.mark.parametrize("case", ["tied", "reads_logits"])
def test_the_loss_in_chunks_trains_as_locally(case, pool):
    """Tied embeddings (the head's weight is the embedding's, on two stages), and a step that reads
    the logits too, trained through; validation computes the logits whole."""
    torch.manual_seed(0)
    cls = ReadsLogits if case == "reads_logits" else H.FineTune
    local = cls(H.llama(), "lm", lr=0.01, optimizer="AdamW")
    remote = copy.deepcopy(local)
    trainer(None, 2).fit(local, H.padded_data(), H.padded_data(n=4, seed=1))
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=2)
    trainer(strategy, 2).fit(remote, H.padded_data(), H.padded_data(n=4, seed=1))
    assert_same_losses(local.losses, remote.losses, 1e-5)
    assert_same_losses(local.val_losses, remote.val_losses, 1e-5)
    assert_same_weights(local, remote, 1e-4)


def _operators(module: torch.nn.Module) -> dict[str, set[str]]:
    """The operators of each mode's programs, ``namespace::name``, for a ``labels=`` call."""
    from lightning_remote_mp.model.trace import trace_module

    ids = torch.randint(0, H.VOCAB, (2, 8))
    traced = trace_module(module, (ids,), {"labels": ids, "use_cache": False}, "model")
    return {
        mode: {f"{s[1][0]}::{s[1][1]}" for e in traced.entries for s in e.kwargs["programs"][mode]["steps"]}
        for mode in ("train", "eval")
    }


@pytest.mark.parametrize("family", ["llama", "gpt2", "t5"])
def test_a_causal_and_a_sequence_to_sequence_loss_are_chunked_in_training_only(family):
    ops = _operators(getattr(H, family)())
    assert {"lrmp::linear_cross_entropy", "lrmp::deferred_linear"} <= ops["train"]
    assert "aten::cross_entropy_loss" not in ops["train"]
    assert "aten::cross_entropy_loss" in ops["eval"] and not any(op.startswith("lrmp::") for op in ops["eval"])


class Softcapped(torch.nn.Module):
    """Reads the logits for more than the loss (a softcap, as Gemma 2's head does): computed whole."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(H.VOCAB, 8), torch.nn.Linear(8, H.VOCAB)

    def forward(self, ids, labels):
        logits = self.head(self.embed(ids))
        logits = 30 * torch.tanh(logits / 30)
        return torch.nn.functional.cross_entropy(logits.view(-1, H.VOCAB), labels.view(-1)), logits


def test_logits_read_by_more_than_the_loss_keep_the_whole_loss():
    from lightning_remote_mp.model.trace import trace_module

    ids = torch.randint(0, H.VOCAB, (2, 8))
    traced = trace_module(Softcapped(), (ids, ids), {}, "model")
    steps = [s[1][1] for e in traced.entries for s in e.kwargs["programs"]["train"]["steps"]]
    assert "cross_entropy_loss" in steps and "linear_cross_entropy" not in steps
