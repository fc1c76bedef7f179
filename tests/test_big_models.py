"""Models bigger than the driver (issue #35): pretrained weights read by the workers from the
``save_pretrained`` files, sharded checkpoints written by the workers, trained weights that stay
where they are, and the errors for weights that do not fit.

Each test trains a tiny HuggingFace Llama (untied, its safetensors split over several shards, as a
large model's are) through real workers and compares with the same model trained locally.
"""

from __future__ import annotations

import json
import os
import signal

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

pytest.importorskip("transformers")

import lrmp_hf as H  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_strategy import assert_same_losses, assert_same_weights, trainer  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lightning_remote_mp import RemoteModelParallelStrategy  # noqa: E402
from lightning_remote_mp.errors import LrmpError, WeightsError  # noqa: E402
from lightning_remote_mp.lightning.checkpoint_io import FileCheckpointIO  # noqa: E402

TOL = 2e-5


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> str:
    """A tiny untied Llama saved as sharded safetensors with an index, as ``save_pretrained`` writes a big one."""
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    H.llama(tie_word_embeddings=False).save_pretrained(path, max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    return str(path)


def loaded(path: str, meta: bool = False) -> H.FineTune:
    """The LightningModule as users write it: ``from_pretrained``, or the model built on the meta device."""
    if meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    model.train()
    return H.FineTune(model, "lm", lr=0.01, optimizer="AdamW")


def local_run(path: str, epochs: int) -> H.FineTune:
    model = loaded(path)
    trainer(None, epochs).fit(model, H.padded_data())
    return model


def shards_of(directory) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_pretrained_weights_read_by_the_workers_train_as_locally(pretrained, pool):
    """``from_pretrained`` unchanged, and ``pretrained=`` the same directory: each worker reads its
    stage's tensors from the shards, and training equals local training step by step."""
    local = local_run(pretrained, 2)
    remote = loaded(pretrained)
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=2, pretrained=pretrained)
    trainer(strategy, 2).fit(remote, H.padded_data())
    assert_same_losses(local.losses, remote.losses, TOL)
    assert_same_weights(local, remote, 1e-4)  # a small model: its weights come back (gather_limit)
    # A later run sends the trained weights here, not the pretrained files' again.
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], pretrained=pretrained)
    trainer(strategy, 1).validate(remote, H.padded_data(seed=1))
    trainer(None, 1).validate(local, H.padded_data(seed=1))
    assert_same_losses(local.val_losses, remote.val_losses, TOL)


def test_a_meta_model_trains_with_no_weights_on_the_driver_and_checkpoints_by_worker(pretrained, pool, tmp_path):
    """The model built on the meta device: the workers read every weight, write every checkpoint,
    and the trained weights in the checkpoint equal local training's; the driver never holds one."""
    local = local_run(pretrained, 2)
    remote = loaded(pretrained, meta=True)
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:2], split=["model"], microbatches=2, pretrained=pretrained, state_dict_type="sharded"
    )
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(strategy, 2, enable_checkpointing=True, callbacks=[checkpoints]).fit(remote, H.padded_data())
    assert_same_losses(local.losses, remote.losses, TOL)
    assert all(p.is_meta for p in remote.model.parameters())  # never materialised here
    last = tmp_path / "last.ckpt"
    manifest = json.loads((last / "lrmp-checkpoint.json").read_text())
    assert sorted(f["stage"] for f in manifest["files"]) == [0, 1]
    saved = shards_of(last)
    for name, value in local.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-4)
        # Adam's moments travelled too, keyed by the same name
        assert f"optimizer.0.{name}.exp_avg" in saved
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no partial directory left


class _SeesPendingSave(L.Callback):
    def __init__(self) -> None:
        self.pending: list[bool] = []

    def on_train_epoch_start(self, trainer, pl_module):
        self.pending.append(trainer.strategy._saves.pending is not None)


