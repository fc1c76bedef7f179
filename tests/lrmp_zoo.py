"""Small real architectures as layer specs, for the model-zoo tests: the shapes of what people
train (a causal transformer LM, CNNs with BatchNorm and Dropout, a residual CNN with downsampling
blocks, a HuggingFace GPT-2 block stack), each small enough to train for a few steps in seconds."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_remote_mp import SpecSequential

VOCAB, DIM, SEQ = 32, 32, 16


def causal_lm_spec(blocks: int = 2, batch: int = 8) -> list:
    """Token ids in, next-token logits out: embedding, learned positions, a causal mask published
    as a variable, nn.TransformerEncoderLayer blocks that take it, a head."""
    shape = (batch, SEQ, DIM)
    block = {
        "layer": "torch.nn.TransformerEncoderLayer",
        "kwargs": {"d_model": DIM, "nhead": 2, "dim_feedforward": 4 * DIM, "dropout": 0.0, "batch_first": True},
        "input_shape": [shape, (SEQ, SEQ)],
        "dependencies": ["mask"],
    }
    return _language_model([block] * blocks, batch)


def _language_model(blocks: list, batch: int) -> list:
    """Token embedding, learned positions and the causal mask; ``blocks``; a norm and the head."""
    shape = (batch, SEQ, DIM)
    return [
        {
            "layer": "torch.nn.Embedding",
            "kwargs": {"num_embeddings": VOCAB, "embedding_dim": DIM},
            "input_shape": [batch, SEQ],
        },
        ("lightning_remote_mp.layers.PositionalEmbedding", {"max_len": SEQ, "dim": DIM}, shape),
        ("lightning_remote_mp.layers.CausalMask", {}, shape),
        *blocks,
        ("torch.nn.LayerNorm", {"normalized_shape": DIM}, shape),
        ("torch.nn.Linear", {"in_features": DIM, "out_features": VOCAB}, shape),
    ]


def _gpt2_block_returns_tuple() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) < 5


def gpt2_spec(blocks: int = 2, batch: int = 8) -> list:
    """The same LM with HuggingFace GPT2Blocks: their config built on the worker from plain data,
    the causal mask passed as the ``attention_mask`` keyword."""
    shape = (batch, SEQ, DIM)
    config = {
        "object": "transformers.GPT2Config",
        "kwargs": {
            "n_embd": DIM,
            "n_head": 2,
            "n_layer": blocks,
            "n_positions": SEQ,
            "vocab_size": VOCAB,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "attn_implementation": "eager",
        },
    }
    gpt2_blocks = [
        {
            "layer": "transformers.models.gpt2.modeling_gpt2.GPT2Block",
            "kwargs": {"config": config, "layer_idx": i},
            "input_shape": [shape, (SEQ, SEQ)],
            "dependencies": {"attention_mask": "mask"},
            # transformers 4 returns (hidden_states, ...), 5 the tensor alone
            **({"output": 0} if _gpt2_block_returns_tuple() else {}),
        }
        for i in range(blocks)
    ]
    return _language_model(gpt2_blocks, batch)


def cnn_spec(dropout: float, batch: int = 16) -> list:
    """8x8 one-channel images (like sklearn's digits) to 10 classes, with BatchNorm and Dropout."""
    return [
        ("torch.nn.Conv2d", {"in_channels": 1, "out_channels": 8, "kernel_size": 3, "padding": 1}, (batch, 1, 8, 8)),
        ("torch.nn.BatchNorm2d", {"num_features": 8}, (batch, 8, 8, 8)),
        ("torch.nn.ReLU", {}, (batch, 8, 8, 8)),
        ("torch.nn.MaxPool2d", {"kernel_size": 2}, (batch, 8, 8, 8)),
        ("torch.nn.Conv2d", {"in_channels": 8, "out_channels": 16, "kernel_size": 3, "padding": 1}, (batch, 8, 4, 4)),
        ("torch.nn.BatchNorm2d", {"num_features": 16}, (batch, 16, 4, 4)),
        ("torch.nn.ReLU", {}, (batch, 16, 4, 4)),
        ("torch.nn.Flatten", {}, (batch, 16, 4, 4)),
        ("torch.nn.Dropout", {"p": dropout}, (batch, 256)),
        ("torch.nn.Linear", {"in_features": 256, "out_features": 10}, (batch, 256)),
    ]


def _conv(cin: int, cout: int, stride: int, hw: int, batch: int, **extra) -> dict:
    return {
        "layer": "torch.nn.Conv2d",
        "kwargs": {
            "in_channels": cin,
            "out_channels": cout,
            "kernel_size": 3,
            "stride": stride,
            "padding": 1,
            "bias": False,
        },
        "input_shape": [batch, cin, hw, hw],
        **extra,
    }


def resnet_spec(batch: int = 16) -> list:
    """A stem and two residual blocks (the first downsamples: a strided conv on the main path and a
    strided 1x1 conv projecting the skip, as torchvision's BasicBlock does), pooled to 10 classes."""
    b = batch
    return [
        _conv(1, 8, 1, 8, b),
        ("torch.nn.BatchNorm2d", {"num_features": 8}, (b, 8, 8, 8)),
        {"layer": "torch.nn.ReLU", "kwargs": {}, "input_shape": [b, 8, 8, 8], "out_variables": ["stem"]},
        _conv(8, 16, 2, 8, b),
        ("torch.nn.BatchNorm2d", {"num_features": 16}, (b, 16, 4, 4)),
        ("torch.nn.ReLU", {}, (b, 16, 4, 4)),
        _conv(16, 16, 1, 4, b),
        ("torch.nn.BatchNorm2d", {"num_features": 16}, (b, 16, 4, 4)),
        {
            "layer": "lightning_remote_mp.layers.Add",
            "kwargs": {
                "projection": {
                    "object": "torch.nn.Conv2d",
                    "kwargs": {"in_channels": 8, "out_channels": 16, "kernel_size": 1, "stride": 2, "bias": False},
                }
            },
            "input_shape": [(b, 16, 4, 4), (b, 8, 8, 8)],
            "dependencies": ["stem"],
        },
        {"layer": "torch.nn.ReLU", "kwargs": {}, "input_shape": [b, 16, 4, 4], "out_variables": ["block1"]},
        _conv(16, 16, 1, 4, b),
        ("torch.nn.BatchNorm2d", {"num_features": 16}, (b, 16, 4, 4)),
        ("torch.nn.ReLU", {}, (b, 16, 4, 4)),
        _conv(16, 16, 1, 4, b),
        ("torch.nn.BatchNorm2d", {"num_features": 16}, (b, 16, 4, 4)),
        {
            "layer": "lightning_remote_mp.layers.Add",
            "kwargs": {},
            "input_shape": [(b, 16, 4, 4), (b, 16, 4, 4)],
            "dependencies": ["block1"],
        },
        ("torch.nn.ReLU", {}, (b, 16, 4, 4)),
        ("torch.nn.AdaptiveAvgPool2d", {"output_size": 1}, (b, 16, 4, 4)),
        ("torch.nn.Flatten", {}, (b, 16, 1, 1)),
        ("torch.nn.Linear", {"in_features": 16, "out_features": 10}, (b, 16)),
    ]


class Classifier(L.LightningModule):
    """Cross-entropy over the SpecSequential's logits (flattened over positions for an LM)."""

    def __init__(self, spec: list, lr: float = 1e-2, optimizer: str = "AdamW", **spec_kwargs) -> None:
        super().__init__()
        self.net = SpecSequential(spec, **spec_kwargs)
        self.lr = lr
        self.optimizer = optimizer
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self.logits(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def configure_optimizers(self):
        return getattr(torch.optim, self.optimizer)(self.parameters(), lr=self.lr)


def token_data(n: int = 32, batch: int = 8, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    # A learnable pattern: each token is the previous one plus one, from a random start.
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)


def image_data(n: int = 48, batch: int = 16, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g) + y.view(-1, 1, 1, 1) / 5.0
    return DataLoader(TensorDataset(x, y), batch_size=batch)
