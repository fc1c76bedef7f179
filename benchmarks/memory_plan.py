"""``lrmp-plan``'s prediction against what each worker measures (issue #59): three ways of fine-tuning
one small Llama, each planned from its config by `lightning_remote_mp.driver.memory_plan.plan_memory`
and then trained through lrmp on two fresh local workers.

The model is a LlamaForCausalLM at a shape where activations and logits matter (hidden 256, 6
layers, 4 heads, 2 key/value heads, intermediate 704, vocabulary 16,384, untied), trained on 2
micro-batches of 1 x 2,048 random tokens (``labels=`` the ids), GPipe, AdamW, 3 steps (the peak comes
with the second, once AdamW's moments exist), as:

- ``fp32 full``: every parameter trained, in float32;
- ``bf16 LoRA``: the base in bfloat16, peft's LoRA r=8 on all linear layers (its adapters float32);
- ``QLoRA``: the base quantized by bitsandbytes to NF4 with double quantization (compute float32),
  ``prepare_model_for_kbit_training``, LoRA r=8 on all linear layers, as tests/test_qlora.py builds it.

The plan (``stages=2``) splits the layers and the run places them that way
(``balance=`` the unit where stage 1 starts). It plans the loss as this lrmp computes it: in chunks
(`lightning_remote_mp.model.head_loss`, 0.16.0), or over whole logits before that module.

Measured: each worker's peak above the bare worker. Before ``fit`` (workers started, torch imported,
nothing placed: a few hundred MB each, not in the plan) this script reads each worker's ``RssAnon``
and resets its peak (``/proc/PID/clear_refs``, as benchmarks/memory.py does); after ``fit`` it reads
the peak (``VmHWM``, anonymous and file pages together) and takes off the file and shared pages the
worker has then (``RssFile``, ``RssShmem``: torch's libraries, paged in as they are first used) and
the ``RssAnon`` before: the peak of the memory the run added (while writing this, ``RssAnon`` read
every 5 ms gave the same within 2 MB). The plan predicts what the model adds; the worker's own
session (the received programs, the messages in flight, Python's objects: about 25 MB with a
model of nothing) is in the measurement and not in the plan. Each case runs ``--repeats`` times (3)
in fresh processes: the table gives the median and the range.

    python benchmarks/memory_plan.py            # the three cases, 3 runs each: ~6 min on 2 cores
    python benchmarks/memory_plan.py --quick    # a smaller shape (2 layers, 512 tokens): a smoke run
    python benchmarks/memory_plan.py --cases "fp32 full"
    python benchmarks/memory_plan.py --arenas 1   # the workers' threads share one glibc heap

``--arenas 1`` (``MALLOC_ARENA_MAX=1``) runs the workers with one glibc heap for all their threads.
Before 0.16.2 it mattered: a worker's activations came from its heaps, and the peak varied from run
to run with which thread allocated where. Now a worker maps its large tensors apart
(`lightning_remote_mp.worker.allocator`), and the peaks come out the same with or without it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, exit_now, exit_on_sigterm, markdown_table, median, spread, timed_trainer  # noqa: E402

CASES = {
    "fp32 full": {"dtype": "float32"},
    "bf16 LoRA": {"dtype": "bfloat16", "lora_rank": 8},
    "QLoRA": {"dtype": "float32", "lora_rank": 8, "quantization": "nf4", "double_quant": True},
}
#: (hidden, intermediate, layers, heads, key/value heads, vocabulary, tokens per sequence)
SHAPE = (256, 704, 6, 4, 2, 16384, 2048)
QUICK_SHAPE = (128, 384, 2, 2, 1, 8192, 512)
MICROBATCHES, ROWS, STEPS = 2, 1, 3
MB = 1e6


def _status(pid: int) -> dict[str, int]:
    """``VmHWM``, ``RssAnon``, ``RssFile`` and ``RssShmem`` of ``/proc/PID/status``, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS


def config_of(shape: tuple[int, ...]):
    from transformers import LlamaConfig

    hidden, intermediate, layers, heads, kv_heads, vocab, seq = shape
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
    )


