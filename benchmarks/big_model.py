"""Models bigger than the driver (issue #35): what fine-tuning a pretrained HF Llama costs the driver.

For each size, a Llama-architecture model (vocab 32k, untied) is saved with ``save_pretrained``
(sharded safetensors), then fine-tuned with AdamW on two local workers, in three ways, each in a
child process of its own whose memory this script samples every 0.1 s (``RssAnon`` of
``/proc/PID/status``: anonymous memory, memory-mapped files apart):

- ``lrmp``: ``from_pretrained`` unchanged, ``pretrained=`` the directory (the workers read their
  stages' tensors), ``state_dict_type="sharded"`` (the workers write the checkpoint), and
  ``gather_limit=1``: nothing comes back at the end, as for a model past the default 1 GiB;
- ``lrmp-async``: ``lrmp`` with Lightning's ``AsyncCheckpointIO``: a save blocks training only while
  the workers copy their tensors to host memory, and they write their files while training goes on;
- ``lrmp-gather``: the path before #35: the driver sends every weight and gathers every checkpoint
  (``state_dict_type="full"``, ``gather_limit`` above the model);
- ``local``: the same model in one plain Lightning process.

Each run trains 3 steps (batch 4 x 32, 2 micro-batches), saves a checkpoint after step 2, ends
``fit``, then resumes from the checkpoint in a new Trainer for 1 more step. The table gives the
driver's peak growth over its memory before ``from_pretrained``, in each phase (load, train,
checkpoint, the end of ``fit``, the resume after the first model is dropped) and in all; each
worker's peak; and the seconds to the first step, to save, to resume and to end ``fit``.

    python benchmarks/big_model.py                  # sizes 0.2, 0.8 and 2.4 GB (fp32); ~15 min on 2 cores
    python benchmarks/big_model.py --sizes 0.2      # one size, a minute
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, markdown_table, python, rss_anon  # noqa: E402

#: fp32 GB -> (hidden, layers): vocab 32000, intermediate 2.75 x hidden, untied embeddings.
SHAPES = {0.2: (512, 5), 0.8: (1024, 10), 2.4: (1536, 18)}
MODES = ("lrmp", "lrmp-async", "lrmp-gather", "local")


def children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


# --- the child: one run --------------------------------------------------------------------


def child(mode: str, path: str, work: str) -> None:
    def mark(event: str, **kw) -> None:
        print(json.dumps({"event": event, "t": time.monotonic(), **kw}), flush=True)

    import lightning as L
    import torch
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from lightning_remote_mp import RemoteModelParallelStrategy

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, 32000, (32,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_pretrained(path)
            self.model.train()

        def training_step(self, batch, batch_idx):
            if batch_idx == 0 or self.trainer.global_step == 0:
                mark("step")
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    class SaveAt(L.Callback):
        def on_train_end(self, trainer, pl_module):
            mark("phase", name="end")  # what the end of fit brings back

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                mark("phase", name="checkpoint")
                started = time.monotonic()
                trainer.save_checkpoint(os.path.join(work, "step2.ckpt"))
                mark("saved", seconds=time.monotonic() - started)
                mark("phase", name="train")

    def strategy():
        if (
            mode.startswith("lrmp") and mode != "lrmp-gather"
        ):  # as a model past the default gather_limit (1 GiB) runs: nothing comes back
            return RemoteModelParallelStrategy(
                split=["model"], microbatches=2, pretrained=path, state_dict_type="sharded", gather_limit=1
            )
        return RemoteModelParallelStrategy(
            split=["model"], microbatches=2, state_dict_type="full", gather_limit=1 << 40
        )

    def trainer(steps: int):
        return L.Trainer(
            max_steps=steps,
            strategy=strategy() if mode != "local" else "auto",
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=[SaveAt()],
            plugins=[AsyncCheckpointIO()] if mode == "lrmp-async" else None,
            default_root_dir=work,
        )

    loader = DataLoader(Tokens(), batch_size=4)
    mark("phase", name="load")
    model = FineTune()
    mark("phase", name="train")
    started = time.monotonic()
    run = trainer(3)
    run.fit(model, loader)
    mark("fit", seconds=time.monotonic() - started)
    del model, run
    gc.collect()
    mark("phase", name="resume")
    started = time.monotonic()
    resumed = FineTune()
    trainer(4).fit(resumed, loader, ckpt_path=os.path.join(work, "step2.ckpt"))
    mark("resumed", seconds=time.monotonic() - started)
    mark("done")


# --- the parent: runs and samples ----------------------------------------------------------


def run_one(mode: str, path: str, timeout: float) -> dict:
    work = tempfile.mkdtemp(prefix="lrmp-big-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [python(), os.path.abspath(__file__), "--child", mode, "--path", path, "--work", work],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    base = 0
    phase = "start"
    peaks: dict[str, int] = {}
    workers: dict[int, int] = {}
    events: list[dict] = []
    done = threading.Event()

    def read() -> None:
        nonlocal phase
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            events.append(event)
            if event["event"] == "phase":
                phase = event["name"]
        done.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not done.is_set() and time.monotonic() < deadline:
        now = rss_anon(proc.pid)
        if phase == "start":
            base = now
        else:
            peaks[phase] = max(peaks.get(phase, 0), now - base)
        for c in children(proc.pid):
            workers[c] = max(workers.get(c, 0), rss_anon(c))
        time.sleep(0.1)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    shutil.rmtree(work, ignore_errors=True)
    t = {e["event"]: e for e in events}
    first_step = next((e["t"] for e in events if e["event"] == "step"), None)
    load = next((e["t"] for e in events if e["event"] == "phase" and e["name"] == "load"), None)
    return {
        "ok": "done" in t,
        "peaks": peaks,
        "workers": sorted(workers.values(), reverse=True)[:2],
        "first_step": (first_step - load) if first_step and load else None,
        "save": t.get("saved", {}).get("seconds"),
        "fit": t.get("fit", {}).get("seconds"),
        "resume": t.get("resumed", {}).get("seconds"),
    }


def save_model(size: float, directory: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers = SHAPES[size]
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size="200MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=sorted(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--path")
    parser.add_argument("--work")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.path, args.work)
        return
    print(environment())
    mb = 1e6
    rows = []
    for size in args.sizes:
        directory = tempfile.mkdtemp(prefix="lrmp-llama-")
        try:
            nbytes = save_model(size, directory)
            for mode in args.modes:
                r = run_one(mode, directory, args.timeout)
                p = r["peaks"]
                worst = max(p.values(), default=0)
                fmt = lambda s: "-" if s is None else f"{s:.1f}"  # noqa: E731
                rows.append(
                    [
                        f"{nbytes / mb:,.0f}",
                        mode if r["ok"] else f"{mode} (failed)",
                        f"{p.get('load', 0) / mb:,.0f}",
                        f"{p.get('train', 0) / mb:,.0f}",
                        f"{p.get('checkpoint', 0) / mb:,.0f}",
                        f"{p.get('end', 0) / mb:,.0f}",
                        f"{p.get('resume', 0) / mb:,.0f}",
                        f"{worst / mb:,.0f} ({worst / nbytes:.2f}x)",
                        ", ".join(f"{w / mb:,.0f}" for w in r["workers"]) or "-",
                        fmt(r["first_step"]),
                        fmt(r["save"]),
                        fmt(r["fit"]),
                        fmt(r["resume"]),
                    ]
                )
                print(f"size {size}: {mode} done", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    header = [
        "model MB",
        "run",
        "driver +MB load",
        "+MB train",
        "+MB checkpoint",
        "+MB end of fit",
        "+MB resume",
        "driver peak (x model)",
        "workers' peak MB",
        "s to 1st step",
        "s save",
        "s fit",
        "s resume",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
