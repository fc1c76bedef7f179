"""QLoRA through the pipeline (issue #47, item 4): what each worker holds against what its stage
needs, what the driver holds, and the time per step against local QLoRA and bf16 LoRA.

For each size, a Llama-architecture model (vocab 32k, untied, grouped-query attention) is saved
in bfloat16 with ``save_pretrained``, then fine-tuned with LoRA (r=8 on ``q_proj`` and
``v_proj``, AdamW lr 1e-4 over the adapters; batch 4 x 64 random tokens, ``labels=`` the ids) in
three ways, each in a child process of its own whose memory this script samples every 0.1 s
(``RssAnon`` of ``/proc/PID/status``: anonymous memory; pages of memory-mapped files apart):

- ``lrmp-qlora``: ``from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
  nf4, double quantization, float32 compute), device_map="meta")``, ``prepare_model_for_kbit_training``
  and ``get_peft_model``, through ``RemoteModelParallelStrategy(split=["model"], microbatches=1,
  pretrained=path)`` on two local workers: each worker quantizes its stage as it reads it;
- ``lrmp-lora-bf16``: the same LoRA over the bf16 base (built on the meta device from the config),
  the same strategy;
- ``local-qlora``: ``from_pretrained(path, quantization_config=...)`` with bitsandbytes' CPU kernels
  and the same peft recipe, in a plain Lightning Trainer in one process.

At one micro-batch the two stages take turns, so each worker gets all ``cores`` as torch threads,
as the local run does (``--microbatches 2 --worker-threads 1``: the stages overlap, a core each),
the driver one. Per run the table gives the seconds to build the model, the seconds from the
start of that build to the end of step 1 (for lrmp this includes the trace, the workers'
reading and quantizing, and step 1), the median seconds per step over the later steps, the driver's
peak ``RssAnon`` growth over its own just before the model is built, and each worker's over its
own just before ``fit``.

For ``lrmp-qlora``, a second table sets each worker's peak growth against what its stage needs:
the state it must hold as anonymous memory, computed from the model, plus the activations and
transients it measures.

The computed state (the ``state`` column):

- the packed base: every ``Linear4bit`` weight of the stage in NF4 with double quantization (the
  packed bytes, the 8-bit block scales and their float32 scales, `four_bit.Format.parts`: about
  0.52 bytes a weight);
- the full-precision frozen tensors the worker must copy: ``prepare_model_for_kbit_training``
  upcasts the embeddings, norms and ``lm_head`` to float32, so reading them from the bf16 files
  casts them into anonymous memory. (A frozen tensor whose dtype is the file's stays pages of the
  mapped file, ``RssFile``: the table shows those bytes, uncounted.)
- the adapters, and AdamW's two moments of each (2 x adapters);
- the largest layer's weight dequantized while it runs: float32 (4 bytes a weight) and the int32
  index of its packed bytes (2 bytes a weight).

The measured part: a traced module is placed at its first call, so each worker reads and
quantizes its stage during step 1's forward, and logs ``stage N read K tensors (X MB) ...`` when
it has. This script notes when each such line reaches it; the worker's first ``RssAnon`` sample
after that is what it holds after setup (``held after setup``: its growth over its own just before
``fit``; it should be the packed base + fp32 frozen + adapters, nothing else: AdamW's moments and
the dequantized weight come later). Activations + transients = the worker's peak ``RssAnon`` -
held after setup: the micro-batches' activations kept for the backward (2 x 64 tokens each), the
adapters' gradients and AdamW's moments made at the first step, a dequantized weight, the
operators' scratch, and anything else made after setup. Needs = the computed state + activations
+ transients; ``peak / needs`` = the peak growth over it. (AdamW's moments and a dequantized weight
are both in the computed state and in what is measured: counted twice, a few MB.) The workers'
own log gives the bytes each read from the files, as a check of the packed base plus frozen
tensors counted here; its reading time places, on stderr, each worker's growth when it began
reading (what the session made before it read a weight).

    python benchmarks/qlora.py                    # sizes 0.2, 1.0 and 2.2 GB (bf16); not yet timed
    python benchmarks/qlora.py --sizes 0.2        # the smallest: 2 to 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, exit_now, markdown_table, median, python, rss_anon, timed_trainer  # noqa: E402

#: bf16 GB -> (hidden, intermediate, layers, heads, key/value heads): vocab 32000, untied. The
#: largest is TinyLlama-1.1B's shape.
SHAPES = {
    0.2: (768, 2112, 8, 12, 3),
    1.0: (1536, 4224, 16, 24, 6),
    2.2: (2048, 5632, 22, 32, 4),
}
MODES = ("lrmp-qlora", "lrmp-lora-bf16", "local-qlora")
BATCH, SEQ, VOCAB = 4, 64, 32000
#: The dtype of the saved files: a frozen tensor the model holds in another dtype is copied.
FILE_DTYPE = "bfloat16"


# --- the child: one run --------------------------------------------------------------------


def child(mode: str, path: str, steps: int) -> None:
    def mark(event: str, **kw) -> None:
        print(json.dumps({"event": event, "t": time.monotonic(), **kw}), flush=True)

    import logging

    import lightning as L
    import peft
    import torch
    from torch.utils.data import DataLoader, Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from lightning_remote_mp import RemoteModelParallelStrategy
    from lightning_remote_mp.driver.launch import LocalWorkers

    cores = os.cpu_count() or 2
    torch.set_num_threads(cores if mode == "local-qlora" else 1)

    class Tokens(Dataset):
        def __len__(self) -> int:
            return BATCH * steps

        def __getitem__(self, i: int) -> dict:
            ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def four_bit() -> BitsAndBytesConfig:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.float32,
        )

    class FineTune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if mode == "local-qlora":
                base = AutoModelForCausalLM.from_pretrained(path, quantization_config=four_bit())
            elif mode == "lrmp-qlora":
                base = AutoModelForCausalLM.from_pretrained(path, quantization_config=four_bit(), device_map="meta")
            else:
                with torch.device("meta"):
                    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
            if mode != "lrmp-lora-bf16":
                base = peft.prepare_model_for_kbit_training(base)
            torch.manual_seed(1)
            config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            model = peft.get_peft_model(base, config)
            if mode != "local-qlora":  # adapters made on the meta device: values here, as examples/ does
                for module in model.modules():
                    if hasattr(module, "lora_A"):
                        for part in (module.lora_A, module.lora_B):
                            part.to_empty(device="cpu")
                        module.reset_lora_parameters("default", True)
            model.train()
            self.model = model

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    class Marks(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            mark("step", n=trainer.global_step, loss=float(outputs["loss"]))

    placed: list[str] = []

    class Placement(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if " placed:\n" in message:
                placed.extend(message.split("\n")[1:])

    workers = None
    if mode.startswith("lrmp"):
        session_log = logging.getLogger("lightning_remote_mp.driver.session")
        session_log.setLevel(logging.INFO)
        session_log.addHandler(Placement())
        # INFO: each worker logs the bytes it read from the files (a check of the needs counted here).
        workers = LocalWorkers(2, devices=["cpu"] * 2, threads=WORKER_THREADS or cores, log_level="INFO")
        workers.start()
        mark("workers", workers=[{"pid": p.pid, "address": a} for p, a in zip(workers.procs, workers.addresses)])
    try:
        mark("build", rss=rss_anon("self"))
        model = FineTune()
        mark("built")
        strategy = "auto"
        if workers is not None:
            strategy = RemoteModelParallelStrategy(
                hosts=workers.addresses, split=["model"], microbatches=MICROBATCHES, pretrained=path
            )
        trainer = timed_trainer(strategy, steps, [Marks()])
        if workers is not None:
            mark("fit", workers={p.pid: rss_anon(p.pid) for p in workers.procs})
        trainer.fit(model, DataLoader(Tokens(), batch_size=BATCH))
        mark("fitted")
        if mode == "lrmp-qlora":
            mark("needs", stages=stage_needs(model.model, placed))
        mark("done")
    finally:
        if workers is not None:
            workers.stop()
    exit_now(0)


_STAGE = re.compile(r"^stage (\d+) @ (\S+): layers \d+-\d+ \((.*)\), [\d,]+ parameters")


def stage_needs(model, placed: list[str]) -> list[dict]:
    """What each stage of the QLoRA model needs as anonymous memory (see the module docstring),
    from the placement log's lines (``stage N @ ADDRESS: layers a-b (units), ...``)."""
    import torch

    from lightning_remote_mp.model.bnb_layers import _linear4bit_class, format_of

    linear4bit = _linear4bit_class()
    # The model's pieces in order: the embeddings, each decoder layer, the final norm, the head.
    pieces = [
        (name, m)
        for name, m in model.named_modules()
        if re.search(r"(^|\.)(embed_tokens|norm|lm_head|layers\.\d+)$", name) and not re.search(r"layers\.\d+\.", name)
    ]

    def covered(label: str) -> list[int]:
        ends = label.split("..")
        found = [
            [i for i, (p, _) in enumerate(pieces) if p == e or e.startswith(p + ".") or p.startswith(e + ".")]
            for e in ends
        ]
        if not all(found):
            return []
        return list(range(min(found[0]), max(found[-1]) + 1))

    stages: dict[int, dict] = {}
    for line in placed:
        m = _STAGE.match(line.strip())
        if m is None:
            continue
        index, address, labels = int(m[1]), m[2], m[3].split(", ")
        held = sorted({i for label in labels for i in covered(label)})
        stages[index] = {"stage": index, "address": address, "pieces": [pieces[i][0] for i in held]}
    owners = collections.Counter(p for s in stages.values() for p in s["pieces"])
    for s in stages.values():
        packed = anon = mapped = adapters = largest = 0
        for name in s["pieces"]:
            piece = dict(pieces)[name]
            for path, module in piece.named_modules():
                if linear4bit is not None and isinstance(module, linear4bit):
                    fmt = format_of(module, f"{name}.{path}")
                    packed += sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in fmt.parts().values())
                    largest = max(largest, fmt.numel)
                    own = [p for n, p in module.named_parameters(recurse=False) if n != "weight"]
                else:
                    own = list(module.parameters(recurse=False))
                for p in own:
                    nbytes = p.numel() * p.element_size()
                    if p.requires_grad:
                        adapters += nbytes
                    elif str(p.dtype).removeprefix("torch.") == FILE_DTYPE:
                        mapped += nbytes
                    else:
                        anon += nbytes
        s.update(
            packed=packed,
            frozen_anon=anon,
            frozen_mapped=mapped,
            adapters=adapters,
            adam=2 * adapters,
            dequantized=6 * largest,  # float32 weight + int32 index of its packed bytes
            state=packed + anon + 3 * adapters + 6 * largest,
            shared=[p for p in s["pieces"] if owners[p] > 1],
        )
    return [stages[i] for i in sorted(stages)]


