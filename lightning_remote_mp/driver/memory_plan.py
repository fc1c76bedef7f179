"""A memory plan before the first byte moves: what each stage of a HuggingFace causal LM will hold
on its worker, from the model's config alone, whether it fits, and if not what to change
(``lrmp-plan``).

`plan_memory` builds the model on the meta device (no weights are read, nothing is allocated),
learns each worker's free memory (given, or asked from running workers in the greeting every
driver gets: `workers_free_memory`), splits the decoder layers over the stages as the placement
would (embeddings on the first stage, the final norm and the head on the last, a tied embedding on
both; the contiguous split that keeps the fullest stage emptiest against its worker's memory) and
counts each stage's base, trainable parameters, gradients, optimizer state, activations, logits
and a generation's key/value cache. `MemoryPlan.report` is what ``lrmp-plan`` prints: the table,
the verdict, and `MemoryPlan.advice`, each change with what the fullest stage then needs.

What each stage holds, and where each number comes from, is `lightning_remote_mp.model.stage_memory`'s
(the model's sizes: `lightning_remote_mp.model.causal_lm`). ``benchmarks/memory_plan.py`` compares
the plan with the peak each worker measures (docs/big_models.md has its table).

>>> from transformers import LlamaConfig
>>> config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
...                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
>>> plan = plan_memory(config, memory=["64MB", "64MB"], seq_len=256, microbatches=2)
>>> [(s.layers, s.fits) for s in plan.stages]
[(range(0, 3), True), (range(3, 4), True)]
>>> plan.stages[0].base  # float32: the embeddings (1000 x 64) and three layers of 36,992 parameters
699904
>>> plan_memory(config, memory=["64MB", "64XB"])
Traceback (most recent call last):
...
lightning_remote_mp.errors.ConfigurationError: memory '64XB' (worker 1) is not a size like 24GB, 24GiB, 512MB or 25769803776
"""  # noqa: E501

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

import torch

from lightning_remote_mp.errors import ConfigurationError
from lightning_remote_mp.model.causal_lm import ModelShape, load_config, model_shape
from lightning_remote_mp.model.stage_memory import (
    DTYPES,
    StagePlan,
    Training,
    dtype_of,
    lrmp_loss_chunk,
    split_stages,
)

log = logging.getLogger(__name__)
#: How far over a worker's free memory a stage's plan may be before the strategy refuses to start
#: (below it, a warning): the plan is within about 20% of the peaks workers measure
#: (``benchmarks/memory_plan.py``), and a false refusal costs a run that would have fitted.
PLAN_MARGIN = 1.25