def test_with_async_checkpoint_io_the_workers_write_while_training_goes_on(pretrained, pool, tmp_path):
    """Lightning's ``AsyncCheckpointIO``: each save blocks only while the workers copy their tensors;
    the directory is named once their files are written, the top-k checkpoint it replaces is removed
    only then, and every checkpoint holds what local training had at its epoch."""
    local = local_run(pretrained, 3)
    remote = loaded(pretrained)
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:2], split=["model"], microbatches=2, pretrained=pretrained, state_dict_type="sharded"
    )
    seen = _SeesPendingSave()
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=1)  # the latest, and last
    run = trainer(strategy, 3, enable_checkpointing=True, callbacks=[seen, checkpoints], plugins=[AsyncCheckpointIO()])
    run.fit(remote, H.padded_data())
    assert seen.pending == [False, True, True]  # a save from the epoch before was still being named
    assert isinstance(run.strategy.checkpoint_io.checkpoint_io, FileCheckpointIO)  # the plugin wraps lrmp's
    assert_same_losses(local.losses, remote.losses, TOL)
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2 and names[0].startswith("epoch=2-") and names[1] == "last.ckpt", names
    for name in names:
        saved = shards_of(tmp_path / name)
        for key, value in local.state_dict().items():
            torch.testing.assert_close(saved[key], value, rtol=0, atol=1e-4)


@pytest.mark.parametrize("stages", [3])
def test_a_sharded_checkpoint_resumes_onto_another_number_of_stages(pretrained, pool, tmp_path, stages):
    """Two epochs on two stages, saved sharded; two more resumed onto three stages: the losses and
    weights of an uninterrupted four-epoch local run (Adam's state came back by parameter name)."""
    local = local_run(pretrained, 4)
    first = loaded(pretrained)
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:2], split=["model"], microbatches=2, pretrained=pretrained, state_dict_type="sharded"
    )
    run = trainer(strategy, 2, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True)])
    run.fit(first, H.padded_data())
    second = loaded(pretrained, meta=True)
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:stages], split=["model"], microbatches=2, state_dict_type="sharded"
    )
    run = trainer(strategy, 4, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path / "second")])
    run.fit(second, H.padded_data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert_same_losses(local.losses, first.losses + second.losses, TOL)
    (last,) = (tmp_path / "second").iterdir()
    saved = shards_of(last)
    assert len(json.loads((last / "lrmp-checkpoint.json").read_text())["files"]) == stages
    for name, value in local.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-4)


def test_weights_over_the_gather_limit_stay_with_the_workers_and_a_later_run_needs_the_checkpoint(
    pretrained, pool, tmp_path
):
    """Past ``gather_limit`` nothing comes back at the end of fit: the module goes to the meta device
    (no stale pretrained weights to run by mistake), ``validate`` without a checkpoint is refused,
    and with the sharded checkpoint it scores the trained weights, as the local model does."""
    local = local_run(pretrained, 1)
    remote = loaded(pretrained)

    def strategy():
        return RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], pretrained=pretrained, gather_limit=1)

    run = trainer(strategy(), 1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path)])
    run.fit(remote, H.padded_data())
    assert all(p.is_meta for p in remote.model.parameters())
    (checkpoint,) = [p for p in os.listdir(tmp_path) if p.endswith(".ckpt")]
    assert (tmp_path / checkpoint).is_dir()  # over the limit, "auto" checkpoints are sharded
    with pytest.raises(WeightsError, match="ckpt_path"):
        trainer(strategy(), 1).validate(remote, H.padded_data(seed=1))
    trainer(None, 1).validate(local, H.padded_data(seed=1))
    trainer(strategy(), 1).validate(remote, H.padded_data(seed=1), ckpt_path=str(tmp_path / checkpoint))
    assert_same_losses(local.val_losses, remote.val_losses[-len(local.val_losses) :], TOL)


class _KillAtEpoch(L.Callback):
    """Kills one worker at the end of an epoch, before ``ModelCheckpoint`` saves (it runs last)."""

    def __init__(self, pid: int, epoch: int) -> None:
        self.pid, self.epoch = pid, epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            os.kill(self.pid, signal.SIGKILL)


