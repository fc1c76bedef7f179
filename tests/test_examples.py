"""The examples run as documented: the LightningCLI configs, the digits classifier, the demo, the GPTs.

Everything runs in this process (the examples' ``main`` functions) on local workers over loopback:
the ones the strategy starts by itself, or the suite's shared ones (``pool``) given as hosts.
``multi_machine.yaml`` names addresses of other machines: it is only printed and parsed, never fitted.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
from types import ModuleType

import pytest
import yaml

from lightning_remote_mp import RemoteModelParallelStrategy

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
CONFIGS = os.path.join(EXAMPLES, "configs")
MULTI_MACHINE_HOSTS = ["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"]


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` under a name of its own (``lrmp_example_<name>``)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # the examples import residual_model from beside them
    module_name = f"lrmp_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, os.path.join(EXAMPLES, f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


@pytest.fixture
def cli(monkeypatch):
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse: pip install -e '.[examples]'")
    monkeypatch.setattr(sys, "argv", ["cli.py"])  # the CLI reads its arguments from `args` alone
    return load_example("cli")


QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


@pytest.mark.timeout(120)
def test_cli_fit_then_validate_with_local_yaml(cli, tmp_path):
    local = os.path.join(CONFIGS, "local.yaml")
    small = ["--trainer.max_epochs", "2", "--trainer.limit_train_batches", "6", "--model.width", "32"]
    root = ["--trainer.default_root_dir", str(tmp_path)]

    fitted = cli.main(["fit", "--config", local, *small, *root, *QUIET])
    strategy = fitted.trainer.strategy
    assert isinstance(strategy, RemoteModelParallelStrategy)
    assert strategy.hosts is None and strategy.local_workers.count == 2 and strategy.balance == "memory"
    assert strategy.session is None and strategy._workers is None  # the local workers were stopped
    assert fitted.trainer.global_step == 2 * 6
    fit_metrics = {k: float(v) for k, v in fitted.trainer.callback_metrics.items()}
    assert {"train_loss", "val_loss", "val_acc"} <= fit_metrics.keys()
    ckpt = fitted.trainer.checkpoint_callback.best_model_path
    assert ckpt and os.path.exists(ckpt)

    # The checkpoint of the remote run, validated on fresh local workers, scores what fit's last
    # validation scored.
    validated = cli.main(["validate", "--config", local, "--model.width", "32", "--ckpt_path", ckpt, *root, *QUIET])
    metrics = {k: float(v) for k, v in validated.trainer.callback_metrics.items()}
    assert metrics["val_loss"] == pytest.approx(fit_metrics["val_loss"], abs=1e-5)
    assert metrics["val_acc"] == pytest.approx(fit_metrics["val_acc"], abs=1e-6)
    assert validated.trainer.strategy._workers is None


@pytest.mark.timeout(60)
def test_cli_print_config_shows_the_multi_machine_hosts(cli, capsys):
    multi = os.path.join(CONFIGS, "multi_machine.yaml")
    with pytest.raises(SystemExit) as done:
        cli.main(["fit", "--config", multi, "--print_config"])
    assert done.value.code in (0, None)
    printed = capsys.readouterr().out
    for host in MULTI_MACHINE_HOSTS:
        assert host in printed
    strategy = yaml.safe_load(printed)["trainer"]["strategy"]
    assert strategy["class_path"] == "lightning_remote_mp.RemoteModelParallelStrategy"
    assert strategy["init_args"]["hosts"] == MULTI_MACHINE_HOSTS
    assert strategy["init_args"]["balance"] == [5, 5] and strategy["init_args"]["microbatches"] == 4

    # Building the Trainer from it contacts nobody (workers are contacted when fit sets up).
    built = cli.main(["--config", multi], run=False)
    assert isinstance(built.trainer.strategy, RemoteModelParallelStrategy)
    assert built.trainer.strategy.hosts == MULTI_MACHINE_HOSTS and built.trainer.strategy.session is None


@pytest.mark.timeout(120)
def test_digits_classifier_reaches_95_percent_validation_accuracy(pool):
    pytest.importorskip("sklearn", reason="the digits example needs scikit-learn: pip install -e '.[examples]'")
    digits = load_example("digits")
    # On two of the suite's shared local workers, as `--hosts` would (the zero-config start of
    # local workers is covered by the CLI test and the quickstart).
    metrics = digits.main(epochs=5, hosts=pool[:2])
    assert metrics["val_acc"] >= 0.95, metrics


@pytest.fixture
def restore_lrmp_log_level():
    logger = logging.getLogger("lightning_remote_mp")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.mark.timeout(120)
def test_demo_trains_and_its_loss_falls(monkeypatch, capsys, restore_lrmp_log_level, pool):
    demo = load_example("demo")
    monkeypatch.setattr(sys, "argv", ["demo.py", "--epochs", "2", "--hosts", *pool[:2]])
    demo.main()
    out = capsys.readouterr().out
    losses = [float(m) for m in re.findall(r"mean loss (\d+\.\d+)", out)]
    assert len(losses) == 2, out
    assert losses[-1] < losses[0], losses
    assert "training accuracy of the returned model" in out


@pytest.mark.timeout(120)
def test_char_gpt_learns_on_four_workers(pool):
    char_gpt = load_example("char_gpt")
    model, sample = char_gpt.main(steps=24, hosts=pool[:4])
    first, last = sum(model.losses[:4]) / 4, sum(model.losses[-4:]) / 4
    assert last < first - 0.5, model.losses
    assert sample.startswith("def ") and len(sample) == 4 + 120


@pytest.mark.timeout(120)
def test_hf_gpt2_traced_unchanged_learns_on_two_workers(pool):
    transformers = pytest.importorskip("transformers", reason="the example needs transformers: pip install -e '.[hf]'")
    hf_gpt2 = load_example("hf_gpt2")
    module, sample = hf_gpt2.main(steps=16, hosts=pool[:2], log_every=0, sample_bytes=8)
    first, last = sum(module.losses[:4]) / 4, sum(module.losses[-4:]) / 4
    assert len(module.losses) == 16 and last < first - 1.0, module.losses
    # After fit the model is local again: a plain GPT2LMHeadModel with its own forward and keys.
    assert type(module.model) is transformers.GPT2LMHeadModel and "forward" not in vars(module.model)
    assert "model.transformer.h.0.attn.c_attn.weight" in module.state_dict()
    assert sample.startswith(b"def ") and len(sample) == 4 + 8


@pytest.mark.timeout(180)
@pytest.mark.parametrize("adapter", ["", "lora", "qlora"])
def test_finetune_pretrained_exports_a_model_transformers_loads(pool, tmp_path, adapter):
    """The real workflow for a model bigger than the driver: weights read by the workers, sharded
    checkpoints, an export that from_pretrained (or peft, over the 4-bit base with QLoRA) loads."""
    pytest.importorskip("transformers", reason="the example needs transformers: pip install -e '.[hf]'")
    if adapter == "qlora":
        pytest.importorskip("bitsandbytes", reason="--qlora needs bitsandbytes: pip install -e '.[qlora]'")
    finetune = load_example("finetune_pretrained")
    exported = finetune.main(
        hosts=pool[:2], lora=adapter == "lora", qlora=adapter == "qlora", epochs=1, workdir=str(tmp_path)
    )
    expected = ["adapter_config.json", "adapter_model.safetensors"] if adapter else ["config.json"]
    assert all(os.path.isfile(os.path.join(exported, name)) for name in expected)
