"""The model zoo: small real architectures trained through real Trainers on real workers, each
compared step by step with the same model trained locally."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lrmp_zoo import (
    Classifier,
    causal_lm_spec,
    cnn_spec,
    gpt2_spec,
    image_data,
    resnet_spec,
    token_data,
)
from test_strategy import assert_same_losses, assert_same_weights, trainer

from lightning_remote_mp import RemoteModelParallelStrategy

TOL = 2e-5


def fit(model: Classifier, data_fn, strategy=None, epochs: int = 2, ckpt_path=None, **kwargs) -> Classifier:
    kwargs.setdefault("num_sanity_val_steps", 2)  # Lightning's default: validation before the first step
    trainer(strategy, epochs, **kwargs).fit(model, data_fn(), data_fn(seed=1), ckpt_path=ckpt_path)
    return model


def remote_equals_local(make, data_fn, twin, strategy, **kwargs) -> tuple[Classifier, Classifier]:
    torch.manual_seed(0)
    local = make()
    remote = twin(local)
    fit(local, data_fn, **kwargs)
    fit(remote, data_fn, strategy, **kwargs)
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_losses(local.val_losses, remote.val_losses, TOL)
    assert_same_weights(local, remote, TOL)
    return local, remote


def test_causal_transformer_lm_on_four_workers_with_microbatches(twin, pool):
    """Integer tokens in, a causal mask made on stage 0 and used on every later stage. SGD, not
    Adam: the key projection's bias has a zero gradient in exact arithmetic, and Adam turns the
    rounding noise of summing it over micro-batches into full-size steps."""
    remote_equals_local(
        lambda: Classifier(causal_lm_spec(blocks=2), optimizer="SGD", lr=0.1),
        token_data,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:4], microbatches=4),
    )


def test_cnn_with_batchnorm_follows_lightning_train_and_eval_switches(twin, pool):
    """Sanity check, validation every epoch: BatchNorm must normalise by batch statistics in
    training and by running statistics in validation, on every worker, at every step. Lightning
    restores training mode after validation by setting ``.training`` directly."""
    local, remote = remote_equals_local(
        lambda: Classifier(cnn_spec(dropout=0.0), optimizer="Adam"),
        image_data,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:2]),
    )
    assert len(remote.val_losses) == 2 + 2 * 3  # the sanity check, then every epoch
    for k, v in local.state_dict().items():
        if "running_mean" in k:
            torch.testing.assert_close(remote.state_dict()[k], v, atol=TOL, rtol=0)


def test_residual_cnn_with_downsampling_blocks(twin, pool):
    remote_equals_local(
        lambda: Classifier(resnet_spec(), optimizer="SGD", lr=0.05),
        image_data,
        twin,
        RemoteModelParallelStrategy(hosts=pool[:3]),
    )


def test_dropout_is_seeded_from_the_driver_and_off_in_validation(pool):
    """Remote dropout masks differ from local ones, but a seeded run repeats bit for bit, and
    validation (eval mode) computes exactly what the trained weights give locally."""

    def run() -> Classifier:
        L.seed_everything(0, verbose=False)
        model = Classifier(cnn_spec(dropout=0.5), optimizer="Adam")
        return fit(model, image_data, RemoteModelParallelStrategy(hosts=pool[:2]), epochs=1, num_sanity_val_steps=0)

    first, second = run(), run()
    assert first.losses == second.losses
    assert first.val_losses == second.val_losses
    # After fit the LightningModule holds the trained weights: validate them locally, in eval mode.
    first.val_losses.clear()
    L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False).validate(first, image_data(seed=1))
    assert_same_losses(first.val_losses, second.val_losses, TOL)


def test_huggingface_gpt2_blocks(twin):
    """GPT2Blocks built on the workers from plain data (the config is a nested object value),
    the causal mask passed by keyword; local workers are allowed transformers automatically."""
    pytest.importorskip("transformers")
    remote_equals_local(
        lambda: Classifier(gpt2_spec(blocks=2), optimizer="SGD", lr=0.1),
        token_data,
        twin,
        RemoteModelParallelStrategy(microbatches=2),
        epochs=1,
    )


def _running_statistics(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if "running" in k or "num_batches_tracked" in k}


def _deferred_locally(model: L.LightningModule, microbatches: int) -> dict[str, torch.Tensor]:
    """What deferred batch norm keeps, computed here: each micro-batch normalised by its own
    statistics, the running statistics updated once per mini-batch from the whole's."""
    from lightning_remote_mp.worker.deferred_bn import DeferredStatistics

    statistics = DeferredStatistics()
    model.train()
    with torch.no_grad():
        for x, _ in image_data():
            for part in x.tensor_split(microbatches):  # the pipeline's micro-batch sizes
                with statistics.recording(model):
                    model.logits(part)
            statistics.commit()
    return _running_statistics(model)


@pytest.mark.parametrize("traced", [False, True], ids=["spec", "traced"])
def test_deferred_batch_norm_updates_running_statistics_once_per_mini_batch(traced, pool):
    """With micro-batches, a batch norm in training normalises each by its own statistics. With
    deferred_batch_norm it updates its running statistics once per mini-batch from the whole
    mini-batch's (torchgpipe's DeferredBatchNorm) and counts one batch: the first batch norm, whose
    input no other one changes, keeps what local training of the same batches keeps (the weights
    held still, lr=0). Without it, every batch norm moves once per micro-batch, from it alone."""
    from lrmp_traced import ResNet, Trained

    def make() -> L.LightningModule:
        torch.manual_seed(0)
        return Trained(ResNet(), lr=0.0) if traced else Classifier(cnn_spec(dropout=0.0), optimizer="SGD", lr=0.0)

    def remote(**kwargs) -> dict[str, torch.Tensor]:
        model = make()
        strategy = RemoteModelParallelStrategy(
            hosts=pool[:2], microbatches=4, split=["model"] if traced else None, **kwargs
        )
        fit(model, image_data, strategy, epochs=1, num_sanity_val_steps=0)
        return _running_statistics(model)

    local = make()
    fit(local, image_data, epochs=1, num_sanity_val_steps=0)
    whole = _running_statistics(local)
    deferred = remote(deferred_batch_norm=True)
    for k, v in _deferred_locally(make(), 4).items():
        torch.testing.assert_close(deferred[k], v, atol=1e-5, rtol=1e-5, msg=k)
    first = next(k for k in whole if "running_mean" in k).rpartition(".")[0]  # the first batch norm
    for k, v in whole.items():
        if k.startswith(first + "."):
            torch.testing.assert_close(deferred[k], v, atol=1e-5, rtol=1e-5, msg=k)
    recomputed = remote(deferred_batch_norm=True, checkpoint="always")  # a forward run again counts once
    for k, v in deferred.items():
        torch.testing.assert_close(recomputed[k], v, atol=1e-6, rtol=1e-6, msg=k)
    per_microbatch = remote()
    assert all(int(per_microbatch[k]) == 4 * int(v) for k, v in whole.items() if "num_batches_tracked" in k)
    assert not torch.allclose(per_microbatch[first + ".running_var"], whole[first + ".running_var"], atol=1e-4)