def test_a_worker_lost_during_a_save_leaves_the_previous_checkpoint_whole(pretrained, start_workers, tmp_path):
    workers = start_workers(2)
    strategy = RemoteModelParallelStrategy(
        hosts=workers.addresses, split=["model"], pretrained=pretrained, state_dict_type="sharded", heartbeat_timeout=3
    )
    callbacks = [_KillAtEpoch(workers.procs[1].pid, 1), ModelCheckpoint(dirpath=tmp_path, save_last=True)]
    with pytest.raises(LrmpError):
        trainer(strategy, 2, enable_checkpointing=True, callbacks=callbacks).fit(loaded(pretrained), H.padded_data())
    last = tmp_path / "last.ckpt"
    manifest = json.loads((last / "lrmp-checkpoint.json").read_text())
    assert all((last / f["file"]).is_file() for f in manifest["files"])
    assert torch.load(last / "lightning.ckpt", weights_only=False)["epoch"] == 0  # the first epoch's, whole
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_a_run_removes_the_unfinished_checkpoints_a_crashed_run_left_and_nothing_else(pretrained, pool, tmp_path):
    """Hidden directories of a save that never finished (a worker killed mid-save, a driver that
    died) go at a run's first save there; one that holds a file lrmp never writes stays."""
    ours = tmp_path / ".last.ckpt.lrmp-partial-0123abcd"
    ours.mkdir()
    (ours / "model-stage0.safetensors").write_bytes(b"half")
    (ours / ".model-stage1.safetensors.partial").write_bytes(b"half")
    replaced = tmp_path / ".epoch=0.ckpt.lrmp-old-89abcdef"
    replaced.mkdir()
    (replaced / "lightning.ckpt").write_bytes(b"old")
    theirs = tmp_path / ".notes.lrmp-partial-ffffffff"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:2], split=["model"], pretrained=pretrained, state_dict_type="sharded"
    )
    trainer(strategy, 1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path)]).fit(
        loaded(pretrained), H.padded_data()
    )
    assert not ours.exists() and not replaced.exists()
    assert (theirs / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".notes.lrmp-partial-ffffffff", "epoch=0-step=2.ckpt"]


def test_weights_of_another_model_are_refused_naming_the_tensor_and_the_file(pretrained, pool, tmp_path):
    other = tmp_path / "other"
    H.llama(tie_word_embeddings=False, intermediate_size=48).save_pretrained(other)
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], pretrained=str(other))
    with pytest.raises(WeightsError, match=r"mlp\.\w+_proj\.weight.*model\.safetensors.*shape"):
        trainer(strategy, 1).fit(loaded(pretrained), H.padded_data())


def test_a_meta_model_without_its_weights_is_refused_before_training(pretrained, pool, tmp_path):
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"])
    model = loaded(pretrained, meta=True)
    model.model.name_or_path = ""  # built from a config alone: no directory to read
    with pytest.raises(WeightsError, match="meta device.*pretrained="):
        trainer(strategy, 1).fit(model, H.padded_data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], pretrained=str(tmp_path / "nowhere"))
    with pytest.raises(WeightsError, match="nowhere.* does not exist"):
        trainer(strategy, 1).fit(loaded(pretrained), H.padded_data())


