"""What a long sequence costs a pipeline stage of an LLM (issue #59), locally and on lrmp's workers.

Table 1, gradient checkpointing: a Llama (hidden 256, 8 layers, AdamW) trained on batches of
4 x 2,048 tokens, with and without transformers' ``gradient_checkpointing_enable()``: locally in one
process, and through lrmp on two fresh local workers (``microbatches=2``). Each process's peak
``RssAnon`` (sampled every 2 ms while it trains) above its ``RssAnon`` before ``fit``; the saving is
the peak without checkpointing minus the peak with it.

Table 2, the loss's logits: a Llama (hidden 64, 2 layers), one sequence of 2,048 tokens, ``labels=``,
``microbatches=1`` on two workers, at vocabularies of 8,192 and 128,256: the last stage's peak.

With ``--padded`` table 1's batches are padded (each row by up to a quarter of its tokens, with its
``attention_mask`` and ``-100`` labels there), as fine-tuning batches are: a local call then builds
the attention's mask too (transformers passes ``is_causal`` instead only when no row is padded),
as every traced call does (under ``torch.export`` it cannot tell).

    python benchmarks/llm_memory.py            # ~4 min on 2 cores
    python benchmarks/llm_memory.py --only checkpointing --padded
    python benchmarks/llm_memory.py --quick    # small shapes: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, exit_on_sigterm, markdown_table, python, rss_anon, timed_trainer  # noqa: E402

MB = 2**20


class PeakSampler:
    """The peak ``RssAnon`` of some processes, sampled on a thread every ``every`` seconds."""

    def __init__(self, pids: list[int | str], every: float = 0.002) -> None:
        self.pids, self.every = pids, every
        self.base = [rss_anon(p) for p in pids]
        self.peak = list(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, p in enumerate(self.pids):
                self.peak[i] = max(self.peak[i], rss_anon(p))
            time.sleep(self.every)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def rise(self) -> list[float]:
        return [(p - b) / MB for p, b in zip(self.peak, self.base)]


def llama(layers: int, hidden: int, vocab: int, tokens: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 2),
        num_key_value_heads=max(hidden // 64, 2),
        max_position_embeddings=tokens,
    )
    return LlamaForCausalLM(config)


def _module(model: Any) -> Any:
    import lightning as L
    import torch

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            if isinstance(batch, dict):  # padded: input_ids, attention_mask and labels, as a tokenizer's collator
                return self.model(**batch).loss
            return self.model(batch, labels=batch).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return FineTune()


def _data(rows: int, tokens: int, vocab: int, steps: int, padded: bool = False) -> Any:
    """Random token ids; ``padded``: each row padded at its end by a different amount (up to a
    quarter of it), with its ``attention_mask`` and ``labels`` -100 there, as a tokenizer pads a batch."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (rows * steps, tokens), generator=g)
    if not padded:
        return torch.utils.data.DataLoader(ids, batch_size=rows)
    lengths = tokens - torch.randint(0, tokens // 4, (rows * steps,), generator=g)
    mask = (torch.arange(tokens) < lengths[:, None]).long()
    batches = [
        {
            "input_ids": ids[i].masked_fill(mask[i] == 0, 0),
            "attention_mask": mask[i],
            "labels": ids[i].masked_fill(mask[i] == 0, -100),
        }
        for i in range(rows * steps)
    ]
    return torch.utils.data.DataLoader(batches, batch_size=rows)


def run(
    mode: str,
    layers: int,
    hidden: int,
    vocab: int,
    tokens: int,
    rows: int,
    steps: int,
    gc: bool,
    padded: bool = False,
    microbatches: int = 2,
    split_backward: Any = "auto",
) -> list[float]:
    """One training run, ``mode`` "local" or "lrmp": each process's peak rise in MB (the driver, or
    the workers)."""
    import torch

    torch.manual_seed(0)
    model = llama(layers, hidden, vocab, tokens)
    if gc:
        model.gradient_checkpointing_enable()
    module, data = _module(model), _data(rows, tokens, vocab, steps, padded)
    if mode == "local":
        # The workers' malloc policy (`lightning_remote_mp.worker.allocator`: freed blocks up to 32 MiB
        # kept on the heap for the next step), so that the two processes' peaks count alike.
        from lightning_remote_mp.worker import allocator

        allocator.keep_freed_memory()
        with PeakSampler(["self"]) as sampler:
            timed_trainer("auto", steps, []).fit(module, data)
        return sampler.rise
    from lightning_remote_mp import RemoteModelParallelStrategy
    from lightning_remote_mp.driver.launch import LocalWorkers

    workers = LocalWorkers(2, devices=["cpu"] * 2, threads=1)
    workers.start()
    try:
        strategy = RemoteModelParallelStrategy(
            hosts=list(workers.addresses), split=["model"], microbatches=microbatches
        )
        with PeakSampler([p.pid for p in workers.procs]) as sampler:
            timed_trainer(strategy, steps, []).fit(module, data)
        return sampler.rise
    finally:
        workers.stop()


def child(argv: list[str]) -> None:
    """Runs one configuration in this process (a fresh one per run) and prints its peaks as JSON."""
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning_remote_mp").setLevel(logging.ERROR)
    spec = json.loads(argv[0])
    print("RESULT " + json.dumps(run(**spec)), flush=True)


def measure(**spec: Any) -> list[float]:
    out = subprocess.run(
        [python(), os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"a run failed ({spec}):\n{out.stderr[-3000:]}")
    return json.loads(line[7:])


def checkpointing_table(layers: int, hidden: int, tokens: int, rows: int, steps: int, padded: bool = False) -> str:
    shape = dict(layers=layers, hidden=hidden, vocab=1024, tokens=tokens, rows=rows, steps=steps, padded=padded)
    peaks = {(mode, gc): measure(mode=mode, gc=gc, **shape) for mode in ("local", "lrmp") for gc in (False, True)}
    local_saving = peaks["local", False][0] - peaks["local", True][0]
    processes = [("local, one process", "local", 0)] + [(f"lrmp stage {s}", "lrmp", s) for s in range(2)]
    table = []
    for label, m, i in processes:
        off, on = peaks[m, False][i], peaks[m, True][i]
        table.append([label, f"{off:,.0f}", f"{on:,.0f}", f"{off - on:,.0f}"])
    remote_saving = sum(peaks["lrmp", False]) - sum(peaks["lrmp", True])
    table.append(["lrmp, both stages", "", "", f"{remote_saving:,.0f} ({remote_saving / local_saving:.2f}x local's)"])
    header = ["process", "peak rise, no checkpointing (MB)", "with checkpointing (MB)", "saving (MB)"]
    return (
        f"Llama hidden {hidden}, {layers} layers, batch {rows} x {tokens} tokens{' (padded)' * padded}, AdamW, "
        f"{steps} steps; "
        "lrmp: 2 workers, microbatches=2\n\n" + markdown_table(header, table)
    )


def logits_table(hidden: int, tokens: int, vocabs: list[int]) -> str:
    table = []
    for vocab in vocabs:
        shape = dict(layers=2, hidden=hidden, vocab=vocab, tokens=tokens, rows=1, steps=2, gc=False)
        local = measure(mode="local", **shape)[0]
        stages = measure(mode="lrmp", microbatches=1, **shape)
        logits = tokens * vocab * 4 / MB
        table.append([f"{vocab:,}", f"{logits:,.0f}", f"{local:,.0f}", f"{stages[0]:,.0f}", f"{stages[1]:,.0f}"])
    header = ["vocabulary", "fp32 logits (MB)", "local peak rise (MB)", "lrmp stage 0 (MB)", "lrmp last stage (MB)"]
    return (
        f"Llama hidden {hidden}, 2 layers, one sequence of {tokens} tokens, labels=, AdamW, 2 steps; "
        "lrmp: 2 workers, microbatches=1\n\n" + markdown_table(header, table)
    )


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    parser.add_argument("--only", choices=["checkpointing", "logits"], help="one of the two tables")
    parser.add_argument(
        "--padded", action="store_true", help="checkpointing's batches padded, with an attention_mask (see _data)"
    )
    args = parser.parse_args()
    print(environment(), flush=True)
    if args.only != "logits":
        shape = dict(layers=2, hidden=64, tokens=128, rows=2, steps=1) if args.quick else {}
        shape = {**dict(layers=8, hidden=256, tokens=2048, rows=4, steps=3), **shape, "padded": args.padded}
        print(checkpointing_table(**shape), flush=True)
    if args.only != "checkpointing":
        print(logits_table(64, 256, [512, 8192]) if args.quick else logits_table(64, 2048, [8192, 128256]))


if __name__ == "__main__":
    main()
