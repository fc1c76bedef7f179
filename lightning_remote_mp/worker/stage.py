"""The stage executor: one stage's layers on the worker's device, forward and backward by call id.

Each forward under grad keeps what backward needs, keyed by the driver's call id, until the
matching backward (or a release, when the driver dropped the graph without a backward).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lightning_remote_mp.errors import SpecError
from lightning_remote_mp.flow import Main, SplitBackward, is_floating, is_main
from lightning_remote_mp.model.build import build_layer
from lightning_remote_mp.model.entries import LayerEntry, normalize_entry
from lightning_remote_mp.model.graph_layer import LAYER_PATH
from lightning_remote_mp.model.spec import apply_modes
from lightning_remote_mp.model.wiring import run_layers
from lightning_remote_mp.worker.caches import GenerationCaches
from lightning_remote_mp.worker.deferred_bn import DeferredStatistics
from lightning_remote_mp.worker.deferred_grads import DeferredWeightGrads, accumulate_grad, auto_min_macs
from lightning_remote_mp.worker.device_io import DeviceIO


def _elements(value: Main) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _signature(x: Main, variables: Mapping[str, torch.Tensor]) -> tuple[Any, ...]:
    """The shapes and dtypes of a forward's inputs: what decides the sizes of its linear calls."""
    return (
        tuple((t.shape, t.dtype) for t in _elements(x)),
        tuple((n, t.shape, t.dtype) for n, t in sorted(variables.items())),
    )


def _writable(t: torch.Tensor) -> torch.Tensor:
    """A received tensor as the layers get it: a leaf that requires grad (whose ``.grad`` is the input
    gradient sent back) as an alias that is neither a leaf nor a view, so that the stage's first operation
    may write into it in place (``x.add_(1)``, as locally on the previous layer's output); autograd refuses
    that on a leaf that requires grad and on a view of one. ``_unsafe_view`` (how matmul returns its
    products) shares the memory: no copy, and no one reads the received tensor's values after the layers."""
    return torch.ops.aten._unsafe_view(t, t.shape) if t.requires_grad and t.is_leaf else t


def _pairs(y: Main, grad: Any) -> list[tuple[torch.Tensor, Any]]:
    """(output, its gradient or None) pairs, for a tensor or a tuple."""
    if isinstance(y, tuple):
        grads = grad if isinstance(grad, tuple) and len(grad) == len(y) else (None,) * len(y)
        return [(t, g if isinstance(g, torch.Tensor) else None) for t, g in zip(y, grads)]
    return [(y, grad if isinstance(grad, torch.Tensor) else None)]


@dataclasses.dataclass
class _Saved:
    x: Main
    imports: dict[str, torch.Tensor]
    y: Main | None  # None when the forward is to be recomputed at backward
    exports: dict[str, torch.Tensor]
    recompute: _Recompute | None = None


@dataclasses.dataclass
class _Recompute:
    """What re-running a forward at backward needs to compute exactly what the first run did."""

    rng: torch.Tensor
    device_rng: torch.Tensor | None
    autocast: Mapping[str, Any] | None


def _adopted(tensor: torch.Tensor, device: torch.device, owned: bool) -> torch.Tensor:
    """``tensor`` on ``device``, as the stage's own: a copy unless it is ``owned`` or moved anyway."""
    moved = tensor.to(device)
    return moved if owned or moved is not tensor else moved.clone()


def _well_formed_modes(modes: Any, layers: int) -> bool:
    """A `lightning_remote_mp.model.spec.Modes` value: a bool, or one bool or list of bools per layer."""
    if isinstance(modes, bool):
        return True
    return (
        isinstance(modes, list)
        and len(modes) >= layers
        and all(isinstance(m, bool) or (isinstance(m, list) and all(isinstance(f, bool) for f in m)) for m in modes)
    )


