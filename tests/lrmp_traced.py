"""Unchanged nn.Modules for the tracing tests: nothing here is a spec, and no worker imports this file."""

from __future__ import annotations

import lightning as L
import torch
from lrmp_zoo import Classifier
from torch import nn

VOCAB, DIM, SEQ = 32, 32, 16


class CausalLM(nn.Module):
    """Embedding, learned positions, a causal nn.TransformerEncoder, a head: the shape of a small GPT."""

    def __init__(self, layers: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        block = nn.TransformerEncoderLayer(DIM, 2, 4 * DIM, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        h = self.encoder(self.embed(ids) + self.pos[:t], mask=mask, is_causal=True)
        return self.head(self.norm(h))


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: two 3x3 convs with BatchNorm, and a strided 1x1 projection of the
    skip when it downsamples."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """A small ResNet for 8x8 one-channel images: stem, residual stages (the second downsamples), pooled head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(8, 8, 1), BasicBlock(8, 16, 2))
        self.layer2 = nn.Sequential(BasicBlock(16, 16, 1))
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.layer2(self.layer1(self.stem(x))), 1), 1))


class DataDependent(nn.Module):
    """Branches on a tensor's value: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum() > 0:
            return self.b(h)
        return h


class Trained(Classifier):
    """The zoo's classifier over any nn.Module's logits (``output``: the attribute holding them, for a
    HuggingFace ``ModelOutput``)."""

    def __init__(self, model: nn.Module, lr: float = 0.05, optimizer: str = "SGD", output: str | None = None) -> None:
        L.LightningModule.__init__(self)
        self.model = model
        self.lr = lr
        self.optimizer = optimizer
        self.output = output
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        return getattr(out, self.output) if self.output else out
