"""How a traced module is called: traced at its first call, then run by the workers.

`TracedForward` stands in for a split module's ``forward``. Its first call traces the module
(`lightning_remote_mp.model.trace.trace_module`) and places the units on the workers; every later
call maps its arguments to the pipeline's inputs and the outputs back
(`lightning_remote_mp.model.traced.Interface`). A call with other arguments (``labels=`` in
training, none in validation), or in a mode not traced yet, is another program: traced at its first
such call and placed on the stages and tensors of the first, up to `SIGNATURES` programs of the
module in one run. An export costs seconds, so a first call in train mode (``fit``'s first step
without a sanity check) is traced in train mode alone, and the eval program at the first call in
eval mode: it reads a part of the train program's tensors, so it runs over the same stages. A first
call in eval mode is traced in both modes: a train program reads tensors an eval program does not
(BatchNorm's count of batches), which the stages placed then must hold (issue #60).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_remote_mp.errors import TraceError
from lightning_remote_mp.model.generation import GenerateHooks, generation_forward, step_cache, step_inputs, step_output
from lightning_remote_mp.model.trace import MODES, trace_module
from lightning_remote_mp.model.traced import Interface, TracedSequential, as_tuple, call_difference

log = logging.getLogger(__name__)

#: The most programs a traced module may have in one run (ways of calling it, each in the modes it
#: runs in: `TracedForward._signature`).
SIGNATURES = 4


def _modes(module: nn.Module) -> tuple[str, ...]:
    """The modes a call of ``module`` runs its units in: ``("train",)``, ``("eval",)``, or both where
    its submodules' modes differ (a frozen BatchNorm's eval in a model that trains)."""
    flags = {m.training for m in module.modules()}
    return tuple(mode for mode, flag in (("train", True), ("eval", False)) if flag in flags)


def _runs_as(traced: TracedSequential, args: tuple, kwargs: dict, modes: tuple[str, ...]) -> dict | None:
    """``kwargs`` in ``traced``'s order if ``traced`` runs this call (its arguments, in these
    ``modes``), else ``None``."""
    if not set(modes) <= set(traced.trace_modes):  # type: ignore[arg-type]
        return None
    ordered = _in_order(kwargs, traced.interface.in_spec)  # type: ignore[attr-defined]
    return ordered if traced.interface.in_spec == pytree.tree_structure((args, ordered)) else None  # type: ignore[attr-defined]


class TracedForward:
    """Stands in for a traced module's ``forward``: traces and places at the first call, then runs
    every call through the workers.

    The traces are kept on the module (``_lrmp_trace``: the first call's, the other ways of calling
    it, ``generate()``'s steps) and reused by a later run (``validate`` or ``test`` after ``fit``,
    ``fit`` again after a recovery) while the module holds the same weight tensors and is called the
    same way: tracing costs seconds per export. Delete the attribute to trace again after changing
    the module's code or settings.

    Args:
        name: the module's name in the LightningModule.
        module: the module.
        place: called with the `TracedSequential` once traced; it ships the units to workers.
    """

    def __init__(self, name: str, module: nn.Module, place: Callable[..., None]) -> None:
        self.name = name
        self.module = module
        self.place = place
        self.traced: TracedSequential | None = None
        self.signatures: list[TracedSequential] = []  # the traces of other ways of calling it (`_signature`)
        self._had_forward = "forward" in vars(module)
        self._own_forward = vars(module).get("forward")
        module.forward = self  # type: ignore[method-assign]
        # What the module's own forward takes, as generate() reads it (it passes position_ids where taken).
        self.__signature__ = inspect.signature(type(module).forward.__get__(module))
        #: The programs of ``generate()``'s steps (`lightning_remote_mp.model.generation`), each traced in
        #: the mode it runs in: "prefill", "decode" (in eval mode), "prefill-train", "decode-train".
        self.generation: dict[str, TracedSequential] = {}
        self._generations = itertools.count()
        self.hooks = GenerateHooks(module, self._release, self._step)

    def _kept(self) -> Traces:
        """The module's traces from earlier runs, while it holds the same weight tensors (else none)."""
        kept = vars(self.module).get("_lrmp_trace")
        if not isinstance(kept, Traces) or kept.weights != _weights_key(self.module):
            kept = vars(self.module)["_lrmp_trace"] = Traces(_weights_key(self.module))
        return kept

    def _earlier_trace(self, args: tuple, kwargs: dict) -> TracedSequential | None:
        first = self._kept().first
        if first is None:
            return None
        try:
            first.interface.inputs(args, kwargs)  # type: ignore[attr-defined]
        except TraceError:
            return None
        log.info("module %r: using its trace from an earlier run", self.name)
        return first

    def _trace(self, args: tuple, kwargs: dict, modes: tuple[str, ...]) -> TracedSequential:
        self.detach(hooks=False)  # torch.export calls the module's own forward
        try:
            return trace_module(self.module, args, kwargs, self.name, modes=modes, like=self.traced)
        finally:
            self.module.forward = self  # type: ignore[method-assign]

    def _signature(self, args: tuple, kwargs: dict, modes: tuple[str, ...]) -> tuple[TracedSequential, dict]:
        """The trace of another way of calling the module (``labels=`` in training, none in
        validation) or of the same in another mode, and ``kwargs`` in its order: traced at its first
        call and placed on the stages and tensors of the first call's trace, which it trains; up to
        `SIGNATURES` programs in all."""
        for traced in self.signatures:
            if (ordered := _runs_as(traced, args, kwargs, modes)) is not None:
                return traced, ordered
        spec = pytree.tree_structure((args, kwargs))
        first: Any = self.traced
        kept = self._kept()
        for traced in kept.signatures if kept.first is first else ():
            if (ordered := _runs_as(traced, args, kwargs, modes)) is not None:
                log.info("module %r: using its trace of this call from an earlier run", self.name)
                self._place(traced, args, ordered, f"{self.name}@{len(self.signatures) + 2}")
                self.signatures.append(traced)
                return traced, ordered
        if first.interface.in_spec == spec:  # type: ignore[attr-defined]
            differs = f"module {self.name!r} was traced at its first call in {' and '.join(first.trace_modes)} mode"
        else:
            differs = (
                f"module {self.name!r} was traced at its first call; this call "
                f"{call_difference(first.interface.in_spec, spec)}"
            )
        if len(self.signatures) + 1 >= SIGNATURES:
            raise TraceError(
                f"{differs}, and it already has {SIGNATURES} programs (a way of calling it, in the modes it runs "
                f"in), each a program of its own on the workers (at most {SIGNATURES}): call it in fewer ways "
                "(the same arguments at every call)"
            )
        with torch.inference_mode(False):
            args, kwargs = pytree.tree_map_only(torch.Tensor, _plain, (args, kwargs))
            traced = self._trace(args, kwargs, modes)
            if not _shares(traced, first):
                raise TraceError(
                    f"{differs}; called this way it is cut into other units "
                    f"({', '.join(e.name for e in traced.entries)}) than at its first call, so it cannot run on "
                    "the stages placed then. Call it with the same arguments every time: pass labels= in "
                    "validation_step too (the loss is then computed on the last stage as in training), or "
                    "compute the loss in training_step and never pass labels="
                )
            self._place(traced, args, kwargs, f"{self.name}@{len(self.signatures) + 2}")
        self.signatures.append(traced)
        if kept.first is first:
            kept.signatures.append(traced)
        return traced, kwargs

    def _place(self, traced: TracedSequential, args: tuple, kwargs: dict, *view: str) -> None:
        """Ship ``traced`` (as a ``view`` of the first trace's placement, if given), with this call's
        inputs as its example (balance="time" and the batch check run them), dropped afterwards."""
        traced.example = traced.interface.inputs(args, kwargs)  # type: ignore[attr-defined]
        try:
            self.place(traced, *view)
        finally:
            traced.example = None  # type: ignore[attr-defined]  # the first batch, no longer needed

    def detach(self, hooks: bool = True) -> None:
        """Give the module its own ``forward`` back (and, with ``hooks``, its own ``generate``)."""
        if self._had_forward:
            self.module.forward = self._own_forward  # type: ignore[method-assign]
        else:
            vars(self.module).pop("forward", None)
        if hooks:
            self.hooks.detach()

    def _step(self, args: tuple, kwargs: dict, cache: Any) -> Any:
        """A step of ``generate()``, through the stages with the generation's cache there
        (`lightning_remote_mp.model.generation`): a prefill (the prompt) or a decode step (a token)."""
        step = step_inputs(args, kwargs, cache)
        ids = step.pop("input_ids")
        phase = ("decode" if ids.shape[1] == 1 else "prefill") + ("-train" if self.module.training else "")
        traced = (
            self.generation.get(phase) or self._earlier_step(phase, ids, step) or self._trace_step(phase, ids, step)
        )
        if cache.generation is None:
            cache.generation, cache.remote = next(self._generations), traced.remote
        interface: Interface = traced.interface  # type: ignore[attr-defined]
        inputs = tuple(interface.inputs((ids,), _in_order(step, interface.in_spec)))  # type: ignore[attr-defined]
        generation = (cache.generation, cache.capacity, cache.take_reorder())
        logits = interface.outputs(list(traced.remote.generation_step(inputs, generation)))
        cache.tokens += ids.shape[1]
        return step_output(self.module, logits, cache)

    def _earlier_step(self, phase: str, ids: torch.Tensor, step: dict[str, torch.Tensor]) -> TracedSequential | None:
        """The program of ``phase`` from an earlier run on the stages of the same first trace, placed again."""
        kept = self._kept()
        traced = kept.generation.get(phase) if self.traced is not None and kept.first is self.traced else None
        if traced is not None:
            log.info("module %r: using its trace of generate()'s %s from an earlier run", self.name, phase)
            with torch.inference_mode(False):
                self._place(traced, (_plain(ids),), {k: _plain(v) for k, v in step.items()}, f"{self.name}@{phase}")
            self.generation[phase] = traced
        return traced

    def _trace_step(self, phase: str, ids: torch.Tensor, step: dict[str, torch.Tensor]) -> TracedSequential:
        """The program of ``phase``, traced at its first use (a module on the meta device, trained past
        gather_limit, with its inputs there too) and placed on the stages and tensors of the module's
        first trace, or as its first."""
        with torch.inference_mode(False):
            ids, step = _plain(ids), {k: _plain(v) for k, v in step.items()}
            meta = any(t.is_meta for t in self.module.parameters())
            self.detach(hooks=False)
            try:
                with generation_forward(self.module):
                    traced = trace_module(
                        self.module,
                        (ids.to("meta") if meta else ids,),
                        {k: v.to("meta") for k, v in step.items()} if meta else step,
                        self.name,
                        modes=("train",) if self.module.training else ("eval",),  # the mode it runs in
                    )
            finally:
                self.module.forward = self  # type: ignore[method-assign]
            traced.generation = phase  # type: ignore[attr-defined]
            if self.traced is None:
                self._place(traced, (ids,), step)
                self.traced = traced
            elif not _shares(traced, self.traced):
                raise TraceError(
                    f"module {self.name!r}: generate()'s {phase} program is cut into other units "
                    f"({', '.join(e.name for e in traced.entries)}) than the module's first trace, so it cannot "
                    "run on the stages placed then"
                )
            else:
                self._place(traced, (ids,), step, f"{self.name}@{phase}")
                kept = self._kept()
                if kept.first is self.traced:
                    kept.generation[phase] = traced
        self.generation[phase] = traced
        return traced

    def _release(self, cache: Any) -> None:
        """Free a finished generation's caches on the workers."""
        if getattr(cache, "generation", None) is not None and cache.remote is not None:
            cache.remote.release_generation(cache.generation)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cache = step_cache(kwargs)
        if cache is not None:
            return self._step(args, kwargs, cache)
        kwargs = _without_cache(self.module, kwargs)
        modes = _modes(self.module)
        if self.traced is None:
            with torch.inference_mode(False):
                args, kwargs = pytree.tree_map_only(torch.Tensor, _plain, (args, kwargs))
                traced = self._earlier_trace(args, kwargs)
                if traced is None:
                    # A training call alone: its program alone, the first validation's traced then (an
                    # eval program reads a part of a train program's tensors: placed over the same). A
                    # first call in eval mode is traced in train mode too: a train program reads tensors
                    # (BatchNorm's count of batches) an eval program does not, which its stages must hold.
                    traced = self._trace(args, kwargs, modes if modes == ("train",) else MODES)
                    vars(self.module)["_lrmp_trace"] = Traces(_weights_key(self.module), traced)
                self._place(traced, args, kwargs)
                self.traced = traced
        traced = self.traced
        ordered = _runs_as(traced, args, kwargs, modes)
        if ordered is None:
            traced, ordered = self._signature(args, kwargs, modes)
        kwargs = ordered
        interface: Interface = traced.interface  # type: ignore[attr-defined]
        inputs = interface.inputs(args, kwargs)
        if traced.remote is None:
            return interface.outputs(list(as_tuple(traced.run_locally(*inputs))))
        return interface.outputs(list(traced.remote(inputs)))


