"""Tracing: what splitting an unchanged nn.Module costs against writing the same model as a layer spec.

One causal transformer LM -- token embedding, learned positions, ``depth`` nn.TransformerEncoderLayer
blocks under a causal mask, a LayerNorm and a linear head; dropout 0 -- is built two ways with the
same architecture, parameter count and initial weights:

(a) ``spec``: a ``SpecSequential`` of torch.nn layers (Embedding, ``layers.PositionalEmbedding``,
    ``layers.CausalMask``, the blocks taking the mask as a dependency, LayerNorm, Linear), placed on
    the workers when the strategy sets up;
(b) ``traced``: a plain ``nn.Module`` (an ``nn.TransformerEncoder``), named in
    ``RemoteModelParallelStrategy(split=["net"])``: traced with torch.export at its first call (in
    train and in eval mode), cut into units at module boundaries and shipped as ``GraphLayer``
    programs, which the workers interpret operator by operator.

Both run through a real Lightning Trainer (SGD, cross-entropy over one fixed batch of token ids) on
two local lrmp-workers with one torch thread each (``LocalWorkers(2, threads=1)``, what the strategy
starts itself for ``local_workers=LocalWorkerOptions(2, threads=1)``; started once and reused so that rounds can
alternate, after one untimed warm-up fit: a fresh worker's first optimizer imports torch._dynamo;
``--fresh-workers`` lets the strategy start its own for every fit instead), with the same stage
boundary (the middle block) for both, at each ``--microbatches`` value.

With ``split_backward=True`` (which this benchmark passes) the spec's linear layers (the blocks' projections,
the head) compute their weight gradients after sending the input gradients on, once per batch;
traced units cannot (their programs call ATen's ``linear``, which the split backward does not see;
docs/tracing.md), so *traced / spec* includes that difference as well as the cost of interpreting
programs. ``--no-split-backward`` runs both with plain autograd, to compare like with like.

Measured for every fit, timed inside it by wrapping lrmp's own functions (no library file is changed):

- *trace s*: ``lightning_remote_mp.model.trace.trace_module`` (both exports, the cut, the programs);
- *place s*: ``DriverSession.place`` (shipping the units or layers and their weights, the workers
  building their stages) and ``DriverSession.mirror_optimizer`` (the optimizer built on the workers);
- *setup s*: trace + place; *first step s*: the first training step, which for (b) includes the trace
  and the placement (the strategy traces at the module's first call);
- *steps/s*: the steps after ``--warmup`` steps (a callback on batch ends), and CPU ms per step
  (driver + workers, from /proc) over the same steps, which is less sensitive to a busy machine;
- *traced / spec*: the same round's ratio of steps/s.

A second table describes the traced program: per unit, its operators in train and eval mode, the
values crossing into it and out of it, its weights, and the bytes of its entry as it travels in a
SETUP message (``protocol.encode`` of ``entry.to_wire()``; the weights travel as separate frames).

    python benchmarks/tracing.py            # width 128, depth 4, seq 32, batch 16, m = 1 and 4 (~1-2 min)
    python benchmarks/tracing.py --quick    # smoke run (seconds)
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

LR = 1e-3
KINDS = ("spec", "traced")


# --- the model, two ways ----------------------------------------------------------------------
def lm_spec(cfg: dict[str, Any]) -> list:
    """(a) the LM as a layer spec."""
    b, s, d = cfg["batch"], cfg["seq"], cfg["width"]
    shape = (b, s, d)
    block = {
        "layer": "torch.nn.TransformerEncoderLayer",
        "kwargs": {
            "d_model": d,
            "nhead": cfg["heads"],
            "dim_feedforward": 4 * d,
            "dropout": 0.0,
            "batch_first": True,
        },
        "input_shape": [shape, (s, s)],
        "dependencies": ["mask"],
    }
    return [
        {
            "layer": "torch.nn.Embedding",
            "kwargs": {"num_embeddings": cfg["vocab"], "embedding_dim": d},
            "input_shape": [b, s],
        },
        ("lightning_remote_mp.layers.PositionalEmbedding", {"max_len": s, "dim": d}, shape),
        ("lightning_remote_mp.layers.CausalMask", {}, shape),
        *[block] * cfg["depth"],
        ("torch.nn.LayerNorm", {"normalized_shape": d}, shape),
        ("torch.nn.Linear", {"in_features": d, "out_features": cfg["vocab"]}, shape),
    ]


class CausalLM(nn.Module):
    """(b) the same LM as an ordinary nn.Module: nothing in it knows about lrmp."""

    def __init__(self, vocab: int, width: int, heads: int, depth: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(seq, width) * 0.02)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=ids.device)
        # is_causal=False: attention applies the additive mask, as the spec's blocks do (they get
        # the mask as src_mask with the default is_causal=False), so both run the same operators.
        h = self.encoder(self.embed(ids) + self.pos[:t], mask=mask, is_causal=False)
        return self.head(self.norm(h))


def build_models(cfg: dict[str, Any]) -> tuple[nn.Module, nn.Module]:
    """The spec and the traced module, with the same initial weights (copied from the spec)."""
    from lightning_remote_mp import SpecSequential

    torch.manual_seed(0)
    spec = SpecSequential(lm_spec(cfg))
    lm = CausalLM(cfg["vocab"], cfg["width"], cfg["heads"], cfg["depth"], cfg["seq"])
    layers, depth = spec.layers, cfg["depth"]
    with torch.no_grad():
        lm.embed.weight.copy_(layers[0].weight)
        lm.pos.copy_(layers[1].weight)
        for i in range(depth):
            lm.encoder.layers[i].load_state_dict(layers[3 + i].state_dict())
        lm.norm.load_state_dict(layers[3 + depth].state_dict())
        lm.head.load_state_dict(layers[4 + depth].state_dict())
    n_spec, n_lm = count(spec), count(lm)
    if n_spec != n_lm:
        raise RuntimeError(f"the spec has {n_spec:,} parameters and the traced module {n_lm:,}")
    return spec, lm


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def make_batch(cfg: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


# --- timing lrmp's own steps ----------------------------------------------------------------------
RECORD: dict[str, Any] = {}


def instrument() -> None:
    """Wrap ``trace.trace_module``, ``trace.export`` and ``DriverSession.place`` (in this process
    only) so that each fit records how long they took, and the traced module."""
    from lightning_remote_mp.driver.session import DriverSession
    from lightning_remote_mp.model import trace

    def timed(fn: Any, key: str, keep: bool = False) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            RECORD[key] = RECORD.get(key, 0.0) + time.perf_counter() - t0
            if keep:
                RECORD["traced"] = out
            return out

        return wrapper

    trace.trace_module = timed(trace.trace_module, "trace", keep=True)  # TracedForward looks it up here
    DriverSession.place = timed(DriverSession.place, "place")
    # The optimizer's mirror on the workers (OPTIM_CREATE round trips): part of placing, at setup for
    # a spec and right after the trace for a traced module.
    DriverSession.mirror_optimizer = timed(DriverSession.mirror_optimizer, "place")
    export = trace.export

    @functools.wraps(export)
    def timed_export(module: Any, args: Any, kwargs: Any, name: str, training: bool) -> Any:
        t0 = time.perf_counter()
        out = export(module, args, kwargs, name, training)
        RECORD[f"export_{'train' if training else 'eval'}"] = time.perf_counter() - t0
        return out

    trace.export = timed_export  # trace_module looks it up here


def cold_trace(lm: nn.Module, cfg: dict[str, Any]) -> dict[str, float]:
    """``trace_module`` of a copy of the module, timed outside any fit: called first in the process,
    it also pays torch.export's one-off start-up, as the first fit of a training script does."""
    from lightning_remote_mp.model import trace

    RECORD.clear()
    trace.trace_module(copy.deepcopy(lm), (make_batch(cfg)[0],), {}, "net")
    return {k: RECORD[k] for k in ("trace", "export_train", "export_eval")}


