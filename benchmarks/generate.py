"""Generation through the pipeline: ``generate()`` on a split HuggingFace Llama against the same
model's ``generate()`` in one process (issue #48, item 4).

The model is an unchanged ``LlamaForCausalLM`` (vocabulary 32,000, hidden 256, 8 layers, 4 heads
and 2 key/value heads, MLP 688, untied LM head: 22 M parameters, 89 MB in float32), small enough
that a decode step takes a few milliseconds on 2 cores, so that lrmp's cost per step (the target is
1 ms per stage) is not lost in the noise of the compute. A decode step reads every weight but the
embedding once: it is bound by memory bandwidth, so its time follows the bytes (56 MB here; the LM
head is 33 MB of them). ``--hidden 512 --intermediate 1408 --heads 8 --kv-heads 4`` is the
issue's size, 56 M parameters (160 MB read per step). Prompts of ``--prompt`` random tokens (no
padding), ``--new-tokens`` new ones, greedy (``do_sample=False``; no EOS, so every row writes them
all), at each batch size of ``--batches``, in these modes, all in one run:

- ``local``: the model's ``generate()`` in this process with all the machine's cores as torch
  threads; ``local, 1 thread`` beside it, what one stage's worker gets for compute when the
  stages compute at once;
- ``lrmp``: ``generate()`` in a ``predict_step`` of a LightningModule whose model is traced with
  ``RemoteModelParallelStrategy(split=["model"], microbatches=m)`` over 2 and 4 local
  ``lrmp-worker`` processes on loopback. At one micro-batch the stages take turns, so each worker
  has all the machine's cores as torch threads, as a stage on a machine of its own would, and at
  batch 1 once more with one thread each (what local workers get by default on 2 cores, and on
  this machine the faster: one token's small products gain nothing from a second thread); at two
  micro-batches, ``cores // stages`` (at least 1). The driver computes with one thread (it only
  picks tokens).
  The key/value cache stays on the workers; each decode step is one pipelined forward; ``m`` splits
  the batch's rows (m = 2 only at the largest batch on 2 stages, the issue's case for both stages
  decoding at once). Over ``--lan``'s emulated hosts, which share this machine's cores, one thread
  each.

Each mode writes one short warm-up generation (2 tokens: lrmp traces its prefill and decode
programs there) and ``--repeats`` timed ones, per round; ``--rounds`` rotates the modes' order. Measured:

- on the driver, by a stopping criterion that only reads the clock: the time to the first token
  (the prefill, reported apart) and each decode step's time; forward hooks on the model time each
  step's model call (locally the compute; through lrmp the pipelined forward's round trip), so a
  token's time splits into the model call and generate's own loop (logits processing, the token's
  choice, the stopping criteria);
- on the workers, their timeline (the events ``RemoteModelParallelStrategy(timeline=...)``
  records: each stage's forward spans and the stage-to-stage transfers, put on the driver's clock):
  each decode step's model call splits into time when some stage computes, time when only a
  stage-to-stage message is in flight, and the rest (the driver's messages to the first stage and
  back from the last, encoding, dispatch); each stage's busy fraction over the decode phase and the
  fraction of it in which two stages or more compute at once;
- bytes per decode step on the driver's link: the kernel's counters of the driver's own TCP
  connections (`lightning_remote_mp.wire.traffic.Traffic`), both directions.

With ``--lan``, the lrmp modes run once more over emulated hosts (network namespaces, every link
shaped to 1 Gbit/s with tc's token bucket filter, ``tests/lrmp_lan.py``): the driver on host 0,
stage i on host i + 1. Needs root and iproute2; skipped, saying why, where namespaces cannot be made.

    python benchmarks/generate.py                                # the issue's settings (~5 min on 2 cores)
    python benchmarks/generate.py --new-tokens 16 --prompt 32    # shorter
    python benchmarks/generate.py --quick                        # a tiny model (under a minute)
    python benchmarks/generate.py --lan                          # and over 1 Gbit/s links
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Mode:
    kind: str  # "local" or "lrmp"
    batch: int
    stages: int = 1  # lrmp: workers; local: 1
    m: int = 1
    threads: int = 1  # torch threads per process that computes

    @property
    def label(self) -> str:
        if self.kind == "local":
            return "local" if self.threads == CORES else f"local, {self.threads} thread{'s' * (self.threads > 1)}"
        return f"lrmp {self.stages} stages"


CORES = os.cpu_count() or 1


def modes(batches: Sequence[int]) -> list[Mode]:
    out = []
    for b in batches:
        out += [Mode("local", b, threads=CORES)]
        if CORES > 1:
            out += [Mode("local", b, threads=1)]
        for stages in (2, 4):
            out.append(Mode("lrmp", b, stages, 1, CORES))  # the stages take turns: all cores each
            if b == 1 and CORES > 1:  # and one each, as local workers get by default here (cores // stages)
                out.append(Mode("lrmp", b, stages, 1, 1))
            if stages == 2 and b == max(batches) and b > 1:
                out.append(Mode("lrmp", b, stages, 2, max(1, CORES // stages)))
    return out


# --- the model and the prompts -----------------------------------------------------------------
def make_model(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(1024, 2 * (args.prompt + args.new_tokens)),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # every row writes all its new tokens
    model.generation_config.pad_token_id = 0
    return model


def make_prompts(batch: int, length: int, vocab: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(batch)
    return torch.randint(3, vocab, (batch, length), generator=g)


# --- one timed generation ------------------------------------------------------------------------
def greedy(ids: Any, new: int, **more: Any) -> dict[str, Any]:
    """``generate``'s arguments: ``new`` tokens for every row, greedy."""
    import torch

    return (
        dict(
            attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        )
        | more
    )


