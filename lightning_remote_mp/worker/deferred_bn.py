"""Deferred batch norm: running statistics updated once per mini-batch, from the whole mini-batch.

With micro-batches, a BatchNorm layer in training mode sees each micro-batch alone: it normalises
each by its own statistics (as torchgpipe's ``DeferredBatchNorm`` does too), and, left alone, it
would also update its running statistics once per micro-batch, from that micro-batch only, and
count each as a batch. `DeferredStatistics` (``deferred_batch_norm=True`` on the strategy) keeps
the normalisation and defers the rest: while a stage's forward runs, every ``F.batch_norm`` call in
training mode (``nn.BatchNorm*d`` layers, and the ``batch_norm`` steps of traced programs) leaves
the running statistics alone and adds its input's per-channel sum and sum of squares to the
mini-batch's; once the last micro-batch of the mini-batch has been through the stage, `commit`
updates the running statistics from those sums (the mean, and the unbiased variance, of the whole
mini-batch, with the momentum the layer asked for) and counts one batch in ``num_batches_tracked``:
what the layer would have done with the whole mini-batch at once.

>>> bn, deferred = torch.nn.BatchNorm1d(2), DeferredStatistics()
>>> x = torch.randn(8, 2)
>>> with deferred.recording(bn):
...     _ = bn(x[:4]); _ = bn(x[4:])
>>> deferred.commit()
>>> whole = torch.nn.BatchNorm1d(2)
>>> _ = whole(x)
>>> torch.allclose(bn.running_var, whole.running_var), int(bn.num_batches_tracked)
(True, 1)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


@dataclasses.dataclass
class _Sums:
    """One layer's statistics over the micro-batches seen so far."""

    running_mean: torch.Tensor
    running_var: torch.Tensor
    momentum: float | None
    total: torch.Tensor  # per channel, float64
    squares: torch.Tensor
    count: int = 0


class _Intercept(TorchFunctionMode):
    def __init__(self, owner: DeferredStatistics) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            return self.owner._batch_norm(*args, **kwargs)
        return func(*args, **kwargs)


class DeferredStatistics:
    """A stage's deferred batch-norm statistics (see the module docstring)."""

    def __init__(self) -> None:
        self._sums: dict[int, _Sums] = {}  # by id(running_mean)
        self._counters: list[tuple[torch.Tensor, torch.Tensor]] = []  # (num_batches_tracked, its value before)

    @contextlib.contextmanager
    def recording(self, module: nn.Module) -> Iterator[None]:
        """Run a forward of ``module`` (a stage's layers) with its batch-norm statistics deferred."""
        if not self._sums and not self._counters:  # the mini-batch's first micro-batch: counters as they were
            self._counters = [
                (b, b.clone()) for name, b in module.named_buffers() if name.endswith("num_batches_tracked")
            ]
        with _Intercept(self):
            yield

    @property
    def waiting(self) -> bool:
        """Whether statistics wait for `commit`."""
        return bool(self._sums)

    def _batch_norm(
        self,
        input: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        training: bool = False,
        momentum: float | None = 0.1,
        eps: float = 1e-5,
    ) -> torch.Tensor:
        if not training or running_mean is None or running_var is None:
            return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        dims = [d for d in range(input.dim()) if d != 1]
        with torch.no_grad():
            x = input.detach().to(torch.float64)
            sums = self._sums.get(id(running_mean))
            if sums is None:
                zeros = torch.zeros(input.shape[1], dtype=torch.float64, device=input.device)
                # The momentum of the first micro-batch: with momentum=None (a cumulative average) the
                # layer computes it from num_batches_tracked, which is then the mini-batch's count.
                sums = self._sums[id(running_mean)] = _Sums(running_mean, running_var, momentum, zeros, zeros.clone())
            sums.total += x.sum(dims)
            sums.squares += (x * x).sum(dims)
            sums.count += input.numel() // input.shape[1]
        # Normalised by its own statistics, the running ones left alone.
        return F.batch_norm(input, None, None, weight, bias, True, 0.0, eps)

    def discard(self) -> None:
        """Forget the statistics recorded since the last commit, and the batches counted meanwhile."""
        with torch.no_grad():
            for counter, before in self._counters:
                counter.copy_(before)
        self._sums.clear()
        self._counters = []

    def commit(self) -> None:
        """Update every running statistic recorded since the last commit from the whole mini-batch's
        sums, and count one batch."""
        with torch.no_grad():
            for s in self._sums.values():
                n = s.count
                mean = s.total / n
                var = (s.squares / n - mean * mean).clamp(min=0) * (n / max(n - 1, 1))  # unbiased, as BatchNorm keeps
                m = 0.1 if s.momentum is None else s.momentum
                s.running_mean.mul_(1 - m).add_(mean.to(s.running_mean.dtype), alpha=m)
                s.running_var.mul_(1 - m).add_(var.to(s.running_var.dtype), alpha=m)
            for counter, before in self._counters:
                if not torch.equal(counter, before):  # a layer that trained in this mini-batch: one batch
                    counter.copy_(before + 1)
        self._sums.clear()
        self._counters = []