def _in_order(kwargs: dict[str, Any], spec: Any) -> dict[str, Any]:
    """``kwargs`` in the order of the traced call's (``spec``) where they name the same arguments:
    the same call, whichever order the keywords came in."""
    traced = pytree.tree_unflatten([None] * spec.num_leaves, spec)[1]
    return {k: kwargs[k] for k in traced} if traced.keys() == kwargs.keys() else kwargs


def _shares(traced: TracedSequential, first: TracedSequential) -> bool:
    """Whether ``traced`` can run on the stages placed for ``first``: the same units, each holding
    tensors of its unit in ``first`` under the same names (an eval program reads a part of a train
    program's: not BatchNorm's count of batches), and a constant the trace made of the same value."""
    if [e.name for e in traced.entries] != [e.name for e in first.entries]:
        return False
    if not traced.state_names.items() <= first.state_names.items():
        return False
    for mine, theirs in zip(traced.layers, first.layers):
        a, b = mine.state_dict(keep_vars=True), theirs.state_dict(keep_vars=True)
        if not a.keys() <= b.keys():
            return False
        for name, t in a.items():
            u = b[name]
            if t is not u and (t.shape != u.shape or t.dtype != u.dtype or (not t.is_meta and not torch.equal(t, u))):
                return False
    return True


