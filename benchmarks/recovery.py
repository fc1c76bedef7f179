"""Recovery inside ``fit`` (issue #50, item 3): how long a run takes to be back where it was after a
worker is SIGKILLed, and where that time goes.

Each run trains a Llama (``transformers.LlamaConfig``: vocab 8000, untied, fp32, built in the
child from a seeded generator) traced with ``RemoteModelParallelStrategy(split=["model"],
microbatches=2, recovery=True, heartbeat_timeout=H, state_dict_type="sharded")`` on the default two
local workers (one torch thread each on 2 cores; the driver one). ``training_step`` returns
``self.model(input_ids=ids, labels=ids).loss``; batch 4 x 64 random token ids (a seeded Dataset, in
order), AdamW lr 1e-4. ``ModelCheckpoint(every_n_train_steps=N, save_last=True, save_top_k=-1)``
saves every N steps, synchronously or with ``plugins=[AsyncCheckpointIO()]`` (``--modes``). A
callback SIGKILLs worker 1 (``trainer.strategy._workers.local.procs[1]``) at the start of step K,
K drawn from N+1..2N by ``random.Random(seed)`` (one draw per run, in table order); the run has K
steps, so it ends once step K is run again.

Each run is a child process (``--child``; its events on stdout as JSON lines, each stamped with
``time.monotonic()``: the step ends from ``on_train_batch_end``, the kill, and the records of a
``logging.Handler`` on the recovery loggers). From them, per run:

- ``s/step before``: median seconds per step before the kill, over steps 2..K-1 (step 1 traces
  and places the model: ``s to step 1`` from ``fit``'s call; a synchronous save at step N falls in
  step N+1's time);
- ``resumed from``: the checkpoint's step, i.e. the first step ended after the relaunch, minus
  one; ``run again``: the steps from there to K, the killed one included;
- ``detection``: the kill -> the WARNING ``... recovering (`` (``lightning_remote_mp.lightning.recovery``:
  the heartbeat or the broken link noticed, ``fit`` unwound); should be under ``--heartbeat``;
- ``placement``: -> the INFO ``recovery: the workers are connected again`` (``...driver.recovery``:
  any background save waited for, the run torn down, two new local workers started and greeted);
- ``loading``: -> the end of the first step after the relaunch (Lightning restores the driver's
  state; the traced model is placed and each worker reads its stage and AdamW state from the
  sharded checkpoint at its first call; then that step runs);
- ``replay``: -> the end of step K run again (the steps since the checkpoint, on the kept batches);
- ``back``: the kill -> that end, the four summed.

Three models: 17 MB, a 70B's depth (80 decoder layers) at tiny widths as in benchmarks/depth.py
(hidden 64, 4 heads, MLP 128; issue #60); 25 MB (4 layers of 256) and 250 MB (8 layers of 768).
With ``--generate`` a validation every N steps calls ``generate()`` (16 new tokens, greedy) too,
and each run is timed again without the kill: ``cost`` is the kill's cost to ``fit`` (its seconds
with the kill less without), and the last column what remains of it beyond the detection, the
loading and the replay: the relaunch and anything traced again (issue #60: at most 5 s).

    python benchmarks/recovery.py                      # 17, 25 and 250 MB x sync, async: ~3 min on 2 cores
    python benchmarks/recovery.py --generate --modes sync   # and generate() in validation (~3 min)
    python benchmarks/recovery.py --quick              # 17 MB, sync only (~25 s)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, exit_now, markdown_table, median, python, timed_trainer  # noqa: E402

#: Nominal fp32 MB -> (hidden, intermediate, layers, heads); vocab 8000, untied. 17 MB: a 70B's depth
#: (80 decoder layers) at tiny widths, as benchmarks/depth.py's (issue #60).
SHAPES = {17: (64, 128, 80, 4), 25: (256, 688, 4, 4), 250: (768, 2048, 8, 12)}
MODES = ("sync", "async")
BATCH, SEQ, VOCAB = 4, 64, 8000


# --- the child: one run ----------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    def mark(event: str, **kw) -> None:
        print(json.dumps({"event": event, "t": time.monotonic(), **kw}), flush=True)

    import logging
    import warnings

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader, Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_remote_mp import RemoteModelParallelStrategy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    kill = args.kill  # the step (1-based) during which worker 1 is killed

    class Records(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "recovering (" in message:
                mark("lost", message=message.splitlines()[0])
            elif "connected again" in message:
                mark("placed", message=message)

    for name in ("lightning_remote_mp.lightning.recovery", "lightning_remote_mp.driver.recovery"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(Records(logging.INFO))

    class Tokens(Dataset):
        def __len__(self) -> int:
            return BATCH * kill

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(args.seed * 100_003 + i))

    class Net(L.LightningModule):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def training_step(self, ids, batch_idx):
            return self.model(input_ids=ids, labels=ids).loss

        def validation_step(self, ids, batch_idx):  # with --generate only
            self.model.generate(ids[:1, :8], max_new_tokens=16, do_sample=False, pad_token_id=0)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Events(L.Callback):
        killed = False

        def on_train_batch_start(self, trainer, *_) -> None:
            if not args.uninterrupted and not self.killed and trainer.global_step >= kill - 1:
                os.kill(trainer.strategy._workers.local.procs[1].pid, signal.SIGKILL)
                self.killed = True
                mark("kill", step=trainer.global_step + 1)

        def on_train_batch_end(self, trainer, *_) -> None:
            mark("step", n=trainer.global_step)

    hidden, intermediate, layers, heads = SHAPES[args.size]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    mark("model", params=params, bytes=4 * params)
    strategy = RemoteModelParallelStrategy(
        split=["model"], microbatches=2, recovery=True, heartbeat_timeout=args.heartbeat, state_dict_type="sharded"
    )
    checkpoints = ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every, save_last=True, save_top_k=-1)
    validation = dict(val_check_interval=args.every, limit_val_batches=1) if args.generate else {}
    trainer = timed_trainer(
        strategy,
        kill,
        [checkpoints, Events()],
        enable_checkpointing=True,
        plugins=[AsyncCheckpointIO()] if args.child == "async" else None,
        **validation,
    )
    mark("fit")
    loader = DataLoader(Tokens(), batch_size=BATCH)
    trainer.fit(Net(model), loader, DataLoader(Tokens(), batch_size=BATCH) if args.generate else None)
    mark("done")
    exit_now(0)


# --- the parent: runs and their phases -------------------------------------------------------


def run_one(size: int, mode: str, kill: int, args: argparse.Namespace, uninterrupted: bool = False) -> dict:
    directory = tempfile.mkdtemp(prefix="lrmp-recovery-")
    cmd = [python(), os.path.abspath(__file__), "--child", mode, "--sizes", str(size), "--kill", str(kill)]
    cmd += ["--uninterrupted"] * uninterrupted + ["--generate"] * args.generate
    cmd += [
        "--every",
        str(args.every),
        "--seed",
        str(args.seed),
        "--heartbeat",
        str(args.heartbeat),
        "--dir",
        directory,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    # A session of its own: on a timeout the child and the workers it started go together.
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=args.timeout)
        why = "" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        why = f"timed out after {args.timeout:.0f} s"
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    first = {}
    for e in events:
        first.setdefault(e["event"], e)
    steps = [(e["n"], e["t"]) for e in events if e["event"] == "step"]
    r: dict = {"size": size, "mode": mode, "kill": kill, "params": first.get("model", {}).get("params")}
    if "fit" in first and "done" in first:
        r["fit"] = first["done"]["t"] - first["fit"]["t"]
    if uninterrupted:
        return r if "fit" in r else {**r, "failed": why or "no end"}
    if not why and not all(k in first for k in ("kill", "lost", "placed", "done")):
        why = "no recovery: " + ", ".join(k for k in ("kill", "lost", "placed", "done") if k not in first)
    if why:
        print(f"{size} MB {mode}: {why}; its last output:\n" + "\n".join(err.splitlines()[-30:]), file=sys.stderr)
        return {**r, "failed": why}
    t_kill, t_lost, t_placed = first["kill"]["t"], first["lost"]["t"], first["placed"]["t"]
    before = [t for n, t in steps if t < t_kill]
    after = [(n, t) for n, t in steps if t > t_placed]
    back = next((t for n, t in after if n >= kill), None)
    if back is None:
        return {**r, "failed": f"step {kill} never ended after the recovery"}
    return {
        **r,
        "first_step": before[0] - first["fit"]["t"] if before else None,
        "per_step": median(b - a for a, b in zip(before, before[1:])),
        "resumed": after[0][0] - 1,
        "detection": t_lost - t_kill,
        "placement": t_placed - t_lost,
        "loading": after[0][1] - t_placed,
        "replay": back - after[0][1],
        "back": back - t_kill,
        "lost": first["lost"]["message"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=sorted(SHAPES), choices=sorted(SHAPES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heartbeat", type=float, default=2.0, help="heartbeat_timeout, seconds")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--quick", action="store_true", help="the smallest size, sync only")
    parser.add_argument(
        "--generate",
        action="store_true",
        help="validation every --every steps calls generate() (16 tokens); each run is also timed uninterrupted",
    )
    parser.add_argument("--uninterrupted", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--kill", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.size = args.sizes[0]
        child(args)
        return
    if args.quick:
        args.sizes, args.modes = [min(SHAPES)], ["sync"]
    started = time.monotonic()
    print(environment())
    print(
        f"Llama fp32, vocab {VOCAB}; batch {BATCH} x {SEQ}, 2 micro-batches, AdamW; 2 local workers; sharded "
        f"checkpoints every {args.every} steps; heartbeat_timeout {args.heartbeat:g} s; seed {args.seed}",
        flush=True,
    )
    header = [
        "model MB fp32 (params), layers",
        "save",
        "s to step 1",
        "s/step before",
        "killed in step",
        "resumed from",
        "run again",
        "detection s",
        "placement s",
        "loading s",
        "replay s",
        "kill -> back s",
    ]
    if args.generate:  # fit's seconds with the kill and without; the kill's cost beyond detection, loading, replay
        header += ["fit s", "fit s, no kill", "cost s", "cost beyond detection, loading, replay s"]
    rng = random.Random(args.seed)
    fmt = lambda x, d=1: "-" if x is None or x != x else f"{x:,.{d}f}"  # noqa: E731
    rows, slow = [], []
    for size in args.sizes:
        for mode in args.modes:
            kill = rng.randint(args.every + 1, 2 * args.every)
            t0 = time.monotonic()
            r = run_one(size, mode, kill, args)
            print(f"{size} MB {mode}: kill at step {kill}, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
            model = f"{4 * r['params'] / 1e6:,.0f} ({r['params'] / 1e6:.1f}M)" if r["params"] else f"~{size}"
            model += f", {SHAPES[size][2]} layers"
            if "failed" in r:
                failed = [model, mode, "-", "-", kill, "-", "-", f"FAILED: {r['failed']}"]
                rows.append(failed + [""] * (len(header) - len(failed)))
                continue
            extra = []
            if args.generate:
                whole = run_one(size, mode, kill, args, uninterrupted=True).get("fit")
                cost = r["fit"] - whole if whole else None
                beyond = cost - r["detection"] - r["loading"] - r["replay"] if cost is not None else None
                extra = [fmt(r["fit"]), fmt(whole), fmt(cost), fmt(beyond)]
            if r["detection"] > args.heartbeat:
                slow.append(f"{model} {mode}: detection {r['detection']:.2f} s > heartbeat {args.heartbeat:g} s")
            rows.append(
                [
                    model,
                    mode,
                    fmt(r["first_step"]),
                    fmt(r["per_step"], 2),
                    kill,
                    r["resumed"],
                    kill - r["resumed"],
                    fmt(r["detection"], 2),
                    fmt(r["placement"]),
                    fmt(r["loading"]),
                    fmt(r["replay"]),
                    fmt(r["back"]),
                    *extra,
                ]
            )
    print()
    print(markdown_table(header, rows))
    for line in slow:
        print(f"note: {line}")
    print(f"\n({time.monotonic() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