class StepClock:
    """A stopping criterion that never stops: it reads the clock after each new token (the first
    call comes after the prefill) and calls ``at_first`` once then."""

    def __init__(self, at_first: Any = None) -> None:
        self.times: list[float] = []
        self.at_first = at_first
        self.first_extra: Any = None

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        self.times.append(time.time())
        if len(self.times) == 1 and self.at_first is not None:
            self.first_extra = self.at_first()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def timed_generate(generate: Any, model: Any, ids: Any, new: int, at_first: Any = None) -> dict[str, Any]:
    """``generate(ids, ...)`` greedy, timing its steps (`StepClock`) and its model calls (forward
    hooks on ``model``, registered only around this call: a traced module is traced before)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Criterion(StoppingCriteria):
        def __init__(self, clock: StepClock) -> None:
            self.clock = clock

        def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
            return self.clock(input_ids, scores, **kwargs)

    clock = StepClock(at_first)
    calls: list[list[float]] = []
    pre = model.register_forward_pre_hook(lambda *_: calls.append([time.time()]))
    post = model.register_forward_hook(lambda *_: calls[-1].append(time.time()))
    try:
        t0 = time.time()
        with torch.no_grad():
            out = generate(ids, **greedy(ids, new, stopping_criteria=StoppingCriteriaList([Criterion(clock)])))
        t_end = time.time()
    finally:
        pre.remove()
        post.remove()
    if len(clock.times) != new or len(calls) != new:
        raise RuntimeError(f"expected {new} steps, saw {len(clock.times)} tokens and {len(calls)} model calls")
    steps = new - 1
    decode_calls = calls[1:]
    return {
        "t0": t0,
        "t_end": t_end,
        "times": clock.times,
        "calls": calls,
        "total_s": t_end - t0,
        "prefill_s": clock.times[0] - t0,
        "decode_s": (clock.times[-1] - clock.times[0]) / max(1, steps),
        "call_s": sum(b - a for a, b in decode_calls) / max(1, steps),
        "first_extra": clock.first_extra,
        "tokens": out[:, ids.shape[1] :].clone(),
    }


# --- spans: what the workers did -------------------------------------------------------------------
def partition(spans: dict[str, list[tuple[float, float]]], a: float, b: float) -> dict[str, float]:
    """Seconds of ``[a, b]`` in which some span of ``spans["compute"]`` runs; of the rest, in which
    some ``spans["transfer"]`` is in flight; and the remainder ("other")."""
    points = {a, b}
    for kind in spans.values():
        for s, e in kind:
            points.update(p for p in (s, e) if a < p < b)
    out = {"compute": 0.0, "transfer": 0.0, "other": 0.0}
    ordered = sorted(points)
    for s, e in zip(ordered, ordered[1:]):
        mid = (s + e) / 2
        if any(x <= mid < y for x, y in spans["compute"]):
            out["compute"] += e - s
        elif any(x <= mid < y for x, y in spans["transfer"]):
            out["transfer"] += e - s
        else:
            out["other"] += e - s
    return out


def concurrency(spans: list[tuple[float, float]], a: float, b: float, at_least: int) -> float:
    """Seconds of ``[a, b]`` in which ``at_least`` of ``spans`` run at once (one stage's spans never overlap)."""
    edges = sorted(
        [(max(s, a), 1) for s, e in spans if e > a and s < b] + [(min(e, b), -1) for s, e in spans if e > a and s < b]
    )
    total, running, last = 0.0, 0, a
    for t, step in edges:
        if running >= at_least:
            total += t - last
        running += step
        last = t
    return total


def worker_view(record: dict[str, Any], events: list[tuple[float, list[Any]]], stages: int) -> dict[str, Any]:
    """Split each decode step's model call by the workers' events (``(clock offset, event)``), and
    each stage's busy fraction over the decode phase."""
    # A call is (program, its call number): the prefill's and the decode steps' programs count apart.
    forwards: dict[tuple[str, int], list[tuple[int, float, float]]] = {}  # call -> (stage, start, end)
    transfers: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for offset, ev in events:
        if ev[0] == "forward":
            _, key, stage, call, _mb, s, e = ev
            forwards.setdefault((key, call), []).append((stage, s - offset, e - offset))
        elif ev[0] == "transfer":
            _, key, _src, _dst, call, _mb, s, e = ev  # sent on the sender's clock: on one machine, the same
            transfers.setdefault((key, call), []).append((s - offset, e - offset))
    calls = sorted(forwards, key=lambda c: min(s for _, s, _ in forwards[c]))  # in the order they ran
    if len(calls) != len(record["calls"]):
        raise RuntimeError(f"the workers recorded {len(calls)} calls for {len(record['calls'])} model calls")
    split = {"compute": 0.0, "transfer": 0.0, "other": 0.0}
    for call, (a, b) in zip(calls[1:], record["calls"][1:]):
        spans = {"compute": [(s, e) for _, s, e in forwards[call]], "transfer": transfers.get(call, [])}
        for k, v in partition(spans, a, b).items():
            split[k] += v
    steps = max(1, len(calls) - 1)
    start, end = record["times"][0], record["times"][-1]
    decode_spans = [x for call in calls[1:] for x in forwards[call]]
    busy = [
        sum(max(0.0, min(e, end) - max(s, start)) for st, s, e in decode_spans if st == i) / (end - start)
        for i in range(stages)
    ]
    together = concurrency([(s, e) for _, s, e in decode_spans], start, end, 2) / (end - start)
    return {**{f"{k}_s": v / steps for k, v in split.items()}, "busy": busy, "together": together}


# --- the modes -----------------------------------------------------------------------------------------
def run_local(model: Any, mode: Mode, ids: Any, new: int, repeats: int) -> list[dict[str, Any]]:
    import torch

    torch.set_num_threads(mode.threads)
    timed_generate(model.generate, model, ids, 2)  # warm-up
    out = []
    for _ in range(repeats):
        record = timed_generate(model.generate, model, ids, new)
        record.update(compute_s=record["call_s"], transfer_s=0.0, other_s=0.0, busy=[], together=None, bytes=None)
        out.append(record)
    return out


def run_lrmp(model: Any, mode: Mode, hosts: list[str], ids: Any, new: int, repeats: int) -> list[dict[str, Any]]:
    import lightning as L
    import torch

    from lightning_remote_mp import RemoteModelParallelStrategy
    from lightning_remote_mp.lightning.timeline import clock_offset
    from lightning_remote_mp.wire import protocol
    from lightning_remote_mp.wire.requests import Timeline
    from lightning_remote_mp.wire.traffic import Traffic
    from lightning_remote_mp.wire.transport import broadcast

    torch.set_num_threads(1)  # the driver picks tokens; the workers compute
    traffic = Traffic()

    class Writer(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.records: list[dict[str, Any]] = []
            self.offsets: dict[str, float] = {}

        def predict_step(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:  # warm-up: traces the prefill and decode programs, places the stages
                self.model.generate(batch, **greedy(batch, 2))
                return
            conns = self.trainer.strategy.session.conns
            if not self.offsets:
                self.offsets = {c.address: clock_offset(c) for c in conns}
                broadcast(conns, protocol.TIMELINE, Timeline("start").body())
            broadcast(conns, protocol.TIMELINE, Timeline("fetch").body())  # drop what came before
            record = timed_generate(self.model.generate, self.model, batch, new, at_first=traffic.sample)
            moved = traffic.sample()
            replies = broadcast(conns, protocol.TIMELINE, Timeline("fetch").body())
            events = [(self.offsets[c.address], ev) for c, r in zip(conns, replies) for ev in r["events"]]
            record.update(worker_view(record, events, mode.stages))
            first = record["first_extra"]
            record["bytes"] = None if first is None or moved is None else (moved - first) / max(1, new - 1)
            self.records.append(record)

    writer = Writer()
    strategy = RemoteModelParallelStrategy(hosts=hosts, split=["model"], microbatches=mode.m)
    trainer = _common.timed_trainer(strategy, max_steps=-1, callbacks=())  # its step bounds are fit's, not predict's
    trainer.predict(writer, torch.utils.data.DataLoader([ids] * (1 + repeats), batch_size=None))
    return writer.records


# --- the tables -----------------------------------------------------------------------------------------
def ms(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x * 1e3:.{digits}f}"


def tables(
    results: dict[tuple[str, Mode], list[dict[str, Any]]], want: dict[tuple[int, int], Any], new: int
) -> tuple[str, str]:
    med = _common.median
    first_rows, second_rows = [], []
    for (link, mode), runs in results.items():
        decode = [r["decode_s"] for r in runs]
        # Against local with as many threads: a matrix product sums in another order on another number
        # of threads, and a greedy choice between two near-equal logits of a random model can flip.
        ref = want.get((mode.batch, mode.threads), want[(mode.batch, CORES)])
        same = all(bool((r["tokens"] == ref).all()) for r in runs)
        over: dict[int, float] = {}  # ms/token over local's with this many threads, same batch
        for threads in {CORES, 1}:
            local = results.get(("loopback", Mode("local", mode.batch, threads=threads)))
            if mode.kind == "lrmp" and local:
                over[threads] = med(decode) - med(r["decode_s"] for r in local)
        target = "-"
        if mode.batch == 1 and link == "loopback" and over:
            # Against the faster local run: on a shared 2-core machine the 2-thread one can be the slower.
            gap = min(over.values())
            target = f"{'met' if gap <= 1e-3 * mode.stages else 'missed'} (<= +{mode.stages} ms)"
        first_rows.append(
            [
                link,
                mode.label,
                mode.batch,
                mode.m if mode.kind == "lrmp" else "-",
                mode.threads,
                f"{_common.median(mode.batch * new / r['total_s'] for r in runs):,.1f}",
                ms(med(r["prefill_s"] for r in runs), 1),
                ms(med(decode)),
                f"{min(decode) * 1e3:.2f}-{max(decode) * 1e3:.2f}",
                f"{over[CORES] * 1e3:+.2f}" if CORES in over else "-",
                f"{over[1] * 1e3:+.2f}" if 1 in over and CORES > 1 else "-",
                target,
                "yes" if same else "NO",
            ]
        )
        busy = [med(r["busy"][i] for r in runs) for i in range(mode.stages)] if mode.kind == "lrmp" else []
        together = med(r["together"] for r in runs) if mode.kind == "lrmp" else None
        moved = [r["bytes"] for r in runs if r["bytes"] is not None]
        second_rows.append(
            [
                link,
                mode.label,
                mode.batch,
                mode.m if mode.kind == "lrmp" else "-",
                ms(med(decode)),
                ms(med(r["call_s"] for r in runs)),
                ms(med(r["compute_s"] for r in runs)),
                ms(med(r["transfer_s"] for r in runs)) if mode.kind == "lrmp" else "-",
                ms(med(r["other_s"] for r in runs)) if mode.kind == "lrmp" else "-",
                ms(med(r["decode_s"] - r["call_s"] for r in runs)),
                " / ".join(f"{b:.0%}" for b in busy) or "-",
                "-" if together is None else f"{together:.0%}",
                f"{med(moved):,.0f}" if moved else "-",
            ]
        )
    first = _common.markdown_table(
        [
            "link",
            "mode",
            "batch",
            "micro-batches",
            "threads each",
            "new tokens/s",
            "prefill ms",
            "ms/token (decode)",
            "min-max",
            "vs local, ms",
            "vs local 1 thread, ms",
            "target: faster local + 1 ms/stage",
            "same tokens as local (as many threads)",
        ],
        first_rows,
    )
    second = _common.markdown_table(
        [
            "link",
            "mode",
            "batch",
            "micro-batches",
            "ms/token",
            "model call",
            "compute (some stage busy)",
            "stage->stage msgs only",
            "driver msgs, dispatch",
            "generate's loop",
            "busy per stage",
            ">= 2 stages at once",
            "driver bytes/token",
        ],
        second_rows,
    )
    return first, second


# --- main --------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--repeats", type=int, default=3, help="timed generations per mode and round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--lan", action="store_true", help="the lrmp modes once more over emulated 1 Gbit/s hosts (root)")
    p.add_argument("--rate", default="1gbit", help="the emulated links' rate with --lan")
    p.add_argument("--quick", action="store_true", help="a tiny model, short prompts, one repeat")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    if args.quick:
        args.vocab, args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 1000, 64, 128, 4, 4, 2
        args.prompt, args.new_tokens, args.batches, args.repeats, args.rounds = 16, 8, "1,4", 1, 1
    return args


def quiet() -> None:
    """Warnings off and the libraries' logs at ERROR, as a timed run wants them (also `versions.py`'s)."""
    warnings.filterwarnings("ignore")
    import lightning  # noqa: F401  (before the levels: its import sets its loggers')

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "lightning_remote_mp"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _common.exit_on_sigterm()
    quiet()
    from lightning_remote_mp.driver.launch import LocalWorkers

    batches = [int(b) for b in args.batches.split(",")]
    every = modes(batches)
    model = make_model(args)
    params = sum(p.numel() for p in model.parameters())
    print(_common.environment())
    print(
        f"Llama: vocabulary {args.vocab}, hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
        f"({args.kv_heads} key/value), MLP {args.intermediate}, untied LM head: {params / 1e6:.1f} M parameters, "
        f"{params * 4 / 1e6:.0f} MB float32; prompts of {args.prompt} tokens, {args.new_tokens} new ones, greedy; "
        f"batches {batches}"
    )
    print(
        f"local: this process, {CORES} torch threads (and 1, for reference); lrmp: local workers on loopback, "
        f"all cores each at one micro-batch (and one each at batch 1), cores // stages at two, the driver 1 "
        "thread; 1 warm-up + "
        f"{args.repeats} timed generations per mode, {args.rounds} round(s)",
        flush=True,
    )
    prompts = {b: make_prompts(b, args.prompt, args.vocab) for b in batches}
    results: dict[tuple[str, Mode], list[dict[str, Any]]] = {}
    started = time.perf_counter()
    pools = {(s, t): LocalWorkers(s, threads=t) for s, t in {(m.stages, m.threads) for m in every if m.kind == "lrmp"}}
    try:
        hosts = {s: w.start() for s, w in pools.items()}
        for r in range(args.rounds):
            order = every[r % len(every) :] + every[: r % len(every)]
            for mode in order:
                t = time.perf_counter()
                if mode.kind == "local":
                    runs = run_local(model, mode, prompts[mode.batch], args.new_tokens, args.repeats)
                else:
                    hosts_now = hosts[(mode.stages, mode.threads)]
                    runs = run_lrmp(model, mode, hosts_now, prompts[mode.batch], args.new_tokens, args.repeats)
                results.setdefault(("loopback", mode), []).extend(runs)
                print(
                    f"  round {r}: {mode.label:18s} batch {mode.batch:3d} m={mode.m}: "
                    f"{_common.median(x['decode_s'] for x in runs) * 1e3:8.2f} ms/token "
                    f"({time.perf_counter() - t:.0f} s)",
                    flush=True,
                )
        for w in pools.values():
            w.stop()
        if args.lan:
            lan_modes(args, every, prompts, model, results)
    finally:
        for w in pools.values():
            w.stop()

    want = {
        (mode.batch, mode.threads): runs[0]["tokens"]
        for (link, mode), runs in results.items()
        if link == "loopback" and mode.kind == "local"
    }
    first, second = tables(results, want, args.new_tokens)
    print()
    print(f"Run time {time.perf_counter() - started:.0f} s.")
    print()
    print(first)
    print()
    print(
        "A decode token's time (ms, medians), split: the model call (through lrmp: the pipelined forward's round "
        "trip) and generate's own loop; the call by the workers' timeline into time when some stage computes, when "
        "only a stage-to-stage message is in flight, and the rest (the driver's messages to the first stage and "
        "back from the last, encoding and dispatch). Busy: each stage's share of the decode phase spent computing. "
        f"Driver bytes: both directions on its TCP connections per decode step (the logits alone are batch x "
        f"{args.vocab} x 4 B)."
    )
    print()
    print(second)
    if not args.quick:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "generate.txt"), "w") as f:
            f.write(first + "\n\n" + second + "\n")
        raw = {
            f"{link} | {mode.label} | batch {mode.batch} | m {mode.m}": [
                # Without each step's clock readings, which the tables above summarize.
                {k: v for k, v in x.items() if k not in ("tokens", "first_extra", "times", "calls")}
                for x in runs
            ]
            for (link, mode), runs in results.items()
        }
        with open(os.path.join(args.out, "generate.json"), "w") as f:
            json.dump({"args": vars(args), "runs": raw}, f)
    _common.exit_now(0)


def lan_modes(
    args: argparse.Namespace,
    every: list[Mode],
    prompts: dict[int, Any],
    model: Any,
    results: dict[tuple[str, Mode], list[dict[str, Any]]],
) -> None:
    """The lrmp modes over emulated hosts (``tests/lrmp_lan.py``), which are gone when it returns or fails."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    from lrmp_lan import Lan, LanUnavailable

    stages = max(m.stages for m in every if m.kind == "lrmp")
    try:
        lan = Lan(1 + stages, args.rate)
    except LanUnavailable as err:
        print(f"no emulated LAN here ({err}): the --lan rows are skipped", flush=True)
        return
    try:
        workers = {i: lan.start_worker(i, "--log-level", "WARNING") for i in range(1, stages + 1)}  # 1 thread each
        for mode in dict.fromkeys(dataclasses.replace(m, threads=1) for m in every if m.kind == "lrmp"):
            t = time.perf_counter()
            hosts = [workers[i] for i in range(1, mode.stages + 1)]
            runs = run_lrmp(model, mode, hosts, prompts[mode.batch], args.new_tokens, args.repeats)
            results.setdefault((args.rate, mode), []).extend(runs)
            print(
                f"  {args.rate}: {mode.label:18s} batch {mode.batch:3d} m={mode.m}: "
                f"{_common.median(x['decode_s'] for x in runs) * 1e3:8.2f} ms/token ({time.perf_counter() - t:.0f} s)",
                flush=True,
            )
    finally:
        lan.close()


if __name__ == "__main__":
    sys.exit(main())
