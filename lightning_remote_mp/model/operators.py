"""Which ATen operators a worker runs: the allowlist every traced program is checked against.

An operator of the ``aten`` namespace is allowed (`allowed_operator`) when it is

- tagged ``core`` by torch (ATen's core IR, ~190 functional operators), or listed in
  `COMPOSITE_OPERATORS` (the composite operators traced training graphs keep, reviewed by name), or
  the in-place variant of one of those (``scatter_add_`` of ``scatter_add``);
- or, derived from torch's own description of it: a public operator (no leading underscore, no
  ``_backward``) each of whose overloads takes and returns only tensors, numbers, strings, dtypes,
  devices, layouts, memory formats, generators and lists of them (no storage, stream, opaque class
  or Python object), and which is not on `DENIED`, each of whose entries says why;
- or named by the worker's owner: ``lrmp-worker --allow-op aten::NAME`` (and, for the driver's
  own check before it sends a program, ``LRMP_ALLOW_OPERATORS=aten::NAME``), never one on `DENIED`.

Outside ATen, a program may name only lrmp's own operators (`OWN_OPERATORS`: ``lrmp::linear_4bit``,
a 4-bit frozen weight's linear layer, `lightning_remote_mp.model.four_bit`; ``lrmp::kv_cache``, a
generation's key/value cache on the stage, `lightning_remote_mp.model.kv_cache`;
``lrmp::linear_cross_entropy`` and ``lrmp::deferred_linear``, a language model's loss and logits
without the whole logits, `lightning_remote_mp.model.head_loss`), which are part of the worker's own
code. Other custom operators (Python code registered as an operator), other namespaces and
control-flow operators stay refused: nothing here calls back into user code or reads a file.

>>> import torch
>>> allowed_operator(torch.ops.aten.stack.default), allowed_operator(torch.ops.aten.vstack.default)
(True, True)
>>> allowed_operator(torch.ops.aten.from_file.default), refused_why("from_file")
(False, 'reads a file the program names')
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import torch

from lightning_remote_mp.model import four_bit, head_loss, kv_cache

#: Operator namespaces whose operators a traced program may call.
ALLOWED_NAMESPACES = ("aten", "lrmp")
#: lrmp's own operators, defined in this package: the only ones of the ``lrmp`` namespace a program may call.
OWN_OPERATORS = {**four_bit.OPERATORS, **kv_cache.OPERATORS, **head_loss.OPERATORS}
#: ATen operators a program may call besides those tagged ``core`` (ATen's core IR, ~160 functional
#: operators): the composite ones that traced training graphs keep (torch.export's default IR is
#: pre-dispatch: ``linear``, ``batch_norm``, ``dropout``... stay whole). Reviewed by name: each reads
#: and writes only within its tensors' bounds. Backward operators are never needed and never allowed.
#: The last line came from auditing what torch.export emits for Llama, Qwen2, Qwen2-MoE, Mixtral, GPT-2,
#: BERT, T5, ViT and a peft LoRA model (docs/tracing.md, "Operators"): ``histc`` counts a tensor's
#: values into the bins the program names (a mixture of experts' tokens per expert); ``index_put``
#: writes values at indices that ATen bounds-checks; ``empty_like`` runs zero-filled like ``empty``;
#: ``_grouped_mm`` is the grouped matrix product of a mixture of experts in bfloat16. The line after
#: it holds the losses of ``torch.nn.functional`` that `lightning_remote_mp.driver.losses` computes
#: on the last stage, and ``broadcast_tensors`` (views of its inputs at one shape) that some of them
#: trace to. The line after that came from the models of issue #38 (Cohere, GPT-J, CodeGen, GLM4 and
#: Ernie 4.5 interleave rotary embeddings with ``stack``, Mamba's scan loop stacks its states, Falcon
#: takes ``weight.T``, DeepSeek-V3 ``new_empty``) and the spellings of the same that a user reaches
#: next: ``stack`` and ``hstack`` are ``cat`` of their inputs, ``numpy_T``, ``mT``, ``moveaxis`` and
#: ``swapdims`` views of one (``permute`` and ``transpose``), ``new_empty`` and ``new_empty_strided``
#: allocators like ``new_zeros`` (run zero-filled, `_ZERO_FILLED`). None does I/O, calls back into
#: Python or reaches beyond its tensors.
COMPOSITE_OPERATORS = frozenset(
    """
    linear bilinear conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d batch_norm
    instance_norm group_norm layer_norm rms_norm dropout feature_dropout alpha_dropout
    feature_alpha_dropout scaled_dot_product_attention softmax log_softmax matmul einsum reshape
    flatten unflatten transpose t contiguous view_as reshape_as expand_as type_as to chunk split
    unbind tensor_split narrow movedim swapaxes repeat_interleave tile masked_fill silu relu6 hardswish
    hardsigmoid mish softplus selu celu glu logsigmoid sigmoid_ tanh_ relu_ square exp2 erfinv
    clamp_min clamp_max clip norm linalg_vector_norm frobenius_norm std var_mean std_mean
    cumprod logsumexp argsort zeros ones zeros_like ones_like new_zeros new_ones new_full rand_like
    randn_like randint tril triu diff outer adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
    adaptive_max_pool1d adaptive_max_pool2d avg_pool1d max_pool1d max_pool2d max_pool3d pad
    upsample_nearest1d upsample_nearest3d upsample_linear1d upsample_bicubic2d pixel_shuffle
    pixel_unshuffle one_hot cross_entropy_loss nll_loss mse_loss l1_loss smooth_l1_loss
    binary_cross_entropy_with_logits __and__ __or__ __xor__ __lshift__ __rshift__ __iand__ __ior__
    bitwise_left_shift bitwise_right_shift floor_divide true_divide cosine_similarity pairwise_distance
    add_ sub_ mul_ div_ copy_ fill_ zero_ clamp_ masked_fill_ index_copy index_add index_fill
    masked_select detach item lift_fresh_copy all isfinite nan_to_num sgn expand_copy
    view_as_real view_as_complex polar complex real imag angle rsub addcmul addcdiv baddbmm addmv
    addbmm lerp hypot logaddexp xlogy frac heaviside dot vdot mv kron cross diag diag_embed
    diagonal_scatter take_along_dim flip fliplr flipud roll rot90 meshgrid broadcast_to
    histc index_put index_put_ empty_like _grouped_mm
    binary_cross_entropy huber_loss soft_margin_loss nll_loss2d nll_loss_nd broadcast_tensors
    stack hstack numpy_T mT moveaxis swapdims new_empty new_empty_strided
    """.split()
)


#: Steps dropped on load: shape and metadata assertions the tracer inserts, which would pin the
#: trace's device (a CUDA worker runs a program traced on a CPU driver) or re-check its guards.
DROPPED_OPERATORS = frozenset(
    {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size", "sym_constrain_range"}
)

#: Operators the derived rule would admit but a worker never runs, by name prefix, each with why.
DENIED: dict[tuple[str, ...], str] = {
    ("from_file",): "reads a file the program names",
    ("pin_memory", "is_pinned"): "page-locked host memory: a device resource outside the worker's own memory",
    ("record_stream",): "device streams are the worker's, not a program's",
    ("resize", "sparse_resize", "set_", "set_data", "is_set_to", "empty_permuted", "empty_quantized"): (
        "changes or allocates a tensor's memory without initialising it, so a program could read memory the "
        "worker freed (another session's weights)"
    ),
    (
        "sparse_",
        "to_sparse",
        "copy_sparse_to_sparse",
        "to_dense",
        "coalesce",
        "is_coalesced",
        "indices",
        "values",
        "crow_indices",
        "col_indices",
        "ccol_indices",
        "row_indices",
        "dense_dim",
        "sparse_dim",
        "sparse_mask",
        "hspmm",
        "smm",
        "sspaddmm",
    ): "sparse and compressed layouts trust their indices as given, so a program could read outside a tensor",
    ("nested_", "to_padded_tensor"): "nested tensors trust their offsets as given",
    (
        "quantize",
        "quantized_",
        "dequantize",
        "q_",
        "int_repr",
        "fake_quantize",
        "fused_moving_avg_obs_fake_quant",
        "choose_qparams",
        "fbgemm_",
    ): "quantized and packed weights are opaque layouts read as given",
    (
        "mkldnn_",
        "to_mkldnn",
        "miopen_",
        "cudnn_",
        "thnn_",
        "slow_conv",
        "conv_depthwise3d",
        "convolution_overrideable",
        "convolution_backward_overrideable",
    ): "backend kernels that ATen picks behind convolution and friends; a traced model never names them",
    ("bincount",): "allocates as many bins as the largest value in its input: a size the data decides",
}

#: Argument and return types of an operator the derived rule admits (as torch's schemas print them).
_PLAIN_TYPES = frozenset(
    f"{wrap[0]}{t}{wrap[1]}"
    for t in (
        "Tensor",
        "int",
        "SymInt",
        "float",
        "bool",
        "number",
        "complex",
        "str",
        "ScalarType",
        "Layout",
        "Device",
        "MemoryFormat",
        "Generator",
    )
    for wrap in (("", ""), ("Optional[", "]"), ("List[", "]"), ("Optional[List[", "]]"), ("List[Optional[", "]]"))
)

#: What the worker's owner allowed besides (``--allow-op``), and the driver's ``LRMP_ALLOW_OPERATORS``.
EXTRA: set[str] = set()


def allow(names: Iterable[str]) -> set[str]:
    """Allow the ATen operators ``names`` (``aten::NAME`` or ``NAME``) besides the rule; one on
    `DENIED` or that this torch lacks is a ``ValueError`` naming it. Returns the names added."""
    added = set()
    for given in names:
        name = given.strip().removeprefix("aten::").removeprefix("aten.")
        if not name:
            continue
        why = refused_why(name)
        if why is not None:
            raise ValueError(f"operator aten::{name} is never run from the wire: it {why}")
        if not isinstance(getattr(torch.ops.aten, name, None), torch._ops.OpOverloadPacket):
            raise ValueError(f"torch {torch.__version__} has no operator aten::{name}")
        added.add(name)
    EXTRA.update(added)
    return added


def refused_why(name: str) -> str | None:
    """Why the operator ``name`` is on `DENIED`, or ``None``."""
    return next((why for prefixes, why in DENIED.items() if name.startswith(prefixes)), None)


def allowed_operator(op: torch._ops.OpOverload) -> bool:
    """Whether a worker runs ``op`` (see the module docstring)."""
    namespace, _, name = op._schema.name.partition("::")
    if namespace == "lrmp":
        return name in OWN_OPERATORS and op is OWN_OPERATORS[name].default
    if namespace not in ALLOWED_NAMESPACES or name.endswith("_backward"):
        return False
    if name in COMPOSITE_OPERATORS or name in DROPPED_OPERATORS or _core(op.overloadpacket):
        return True
    if name.endswith("_") and not name.startswith("_"):
        functional = getattr(torch.ops.aten, name[:-1], None)
        if isinstance(functional, torch._ops.OpOverloadPacket) and (
            name[:-1] in COMPOSITE_OPERATORS or _core(functional)
        ):
            return True
    if refused_why(name) is not None:
        return False
    return name in EXTRA or (not name.startswith("_") and _plain(op.overloadpacket))


@functools.cache
def _core(packet: torch._ops.OpOverloadPacket) -> bool:
    # Core is tagged per overload (arange.start_step, not arange.default); the name is what counts.
    return any(torch.Tag.core in getattr(packet, overload).tags for overload in packet.overloads())


@functools.cache
def _plain(packet: torch._ops.OpOverloadPacket) -> bool:
    """Every overload of ``packet`` takes and returns only `_PLAIN_TYPES`."""
    schemas = [getattr(packet, overload)._schema for overload in packet.overloads()]
    return all(str(a.type) in _PLAIN_TYPES for s in schemas for a in (*s.arguments, *s.returns))


allow(os.environ.get("LRMP_ALLOW_OPERATORS", "").split(","))