# --- one fit --------------------------------------------------------------------------------------
def run_fit(
    cfg: dict[str, Any], kind: str, base: nn.Module, m: int, addresses: list[str] | None, pids: list[int]
) -> dict[str, Any]:
    """One Trainer.fit of ``warmup + steps`` steps; what it measured."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from lightning_remote_mp import LocalWorkerOptions, RemoteModelParallelStrategy

    total = cfg["warmup"] + cfg["steps"]

    class LitLM(L.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net
            self.first_loss: float | None = None

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            logits = self.net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            if self.first_loss is None:
                self.first_loss = loss.item()
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.ends: list[float] = []
            self.cpu: list[list[float]] = []
            self.pids = list(pids)

        def on_train_start(self, trainer: Any, *args: Any) -> None:
            workers = getattr(trainer.strategy, "_workers", None)  # --fresh-workers: the strategy's own
            local = workers.local if workers is not None else None
            if not self.pids and local is not None:
                self.pids = [p.pid for p in local.procs]

        def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())
            if len(self.ends) in (cfg["warmup"], total):
                self.cpu.append([time.process_time(), *(_common.process_cpu(p) for p in self.pids)])

    class Repeat(torch.utils.data.IterableDataset):
        def __init__(self, n: int) -> None:
            self.n = n
            self.batch = make_batch(cfg)

        def __iter__(self):
            for _ in range(self.n):
                yield self.batch

    half = cfg["depth"] // 2
    if kind == "spec":
        balance: Any = [3 + half, cfg["depth"] - half + 2]  # embed, pos, mask + half the blocks | the rest
    else:
        balance = {"net": [f"encoder.layers.{half}"]}
    workers: dict[str, Any] = {"hosts": addresses} if addresses else {"local_workers": LocalWorkerOptions(2, threads=1)}
    strategy = RemoteModelParallelStrategy(
        **workers,
        balance=balance,
        microbatches=m,
        split_backward=cfg["split_backward"],
        split=["net"] if kind == "traced" else None,
    )
    timer = StepTimer()
    trainer = _common.timed_trainer(strategy, total, [timer])
    model = LitLM(copy.deepcopy(base))
    RECORD.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, torch.utils.data.DataLoader(Repeat(total), batch_size=None))
    if len(timer.ends) != total:
        raise RuntimeError(f"{kind} m={m}: {len(timer.ends)} steps ran, expected {total}")
    steady = timer.ends[-1] - timer.ends[cfg["warmup"] - 1]
    cpu = sum(b - a for a, b in zip(*timer.cpu)) if len(timer.cpu) == 2 else float("nan")
    trace_s = RECORD.get("trace", 0.0)
    return {
        "trace_s": trace_s,
        "export_train_s": RECORD.get("export_train", 0.0),
        "export_eval_s": RECORD.get("export_eval", 0.0),
        "place_s": RECORD.get("place", 0.0),
        "setup_s": trace_s + RECORD.get("place", 0.0),
        "first_step_s": timer.ends[0] - timer.starts[0],
        "steps_per_s": cfg["steps"] / steady,
        "cpu_ms_per_step": cpu / cfg["steps"] * 1e3,
        "first_loss": model.first_loss,
        "traced": RECORD.get("traced"),
    }


# --- the traced program ----------------------------------------------------------------------------
def entry_bytes(entries: list[Any]) -> list[int]:
    """Bytes of each entry as it travels in a SETUP message (its own header frame, no weights)."""
    from lightning_remote_mp.wire import protocol

    return [sum(len(f) for f in protocol.encode(protocol.SETUP, 0, "s", {"entries": [e.to_wire()]})) for e in entries]


def describe_traced(traced: Any) -> list[list[str]]:
    rows = []
    for i, (entry, layer, size) in enumerate(zip(traced.entries, traced.layers, entry_bytes(traced.entries))):
        progs = entry.kwargs["programs"]
        train, evals = progs.get("train", {}), progs.get("eval", {})
        weights = sum(t.numel() for t in layer.parameters())
        rows.append(
            [
                str(i),
                entry.name,
                str(len(train.get("steps", []))),
                str(len(evals.get("steps", []))),
                str(len(train.get("inputs", []))),
                str(len(train.get("outputs", []))),
                f"{weights:,}",
                f"{size:,}",
            ]
        )
    return rows


class _Starting:
    """``LocalWorkers.start`` in a thread (it mostly waits for the workers' ready lines)."""

    def __init__(self, workers: Any) -> None:
        self.result: list[str] | None = None
        self.error: BaseException | None = None
        self.thread = None
        if workers is not None:
            self.thread = threading.Thread(target=self._run, args=(workers,), daemon=True)
            self.thread.start()

    def _run(self, workers: Any) -> None:
        try:
            self.result = workers.start()
        except BaseException as err:  # re-raised in the main thread
            self.error = err

    def addresses(self) -> list[str] | None:
        if self.thread is None:
            return None
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


# --- the run -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run: small model, few steps, one round")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4, help="transformer blocks (at least 2: one per stage)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from timing (>= 1)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration per round")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every configuration once")
    p.add_argument(
        "--fresh-workers",
        action="store_true",
        help="let the strategy start its own 2 workers (LocalWorkerOptions(2, threads=1)) for every fit",
    )
    p.add_argument(
        "--no-split-backward",
        dest="split_backward",
        action="store_false",
        help="split_backward=False for both models (traced units never defer weight gradients; the spec's "
        "linear layers do with split_backward=True, which this benchmark passes otherwise)",
    )
    p.add_argument(
        "--no-cold-trace",
        dest="cold_trace",
        action="store_false",
        help="skip timing the process's first trace_module outside any fit (torch.export's one-off start-up)",
    )
    p.add_argument("--out", default=_common.RESULTS, help="folder for tracing.json")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.depth, args.heads, args.seq, args.batch, args.vocab = 32, 2, 2, 8, 4, 32
        args.warmup, args.steps, args.rounds, args.microbatches = 1, 3, 1, [2]
        args.cold_trace = False
    args.warmup = max(1, args.warmup)
    if args.depth < 2:
        p.error("--depth must be at least 2 (the stage boundary is the middle block)")
    if args.width % args.heads:
        p.error("--width must be a multiple of --heads")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from lightning_remote_mp.driver.launch import LocalWorkers

    torch.set_num_threads(1)
    _common.exit_on_sigterm()
    keys = ("width", "depth", "heads", "seq", "batch", "vocab", "warmup", "steps", "split_backward")
    cfg = {k: getattr(args, k) for k in keys}
    configs = [(kind, m) for m in args.microbatches for kind in KINDS]
    run = "quick" if args.quick else "full"
    print(f"# lrmp tracing: a traced nn.Module against the same model as a layer spec ({run} run)")
    print(
        f"causal LM: vocab {args.vocab}, width {args.width}, {args.heads} heads, {args.depth} x "
        f"nn.TransformerEncoderLayer (ffn {4 * args.width}, dropout 0), seq {args.seq}, batch {args.batch}; "
        f"SGD; 2 stages split at block {args.depth // 2}; split_backward={args.split_backward}; "
        f"{args.warmup} warm-up + {args.steps} timed steps per "
        f"fit, {args.rounds} round(s); workers "
        + ("started by the strategy per fit" if args.fresh_workers else "LocalWorkers(2, threads=1), reused")
    )
    print(_common.environment(), flush=True)

    spec_net, lm = build_models(cfg)
    bases = {"spec": spec_net, "traced": lm}
    print(f"parameters: spec {count(spec_net):,}, traced module {count(lm):,} (same)", flush=True)
    instrument()

    workers = None if args.fresh_workers else LocalWorkers(2, devices=["cpu", "cpu"], threads=1)
    results: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configs}
    ratios: dict[int, list[float]] = {m: [] for m in args.microbatches}
    traced_module = None
    started = time.perf_counter()
    try:
        # The workers import torch while this process imports Lightning.
        starting = _Starting(workers)
        import lightning  # noqa: F401  (its import sets its loggers' levels: quiet them after it)

        for name in ("lightning.pytorch", "lightning.fabric"):
            logging.getLogger(name).setLevel(logging.ERROR)
        addresses = starting.addresses()
        pids = [p.pid for p in workers.procs] if workers is not None else []
        cold = cold_trace(lm, cfg) if args.cold_trace else None
        if cold is not None:
            print(f"first trace in this process, outside any fit: {cold['trace']:.2f} s", flush=True)
        if workers is not None and not args.quick:
            # A fresh worker's first optimizer imports torch._dynamo (seconds): pay it before the rounds.
            # (Not in the smoke run, whose first fit pays it in its setup.)
            first = run_fit({**cfg, "warmup": 1, "steps": 1}, "spec", spec_net, 1, addresses, pids)
            print(f"warm-up fit on the fresh workers (untimed): placing took {first['place_s']:.2f} s", flush=True)
        for r in range(args.rounds):
            # Rotate the order every round so that no configuration always runs first or last.
            order = configs[r % len(configs) :] + configs[: r % len(configs)]
            this_round: dict[tuple[str, int], float] = {}
            for c in order:
                kind, m = c
                res = run_fit(cfg, kind, bases[kind], m, addresses, pids)
                traced_module = res.pop("traced") or traced_module
                results[c].append(res)
                this_round[c] = res["steps_per_s"]
                print(
                    f"  round {r + 1}: {kind:6s} m={m}: setup {res['setup_s']:6.2f} s (trace {res['trace_s']:5.2f}), "
                    f"first step {res['first_step_s']:6.2f} s, {res['steps_per_s']:7.2f} steps/s, "
                    f"loss at step 0 {res['first_loss']:.6f}",
                    flush=True,
                )
            for m in args.microbatches:
                ratios[m].append(this_round[("traced", m)] / this_round[("spec", m)])
    finally:
        if workers is not None:
            workers.stop()

    def med(c: tuple[str, int], key: str) -> float:
        return _common.median(r[key] for r in results[c])

    rows = []
    for c in configs:
        kind, m = c
        rows.append(
            [
                kind,
                str(m),
                f"{med(c, 'setup_s'):.2f}",
                f"{med(c, 'trace_s'):.2f}" if kind == "traced" else "-",
                f"{med(c, 'place_s'):.2f}",
                f"{med(c, 'first_step_s'):.2f}",
                f"{med(c, 'steps_per_s'):.2f}",
                f"{_common.median(ratios[m]):.2f}x" if kind == "traced" else "1.00x",
                f"{med(c, 'cpu_ms_per_step'):,.0f}",
            ]
        )
    print()
    print(
        _common.markdown_table(
            [
                "model",
                "microbatches",
                "setup s",
                "trace s",
                "place s",
                "first step s",
                "steps/s (median)",
                "traced / spec, same round",
                "CPU ms/step, all processes",
            ],
            rows,
        )
    )
    losses = {c: results[c][0]["first_loss"] for c in configs}
    worst = max(abs(losses[("traced", m)] - losses[("spec", m)]) for m in args.microbatches)
    print(f"\nloss at step 0, traced vs spec (same weights, same batch): max |difference| {worst:.2e}")
    traced_runs = [r for m in args.microbatches for r in results[("traced", m)]]
    print(
        f"trace in a fit (median): {_common.median(r['trace_s'] for r in traced_runs):.2f} s, of which torch.export "
        f"{_common.median(r['export_train_s'] for r in traced_runs):.2f} s (train mode) + "
        f"{_common.median(r['export_eval_s'] for r in traced_runs):.2f} s (eval mode)"
        + (
            f"; the first trace in the process (outside any fit, before them): {cold['trace']:.2f} s, torch.export "
            f"{cold['export_train']:.2f} s + {cold['export_eval']:.2f} s"
            if cold is not None
            else ""
        )
    )

    summary: dict[str, Any] = {}
    if traced_module is not None:
        unit_rows = describe_traced(traced_module)
        spec_bytes = sum(entry_bytes(spec_net.entries))
        traced_bytes = sum(entry_bytes(traced_module.entries))
        print()
        print(
            f"traced program: {len(unit_rows)} units (the spec: {len(spec_net.entries)} layers); entries "
            f"{traced_bytes:,} bytes in SETUP messages (the spec's: {spec_bytes:,} bytes); weights travel apart "
            f"({count(lm) * 4:,} bytes of float32 parameters either way)"
        )
        print(
            _common.markdown_table(
                ["unit", "covers", "ops (train)", "ops (eval)", "values in", "values out", "parameters", "entry bytes"],
                unit_rows,
            )
        )
        summary = {
            "units": len(unit_rows),
            "unit_rows": unit_rows,
            "traced_entry_bytes": traced_bytes,
            "spec_entry_bytes": spec_bytes,
            "spec_layers": len(spec_net.entries),
        }
    print(f"\nwall time {time.perf_counter() - started:.0f} s")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tracing.json"), "w") as f:
        json.dump(
            {
                "config": cfg,
                "rounds": args.rounds,
                "parameters": count(lm),
                "results": [{"model": k, "microbatches": m, "rounds": results[(k, m)]} for k, m in configs],
                "ratio_traced_over_spec": {str(m): v for m, v in ratios.items()},
                "cold_trace": cold,
                "program": summary,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    _common.exit_now(main())
