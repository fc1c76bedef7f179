"""``generate()`` on a split model (issue #48): transformers' own generation in ``predict_step`` and
``validation_step``, the key/value cache on the stages, every decoding mode equal to the same model's
``generate()`` in one process, token for token.

The prompts are right-padded rows of different lengths, as `lrmp_hf.Padded` makes them (generate's
positions skip the padding, which the workers' programs take as an input).
"""

from __future__ import annotations

import copy
import os
import signal
import statistics
import threading
import time

import pytest
import torch

pytest.importorskip("transformers")

import lrmp_hf as H  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from test_strategy import assert_same_losses, trainer  # noqa: E402

from lightning_remote_mp import RemoteModelParallelStrategy  # noqa: E402
from lightning_remote_mp.errors import LrmpError, TraceError  # noqa: E402

PROMPT, NEW = 6, 5


def prompts(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": batch["input_ids"][:, :PROMPT], "attention_mask": batch["attention_mask"][:, :PROMPT]}


class Writes(H.FineTune):
    """Fine-tunes as `lrmp_hf.FineTune` does, and writes: greedy, beam search and sampling in
    ``predict_step``; greedy in ``validation_step`` (kept in ``written``) beside the loss."""

    def __init__(self, model: torch.nn.Module, **kwargs) -> None:
        super().__init__(model, "lm", **kwargs)
        self.written: list[torch.Tensor] = []

    def predict_step(self, batch, batch_idx):
        p = prompts(batch)
        greedy = self.model.generate(**p, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        beams = self.model.generate(
            **p, max_new_tokens=NEW - 1, num_beams=2, num_return_sequences=2, do_sample=False, pad_token_id=0
        )
        torch.manual_seed(batch_idx)
        sampled = self.model.generate(
            **p, max_new_tokens=NEW, do_sample=True, top_k=10, top_p=0.9, temperature=0.8, pad_token_id=0
        )
        return greedy, beams, sampled

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.written.append(self.model.generate(**prompts(batch), max_new_tokens=NEW, do_sample=False, pad_token_id=0))


def assert_same_writing(local: list, remote: list) -> None:
    assert len(local) == len(remote) and local
    for a, b in zip(local, remote):
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(x, y), (x.tolist(), y.tolist())


FAMILIES = {"llama": (H.llama, 2), "gpt2": (H.gpt2, 1), "mixtral": (H.mixtral, 1), "lora_llama": (H.lora_llama, 2)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_decoding_mode_writes_what_the_model_writes_in_one_process(family, pool):
    """Greedy, beam search with several returned sequences, and seeded sampling with temperature,
    top-k and top-p, in ``predict_step``: the same tokens as the same model's ``generate()`` locally
    (a peft model's ``generate`` calls the model it wraps, whose steps go through the workers too)."""
    build, microbatches = FAMILIES[family]
    torch.manual_seed(0)
    local = Writes(build())
    remote = copy.deepcopy(local)
    data = H.padded_data(n=8, batch=4)
    want = trainer(None, 1).predict(local, data)
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=microbatches)
    assert_same_writing(want, trainer(strategy, 1).predict(remote, data))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_generation_in_validation_between_training_steps_shares_the_trained_weights(checkpointing, pool):
    """A validation that generates, before training and after each epoch: the losses, the
    validation losses and the words written all equal local training's; with transformers' gradient
    checkpointing on too (the workers recompute each decoder layer; generation runs without it). Six
    layers: the trace exports four and copies the others (`lightning_remote_mp.model.repeats`), in
    training, prefill and decoding."""
    torch.manual_seed(0)
    model = H.llama(num_hidden_layers=6)
    if checkpointing:
        model.gradient_checkpointing_enable()
    local = Writes(model, lr=0.01, optimizer="AdamW")
    remote = copy.deepcopy(local)
    trainer(None, 2, num_sanity_val_steps=1).fit(local, H.padded_data(), H.padded_data(n=4, seed=1))
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=2)
    trainer(strategy, 2, num_sanity_val_steps=1).fit(remote, H.padded_data(), H.padded_data(n=4, seed=1))
    assert_same_losses(local.losses, remote.losses, 2e-5)
    assert_same_losses(local.val_losses, remote.val_losses, 2e-5)
    assert_same_writing(local.written, remote.written)


def test_a_model_past_the_gather_limit_writes_from_its_sharded_checkpoint(pool, tmp_path):
    """After ``fit`` a model larger than ``gather_limit`` is on the meta device here: ``predict``
    with ``ckpt_path=`` generates from the weights the workers read from the checkpoint."""
    torch.manual_seed(0)
    local = Writes(H.llama(), lr=0.01, optimizer="AdamW")
    remote = copy.deepcopy(local)
    trainer(None, 1).fit(local, H.padded_data())
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], state_dict_type="sharded", gather_limit=1)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    trainer(strategy, 1, enable_checkpointing=True, callbacks=[checkpoints]).fit(remote, H.padded_data())
    assert all(p.is_meta for p in remote.model.parameters())
    data = H.padded_data(n=4, batch=4)
    want = trainer(None, 1).predict(local, data)
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"])
    got = trainer(strategy, 1).predict(remote, data, ckpt_path=str(tmp_path / "last.ckpt"))
    assert_same_writing(want, got)


