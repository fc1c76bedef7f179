"""``generate()`` on a split model: transformers' own generation, the cache on the stages (issue #48).

A traced module that has ``generate`` (a HuggingFace ``GenerationMixin`` model) keeps it unchanged:
greedy, sampling, beam search, stopping criteria and logits processors all run on the driver, as
Petals' ``RemoteGenerationMixin`` keeps them. Two hooks change what it works with while the module
is split (`GenerateHooks`):

- the cache ``generate`` prepares is a `lightning_remote_mp.model.kv_cache.counting_cache` sized to
  its ``max_length`` (the prompt and ``max_new_tokens``): it counts tokens, and the keys and values
  stay on the stages that hold their layers;
- ``generate`` frees those caches on the workers when it returns or fails.

Each call ``generate`` makes is a step: the module's forward sees the counting cache and runs
`generation_forward`'s program through the stages (`lightning_remote_mp.model.calls`): a prefill
(the prompt) and a decode step (one token) are each traced once, with the attention mask's width as
the cache's length, and only the last position's logits come back.

What it refuses, naming what to do instead: assisted, contrastive and DoLa decoding (they rewind or
read the cache), a cache the caller made (``past_key_values=``), another ``cache_implementation``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lightning_remote_mp.errors import TraceError
from lightning_remote_mp.model.kv_cache import counting_cache, is_counting_cache, tracing_cache

log = logging.getLogger(__name__)

#: The keyword a model's forward takes its cache under (transformers 5: ``cache``; before: ``past_key_values``).
CACHE_KEYWORDS = ("cache", "past_key_values")
#: What ``generate`` may pass a step besides the tokens, the mask and the cache, and is not needed here.
_IGNORED = ("use_cache", "return_dict", "logits_to_keep", "output_attentions", "output_hidden_states")
#: Decoding methods that rewind or read the cache: not supported through the stages.
_REFUSED_MODES = ("assisted_generation", "contrastive_search", "dola_generation")


def generating_model(module: nn.Module) -> nn.Module | None:
    """The model whose ``generate`` runs the decoding: the module itself (a HuggingFace model), or
    the model a peft wrapper's ``generate`` calls (``get_base_model()``); ``None`` for a module that
    does not generate."""
    for candidate in (module, getattr(module, "get_base_model", lambda: None)()):
        if isinstance(candidate, nn.Module) and callable(
            getattr(type(candidate), "_prepare_cache_for_generation", None)
        ):
            return candidate
    return None


def step_cache(kwargs: dict[str, Any]) -> Any:
    """The counting cache a call of the module carries, if it is a step of ``generate`` on the stages."""
    for name in CACHE_KEYWORDS:
        cache = kwargs.get(name)
        if is_counting_cache(cache):
            return cache
    return None


#: The tensors a step passes the model that its program takes, besides ``input_ids``: the mask over
#: every token so far, and the positions ``generate`` computes from it (a padded row's skip its padding).
STEP_INPUTS = ("attention_mask", "position_ids")


def step_inputs(args: tuple, kwargs: dict[str, Any], cache: Any) -> dict[str, torch.Tensor]:
    """A step's tensors (`STEP_INPUTS`, the attention mask all ones where ``generate`` passes none);
    anything else it passes is refused, naming it."""
    ids = args[0] if args else kwargs.get("input_ids")
    known = (*CACHE_KEYWORDS, *_IGNORED, "input_ids", *STEP_INPUTS)
    extra = [k for k, v in kwargs.items() if v is not None and k not in known]
    if not isinstance(ids, torch.Tensor) or len(args) > 1 or extra:
        raise TraceError(
            f"a step of generate() on the workers takes input_ids, attention_mask and position_ids; this one also "
            f"passes {extra or [type(a).__name__ for a in args[1:]]}, which lrmp does not trace for generation"
        )
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones(ids.shape[0], cache.tokens + ids.shape[1], dtype=torch.long, device=ids.device)
    if mask.shape != (ids.shape[0], cache.tokens + ids.shape[1]):
        raise TraceError(
            f"a step of generate() passed an attention mask of shape {tuple(mask.shape)} for {ids.shape[1]} new "
            f"tokens after {cache.tokens}: the mask covers every token so far"
        )
    out = {"input_ids": ids, "attention_mask": mask}
    if kwargs.get("position_ids") is not None:
        out["position_ids"] = kwargs["position_ids"]
    return out


@contextlib.contextmanager
def generation_forward(module: nn.Module) -> Iterator[None]:
    """While tracing a step: the module's forward takes the step's tensors (`step_inputs`), runs its
    own forward with a `tracing_cache` and returns the last position's logits alone. A peft wrapper
    passes the cache on to the model it wraps, whose forward says what the cache is called."""
    target = generating_model(module)
    config = getattr(target, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise TraceError(
            f"generate() on {type(target).__name__} through the workers: an encoder-decoder's cache (the encoder's "
            "keys and values beside the decoder's) does not stay on the stages yet; decoder-only models do"
        )
    params = _forward_params(target) if target is not None else {}
    keyword = next((k for k in CACHE_KEYWORDS if k in params), None)
    layers = getattr(config, "num_hidden_layers", None)
    if keyword is None or layers is None:
        raise TraceError(
            f"{type(module).__name__} takes no key/value cache (no 'cache' or 'past_key_values' argument, or no "
            "config.num_hidden_layers): generate() through the workers needs a HuggingFace decoder that does"
        )
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    own = type(module).forward

    def forward(input_ids: torch.Tensor, attention_mask: torch.Tensor, **more: torch.Tensor) -> torch.Tensor:
        cache = tracing_cache(attention_mask.shape[1], input_ids.shape[1], layers)
        out = own(module, input_ids, attention_mask=attention_mask, use_cache=True, **{keyword: cache}, **keep, **more)
        return out.logits[:, -1:]

    had = vars(module).get("forward")
    module.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had is None:
            vars(module).pop("forward", None)
        else:
            module.forward = had  # type: ignore[method-assign]


def step_output(module: nn.Module, logits: torch.Tensor, cache: Any) -> Any:
    """What the module's forward returns to ``generate`` for a step: its output class with the logits
    and the cache (``CausalLMOutputWithPast``)."""
    output, keyword = _output_class()
    return output(logits=logits, **{keyword: cache})


@functools.cache
def _output_class() -> tuple[type, str]:
    """``CausalLMOutputWithPast`` and the keyword it takes the cache under (read once: a signature
    costs a tenth of the driver's time per token)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    keyword = "cache" if "cache" in inspect.signature(CausalLMOutputWithPast).parameters else "past_key_values"
    return CausalLMOutputWithPast, keyword


class GenerateHooks:
    """While a module is split, its generating model (`generating_model`): ``generate`` frees the
    caches it used on the workers when it returns, and prepares a `counting_cache` of its
    ``max_length`` (see the module docstring). Where that model is inside a peft wrapper, its own
    forward sends the steps (calls with a counting cache) to ``step``, the split module's."""

    def __init__(self, module: nn.Module, release: Callable[[Any], None], step: Callable[..., Any]) -> None:
        self.release = release
        self.caches: list[Any] = []
        self.target = target = generating_model(module)
        names = ("generate", "_prepare_cache_for_generation", "forward")
        self._own = {name: vars(target).get(name) for name in names} if target is not None else {}
        if target is None:
            return
        generate = target.generate
        wrapped = inspect.signature(type(target)._prepare_cache_for_generation)
        ours = list(inspect.signature(self._prepare).parameters)
        fits = list(wrapped.parameters)[1:] == ours

        @functools.wraps(generate)
        def generate_here(*args: Any, **kwargs: Any) -> Any:
            if not fits:  # a private method of transformers', which lrmp replaces: it must take what lrmp's takes
                raise TraceError(
                    f"generate() through the workers replaces transformers' (private) "
                    f"{type(target).__name__}._prepare_cache_for_generation{wrapped}, written for "
                    f"(self, {', '.join(ours)}): this transformers "
                    "changed it. lrmp is tested with transformers 5.24; use that version, or report this"
                )
            if any(kwargs.get(k) is not None for k in CACHE_KEYWORDS):
                raise TraceError(
                    "generate() on a split model keeps its key/value cache on the workers: pass no cache of your own "
                    "(past_key_values=/cache=)"
                )
            started = len(self.caches)
            try:
                return generate(*args, **kwargs)
            finally:
                for cache in self.caches[started:]:
                    self.release(cache)
                del self.caches[started:]

        target.generate = generate_here  # type: ignore[method-assign]
        if fits:
            target._prepare_cache_for_generation = self._prepare  # type: ignore[method-assign]
        if target is not module:  # a peft wrapper's model: its steps go to the split module
            inner = target.forward

            def forward(*args: Any, **kwargs: Any) -> Any:
                cache = step_cache(kwargs)
                return step(args, kwargs, cache) if cache is not None else inner(*args, **kwargs)

            forward.__signature__ = inspect.signature(inner)  # type: ignore[attr-defined]
            target.forward = forward  # type: ignore[method-assign]
        else:
            self._own.pop("forward")

    def _prepare(
        self, generation_config: Any, model_kwargs: dict, generation_mode: Any, batch_size: int, max_cache_length: int
    ) -> None:
        mode = str(getattr(generation_mode, "value", generation_mode))
        if mode in _REFUSED_MODES:
            raise TraceError(
                f"generate() with {mode.replace('_', ' ')} rewinds or reads the key/value cache, which stays on the "
                "workers: use greedy decoding, sampling or beam search"
            )
        if getattr(generation_config, "cache_implementation", None) is not None:
            raise TraceError(
                f"generate(cache_implementation={generation_config.cache_implementation!r}): the key/value cache stays "
                "on the workers, as one cache per stage; leave cache_implementation unset"
            )
        if generation_config.use_cache is False:
            raise TraceError("generate(use_cache=False) would run every token's whole sequence through every stage")
        cache = counting_cache(max_cache_length + 1)
        self.caches.append(cache)
        model_kwargs["cache" if "cache" in _forward_params(self.target) else "past_key_values"] = cache

    def detach(self) -> None:
        for name, own in self._own.items():
            if own is None:
                vars(self.target).pop(name, None)
            else:
                setattr(self.target, name, own)


def _forward_params(module: nn.Module) -> Any:
    return inspect.signature(type(module).forward).parameters