class StageExecutor:
    """Builds and runs one stage.

    Args:
        key: which SpecSequential of the driver's module this stage belongs to.
        index: the stage number.
        start: global index of the stage's first layer.
        entries: the stage's spec entries.
        exports: variables this stage produces that later stages consume.
        device: where the layers live.
        allowed_prefixes: module prefixes classes may be built from.
        init_seed: build the layers from this seed (the driver sends no weights).
        state_arrives: every weight and buffer is given at setup (`load_state_dict` with ``assign``).
        split_backward: defer linear layers' weight gradients to `flush_weight_grads` (see
            `deferred_grads`), so input gradients leave sooner; ``"auto"``: only calls whose
            weight-gradient product is large enough to repay it (`deferred_grads.auto_min_macs`).

    A forward may be *recomputed* (activation checkpointing, per micro-batch as the driver asks):
    it then keeps only its inputs and runs again, with grad, at backward, with the random state
    and buffers (BatchNorm's running statistics) of the first run, so the result is the same.
    """

    def __init__(
        self,
        key: str,
        index: int,
        start: int,
        entries: Sequence[Any],
        exports: Sequence[str],
        device: torch.device,
        allowed_prefixes: Sequence[str],
        init_seed: int | None = None,
        split_backward: SplitBackward = False,
        deferred_batch_norm: bool = False,
        state_arrives: bool = False,
    ) -> None:
        self.key = key
        self.index = index
        self.borrowed: str | None = None  # the key of the stage whose tensors this one holds (`borrow`)
        self.start = start
        self.device = device
        self.exports = list(exports)
        normalized: list[LayerEntry] = [normalize_entry(e, start + i) for i, e in enumerate(entries)]
        for i, e in enumerate(normalized):
            if not isinstance(e.layer, str):
                raise SpecError(f"layer {start + i}: a worker takes layers by dotted path only")
        self.names = [e.name for e in normalized]
        # Layers are built on CPU, seeded per layer when the driver asks (then the driver sends no
        # weights: it has none), else with their default init that the driver's weights replace.
        # Traced units whose every tensor arrives at setup (``state_arrives``) are built on the meta
        # device: a stage's weights are then allocated once, as they are read, not twice.
        on_meta = state_arrives and all(e.layer == LAYER_PATH for e in normalized)
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            layers = {
                str(start + i): build_layer(e, start + i, allowed_prefixes, init_seed=init_seed)
                for i, e in enumerate(normalized)
            }
        self.layers = nn.ModuleDict(layers) if on_meta else nn.ModuleDict(layers).to(device)
        self._indexed = [(int(k), m) for k, m in self.layers.items()]  # what `run_layers` runs, made once
        self._saved: dict[tuple[int, int], _Saved] = {}  # by (call, micro-batch)
        # Per call whose backward runs early: each trainable parameter's own gradient, by id.
        self._early: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.filing = 0  # the number of the last backward that filed deferred weight gradients
        self._modes: Any = None  # the train/eval flags last applied
        min_macs = auto_min_macs(device) if split_backward == "auto" else 0
        self.deferred = DeferredWeightGrads(self.layers, min_macs) if split_backward else None
        self.statistics = DeferredStatistics() if deferred_batch_norm else None
        #: The key/value caches of the generations the driver runs through this stage (`worker.caches`).
        self.caches = GenerationCaches(device)
        self._forwards: dict[int, int] = {}  # with deferred statistics: micro-batches of each call seen so far
        # On a GPU, tensors come and go through side streams (see `device_io`).
        self.io = DeviceIO(device) if device.type == "cuda" else None

    def layer_name(self, global_index: int) -> str:
        i = global_index - self.start
        return self.names[i] if 0 <= i < len(self.names) else ""

    # --- state -----------------------------------------------------------------
    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.layers.named_parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.layers.state_dict().items()}

    def load_state_dict(
        self, state: Mapping[str, torch.Tensor], assign: bool = False, owned: Collection[str] = ()
    ) -> None:
        """Copy ``state`` into the layers; with ``assign`` (at setup) also adopt its dtypes, so a
        driver's bf16 module stays bf16 here, and adopt the tensors named in ``owned`` (read from
        files here: nothing else holds them) without a copy."""
        expected = set(self.layers.state_dict())
        got = set(state)
        if (assign and got != expected) or not got <= expected:
            raise SpecError(
                f"stage {self.index} weights do not match its layers: missing {sorted(expected - got)[:5]}, "
                f"unexpected {sorted(got - expected)[:5]}"
            )
        if assign:
            adopted = {k: _adopted(v, self.device, k in owned) for k, v in state.items()}
            self.layers.load_state_dict(adopted, assign=True)
            if self.deferred is not None:
                self.deferred.parameters_replaced()
            return
        with torch.no_grad():
            for name, tensor in self.layers.state_dict(keep_vars=True).items():
                if name in state:
                    tensor.copy_(state[name])

    def borrow(self, other: StageExecutor) -> None:
        """Hold ``other``'s tensors under the same names, as the same tensors: this stage runs another
        call signature's program over the weights ``other`` trains (`Setup.borrows`); their
        gradients add up in the same ``.grad``, which ``other``'s optimizer steps."""
        theirs = other.layers.state_dict(keep_vars=True)
        for name, mine in self.layers.state_dict(keep_vars=True).items():
            if name not in theirs or theirs[name].shape != mine.shape:
                raise SpecError(
                    f"stage {self.index} of {self.key!r}: stage {other.index} of {other.key!r} holds no tensor "
                    f"{name!r} of shape {tuple(mine.shape)} to share"
                )
            table, leaf = self._slot(name)
            table[leaf] = theirs[name]
        self.borrowed = other.key
        self.caches = other.caches  # a prefill's and a decode's programs write one cache
        if self.deferred is not None:
            self.deferred.parameters_replaced()

    def share(self, groups: Sequence[Sequence[str]]) -> None:
        """Make each group of names (``"<layer index>.<name>"``) one tensor, the first name's: a tied
        weight that several of this stage's layers use trains as one parameter, as on the driver."""
        for group in groups:
            slots = [self._slot(name) for name in group]
            first = slots[0][0][slots[0][1]]
            for table, leaf in slots[1:]:
                if table[leaf] is not None and first is not None and table[leaf].shape != first.shape:
                    raise SpecError(f"stage {self.index}: tensors {group} to share differ in shape")
                table[leaf] = first
        if groups and self.deferred is not None:
            self.deferred.parameters_replaced()

    def _slot(self, name: str) -> tuple[dict[str, Any], str]:
        """The table (a module's parameters or buffers) and key that hold this stage's tensor ``name``
        (``"<layer index>.<path>"``)."""
        index, _, path = name.partition(".")
        owner_path, _, leaf = path.rpartition(".")
        owner = self.layers[index].get_submodule(owner_path) if index in self.layers else None
        if owner is None or (leaf not in owner._parameters and leaf not in owner._buffers):
            raise SpecError(f"stage {self.index}: no tensor {name!r} to share")
        return (owner._parameters if leaf in owner._parameters else owner._buffers), leaf

    def apply_modes(self, modes: Any) -> None:
        """Follow the driver's train/eval flags (a `lightning_remote_mp.model.spec.Modes` value), sent
        with every forward; unchanged flags cost one comparison."""
        if not _well_formed_modes(modes, self.start + len(self.names)):
            raise SpecError(f"stage {self.index}: malformed train/eval flags")
        if modes == self._modes:
            return
        self._modes = None  # unknown until every layer has its flags
        apply_modes(list(self.layers.values()), modes, self.start)
        self._modes = modes

    # --- compute ---------------------------------------------------------------
    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        return self.io.upload(t) if self.io is not None else t.to(self.device)

    def _to_device(self, t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        t = self._upload(t)
        if requires_grad and is_floating(t):
            t = t.detach().requires_grad_(True)
        return t

    def forward(
        self,
        call_id: tuple[int, int],
        x: Main,
        imports: Mapping[str, torch.Tensor],
        *,
        grad: bool,
        needs_grad: Mapping[str, Any],
        autocast: Mapping[str, Any] | None = None,
        modes: Any = None,
        recompute: bool = False,
        microbatches: int = 1,
    ) -> dict[str, Any]:
        """Run the stage. ``x`` is a tensor, or a tuple of them (a traced model's live values);
        ``needs_grad`` says which inputs (``"x"``, one flag per element for a tuple, and import names)
        the driver wants gradients for; ``grad`` whether autograd is on at all; ``recompute``: keep
        only the inputs and run again at backward (activation checkpointing).

        Returns the output ``y``, the ``exports``, whether state was ``saved`` for backward, and
        which outputs ``requires_grad`` (for a tuple ``y``, a list of flags). ``x`` was checked
        where its message was read (`lightning_remote_mp.wire.messages.Forward`)."""
        if modes is not None:
            self.apply_modes(modes)
        x = self._main_to_device(x, needs_grad.get("x") if grad else False)
        variables = {n: self._to_device(t, grad and bool(needs_grad.get(n))) for n, t in imports.items()}
        imported = dict(variables)
        replay = self._recording_state(autocast) if grad and recompute else None
        run_x, run_variables = x, variables
        if replay is not None:
            # The rerun at backward starts from the received tensors: this run, without grad, takes copies,
            # which a layer may write into in place (``x.add_(1)``) without changing what the rerun computes.
            with torch.no_grad():
                run_x = tuple(t.clone() for t in x) if isinstance(x, tuple) else x.clone()
                run_variables = {n: t.clone() for n, t in variables.items()}
        y = self._run(run_x, run_variables, grad=grad and replay is None, autocast=autocast, statistics=True)
        self._count_forward(call_id[0], microbatches)
        exports = self._exports(run_variables)
        if replay is not None:
            # No graph was kept: whether outputs need gradients is what a graph would have said, an
            # over-estimate at worst (an output that turns out not to need one gets none).
            trainable = any(p.requires_grad for p in self.layers.parameters())
            flag = trainable or any(t.requires_grad for t in [*_elements(x), *imported.values()])
            y_flags: Any = [flag and is_floating(t) for t in y] if isinstance(y, tuple) else flag
            requires_grad = {"y": y_flags, **{n: flag for n in exports}}
        else:
            y_flags = [t.requires_grad for t in y] if isinstance(y, tuple) else y.requires_grad
            requires_grad = {"y": y_flags, **{n: t.requires_grad for n, t in exports.items()}}
        saved = grad and any(any(f) if isinstance(f, list) else f for f in requires_grad.values())
        if saved:
            kept_y, kept_exports = (None, {}) if replay is not None else (y, exports)
            self._saved[call_id] = _Saved(x, imported, kept_y, kept_exports, replay)
        return {
            "y": tuple(t.detach() for t in y) if isinstance(y, tuple) else y.detach(),
            "exports": {n: t.detach() for n, t in exports.items()},
            "saved": saved,
            "requires_grad": requires_grad,
        }

    def _last_layer(self) -> nn.Module | None:
        return self._indexed[-1][1] if self._indexed else None

    def defer_heads(self) -> None:
        """On the last stage: its last layer's logits that only the model's output reads are kept as
        their head's input (`lightning_remote_mp.model.head_loss`), `take_heads` after each forward."""
        last = self._last_layer()
        if last is not None and hasattr(last, "defer_heads"):
            last.defer_heads = True

    def take_heads(self) -> dict[int, Any]:
        """The deferred heads of the last forward, by output position (then forgotten)."""
        last = self._last_layer()
        heads = getattr(last, "deferred", None)
        if not heads:
            return {}
        last.deferred = {}  # type: ignore[union-attr]
        return heads  # type: ignore[no-any-return]

    def _main_to_device(self, x: Main, flags: Any) -> Main:
        if isinstance(x, tuple):
            per = flags if isinstance(flags, list) and len(flags) == len(x) else [flags is True] * len(x)
            return tuple(self._to_device(t, f is True) for t, f in zip(x, per))
        return self._to_device(x, flags is True)

    def _recording_state(self, autocast: Mapping[str, Any] | None) -> _Recompute:
        device_rng = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return _Recompute(torch.get_rng_state(), device_rng, autocast)

    def _run(
        self,
        x: Main,
        variables: dict[str, torch.Tensor],
        *,
        grad: bool,
        autocast: Mapping[str, Any] | None,
        split: bool = True,
        statistics: bool = False,
    ) -> Main:
        cast = contextlib.nullcontext()
        if autocast and autocast.get("enabled"):
            cast = torch.autocast(self.device.type, dtype=autocast.get("dtype"))
        defer: contextlib.AbstractContextManager = contextlib.nullcontext()
        if self.deferred is not None and grad and split:
            signature = None
            if self.deferred.skips_small:
                signature = (_signature(x, variables), bool(autocast and autocast.get("enabled")))
            defer = self.deferred.recording(signature)
        deferred_statistics = contextlib.nullcontext()
        if self.statistics is not None and statistics:
            deferred_statistics = self.statistics.recording(self.layers)
        if grad:
            with torch.enable_grad():
                x = tuple(map(_writable, x)) if isinstance(x, tuple) else _writable(x)
                variables.update({n: _writable(t) for n, t in variables.items()})
        with torch.set_grad_enabled(grad), cast, defer, deferred_statistics:
            y = run_layers(self._indexed, x, variables)
        if not is_main(y):
            raise SpecError(
                f"stage {self.index}: layer {self.start + len(self.names) - 1} returned {type(y).__name__}; "
                "the output of a stage must be a tensor (or a tuple of tensors, for a traced model)"
            )
        return y

    def _count_forward(self, call: int, microbatches: int) -> None:
        """With deferred batch-norm statistics: once the last micro-batch of a call has been through
        this stage, update the running statistics from the whole mini-batch's."""
        if self.statistics is None:
            return
        seen = self._forwards[call] = self._forwards.get(call, 0) + 1
        if seen >= microbatches:
            del self._forwards[call]
            if self.statistics.waiting:
                self.statistics.commit()

    def _exports(self, variables: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = [n for n in self.exports if n not in variables]
        if missing:
            raise SpecError(f"stage {self.index} should export {missing}, but its layers did not produce them")
        return {n: variables[n] for n in self.exports}

    def _rerun(self, saved: _Saved) -> None:
        """Recompute a checkpointed forward with grad, as the first run went: the same random state,
        and buffers that the first run already updated (BatchNorm's running statistics) left as they
        are: the rerun updates copies of them, which its graph keeps."""
        replay = saved.recompute
        assert replay is not None
        owners = [(m, name, b) for m in self.layers.modules() for name, b in m._buffers.items() if b is not None]
        for m, name, b in owners:
            m._buffers[name] = b.clone()
        variables = dict(saved.imports)
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(replay.rng)
                if replay.device_rng is not None:
                    torch.cuda.set_rng_state(replay.device_rng, self.device)
                # Plain autograd: deferring the weight gradients would keep every linear layer's input
                # for the whole batch, the memory that recomputing is asked to save.
                saved.y = self._run(saved.x, variables, grad=True, autocast=replay.autocast, split=False)
        finally:
            for m, name, b in owners:
                m._buffers[name] = b
        saved.exports = self._exports(variables)

    def backward(
        self, call_id: tuple[int, int], grad_y: Any, grad_exports: Mapping[str, torch.Tensor], early: bool = False
    ) -> tuple[Main | None, dict[str, torch.Tensor]]:
        """Run a micro-batch's backward. ``early``: a call whose backward runs before the driver's
        (`early_grads`): its weight gradients go to the call's own gradients, and its deferred ones
        are filed under the call, for `flush_early`. Sets `filing`: the backward's number, for that.
        A forward that kept nothing (no output needed a gradient) gives no gradients."""
        saved = self._saved.pop(call_id, None)
        if saved is None:
            return None, {}  # the forward kept nothing: no output needed a gradient
        if saved.recompute is not None:
            self._rerun(saved)
        assert saved.y is not None
        outputs, grads = [], []
        pairs = _pairs(saved.y, grad_y)
        for t, g in [*pairs, *((saved.exports.get(n), g) for n, g in grad_exports.items())]:
            if t is not None and g is not None and t.requires_grad:
                outputs.append(t)
                grads.append(self._upload(g).to(dtype=t.dtype))
        if outputs:
            bucket = call_id[0] if early else None
            filing = self.deferred.filing_backward(bucket) if self.deferred is not None else contextlib.nullcontext(0)
            grads_into = self.early_grads(call_id[0]) if early else contextlib.nullcontext()
            with grads_into, filing as number:
                torch.autograd.backward(outputs, grads)
            self.filing = number
        if isinstance(saved.x, tuple):
            grad_x: Main | None = tuple(t.grad if t.requires_grad else None for t in saved.x)  # type: ignore[misc]
        else:
            grad_x = saved.x.grad if saved.x.requires_grad else None
        grad_imports = {n: t.grad for n, t in saved.imports.items() if t.requires_grad and t.grad is not None}
        return grad_x, grad_imports

    # --- backwards that run before the driver's (`lightning_remote_mp.worker.runtime`) -------
    @contextlib.contextmanager
    def early_grads(self, call: int) -> Any:
        """Within this block, ``.grad`` of each trainable parameter is ``call``'s own: the weight
        gradients of a backward that ran with the loss's gradient taken as 1, kept apart from
        ``.grad`` (which zero_grad may clear meanwhile) until `apply_early` scales them in."""
        staging = self._early.setdefault(call, {})
        params = [p for _, p in self.named_parameters() if p.requires_grad]
        saved = [p.grad for p in params]
        for p in params:
            p.grad = staging.get(id(p), (p, None))[1]
        try:
            yield
        finally:
            for p, g in zip(params, saved):
                if p.grad is not None:
                    staging[id(p)] = (p, p.grad)
                p.grad = g

    def flush_early(self, call: int, through: int | None = None) -> None:
        """The deferred weight gradients of ``call``'s early backwards numbered up to ``through``
        (all of them without it), into the call's own gradients (a W action)."""
        if self.deferred is not None:
            with self.early_grads(call):
                self.deferred.flush(bucket=call, through=through)

    @torch.no_grad()
    def apply_early(self, call: int, scale: torch.Tensor) -> None:
        """Add ``call``'s own weight gradients times ``scale`` (the loss's real gradient) to ``.grad``."""
        self.flush_early(call)
        for p, g in self._early.pop(call, {}).values():
            accumulate_grad(p, g.mul_(scale.to(device=g.device, dtype=g.dtype)))

    def release_early(self, call: int) -> None:
        """Forget ``call``'s own weight gradients (its loss was not differentiated)."""
        self._early.pop(call, None)
        if self.deferred is not None:
            self.deferred.discard(call)

    def flush_weight_grads(self, call: int | None = None) -> bool:
        """Add the deferred weight gradients to ``.grad``: with ``call``, only once none of its
        micro-batches awaits backward any more. Returns whether there was anything to add."""
        if self.deferred is None or not self.deferred.waiting:
            return False
        if call is not None and any(k[0] == call for k in self._saved):
            return False
        return self.deferred.flush()

    def release(self, calls: Sequence[int]) -> None:
        """Drop what forwards of these calls (all their micro-batches) kept for backward."""
        drop = set(calls)
        for key in [k for k in self._saved if k[0] in drop]:
            del self._saved[key]
        for call in drop:
            self.release_early(call)
        if self.statistics is not None and any(self._forwards.pop(c, None) for c in drop):
            self.statistics.discard()  # a call given up on part-way: its statistics count for nothing