_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_UNITS.update({"ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4})


def parse_size(text: str | int, what: str | None = None) -> int:
    """``"24GB"`` (10**9 bytes, as ``lrmp-worker``'s flags read it), ``"24GiB"``, ``"23.5GiB"``,
    ``"512MB"`` or a number of bytes."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text).lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigurationError(f"{what or repr(text)} is not a size like 24GB, 24GiB, 512MB or 25769803776")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def size_text(n: float) -> str:
    """Bytes as the project prints them: ``18.40 GB``, ``512.0 MB``, ``96.0 KB``."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if n >= 1e6:
        return f"{n / 1e6:.1f} MB"
    return f"{n / 1e3:.1f} KB" if n >= 1e3 else f"{n:.0f} B"


def count_text(n: float) -> str:
    """A count of parameters: ``70.55B``, ``103.5M``, ``36.9K``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.{2 if unit == 'B' else 1}f}{unit}"
    return f"{n:.0f}"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """`plan_memory`'s answer: the model, the training, and each stage's needs against its worker's
    free memory (`report` prints it as ``lrmp-plan`` does)."""

    shape: ModelShape
    training: Training
    stages: tuple[StagePlan, ...]

    @property
    def fits(self) -> bool | None:
        """Whether every stage fits its worker's free memory (``None`` when that is not known)."""
        verdicts = [s.fits for s in self.stages]
        return None if None in verdicts else all(verdicts)

    @property
    def fullest(self) -> StagePlan:
        """The stage nearest to its worker's free memory (or needing the most, when that is not known)."""
        return max(self.stages, key=lambda s: s.needs / s.free if s.free else s.needs)

    def table(self) -> str:
        """Each stage's needs as a markdown table."""
        t = self.training
        header = ["stage", "holds", "base", "trainable", "gradients", "optimizer", "activations", "logits"]
        header += ["kv cache"] * bool(t.generation) + ["needs", "free", "fits"]
        rows = []
        for s in self.stages:
            trainable = count_text(s.trainable) + (f" = {size_text(s.adapters)}" if s.adapters else "")
            row = [
                f"{s.index}" + (f" {s.address}" if s.address else ""),
                s.pieces,
                size_text(s.base),
                trainable,
                size_text(s.gradients),
                size_text(s.optimizer),
                size_text(s.activations),
                size_text(s.logits) if s.head else "-",
            ]
            row += [size_text(s.kv_cache)] * bool(t.generation)
            fits = {None: "?", True: "yes", False: f"NO ({size_text(s.needs - (s.free or 0))} over)"}[s.fits]
            rows.append([*row, size_text(s.needs), size_text(s.free) if s.free else "?", fits])
        return markdown_table(header, rows)

    def describe(self) -> str:
        """What was planned, in a sentence."""
        t, m = self.training, self.shape
        dtype = str(t.dtype).removeprefix("torch.")
        if t.quantization == "none":
            base = f"{dtype} base"
        else:
            double = " (double quantization)" if t.double_quant else ""
            base = f"{t.quantization.upper()}{double} base computing in {dtype}"
        if not t.full and t.frozen_dtype not in (None, t.dtype):
            base += f", its embeddings, norms and head in {str(t.frozen_dtype).removeprefix('torch.')}"
        targets = ", ".join(t.lora_targets) if t.lora_targets else "all linear layers"
        how = "full fine-tune" if t.full else f"LoRA r={t.lora_rank} on {targets}"
        loss = "whole logits" if t.whole_logits else f"the loss in chunks of {min(t.loss_chunk, t.tokens):,} tokens"
        gen = f", a generation's cache of {t.generation:,} tokens" if t.generation else ""
        mbs = f"{t.microbatches} micro-batch{'es' * (t.microbatches > 1)}"
        return (
            f"{m.name}: {count_text(m.parameters)} parameters, {len(m.layers)} layers, hidden {m.hidden:,}, vocab "
            f"{m.vocab:,}. {base}; {how}, {t.optimizer}; {mbs} of {t.rows} x {t.seq_len:,} tokens, "
            f"{t.schedule}, gradient checkpointing {'on' if t.checkpointing else 'off'}, {loss}{gen}; "
            f"{len(self.stages)} stages"
        )

    def advice(self) -> list[str]:
        """When a stage does not fit: each change that could help, cheapest first, with what the fullest
        stage then needs; then, if none is enough alone, the fewest of them together that fit; and the
        longest sequence that fits with the changes that cost no hardware."""
        if self.fits is not False:
            return []
        t, free, n = self.training, [s.free for s in self.stages], len(self.stages)
        tries: list[tuple[str, dict[str, Any], int]] = []  # what, the training's changes, workers added
        if t.schedule == "gpipe" and t.microbatches > 1:
            what = (
                f"schedule='1f1b' (stage i holds at most {n} - i micro-batches' activations, not all {t.microbatches})"
            )
            tries.append((what, {"schedule": "1f1b"}, 0))
        if t.rows > 1:
            m = t.microbatches * t.rows
            tries.append(
                (
                    f"microbatches={m} of 1 row each (the same batch), 1F1B",
                    {"microbatches": m, "rows": 1, "schedule": "1f1b"},
                    0,
                )
            )
        if not t.checkpointing:
            tries.append(("gradient checkpointing (model.gradient_checkpointing_enable())", {"checkpointing": True}, 0))
        if t.whole_logits:
            chunk = lrmp_loss_chunk(self.shape.vocab)
            what = f"the loss in chunks of {min(chunk, t.tokens):,} tokens (lrmp's labels= loss), not whole logits"
            tries.append((what, {"whole_logits": False, "loss_chunk": chunk}, 0))
        cheap = len(tries)
        known = [f for f in free if f]
        if known:
            tries.append((f"one more worker with {size_text(min(known))} free ({n + 1} stages)", {}, 1))
        if t.full:
            tries.append(("LoRA r=16 instead of a full fine-tune", {"lora_rank": 16}, 0))
        elif t.quantization == "none":
            tries.append(
                ("a 4-bit base (NF4 with double quantization: QLoRA)", {"quantization": "nf4", "double_quant": True}, 0)
            )
        lines, fitting = [], False
        for what, changes, more in tries:
            plan = self._again(dataclasses.replace(t, **changes), [*free, *[min(known or [0])] * more])
            lines.append(self._outcome(what, plan))
            fitting = fitting or bool(plan and plan.fits)
        if not fitting:
            for i in range(2, len(tries) + 1):
                changes = {k: v for _, c, _ in tries[:i] for k, v in c.items()}
                more = sum(m for _, _, m in tries[:i])
                plan = self._again(dataclasses.replace(t, **changes), [*free, *[min(known or [0])] * more])
                if plan is not None and plan.fits:
                    lines.append(
                        self._outcome("together, " + "; ".join(w.split(" (")[0] for w, _, _ in tries[:i]), plan)
                    )
                    break
        easier = dataclasses.replace(t, **{k: v for _, c, _ in tries[:cheap] for k, v in c.items()})
        seq = self._longest(easier)
        with_them = " with the changes that need no hardware above" if cheap else ""
        if seq:
            lines.append(f"a sequence of at most {seq:,} tokens (now {t.seq_len:,}){with_them}: fits")
        else:
            floor = self._again(dataclasses.replace(easier, seq_len=1), free)
            least = f": {size_text(floor.fullest.needs)} on stage {floor.fullest.index} at 1 token" if floor else ""
            lines.append(f"a shorter sequence{with_them}: none fits (weights, optimizer and transients alone{least})")
        return lines

    def _again(self, t: Training, free: Sequence[int | None]) -> MemoryPlan | None:
        try:
            return MemoryPlan(self.shape, t, split_stages(self.shape, t, free))
        except ConfigurationError:
            return None

    @staticmethod
    def _outcome(what: str, plan: MemoryPlan | None) -> str:
        if plan is None:
            return f"{what}: the model has too few layers for it"
        s = plan.fullest
        needs = f"stage {s.index} needs {size_text(s.needs)} of {size_text(s.free or 0)}"
        return f"{what}: {'fits' if plan.fits else 'still over'}, the fullest {needs}"

    def _longest(self, t: Training) -> int:
        """The longest sequence below ``t.seq_len`` with which every stage fits (a multiple of 128
        tokens from 128 on); 0 when none does."""
        lo, hi = 0, t.seq_len - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            plan = self._again(dataclasses.replace(t, seq_len=mid), [s.free for s in self.stages])
            lo, hi = (mid, hi) if plan is not None and plan.fits else (lo, mid - 1)
        return lo - lo % 128 if lo >= 128 else lo

    def report(self) -> str:
        """The plan as ``lrmp-plan`` prints it: what was planned, the table, the verdict, the advice."""
        lines = [self.describe(), "", self.table(), ""]
        if self.fits is None:
            lines.append("Free memory unknown: give --memory or --hosts for a verdict.")
        elif self.fits:
            lines.append("Fits: every stage within its worker's free memory.")
        else:
            over = [str(s.index) for s in self.stages if s.fits is False]
            lines.append(f"Does NOT fit: stage {', '.join(over)} over its worker's free memory. What would change it:")
            lines += [f"- {line}" for line in self.advice()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table, its columns padded (as the benchmarks print theirs)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells[1:]]
    return "\n".join(lines)


def workers_free_memory(hosts: Sequence[str], connect_timeout: float = 10.0) -> list[tuple[str, int]]:
    """Each running worker's address and free memory in bytes, as it says in its greeting (HELLO),
    through the driver's own links (`lightning_remote_mp.driver.links.WorkerLinks`); the session
    opened to ask is closed at once."""
    from lightning_remote_mp.driver.links import WorkerLinks

    links = WorkerLinks(list(hosts), connect_timeout=connect_timeout)
    try:
        return [(c.address, int(info.get("free_memory") or 0)) for c, info in zip(links.conns, links.workers)]
    finally:
        links.close()


def plan_memory(
    config: Any,
    *,
    memory: Sequence[str | int] | None = None,
    hosts: Sequence[str] | None = None,
    stages: int | None = None,
    dtype: torch.dtype | str | None = None,
    quantization: str = "none",
    double_quant: bool = False,
    lora_rank: int = 0,
    lora_targets: Sequence[str] | None = None,
    adapter_dtype: torch.dtype | str = torch.float32,
    frozen_dtype: torch.dtype | str | None = None,
    optimizer: str = "adamw",
    seq_len: int = 2048,
    rows: int = 1,
    microbatches: int = 1,
    schedule: str = "gpipe",
    checkpointing: bool = False,
    generation: int = 0,
    loss_chunk: int | None = None,
    whole_logits: bool = False,
    connect_timeout: float = 10.0,
) -> MemoryPlan:
    """What each stage of ``config``'s causal LM will need on its worker, and whether it fits there.

    Args:
        config: a transformers ``PretrainedConfig``, a ``config.json`` path, or a directory holding one.
            No weights are read: the model is built on the meta device.
        memory: each worker's free memory (``"24GB"``, ``"24GiB"``, bytes), one per stage in order.
        hosts: running workers' addresses instead: each says its free memory when greeted.
        stages: the number of stages, when neither is given (the plan then gives no verdict).
        dtype: the base's dtype, and the activations' (default: the config's ``torch_dtype``, else float32).
        quantization: ``"none"`` or ``"nf4"`` (bitsandbytes' 4-bit NormalFloat over the decoder's
            linear layers, block size 64); ``double_quant`` quantizes its scales too.
        lora_rank: the LoRA adapters' rank; 0 trains every parameter (a full fine-tune).
        lora_targets: the adapted linear layers, by name (``["q_proj", "v_proj"]``); default all of
            the decoder's linear layers (peft's ``"all-linear"``).
        adapter_dtype: the adapters' dtype, and their gradients' and optimizer state's (peft: float32).
        frozen_dtype: with LoRA, the dtype of the frozen tensors that are not quantized (embeddings,
            norms, the head; default ``dtype``): peft's ``prepare_model_for_kbit_training`` makes them
            float32.
        optimizer: ``"adamw"`` (two moments per trainable parameter) or ``"sgd"`` (none).
        seq_len, rows: tokens per sequence, and sequences per micro-batch.
        microbatches: micro-batches per batch; ``schedule``: ``"gpipe"``, ``"1f1b"`` or ``"zero_bubble"``.
        checkpointing: gradient checkpointing per decoder layer (transformers' ``gradient_checkpointing_enable()``).
        generation: the length (prompt and new tokens) of a generation's key/value cache, 0 for none.
        loss_chunk: tokens per chunk of the loss on the last stage (default: lrmp's, 64 MB of float32
            logits: 130 tokens at a vocabulary of 128,256); ``whole_logits``: plan the loss over whole
            logits instead (lrmp before its chunked loss).
        connect_timeout: with ``hosts``, seconds to wait for each worker.

    Raises:
        ConfigurationError: a config that cannot be read, an unknown option, a size that does not
            parse, LoRA targets that name no layer; naming which.
    """
    given = [name for name, v in (("memory", memory), ("hosts", hosts)) if v]
    if len(given) > 1:
        raise ConfigurationError("give the workers' free memory as memory= or as hosts= (asked from them), not both")
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise ConfigurationError(f"stages must be a positive integer, got {stages!r}")
    config = load_config(config)
    shape = model_shape(config)
    if dtype is None:
        dtype = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
        dtype = dtype if str(dtype).removeprefix("torch.") in DTYPES else torch.float32
    t = Training(
        dtype=dtype_of(dtype, "dtype"),
        quantization=quantization,
        double_quant=double_quant,
        lora_rank=lora_rank,
        lora_targets=tuple(lora_targets) if lora_targets else None,
        adapter_dtype=dtype_of(adapter_dtype, "adapter_dtype"),
        frozen_dtype=dtype_of(frozen_dtype, "frozen_dtype") if frozen_dtype is not None else None,
        optimizer=optimizer,
        seq_len=seq_len,
        rows=rows,
        microbatches=microbatches,
        schedule=schedule,
        checkpointing=checkpointing,
        generation=generation,
        loss_chunk=loss_chunk or lrmp_loss_chunk(shape.vocab),
        whole_logits=whole_logits,
    )
    names = sorted({lin.name for layer in shape.layers for lin in layer.linears})
    for target in t.lora_targets or ():
        if not any(n == target or n.endswith("." + target) for n in names):
            raise ConfigurationError(
                f"lora_targets: {target!r} names no linear layer of {shape.name}'s decoder layers ({', '.join(names)})"
            )
    addresses: list[str | None]
    if memory:
        free: list[int | None] = [parse_size(m, f"memory {str(m)!r} (worker {i})") for i, m in enumerate(memory)]
        addresses = [None] * len(free)
    elif hosts:
        found = workers_free_memory(hosts, connect_timeout)
        addresses, free = [a for a, _ in found], [f for _, f in found]
    else:
        if stages is None:
            raise ConfigurationError("give the workers' free memory (memory=, one size per stage), hosts=, or stages=")
        free, addresses = [None] * stages, [None] * stages
    if stages is not None and stages != len(free):
        raise ConfigurationError(f"stages={stages}, but {given[0]} names {len(free)} workers (one stage each)")
    plans = split_stages(shape, t, free)
    plan = MemoryPlan(shape, t, tuple(dataclasses.replace(s, address=a) for s, a in zip(plans, addresses)))
    log.debug("memory plan: %s", plan.describe())
    return plan


def main(argv: list[str] | None = None) -> int:
    """``lrmp-plan``: the plan printed; exit status 1 when a stage does not fit, 2 for bad input."""
    parser = argparse.ArgumentParser(
        prog="lrmp-plan",
        description="What each worker (pipeline stage) of a HuggingFace causal LM will need, from its config "
        "alone, and whether it fits.",
    )
    parser.add_argument("config", help="a config.json, or the directory holding one (save_pretrained's)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--memory", nargs="+", metavar="SIZE", help="each worker's free memory, in stage order: 24GB 24GB"
    )
    where.add_argument("--hosts", nargs="+", metavar="ADDRESS", help="running workers, asked for their free memory")
    where.add_argument("--stages", type=int, help="the number of stages, without a verdict")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="the base's dtype (default: the config's)")
    parser.add_argument("--quantization", default="none", help="none or nf4 (default none)")
    parser.add_argument("--double-quant", action="store_true", help="nf4's scales quantized too")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA's rank; 0 (default): a full fine-tune")
    parser.add_argument("--lora-targets", nargs="+", metavar="NAME", help="adapted layers (default: all linear)")
    parser.add_argument("--adapter-dtype", default="float32", choices=sorted(DTYPES), help="LoRA's (default float32)")
    parser.add_argument(
        "--frozen-dtype",
        choices=sorted(DTYPES),
        help="LoRA: unquantized frozen tensors' (prepare_model_for_kbit_training: float32)",
    )
    parser.add_argument("--optimizer", default="adamw", help="adamw (default) or sgd")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--rows", type=int, default=1, help="sequences per micro-batch (default 1)")
    parser.add_argument("--microbatches", type=int, default=1, help="micro-batches per batch (default 1)")
    parser.add_argument("--schedule", default="gpipe", help="gpipe (default), 1f1b or zero_bubble")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing per decoder layer")
    parser.add_argument("--generation", type=int, default=0, help="a generation's length, for its key/value cache")
    parser.add_argument(
        "--loss-chunk", type=int, help="tokens per chunk of the loss (default: lrmp's, 64 MB of logits)"
    )
    parser.add_argument("--whole-logits", action="store_true", help="the loss over whole logits (lrmp before chunking)")
    parser.add_argument("--connect-timeout", type=float, default=10.0, help="with --hosts: seconds per worker")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        plan = plan_memory(
            args.config,
            memory=args.memory,
            hosts=args.hosts,
            stages=args.stages,
            dtype=args.dtype,
            quantization=args.quantization,
            double_quant=args.double_quant,
            lora_rank=args.lora_rank,
            lora_targets=args.lora_targets,
            adapter_dtype=args.adapter_dtype,
            frozen_dtype=args.frozen_dtype,
            optimizer=args.optimizer,
            seq_len=args.seq_len,
            rows=args.rows,
            microbatches=args.microbatches,
            schedule=args.schedule,
            checkpointing=args.checkpointing,
            generation=args.generation,
            loss_chunk=args.loss_chunk,
            whole_logits=args.whole_logits,
            connect_timeout=args.connect_timeout,
        )
    except ConfigurationError as err:
        parser.exit(2, f"lrmp-plan: {err}\n")
    print(plan.report())
    return 1 if plan.fits is False else 0


def plan_traced(
    module: Any,
    *,
    microbatches: int,
    schedule: str,
    optimizer: str | None,
    free: Sequence[int | None],
) -> tuple[MemoryPlan, list[int]] | None:
    """The plan of a traced HuggingFace causal LM as the strategy trains it (``balance="memory"``):
    the same numbers as `plan_memory`'s, from the module itself (its config, its dtypes, its LoRA
    adapters and 4-bit weights, its checkpointing, the traced call's tokens) and the strategy's
    options, with the units each stage gets; ``None`` for a module the plan does not know (not a
    causal LM transformers can build from its config, units that are not one per decoder layer)."""
    owner = getattr(module, "_owner", None)
    config = getattr(owner, "config", None)
    if owner is None or config is None or not hasattr(config, "to_dict"):
        return None
    try:
        shape = model_shape(config)
    except (ConfigurationError, ImportError) as err:
        log.debug("no memory plan for %s: %s", type(owner).__name__, err)
        return None
    layers = _decoder_units(module, shape)
    if layers is None:
        return None
    params = dict(owner.named_parameters())
    lora = [(n, p) for n, p in params.items() if ".lora_A." in n]
    formats = [fmt for _, _, fmt in getattr(module, "quantized", {}).values()]
    decoder = [p for n, p in params.items() if f"{shape.layers_path}." in n and ".lora_" not in n]
    dtype = formats[0].dtype if formats else max(decoder, key=lambda p: p.numel()).dtype
    tokens = _tokens(module)
    if tokens is None:
        return None
    rows, seq_len = tokens
    embeddings = owner.get_input_embeddings() if hasattr(owner, "get_input_embeddings") else None
    t = Training(
        dtype=dtype if dtype in DTYPES.values() else torch.float32,
        quantization="nf4" if formats else "none",
        double_quant=bool(formats and formats[0].nested),
        lora_rank=int(lora[0][1].shape[0]) if lora else 0,
        lora_targets=tuple(sorted({n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in lora})) or None,
        adapter_dtype=lora[0][1].dtype if lora else torch.float32,
        frozen_dtype=getattr(getattr(embeddings, "weight", None), "dtype", None) if lora else None,
        optimizer=optimizer or "adamw",
        seq_len=seq_len,
        rows=max(1, -(-rows // microbatches)),
        microbatches=microbatches,
        schedule=schedule,
        checkpointing=any(e.kwargs.get("checkpoint") for e in module.entries),
        loss_chunk=lrmp_loss_chunk(shape.vocab),
    )
    try:
        stages = split_stages(shape, t, free)
    except ConfigurationError:
        return None
    first, last = layers[0], layers[-1]
    counts = [len(s.layers) + (first if s.index == 0 else 0) for s in stages]
    counts[-1] += len(module.entries) - last - 1
    if min(counts) < 1:
        return None
    return MemoryPlan(shape, t, stages), counts


def _decoder_units(module: Any, shape: ModelShape) -> list[int] | None:
    """The units that are the decoder layers 0, 1, ... in order, one each (their labels end in
    ``model.layers.<i>``); ``None`` where they are not."""
    pattern = re.compile(rf"(?:^|\.){re.escape(shape.layers_path)}\.(\d+)$")
    found = [(k, m) for k, e in enumerate(module.entries) if (m := pattern.search(e.label or ""))]
    if [int(m.group(1)) for _, m in found] != list(range(len(shape.layers))):
        return None
    units = [k for k, _ in found]
    return units if units == list(range(units[0], units[0] + len(units))) else None


def _tokens(module: Any) -> tuple[int, int] | None:
    """The traced call's rows and tokens per row: its first unit's first two-dimensional integer
    input (the ids)."""
    for example in module.entries[0].kwargs.get("examples", ()):
        shape, dtype = example.get("shape"), example.get("dtype")
        if shape and len(shape) == 2 and dtype in (torch.int64, torch.int32):
            return int(shape[0]), int(shape[1])
    return None


if __name__ == "__main__":
    sys.exit(main())