def build(case: str, config, directory: str):
    """The model of ``case``, as people build it: a LoRA model's adapters made by peft."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    if case == "bf16 LoRA":
        return peft.get_peft_model(model.to(torch.bfloat16), lora)
    if case == "QLoRA":
        model.save_pretrained(directory)
        four_bit = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )
        model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=four_bit)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        return peft.get_peft_model(model, lora)
    return model


def chunked_loss() -> bool:
    """Whether this lrmp computes a ``labels=`` loss in chunks (`lightning_remote_mp.model.head_loss`)
    or, before that module, over whole logits: the plan is told which."""
    import importlib.util

    return importlib.util.find_spec("lightning_remote_mp.model.head_loss") is not None


def child(case: str, quick: bool) -> None:
    """One case in this process, with two fresh workers: prints one JSON line."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, Dataset

    from lightning_remote_mp import RemoteModelParallelStrategy
    from lightning_remote_mp.driver.launch import LocalWorkers
    from lightning_remote_mp.driver.memory_plan import plan_memory

    torch.set_num_threads(1)
    shape = QUICK_SHAPE if quick else SHAPE
    seq, vocab = shape[-1], shape[-2]
    steps = 2 if quick else STEPS
    config = config_of(shape)
    options = dict(seq_len=seq, rows=ROWS, microbatches=MICROBATCHES, schedule="gpipe")
    plan = plan_memory(config, stages=2, whole_logits=not chunked_loss(), **options, **CASES[case])

    class Tokens(Dataset):
        def __len__(self) -> int:
            return ROWS * MICROBATCHES * steps

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class FineTune(L.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model
            self.model.train()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    with tempfile.TemporaryDirectory() as directory:
        model = build(case, config, directory)
        prefix = "base_model.model." if CASES[case].get("lora_rank") else ""
        first = plan.stages[1].layers
        start = f"{prefix}{plan.shape.layers_path}.{first.start}" if len(first) else f"{prefix}model.norm"
        workers = LocalWorkers(2, devices=["cpu"] * 2, threads=1)
        workers.start()
        try:
            time.sleep(1.0)  # the workers settle after their ready line
            before = [_status(p.pid) for p in workers.procs]
            for p in workers.procs:
                _reset_peak(p.pid)
            strategy = RemoteModelParallelStrategy(
                hosts=workers.addresses, split=["model"], microbatches=MICROBATCHES, balance={"model": [start]}
            )
            started = time.monotonic()
            trainer = timed_trainer(strategy, steps, [])
            trainer.fit(FineTune(model), DataLoader(Tokens(), batch_size=ROWS * MICROBATCHES))
            seconds = time.monotonic() - started
            after = [_status(p.pid) for p in workers.procs]
        finally:
            workers.stop()
    stages = []
    for s, b, a in zip(plan.stages, before, after):
        measured = a["VmHWM"] - a["RssFile"] - a["RssShmem"] - b["RssAnon"]
        parts = {k: getattr(s, k) for k in ("base", "adapters", "gradients", "optimizer", "activations", "logits")}
        stages.append({"stage": s.index, "holds": s.pieces, "predicted": s.needs, "measured": measured} | parts)
    print(json.dumps({"case": case, "seconds": seconds, "bare": [b["RssAnon"] for b in before], "stages": stages}))
    exit_now(0)


def run(case: str, quick: bool, timeout: float, arenas: int = 0) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", case] + ["--quick"] * quick
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if arenas:  # the workers inherit it: glibc's heap arenas, one per thread by default (up to 8 per core)
        env["MALLOC_ARENA_MAX"] = str(arenas)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{case} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller shape: a smoke run")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--repeats", type=int, default=None, help="runs per case (default 3; --quick 1)")
    parser.add_argument("--arenas", type=int, default=0, help="MALLOC_ARENA_MAX for the workers (default: glibc's)")
    parser.add_argument("--out", default=None, help="ignored; kept for the smoke test's interface")
    parser.add_argument("--_child", choices=list(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._child:
        exit_on_sigterm()  # a terminated run still stops its workers
        child(args._child, args.quick)
    args.repeats = args.repeats or (1 if args.quick else 3)
    hidden, intermediate, layers, heads, kv_heads, vocab, seq = QUICK_SHAPE if args.quick else SHAPE
    print(environment())
    print(
        f"LlamaForCausalLM: hidden {hidden}, {layers} layers, {heads} heads ({kv_heads} key/value), intermediate "
        f"{intermediate}, vocab {vocab:,}, untied; {MICROBATCHES} micro-batches of {ROWS} x {seq:,} tokens, GPipe, "
        f"AdamW, {2 if args.quick else STEPS} steps, 2 local workers (1 thread each). Predicted: lrmp-plan's needs "
        f"({'the loss in chunks' if chunked_loss() else 'whole logits'}); measured: each worker's peak "
        f"above the bare worker (anonymous memory), the median of {args.repeats} runs (their range)"
        + (f"; MALLOC_ARENA_MAX={args.arenas}" if args.arenas else "")
        + ". MB"
    )
    rows = []
    for case in args.cases:
        runs = [run(case, args.quick, args.timeout, args.arenas) for _ in range(args.repeats)]
        for r in runs:
            print(
                f"{case}: {r['seconds']:.0f} s; bare workers {[round(b / MB) for b in r['bare']]} MB", file=sys.stderr
            )
        for i, s in enumerate(runs[0]["stages"]):
            static = s["base"] + s["adapters"] + s["gradients"] + s["optimizer"]
            measured = [r["stages"][i]["measured"] for r in runs]
            rows.append(
                [
                    case,
                    f"{s['stage']}: {s['holds']}",
                    f"{static / MB:,.0f}",
                    f"{s['activations'] / MB:,.0f}",
                    f"{s['logits'] / MB:,.0f}" if s["logits"] else "-",
                    f"{s['predicted'] / MB:,.0f}",
                    f"{median(measured) / MB:,.0f}"
                    + (f" ({spread([m / MB for m in measured])})" if len(runs) > 1 else ""),
                    f"{median(measured) / s['predicted']:.2f}",
                ]
            )
    header = ["case", "stage", "weights, gradients, optimizer", "activations", "logits", "predicted", "measured"]
    print(markdown_table([*header, "measured / predicted"], rows))


if __name__ == "__main__":
    main()
