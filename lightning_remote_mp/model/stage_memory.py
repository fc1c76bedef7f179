"""What one pipeline stage of a causal LM holds while it trains, in bytes: `split_stages` splits the
decoder layers over the stages and counts each stage's share (`StagePlan`) for a way of training
(`Training`); `lightning_remote_mp.driver.memory_plan` turns that into a plan with a verdict.

Per stage, from the model's sizes (`lightning_remote_mp.model.causal_lm`):

- **the base**: each weight in the training's dtype, or a decoder's linear layers in 4-bit NF4 as
  bitsandbytes stores them: the packed codes, the block scales (float32, or 8-bit with double
  quantization, plus their own float32 scales per 256), the code tables
  (`lightning_remote_mp.model.four_bit.Format.parts`, what a worker holds). Embeddings, norms and the
  head stay in the dtype, as bitsandbytes leaves them;
- **the trainable parameters**: all of them (a full fine-tune) or LoRA adapters, ``r x (in + out)``
  per targeted linear layer, in ``adapter_dtype`` (peft makes them float32 over a 16-bit base); their
  **gradients** in the same dtype; the **optimizer state**: AdamW's two moments per trainable, in its
  dtype (``torch.optim.AdamW``'s ``exp_avg`` and ``exp_avg_sq``), SGD none;
- **activations**: per decoder layer and token, the tensors autograd saves for the backward in the
  program a worker runs (a ``torch.export`` trace, listed with ``saved_tensors_hooks`` on a traced
  Llama: every count below was checked that way, in float32 and in bfloat16 with LoRA): each
  RMSNorm's input upcast to float32 (and the normalized input, when the norm's weight trains); the
  input of each linear layer whose weight trains, once per shared input (q/k/v, gate/up), or, for
  LoRA, the input of each adapted layer (cast to the adapter's dtype per layer when it differs) and
  its rank-``r`` projection; a gated MLP's gate, activation and up outputs; attention's query, its
  key and value repeated to every head, its output and log-sum-exp, the additive causal mask (a row
  of ``sequence`` values per token) and the rotary cos/sin. A stage holds those of several
  micro-batches at once: all of them under GPipe, at most ``stages - index`` under 1F1B. With
  gradient checkpointing (transformers', per decoder layer) a layer keeps only its input hidden
  state per micro-batch, and one layer's full activations live again while it is recomputed;
- **the logits** on the last stage: the loss computed in chunks holds a chunk's float32
  ``[chunk_tokens, vocab]`` logits and gradients at a time (`CHUNK_BUFFERS`), and a head that trains
  copies of its weight per micro-batch (`TRAINED_HEAD_COPIES_PER_MICROBATCH`); with ``whole_logits``
  (lrmp before its chunked loss) each micro-batch held keeps its whole logits and log-softmax, and
  the loss's backward adds its gradients (`WHOLE_LOGITS_HELD`, `WHOLE_LOGITS_BACKWARD`);
- **a generation's key/value cache**: ``2 x layers x kv_heads x head_dim x length x rows`` values in
  the dtype. Generation runs in validation, when the gradients are freed: a stage needs the larger
  of its training and its generation.

Transients are counted where they peak: a decoder layer's backward (`BACKWARD_WORKSPACE`), a 4-bit
weight dequantized while its layer runs. A worker's own overheads (a CUDA context, torch's and
Python's memory) are not in the plan: it says what the model adds. A CPU worker holds what the plan
counts too: its large tensors are mapped apart from the heap (`lightning_remote_mp.worker.allocator`),
so they leave no holes. ``benchmarks/memory_plan.py`` compares the plan with the peak each worker
measures, on a float32 full fine-tune, a bfloat16 base with LoRA and QLoRA (docs/big_models.md has
its table).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_remote_mp.errors import ConfigurationError
from lightning_remote_mp.model.causal_lm import DecoderLayer, Linear, ModelShape
from lightning_remote_mp.model.four_bit import Format
from lightning_remote_mp.model.head_loss import CHUNK_ELEMENTS
from lightning_remote_mp.schedule import check_schedule

QUANTIZATIONS = ("none", "nf4")
OPTIMIZERS = ("adamw", "sgd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: bitsandbytes' default block size, the one transformers' ``BitsAndBytesConfig`` quantizes with.
NF4_BLOCKSIZE = 64
#: Bytes a float32 value takes: RMSNorm's upcast input, the loss's log-softmax, attention's log-sum-exp.
FP32 = 4
#: The loss in chunks (lrmp's ``labels=`` loss, `lightning_remote_mp.model.head_loss`): tokens per
#: chunk of a `Training` made without ``loss_chunk`` (`plan_memory` takes lrmp's own,
#: ``head_loss.CHUNK_ELEMENTS // vocab``, 64 MB of float32 logits: `lrmp_loss_chunk`).
#: A chunk's float32 ``[chunk, vocab]`` buffers alive at once at the loss's backward
#: (the chunk recomputed, its log-softmax, their gradients): 3.0 chunks for the operator alone in one
#: process, 3.7 to 4.2 on lrmp's workers (a last stage holding the final norm and a frozen head alone,
#: LoRA, 2 micro-batches of 1,024 or 2,048 tokens, vocabularies 16,384 and 32,768).
LOSS_CHUNK = 1024
CHUNK_BUFFERS = 4
#: A head that trains (a full fine-tune): the last stage holds copies of the head's weight, in its
#: gradient's dtype, beside its gradient until the optimizer's step (the chunks' sums of each
#: micro-batch's backward). Measured on the workers (benchmarks/memory_plan.py's float32 full
#: fine-tune with the final norm and the head alone on the last stage, vocabulary 16,384, 2,048
#: tokens a micro-batch, GPipe): -0.4, 1.4 and 2.9 copies above the plan without them at 1, 2 and 4
#: micro-batches; this constant gives 0.6, 1.2 and 2.4. Counted for every micro-batch of the step,
#: whatever the schedule (1F1B not measured).
TRAINED_HEAD_COPIES_PER_MICROBATCH = 0.6
#: Whole logits (``whole_logits=True``, lrmp before its chunked loss), in float32 ``[tokens, vocab]``
#: units. Each micro-batch held keeps its logits (for the driver) and their log-softmax (for the
#: loss's backward), and on lrmp's workers a third such buffer; the loss's backward two more (its
#: gradients). Measured on 0.15.6's workers' last stage (a float32 full fine-tune of a traced Llama, the
#: head alone on it, 2,048 tokens a micro-batch, vocabulary 16,384): 4.7, 8.5, 11.6 and 14.6 units at
#: 1 to 4 micro-batches; these constants give 5, 8, 11 and 14.
WHOLE_LOGITS_HELD = 3.0
WHOLE_LOGITS_BACKWARD = 2.0
#: A decoder layer's backward: the gradients of its activations live beside what the stage holds, a
#: share of one layer's activations of one micro-batch. Measured in one process on a traced Llama's
#: layers, the backward's peak above the forward's end: 0.4 of a layer in float32, 0.2 with LoRA.
BACKWARD_WORKSPACE = 0.5
#: A 4-bit weight dequantized while its layer runs: its values in the compute dtype, plus the int32
#: index of its packed bytes (4 bytes per 2 weights), per benchmarks/qlora.py.
DEQUANTIZE_INDEX_BYTES = 2


def lrmp_loss_chunk(vocab: int) -> int:
    """Tokens per chunk of lrmp's ``labels=`` loss at ``vocab``: ``head_loss.CHUNK_ELEMENTS`` logits."""
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