def test_a_sharded_checkpoint_exports_to_transformers_and_consolidates_into_one_file(pretrained, pool, tmp_path):
    """``lrmp-checkpoint export`` writes save_pretrained's layout that ``from_pretrained`` loads with
    the trained values; ``consolidate`` writes the single file a full checkpoint would have been."""
    from lightning_remote_mp.model.convert import consolidate, main

    local = local_run(pretrained, 1)
    remote = loaded(pretrained, meta=True)
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:2], split=["model"], pretrained=pretrained, state_dict_type="sharded"
    )
    trainer(strategy, 1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt")]).fit(
        remote, H.padded_data()
    )
    (checkpoint,) = (tmp_path / "ckpt").iterdir()
    main(["export", str(checkpoint), str(tmp_path / "hf"), "--max-shard-size", "20KB"])
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = shards_of(tmp_path / "hf")
    assert len(set(index["weight_map"].values())) > 2  # by size, not one per stage
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in shards.values())
    main(["export", str(checkpoint), str(tmp_path / "one")])  # save_pretrained's default: one file for a small model
    assert sorted(os.listdir(tmp_path / "one")) == ["config.json", "model.safetensors"]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, value in local.model.state_dict().items():
        torch.testing.assert_close(exported.state_dict()[name], value, rtol=0, atol=1e-4)
    consolidate(checkpoint, tmp_path / "full.ckpt")
    full = torch.load(tmp_path / "full.ckpt", weights_only=False)
    fresh = loaded(pretrained)
    fresh.load_state_dict(full["state_dict"])  # strict: every key is there
    assert_same_weights(local, fresh, 1e-4)
    adam = full["optimizer_states"][0]["state"]
    assert len(adam) == len(list(local.parameters())) and all("exp_avg" in s for s in adam.values())


def test_a_lora_adapter_exports_alone_and_peft_loads_it(pretrained, pool, tmp_path):
    import peft

    def lora() -> H.FineTune:
        model = loaded(pretrained)
        torch.manual_seed(1)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, modules_to_save=["lm_head"]
        )
        return H.FineTune(peft.get_peft_model(model.model, config), "lm", lr=0.01, optimizer="AdamW")

    remote = lora()
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:2], split=["model"], pretrained=pretrained, state_dict_type="sharded"
    )
    trainer(strategy, 1, enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt")]).fit(
        remote, H.padded_data()
    )
    (checkpoint,) = (tmp_path / "ckpt").iterdir()
    from lightning_remote_mp.model.convert import export_pretrained

    written = export_pretrained(checkpoint, tmp_path / "adapter")
    assert sorted(written) == ["adapter_config.json", "adapter_model.safetensors"]
    # The same tensors, under the same names, as peft's own save_pretrained writes
    remote.model.save_pretrained(tmp_path / "peft")
    ours, peft_own = (
        load_file(tmp_path / "adapter" / "adapter_model.safetensors"),
        load_file(tmp_path / "peft" / "adapter_model.safetensors"),
    )
    assert sorted(ours) == sorted(peft_own) and any("lm_head" in k for k in ours), sorted(ours)
    base = AutoModelForCausalLM.from_pretrained(pretrained)
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    trained = {k: v for k, v in remote.model.named_parameters() if v.requires_grad}
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in trained.items())
    assert any("modules_to_save" in k for k in trained)
    for name, value in trained.items():
        torch.testing.assert_close(reloaded.state_dict()[name], value, rtol=0, atol=0)


def test_a_tied_model_resumes_from_a_sharded_checkpoint_and_consolidates(pool, tmp_path):
    """Llama with tied embeddings: the tie is saved once and found again under either name, on
    another number of stages, and in the consolidated file."""
    from lightning_remote_mp.model.convert import consolidate

    torch.manual_seed(0)
    local = H.FineTune(H.llama(), "lm", lr=0.01, optimizer="AdamW")
    first, second = (H.FineTune(H.llama(), "lm", lr=0.01, optimizer="AdamW") for _ in range(2))
    first.load_state_dict(local.state_dict())
    trainer(None, 4).fit(local, H.padded_data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:3], split=["model"], state_dict_type="sharded")
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(strategy, 2, enable_checkpointing=True, callbacks=[checkpoints]).fit(first, H.padded_data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"])
    trainer(strategy, 4).fit(second, H.padded_data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert_same_losses(local.losses, first.losses + second.losses, TOL)
    assert_same_weights(local, second, 1e-4)
    consolidate(tmp_path / "last.ckpt", tmp_path / "full.ckpt")
    full = torch.load(tmp_path / "full.ckpt", weights_only=False)["state_dict"]
    assert full.keys() == first.state_dict().keys()
    assert full["model.lm_head.weight"] is full["model.model.embed_tokens.weight"]


def test_weights_that_do_not_come_back_are_saved_by_the_workers_if_no_checkpoint_has_them(pretrained, pool, tmp_path):
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], pretrained=pretrained, gather_limit=1)
    trainer(strategy, 1, default_root_dir=str(tmp_path)).fit(loaded(pretrained), H.padded_data())
    (saved,) = [p for p in os.listdir(tmp_path) if p.startswith("lrmp-last-step=")]
    assert (tmp_path / saved / "lrmp-checkpoint.json").is_file()