class WritesInTraining(Writes):
    """Writes (greedy) in ``training_step`` too, where the model is in train mode, before its loss."""

    def training_step(self, batch, batch_idx):
        self.written.append(self.model.generate(**prompts(batch), max_new_tokens=NEW, do_sample=False, pad_token_id=0))
        return super().training_step(batch, batch_idx)


def test_generation_is_traced_in_the_mode_it_runs_in(pool, monkeypatch):
    """``generate()``'s steps, like every call, are exported in the one mode they run in (eval in
    validation, train in ``training_step``): each writes what the model writes in one process, and
    the two modes' steps are traced apart."""
    from lightning_remote_mp.model import calls

    modes = []
    trace = calls.trace_module

    def recording(module, args, kwargs, name, **kw):
        modes.append(kw.get("modes", ("train", "eval")))
        return trace(module, args, kwargs, name, **kw)

    monkeypatch.setattr(calls, "trace_module", recording)
    torch.manual_seed(0)
    local = WritesInTraining(H.llama(), lr=0.01, optimizer="AdamW")
    remote = copy.deepcopy(local)
    options = dict(limit_train_batches=2, limit_val_batches=1)
    trainer(None, 1, **options).fit(local, H.padded_data(), H.padded_data(n=4, seed=1))
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"], microbatches=2)
    trainer(strategy, 1, **options).fit(remote, H.padded_data(), H.padded_data(n=4, seed=1))
    assert_same_writing(local.written, remote.written)
    # prefill and decode in train mode (the prefill is the first call: placed first), the training
    # call in train mode, then validation's call, prefill and decode in eval mode
    assert modes == [("train",), ("train",), ("train",), ("eval",), ("eval",), ("eval",)], modes


def test_generate_with_a_transformers_whose_cache_preparation_changed_is_refused_naming_it(pool):
    """The ledger of private APIs (docs/private_apis.md): lrmp replaces transformers'
    ``_prepare_cache_for_generation`` while a model is split. A transformers whose method takes
    other arguments (an older one's ``assistant_model`` and ``device``) gets a `TraceError` naming
    both signatures at ``generate()``, and training, which does not use it, is untouched."""
    from transformers import LlamaForCausalLM

    class Older(LlamaForCausalLM):
        def _prepare_cache_for_generation(  # noqa: PLR0913 (transformers 4.4x's)
            self, generation_config, model_kwargs, assistant_model, batch_size, max_cache_length, device
        ):
            raise AssertionError("never called through the workers")

    torch.manual_seed(0)
    model = Writes(Older(H.llama().config))
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"])
    trainer(strategy, 1, limit_train_batches=1).fit(model, H.padded_data())
    assert len(model.losses) == 1
    with pytest.raises(
        TraceError,
        match=r"_prepare_cache_for_generation\(self, generation_config, model_kwargs, "
        r"assistant_model.*transformers 5\.24",
    ):
        trainer(RemoteModelParallelStrategy(hosts=pool[:2], split=["model"]), 1).predict(model, H.padded_data(n=4))


class Shapes(H.FineTune):
    """Generates from prompts of other lengths and batch sizes and other ``max_new_tokens``, greedy."""

    def predict_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return tuple(
            self.model.generate(ids[:rows, :length], max_new_tokens=new, do_sample=False, pad_token_id=0)
            for rows, length, new in ((4, 6, 5), (1, 9, 3), (3, 4, 7))
        )


def test_a_deep_model_traces_its_prefill_and_decode_step_once_whatever_the_shapes(pool, monkeypatch):
    """80 decoder layers (issue #60): three generations of other batch sizes, prompt lengths and
    ``max_new_tokens`` trace the prefill and the decode step once each, at four layers of the 80,
    and write what the same model writes in one process."""
    from lightning_remote_mp.model import calls

    traced = []
    trace = calls.trace_module

    def counting(module, args, kwargs, name, **options):
        out = trace(module, args, kwargs, name, **options)
        traced.append(len(out.entries))
        return out

    monkeypatch.setattr(calls, "trace_module", counting)
    torch.manual_seed(0)
    local = Shapes(H.llama(num_hidden_layers=80, hidden_size=16, intermediate_size=32))
    remote = copy.deepcopy(local)
    data = H.padded_data(n=4, batch=4)
    want = trainer(None, 1).predict(local, data)
    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"])
    assert_same_writing(want, trainer(strategy, 1).predict(remote, data))
    assert traced == [84, 84]  # the prefill and the decode step: embeddings, rotary, 80 layers, norm, head