@dataclasses.dataclass(frozen=True)
class Training:
    """How the model is trained, as the plan counts it: the arguments of
    `lightning_remote_mp.driver.memory_plan.plan_memory`, checked."""

    dtype: torch.dtype = torch.float32
    quantization: str = "none"
    double_quant: bool = False
    lora_rank: int = 0
    lora_targets: tuple[str, ...] | None = None
    adapter_dtype: torch.dtype = torch.float32
    optimizer: str = "adamw"
    seq_len: int = 2048
    rows: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    checkpointing: bool = False
    generation: int = 0
    loss_chunk: int = LOSS_CHUNK
    whole_logits: bool = False
    frozen_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATIONS:
            raise ConfigurationError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigurationError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        check_schedule(self.schedule)  # zero-bubble holds activations as 1F1B does
        if self.double_quant and self.quantization == "none":
            raise ConfigurationError("double_quant quantizes 4-bit scales: it needs quantization='nf4'")
        if self.quantization != "none" and not self.lora_rank:
            raise ConfigurationError(
                f"quantization={self.quantization!r} freezes the base: give lora_rank (QLoRA trains adapters over it)"
            )
        for name in ("seq_len", "rows", "microbatches", "loss_chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("lora_rank", "generation"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ConfigurationError(f"{name} must be an integer of at least 0, got {getattr(self, name)!r}")

    @property
    def full(self) -> bool:
        return self.lora_rank == 0

    @property
    def frozen_bytes(self) -> int:
        """Bytes a value of the base's tensors that are neither trained nor quantized takes: with a
        full fine-tune, none is frozen; with LoRA, ``frozen_dtype`` (``prepare_model_for_kbit_training``
        upcasts them to float32), else the dtype."""
        return (self.frozen_dtype or self.dtype).itemsize if not self.full else self.dtype.itemsize

    @property
    def tokens(self) -> int:
        """Tokens per micro-batch."""
        return self.seq_len * self.rows

    def held(self, index: int, stages: int) -> int:
        """Micro-batches whose activations stage ``index`` holds at once."""
        return self.microbatches if self.schedule == "gpipe" else min(self.microbatches, stages - index)

    def targeted(self, lin: Linear) -> bool:
        if self.full:
            return False
        if self.lora_targets is None:
            return True
        return any(lin.name == t or lin.name.endswith("." + t) for t in self.lora_targets)


def dtype_of(value: Any, what: str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise ConfigurationError(f"{what} must be one of {', '.join(DTYPES)}, got {value!r}")
    return DTYPES[name]


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """What one stage needs, in bytes (``trainable`` in parameters), and its worker's free memory."""

    index: int
    layers: range
    embeddings: bool
    head: bool
    parameters: int
    trainable: int
    base: int
    adapters: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    kv_cache: int
    free: int | None = None
    address: str | None = None

    @property
    def training(self) -> int:
        return self.base + self.adapters + self.gradients + self.optimizer + self.activations + self.logits

    @property
    def generating(self) -> int:
        return self.base + self.adapters + self.optimizer + self.kv_cache if self.kv_cache else 0

    @property
    def needs(self) -> int:
        """The stage's peak: the larger of its training and its generation."""
        return max(self.training, self.generating)

    @property
    def fits(self) -> bool | None:
        return None if self.free is None else self.needs <= self.free

    @property
    def pieces(self) -> str:
        parts = ["embeddings"] if self.embeddings else []
        if len(self.layers):
            first, last = self.layers[0], self.layers[-1]
            parts.append(f"layers {first}-{last}" if last > first else f"layer {first}")
        if self.head:
            parts.append("norm, head")
        return ", ".join(parts)


def _weight_bytes(lin: Linear, t: Training) -> int:
    """The frozen or trained weight (and bias) of a decoder's linear layer, as the stage holds it."""
    b = t.dtype.itemsize
    bias = lin.out_features * (b if t.quantization == "none" else t.frozen_bytes) if lin.bias else 0
    if t.quantization == "none":
        return lin.in_features * lin.out_features * b + bias
    fmt = Format((lin.out_features, lin.in_features), t.quantization, NF4_BLOCKSIZE, t.double_quant, t.dtype)
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in fmt.parts().values()) + bias


def layer_activations(layer: DecoderLayer, shape: ModelShape, t: Training) -> int:
    """Bytes one decoder layer saves for its backward per token of a micro-batch (see the module
    docstring), without checkpointing."""
    b, a, h = t.dtype.itemsize, t.adapter_dtype.itemsize, shape.hidden
    saved = layer.norms * (FP32 * h + (b * h if t.full else 0))
    for group in layer.input_groups():
        if t.full:
            saved += group[0].in_features * b
            continue
        targets = [lin for lin in group if t.targeted(lin)]
        if targets:
            shared = a == b  # peft casts an adapter's input to its dtype, per layer
            saved += targets[0].in_features * b if shared else sum(lin.in_features * a for lin in targets)
            saved += len(targets) * t.lora_rank * a
    saved += (3 if layer.gated else 1) * shape.intermediate * b
    attention = shape.heads * shape.head_dim
    saved += 4 * attention * b + shape.heads * FP32 + t.seq_len * b + 2 * shape.head_dim * b
    return saved


@dataclasses.dataclass(frozen=True)
class _LayerCost:
    """One decoder layer's share of a stage (`_costs`)."""

    parameters: int
    base: int
    adapters: int
    trainable: int
    largest_4bit: int
    activations: int  # bytes saved per token, without checkpointing


def _costs(shape: ModelShape, t: Training) -> list[_LayerCost]:
    a = t.adapter_dtype.itemsize
    costs = []
    for layer in shape.layers:
        params = base = adapters = trainable = largest = 0
        for lin in layer.linears:
            n = lin.in_features * lin.out_features
            params += n + lin.out_features * lin.bias
            base += _weight_bytes(lin, t)
            if t.targeted(lin):
                r = t.lora_rank * (lin.in_features + lin.out_features)
                adapters += r * a
                trainable += r
            if t.quantization != "none":
                largest = max(largest, n)
        params += layer.other_params
        base += layer.other_params * t.frozen_bytes
        trainable = params if t.full else trainable
        costs.append(_LayerCost(params, base, adapters, trainable, largest, layer_activations(layer, shape, t)))
    return costs


def _stage(
    shape: ModelShape, t: Training, costs: Sequence[_LayerCost], index: int, stages: int, layers: range
) -> StagePlan:
    b, h, tokens = t.dtype.itemsize, shape.hidden, t.tokens
    first, last = index == 0, index == stages - 1
    mine = costs[layers.start : layers.stop]
    ends = (shape.first_params if first else 0) + (shape.last_params if last else 0)
    if first and last and shape.tied:
        ends -= shape.head_params  # one copy on a single stage
    params = ends + sum(c.parameters for c in mine)
    base = ends * t.frozen_bytes + sum(c.base for c in mine)
    adapters = sum(c.adapters for c in mine)
    trainable = params if t.full else sum(c.trainable for c in mine)
    grad_bytes = b if t.full else t.adapter_dtype.itemsize
    per_token = sum(h * b if t.checkpointing else c.activations for c in mine)  # held per micro-batch
    if not last:
        per_token += h * b  # the stage's output, kept for its backward
    held, logits = t.held(index, stages), 0
    if last:
        per_token += FP32 * h + (b * h if t.full else 0)  # the final norm
        per_token += h * b if t.full else 0  # the head's input, for its weight's gradient
        fp32_logits = tokens * shape.vocab * FP32
        if t.whole_logits:
            logits = int((held * WHOLE_LOGITS_HELD + WHOLE_LOGITS_BACKWARD) * fp32_logits)
        else:
            logits = CHUNK_BUFFERS * min(t.loss_chunk, tokens) * shape.vocab * FP32
            copies = TRAINED_HEAD_COPIES_PER_MICROBATCH * t.microbatches if t.full else 0
            logits += int(copies * shape.head_params * b)
    one_layer = max((c.activations for c in mine), default=0) * tokens  # one micro-batch's
    transient = int(BACKWARD_WORKSPACE * one_layer) + (one_layer if t.checkpointing else 0)  # + its recompute
    largest = max((c.largest_4bit for c in mine), default=0)
    transient += largest * (b + DEQUANTIZE_INDEX_BYTES)  # a 4-bit weight dequantized while its layer runs
    activations = held * per_token * tokens + transient
    return StagePlan(
        index=index,
        layers=layers,
        embeddings=first,
        head=last,
        parameters=params,
        trainable=trainable,
        base=base,
        adapters=adapters,
        gradients=trainable * grad_bytes,
        optimizer=2 * trainable * grad_bytes if t.optimizer == "adamw" else 0,
        activations=activations,
        logits=logits,
        kv_cache=2 * len(layers) * shape.kv_heads * shape.head_dim * t.generation * t.rows * b,
    )


def split_stages(shape: ModelShape, t: Training, free: Sequence[int | None]) -> tuple[StagePlan, ...]:
    """The contiguous split of the decoder layers over ``len(free)`` stages that keeps the fullest
    stage emptiest: the largest share of its worker's free memory when every worker's is known, else
    the most bytes. The first and the last stage may hold no decoder layer, the others at least one."""
    n, stages, costs = len(shape.layers), len(free), _costs(shape, t)
    if n < max(stages - 2, 1):
        raise ConfigurationError(
            f"{stages} stages need at least {max(stages - 2, 1)} decoder layers; the model has {n}"
        )
    known = all(free)
    # best[k]: for the stages so far, holding layers 0..k-1, the least worst load and their plans.
    best: dict[int, tuple[float, list[StagePlan]]] = {0: (0.0, [])}
    for s in range(stages):
        following: dict[int, tuple[float, list[StagePlan]]] = {}
        for k, (worst, plans) in best.items():
            for end in [n] if s == stages - 1 else range(k + (0 < s), n + 1):
                plan = dataclasses.replace(_stage(shape, t, costs, s, stages, range(k, end)), free=free[s])
                score = max(worst, plan.needs / free[s] if known else plan.needs)  # type: ignore[operator]
                if end not in following or score < following[end][0]:
                    following[end] = (score, [*plans, plan])
        best = following
    return tuple(best[n][1])