def _without_cache(module: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's keyword arguments with ``use_cache=False`` where the module takes ``use_cache`` and the
    call does not say: transformers' configs turn the key/value cache on by default, a training or
    evaluation forward never reads it, and it could neither be traced nor travel. The cache is never
    built, and the output's ``past_key_values`` is ``None``."""
    if "use_cache" in kwargs:
        return kwargs
    params = inspect.signature(type(module).forward).parameters
    variadic = any(p.kind is p.VAR_KEYWORD for p in params.values())
    config = getattr(module, "config", None)
    if "use_cache" in params or (variadic and getattr(config, "use_cache", None) is not None):
        return {**kwargs, "use_cache": False}
    return kwargs


@dataclasses.dataclass
class Traces:
    """A module's traces, kept on it (``_lrmp_trace``) for later runs while it holds the tensors of
    ``weights``: the first call's, the other ways of calling it, and ``generate()``'s steps by phase
    (these two placed on the stages of the first)."""

    weights: tuple
    first: TracedSequential | None = None
    signatures: list[TracedSequential] = dataclasses.field(default_factory=list)
    generation: dict[str, TracedSequential] = dataclasses.field(default_factory=dict)


def _weights_key(module: nn.Module) -> tuple:
    """Which tensors the module holds: a trace shares them, so it serves only while they are the same."""
    return tuple((name, id(t)) for name, t in module.state_dict(keep_vars=True).items())


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.is_inference() else t