#: The tokens each of `ManyWrites`' generations makes room for (its cache's capacity, allocated at its
#: first token: half a MB a stage), of which it writes NEW (a stopping criterion ends it).
ROOM = 2048


class ManyWrites(H.FineTune):
    """50 generations in a predict step; ``finished`` counts those done (the test's memory sampler reads it)."""

    finished = 0

    def predict_step(self, batch, batch_idx):
        from transformers import StoppingCriteria, StoppingCriteriaList

        class AfterNew(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), input_ids.shape[1] >= PROMPT + NEW, dtype=torch.bool)

        out = []
        for _ in range(50):
            out.append(
                self.model.generate(
                    **prompts(batch),
                    max_new_tokens=ROOM,
                    stopping_criteria=StoppingCriteriaList([AfterNew()]),
                    do_sample=False,
                    pad_token_id=0,
                )
            )
            self.finished += 1
        return out


def test_caches_are_freed_when_generate_returns_and_bounded_before_the_first_token(start_workers):
    """50 generations leave no cache behind (the workers' memory does not grow after the first few:
    each makes room for `ROOM` tokens, so 50 left behind would be 25 MB a stage), and a generation
    that cannot fit is refused before its first token, saying what fits."""
    workers = start_workers(2)
    torch.manual_seed(0)
    model = ManyWrites(H.llama(max_position_embeddings=PROMPT + ROOM + 8), "lm")
    strategy = RemoteModelParallelStrategy(hosts=workers.addresses, split=["model"])
    samples: list[list[int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if model.finished >= 10:
                samples.append([_rss_anon(p.pid) for p in workers.procs])
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = trainer(strategy, 1).predict(model, H.padded_data(n=4, batch=4))
    finally:
        done.set()
        sampler.join()
    assert len(out[0]) == 50 and all(torch.equal(o, out[0][0]) for o in out[0])
    assert out[0][0].shape[1] == PROMPT + NEW
    # Sampled from the 10th generation on: a fixed share of the run's time was not enough on a loaded
    # machine (the workers still grew from the traces and first generations a third into it).
    tenth = max(1, len(samples) // 10)
    for worker in range(2):
        # What it holds at the end against what it held then, each a median of a tenth of the samples:
        # a cache left behind per generation stays, a message queued a moment on a loaded machine does not.
        before = statistics.median(s[worker] for s in samples[:tenth])
        grown = statistics.median(s[worker] for s in samples[-tenth:]) - before
        assert grown < 8 * 2**20, f"worker {worker} grew by {grown / 2**20:.1f} MB over the generations"
    huge = ManyWrites(H.llama(max_position_embeddings=2**30), "lm")

    class Huge(ManyWrites):
        def predict_step(self, batch, batch_idx):
            return self.model.generate(**prompts(batch), max_new_tokens=2**28, do_sample=False, pad_token_id=0)

    huge = Huge(H.llama(max_position_embeddings=2**30), "lm")
    strategy = RemoteModelParallelStrategy(hosts=workers.addresses, split=["model"])
    with pytest.raises(LrmpError, match=r"cache of 26843\d+ tokens .* about \d+ tokens fit"):
        trainer(strategy, 1).predict(huge, H.padded_data(n=4, batch=4))


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def test_decoding_that_rewinds_the_cache_is_refused_naming_it(pool):
    class PromptLookup(H.FineTune):  # assisted decoding with the prompt as the assistant
        def predict_step(self, batch, batch_idx):
            return self.model.generate(**prompts(batch), max_new_tokens=2, prompt_lookup_num_tokens=2, pad_token_id=0)

    strategy = RemoteModelParallelStrategy(hosts=pool[:2], split=["model"])
    with pytest.raises(TraceError, match="assisted generation rewinds or reads the key/value cache"):
        trainer(strategy, 1).predict(PromptLookup(H.llama(), "lm"), H.padded_data(n=4, batch=4))


def test_a_worker_killed_during_generation_is_named(start_workers):
    workers = start_workers(2)

    class Slow(H.FineTune):
        def predict_step(self, batch, batch_idx):
            if batch_idx == 1:
                os.kill(workers.procs[1].pid, signal.SIGKILL)
            return self.model.generate(**prompts(batch), max_new_tokens=NEW, do_sample=False, pad_token_id=0)

    strategy = RemoteModelParallelStrategy(hosts=workers.addresses, split=["model"], heartbeat_timeout=3.0)
    started = time.monotonic()
    with pytest.raises(LrmpError, match=rf"worker {workers.addresses[1]} \(stage 1\) (died|stopped answering)"):
        trainer(strategy, 1).predict(Slow(H.llama(), "lm"), H.padded_data(n=8, batch=4))
    assert time.monotonic() - started < 60