@pytest.mark.parametrize("copy", [False, True], ids=["streamed", "own-copy"])
def test_a_worker_that_cannot_see_the_files_gets_its_tensors_from_the_driver_a_window_at_a_time(
    pretrained, pool, monkeypatch, caplog, tmp_path, copy
):
    """One worker runs in a mount namespace where the pretrained directory is an empty tmpfs (as on
    a machine without the files): the driver sends that stage's tensors from its memory-mapped
    files, a few KB at a time here, and training still equals local training. With its own copy
    elsewhere (``--weights-root``) the worker reads that, and the driver sends nothing."""
    import shutil
    import subprocess
    import time

    from lrmp_lan import WORKER_OUTPUT, free_port, worker_command

    from lightning_remote_mp.driver import placement
    from lightning_remote_mp.driver.launch import WorkerOutput

    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("mount namespaces cannot be made here (unshare --mount)")
    port = free_port()
    argv = worker_command("--bind", f"tcp://127.0.0.1:{port}", "--allow-module", "lrmp_testlayers")
    if copy:
        shutil.copytree(pretrained, tmp_path / "copy")
        argv += ["--weights-root", f"{pretrained}={tmp_path / 'copy'}"]
    script = f'mount -t tmpfs none "{pretrained}" && exec "$@"'
    proc = subprocess.Popen(["unshare", "--mount", "sh", "-c", script, "sh", *argv], **WORKER_OUTPUT)
    try:
        blind = WorkerOutput(proc).wait_ready(time.monotonic() + 120)
        monkeypatch.setattr(placement, "STREAM_WINDOW", 8192)
        local = local_run(pretrained, 1)
        remote = loaded(pretrained, meta=True)
        strategy = RemoteModelParallelStrategy(
            hosts=[pool[0], blind], split=["model"], microbatches=2, pretrained=pretrained
        )
        trainer(strategy, 1).fit(remote, H.padded_data())
        assert_same_losses(local.losses, remote.losses, TOL)
        said = [r.getMessage() for r in caplog.records if "this driver sends its" in r.getMessage()]
        if copy:
            assert not said
        else:
            assert len(said) == 1 and "(stage 1)" in said[0] and pretrained in said[0], said
    finally:
        proc.kill()
        proc.wait(10)


def test_a_weights_root_that_cannot_work_stops_the_worker_naming_it(tmp_path):
    import subprocess
    import sys

    def run(value: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "lightning_remote_mp.worker", "--weights-root", value]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    plain = run("/models")
    assert plain.returncode == 2 and "give DRIVER_DIR=LOCAL_DIR, both absolute" in plain.stderr
    absent = run(f"/models={tmp_path / 'absent'}")
    assert absent.returncode == 2 and f"{tmp_path / 'absent'} is no directory on this machine" in absent.stderr


class _SavesAtStart(L.Callback):
    def __init__(self, path) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


def test_a_checkpoint_of_a_meta_model_before_its_first_call_is_refused(pretrained, pool, tmp_path):
    """Before its first call a traced meta module is on no worker, so no process holds its weights:
    a checkpoint then (the Tuner saves one) is refused, naming the module and what to do."""
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], pretrained=pretrained)
    run = trainer(strategy, 1, callbacks=[_SavesAtStart(tmp_path / "early.ckpt")])
    with pytest.raises(WeightsError, match="would hold no weights of 'model': it is on the meta device"):
        run.fit(loaded(pretrained, meta=True), H.padded_data())
    assert not (tmp_path / "early.ckpt").exists()