# --- the parent: runs and samples ----------------------------------------------------------

_READ = re.compile(r"stage (\d+) read (\d+) tensors \(([\d.]+) MB\) from \d+ files in ([\d.]+) s")


def run_one(mode: str, path: str, steps: int, timeout: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.monotonic()
    proc = subprocess.Popen(
        [python(), os.path.abspath(__file__), "--child", mode, "--path", path, "--steps", str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    events: list[dict] = []
    tail: collections.deque[str] = collections.deque(maxlen=40)
    read_mb: dict[int, float] = {}
    read_at: dict[int, float] = {}  # when each stage's "read" line reached this process
    read_s: dict[int, float] = {}  # the seconds the line says the reading took
    pids: list[int] = []
    done = threading.Event()

    def read_stdout() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            events.append(event)
            if event["event"] == "workers":
                pids.extend(w["pid"] for w in event["workers"])
        done.set()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))
            m = _READ.search(line)
            if m:
                read_at[int(m[1])] = time.monotonic()
                read_s[int(m[1])] = float(m[4])
                read_mb[int(m[1])] = float(m[3])

    threading.Thread(target=read_stdout, daemon=True).start()
    errors = threading.Thread(target=read_stderr, daemon=True)
    errors.start()
    driver_peak = 0
    worker_peak: dict[int, int] = {}
    samples: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)  # pid: (time, RssAnon)
    deadline = started + timeout
    while not done.is_set() and time.monotonic() < deadline:
        driver_peak = max(driver_peak, rss_anon(proc.pid))
        for pid in list(pids):
            rss = rss_anon(pid)
            samples[pid].append((time.monotonic(), rss))
            worker_peak[pid] = max(worker_peak.get(pid, 0), rss)
        time.sleep(0.1)
    if proc.poll() is None and not done.is_set():
        proc.kill()
    proc.wait()
    errors.join(5)
    seconds = time.monotonic() - started
    first = {e["event"]: e for e in events[::-1]}
    ok = "done" in first
    if not ok:
        print(f"{mode} failed; its last output:\n" + "\n".join(tail), file=sys.stderr, flush=True)
    stepped = [e for e in events if e["event"] == "step"]
    build = first.get("build")
    before = {int(k): v for k, v in first.get("fit", {}).get("workers", {}).items()}
    workers = {w["address"]: w["pid"] for w in first.get("workers", {}).get("workers", [])}
    stages = first.get("needs", {}).get("stages", [])
    for s in stages:
        pid = workers.get(s["address"])
        s["peak"] = worker_peak.get(pid, 0) - before.get(pid, 0) if pid else None
        s["read_mb"] = read_mb.get(s["stage"])
        at = read_at.get(s["stage"])
        held = next((rss for t, rss in samples.get(pid, []) if t >= at), None) if pid and at is not None else None
        s["held"] = held - before.get(pid, 0) if held is not None else None
        # A diagnostic: the growth when the reading began (the last sample before it), i.e. what
        # the worker made for the session before it read a weight (imports, the stage's build).
        began = [rss for t, rss in samples.get(pid, []) if at is not None and t <= at - read_s[s["stage"]]]
        s["began"] = began[-1] - before.get(pid, 0) if began else None
        s["activations"] = worker_peak[pid] - held if held is not None else None
        s["needs"] = s["state"] + s["activations"] if held is not None else None
    return {
        "ok": ok,
        "seconds": seconds,
        "build": first["built"]["t"] - build["t"] if build and "built" in first else None,
        "first_step": stepped[0]["t"] - build["t"] if build and stepped else None,
        "per_step": median(b["t"] - a["t"] for a, b in zip(stepped, stepped[1:])),
        "losses": [e["loss"] for e in stepped],
        "driver": driver_peak - build["rss"] if build else None,
        "workers": [worker_peak[p] - before.get(p, 0) for p in pids if p in worker_peak],
        "stages": stages,
    }


