"""Tiny configs of the HuggingFace families people fine-tune, unchanged, with the batches they train
on: padded (an ``attention_mask``, ``-100`` labels at the padding, spread unevenly over the rows) and
the loss computed inside the model (``labels=``). For the model-zoo tests: each trains in seconds.

The padding token is a token that also occurs in real data, so that no embedding row has a gradient
made only of padding noise: remote and local training then agree within float tolerance.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

VOCAB, SEQ, PAD = 64, 12, 3  # PAD is an ordinary token too


def _transformers():
    import transformers

    return transformers


def gpt2(**kw):
    """GPT-2 with transformers' defaults (tied embeddings, the key/value cache on) but dropout, whose
    masks differ between a worker's stream and the driver's."""
    t = _transformers()
    dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, **dropout)
    return t.GPT2LMHeadModel(t.GPT2Config(**{**config, **kw}))


def llama(**kw):
    """Llama with tied embeddings and grouped-query attention (4 heads, 2 key/value heads)."""
    t = _transformers()
    config = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return t.LlamaForCausalLM(t.LlamaConfig(**{**config, **kw}))


def qwen2(**kw):
    t = _transformers()
    return t.Qwen2ForCausalLM(
        t.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **kw,
        )
    )


def mixtral(**kw):
    """Mixtral's mixture of experts, with the experts implementation torch.export traces to ATen
    operators (``batched_mm``; the default ``grouped_mm`` calls a custom operator of transformers')."""
    t = _transformers()
    kw.setdefault("experts_implementation", "batched_mm")
    return t.MixtralForCausalLM(
        t.MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            **kw,
        )
    )


def bert(**kw):
    """BERT for sequence classification (3 classes), over padded sentences."""
    t = _transformers()
    return t.BertForSequenceClassification(
        t.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **kw,
        )
    )


def t5(**kw):
    """T5 with its defaults: the shared embedding used by the encoder, the decoder and the head."""
    t = _transformers()
    return t.T5ForConditionalGeneration(
        t.T5Config(
            vocab_size=VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
            dropout_rate=0.0,
            **kw,
        )
    )


def vit(**kw):
    t = _transformers()
    return t.ViTForImageClassification(
        t.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=5,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **kw,
        )
    )


def lora_llama(**kw):
    """A peft LoRA adapter on the tied Llama above: only the adapters train."""
    import peft

    return peft.get_peft_model(
        llama(**kw), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )


class Padded(Dataset):
    """Token sequences with a learnable pattern (each token the previous plus one), padded at the end
    by a different amount per row, as a tokenizer pads a batch of sentences."""

    def __init__(self, n: int = 16, seed: int = 0, classes: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB
        lengths = torch.randint(SEQ // 3, SEQ + 1, (n,), generator=g)
        self.mask = (torch.arange(SEQ) < lengths[:, None]).long()
        self.ids = self.ids.masked_fill(self.mask == 0, PAD)
        self.classes = start.squeeze(1) % classes

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].masked_fill(self.mask[i] == 0, -100)
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": labels, "cls": self.classes[i]}


def padded_data(n: int = 16, batch: int = 8, seed: int = 0) -> DataLoader:
    return DataLoader(Padded(n, seed), batch_size=batch)


class Images(Dataset):
    def __init__(self, n: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 5, (n,), generator=g)
        self.x = torch.randn(n, 3, 16, 16, generator=g) + self.y.view(-1, 1, 1, 1) / 4

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def image_data(n: int = 16, batch: int = 8, seed: int = 0) -> DataLoader:
    return DataLoader(Images(n, seed), batch_size=batch)


class FineTune(L.LightningModule):
    """``self.model(**batch).loss``, unchanged, as people fine-tune HuggingFace models.

    ``task``: ``"lm"`` (``labels=`` the tokens, ``-100`` at the padding), ``"classify"`` (``labels=``
    the class of each sequence), ``"seq2seq"`` (T5: the tokens as both the source and the target) or
    ``"image"``."""

    def __init__(self, model: torch.nn.Module, task: str = "lm", lr: float = 0.05, optimizer: str = "SGD") -> None:
        super().__init__()
        self.model = model
        self.task, self.lr, self.optimizer = task, lr, optimizer
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.task == "image":
            return self.model(pixel_values=batch["pixel_values"], labels=batch["labels"]).loss
        labels = batch["cls"] if self.task == "classify" else batch["labels"]
        return self.model(batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        return getattr(torch.optim, self.optimizer)(params, lr=self.lr)
