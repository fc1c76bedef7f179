"""Activation recomputation (``checkpoint=``): a stage keeps only its inputs and runs the forward
again at backward; training is unchanged, Dropout masks and BatchNorm statistics included."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lrmp_zoo import Classifier, causal_lm_spec, cnn_spec, image_data, token_data
from test_strategy import assert_same_losses, assert_same_weights
from test_zoo import fit

from lightning_remote_mp import LrmpError, RemoteModelParallelStrategy


def _seeded_run(pool, make, data, checkpoint: str, split_backward: bool = True) -> Classifier:
    L.seed_everything(0, verbose=False)
    model = make()
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:2], microbatches=4, checkpoint=checkpoint, split_backward=split_backward
    )
    return fit(model, data, strategy, epochs=1)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_recomputation_changes_nothing_with_dropout_and_batchnorm(pool, checkpoint):
    """The recomputed forward draws the same Dropout masks and updates BatchNorm's running
    statistics once, so a seeded run equals the run that kept its activations. (Recomputed
    micro-batches use plain autograd: compared with a plain-autograd run, the sums are the same.)"""
    make = lambda: Classifier(cnn_spec(dropout=0.5), optimizer="SGD", lr=0.05)  # noqa: E731
    kept = _seeded_run(pool, make, image_data, "never", split_backward=False)
    recomputed = _seeded_run(pool, make, image_data, checkpoint)
    tol = 1e-6 if checkpoint == "always" else 1e-5  # the last micro-batch's linear layers split their backward
    assert_same_losses(kept.losses, recomputed.losses, tol)
    assert_same_losses(kept.val_losses, recomputed.val_losses, tol)
    assert_same_weights(kept, recomputed, tol)  # running_mean and running_var included


def test_recomputation_equals_local_training(twin, pool):
    torch.manual_seed(0)
    local = Classifier(causal_lm_spec(blocks=2), optimizer="SGD", lr=0.1)
    remote = twin(local)
    fit(local, token_data)
    fit(remote, token_data, RemoteModelParallelStrategy(hosts=pool[:2], microbatches=2, checkpoint="always"))
    assert_same_losses(local.losses, remote.losses, 2e-5)
    assert_same_weights(local, remote, 2e-5)


def test_an_unknown_checkpoint_mode_is_refused_at_construction():
    with pytest.raises(LrmpError, match="checkpoint must be one of 'never', 'except_last', 'always', got 'sometimes'"):
        RemoteModelParallelStrategy(checkpoint="sometimes")