def save_model(size: float, directory: str) -> tuple[int, int]:
    """The model of ``size`` saved in bfloat16; its parameters and bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, intermediate, layers, heads, kv_heads = SHAPES[size]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: half the memory of a float32 model
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(directory, max_shard_size="500MB")
    params = sum(p.numel() for p in model.parameters())
    return params, sum(p.numel() * p.element_size() for p in model.parameters())


def ratio(results: dict[str, dict], mode: str, base: str) -> str:
    """``mode``'s seconds per step over ``base``'s."""
    a, b = results.get(mode), results.get(base)
    if not (a and b and a["ok"] and b["ok"]):
        return "-"
    return f"{a['per_step'] / b['per_step']:.2f}"


def short(piece: str) -> str:
    """A piece's name without peft's and the causal LM's prefixes: ``layers.3``, ``lm_head``."""
    return piece.removeprefix("base_model.model.").removeprefix("model.")


def span(pieces: list[str]) -> str:
    """The pieces a stage holds, as ``first..last``."""
    if not pieces:
        return "?"
    return short(pieces[0]) if len(pieces) == 1 else f"{short(pieces[0])}..{short(pieces[-1])}"


#: Torch threads per worker (``--worker-threads``; 0: all cores), passed to the child runs by environment.
WORKER_THREADS = int(os.environ.get("LRMP_BENCH_WORKER_THREADS", "0"))
#: Micro-batches per step through lrmp (``--microbatches``), passed the same way.
MICROBATCHES = int(os.environ.get("LRMP_BENCH_MICROBATCHES", "1"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, default=4, help="training steps per run")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--worker-threads", type=int, default=0, help="torch threads per worker (0: all cores)")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches per step through lrmp")
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--path")
    args = parser.parse_args()
    if args.worker_threads:
        os.environ["LRMP_BENCH_WORKER_THREADS"] = str(args.worker_threads)
    os.environ["LRMP_BENCH_MICROBATCHES"] = str(args.microbatches)
    if args.child:
        child(args.child, args.path, args.steps)
        return
    started = time.monotonic()
    cores = os.cpu_count() or 2
    print(environment())
    print(
        f"batch {BATCH} x {SEQ} tokens, {args.steps} steps, {args.microbatches} micro-batch(es) through lrmp; workers "
        f"{args.worker_threads or cores} threads each, local-qlora {cores}, the driver 1"
    )
    mb = 1e6
    fmt = lambda s, d=1: "-" if s is None or s != s else f"{s:,.{d}f}"  # noqa: E731
    mega = lambda n: fmt(n / mb if n is not None else None, 0)  # noqa: E731
    rows, needs_rows = [], []
    for size in args.sizes:
        directory = tempfile.mkdtemp(prefix="lrmp-qlora-")
        try:
            params, nbytes = save_model(size, directory)
            model = f"{nbytes / mb:,.0f} ({params / 1e6:,.0f}M)"
            results = {}
            for mode in args.modes:
                results[mode] = r = run_one(mode, directory, args.steps, args.timeout)
                print(
                    f"size {size}: {mode} {'done' if r['ok'] else 'FAILED'} in {r['seconds']:.0f} s, "
                    f"losses {[round(x, 3) for x in r['losses']]}",
                    file=sys.stderr,
                    flush=True,
                )
                for st in r["stages"]:
                    print(
                        f"size {size}: {mode} stage {st['stage']}: worker +{(st['began'] or 0) / 1e6:,.0f} MB when it "
                        f"began reading, +{(st['held'] or 0) / 1e6:,.0f} MB after (it read {st['read_mb']} MB)",
                        file=sys.stderr,
                        flush=True,
                    )

            for mode, r in results.items():
                stages = {s["address"]: s for s in r["stages"]}
                rows.append(
                    [
                        model,
                        mode if r["ok"] else f"{mode} (failed)",
                        fmt(r["build"]),
                        fmt(r["first_step"]),
                        fmt(r["per_step"], 2),
                        ratio(results, mode, "local-qlora"),
                        ratio(results, mode, "lrmp-lora-bf16"),
                        fmt(r["driver"] / mb if r["driver"] is not None else None, 0),
                        ", ".join(f"{w / mb:,.0f}" for w in r["workers"]) or "-",
                    ]
                )
                for s in stages.values():
                    needs_rows.append(
                        [
                            model,
                            f"{s['stage']}" + (f" (shares {', '.join(s['shared'])})" if s["shared"] else ""),
                            span(s["pieces"]),
                            fmt(s["packed"] / mb, 0),
                            fmt(s["frozen_anon"] / mb, 0),
                            fmt(s["adapters"] / mb, 1),
                            fmt(s["adam"] / mb, 1),
                            fmt(s["dequantized"] / mb, 0),
                            fmt(s["state"] / mb, 0),
                            mega(s["held"]),
                            mega(s["activations"]),
                            mega(s["needs"]),
                            fmt(s["frozen_mapped"] / mb, 0),
                            fmt(s["read_mb"], 0),
                            mega(s["peak"]),
                            f"{s['peak'] / s['needs']:.2f}" if s["peak"] and s["needs"] else "-",
                        ]
                    )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    header = [
        "model MB bf16 (params)",
        "run",
        "s build",
        "s to 1st step",
        "s/step",
        "x local-qlora",
        "x lrmp-lora-bf16",
        "driver +MB",
        "workers +MB",
    ]
    print(markdown_table(header, rows))
    if needs_rows:
        print()
        print(
            "lrmp-qlora, each stage: what it needs as anonymous memory (MB; the state computed, activations and "
            "transients measured) against its worker's peak growth"
        )
        print()
        header = [
            "model MB bf16 (params)",
            "stage",
            "pieces",
            "packed 4-bit",
            "fp32 frozen",
            "adapters",
            "AdamW",
            "dequantized",
            "state",
            "held after setup +MB",
            "activations + transients",
            "needs",
            "bf16 frozen (mapped, not counted)",
            "read from files (worker log)",
            "peak +MB",
            "peak / needs",
        ]
        print(markdown_table(header, needs_rows))
    print(f"\n({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
