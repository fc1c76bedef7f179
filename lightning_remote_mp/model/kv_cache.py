"""A generation's key/value cache, kept by the stages that hold its layers (issue #48).

transformers' ``generate()`` calls the model once per new token with a ``Cache`` whose ``update``
appends each attention layer's new keys and values and returns all of them. Through lrmp, that
cache lives on the workers, as Petals' servers keep theirs: no cache tensor crosses the network.

- **On the workers**, `KVStore` is one generation's cache for one micro-batch on one stage: per
  layer, keys and values for ``capacity`` tokens, allocated at the first token (so a prompt that
  does not fit fails before any token is made) and filled as tokens come. A traced program reaches
  it through lrmp's operator ``lrmp::kv_cache(key, value, layer, length)``, which writes the step's
  keys and values at their positions and returns the first ``length`` of them; the worker's
  runtime makes the store of the step it runs the active one (`active`).
- **At the trace**, `tracing_cache` stands in for the model's cache: its ``update`` is that
  operator, and its lengths are the attention mask's, so a prefill and a decode step are each traced
  once, whatever the lengths.
- **On the driver**, `counting_cache` is the cache ``generate()`` holds: it only counts tokens
  (what ``generate`` asks of it), and keeps the reordering beam search asks for until the next step
  takes it to the stages.

>>> import torch
>>> store = KVStore(capacity=8)
>>> with active(store):
...     k, v = torch.ops.lrmp.kv_cache(torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0, 3)
...     k, v = torch.ops.lrmp.kv_cache(torch.full((1, 2, 1, 4), 2.0), torch.zeros(1, 2, 1, 4), 0, 4)
>>> k.shape, k[0, 0, :, 0].tolist(), store.length(0)
(torch.Size([1, 2, 4, 4]), [1.0, 1.0, 1.0, 2.0], 4)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import torch

from lightning_remote_mp.errors import LrmpError


class CacheError(LrmpError):
    """A generation's cache cannot take a step: it is full, or the step is not the next one."""


class KVStore:
    """One generation's keys and values on one stage, for one micro-batch (see the module docstring).

    Args:
        capacity: the most tokens it holds (the prompt and the new tokens), checked at the first.
        limit_bytes: the most bytes it may allocate (the worker's bound); ``None``: no bound.
    """

    def __init__(self, capacity: int, limit_bytes: int | None = None) -> None:
        self.capacity = capacity
        self.limit_bytes = limit_bytes
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._length: dict[int, int] = {}

    def length(self, layer: int) -> int:
        return self._length.get(layer, 0)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self._keys.values(), *self._values.values()))

    def update(
        self, layer: int, key: torch.Tensor, value: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a step's ``key`` and ``value`` (``[rows, heads, new tokens, dim]``) as tokens up to
        ``length`` of ``layer``; the layer's keys and values up to ``length``."""
        new = key.shape[-2]
        past = length - new
        if past != self.length(layer):
            raise CacheError(
                f"layer {layer}'s cache holds {self.length(layer)} tokens, but the step comes after {past}: "
                "steps of one generation run in order, each once"
            )
        if length > self.capacity:
            raise CacheError(
                f"the generation's cache holds {self.capacity} tokens (the prompt and max_new_tokens), and this "
                f"step would make {length}"
            )
        if layer not in self._keys:
            self._allocate(layer, key, value)
        keys, values = self._keys[layer], self._values[layer]
        if keys.shape[0] != key.shape[0]:
            raise CacheError(f"layer {layer}'s cache holds {keys.shape[0]} rows, and a step brought {key.shape[0]}")
        keys[:, :, past:length] = key
        values[:, :, past:length] = value
        self._length[layer] = length
        return keys[:, :, :length], values[:, :, :length]

    def _allocate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        shape_k = (*key.shape[:2], self.capacity, key.shape[-1])
        shape_v = (*value.shape[:2], self.capacity, value.shape[-1])
        per_layer = (torch.Size(shape_k).numel() * key.element_size()) + torch.Size(
            shape_v
        ).numel() * value.element_size()
        if self.limit_bytes is not None and self.nbytes + per_layer > self.limit_bytes:
            tokens = int(self.limit_bytes // max(1, (len(self._keys) + 1) * per_layer // self.capacity))
            raise CacheError(
                f"a cache of {self.capacity} tokens for {key.shape[0]} rows needs {per_layer / 1e6:.1f} MB for layer "
                f"{layer} alone, past this worker's bound of {self.limit_bytes / 1e6:.1f} MB for a generation's cache: "
                f"about {tokens} tokens fit; generate fewer tokens or fewer sequences at once"
            )
        self._keys[layer] = key.new_zeros(shape_k)
        self._values[layer] = value.new_zeros(shape_v)

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam search's reordering: row ``i`` of every layer becomes row ``rows[i]``."""
        for table in (self._keys, self._values):
            for layer, t in table.items():
                if rows.numel() != t.shape[0] or int(rows.min()) < 0 or int(rows.max()) >= t.shape[0]:
                    raise CacheError(f"a reordering of {rows.numel()} rows for a cache of {t.shape[0]}")
                table[layer] = t.index_select(0, rows.to(t.device))


_ACTIVE: contextvars.ContextVar[KVStore | None] = contextvars.ContextVar("lrmp_kv_store", default=None)


@contextlib.contextmanager
def active(store: KVStore) -> Iterator[KVStore]:
    """``store`` is the cache ``lrmp::kv_cache`` writes to while this runs (a worker's decode step)."""
    token = _ACTIVE.set(store)
    try:
        yield store
    finally:
        _ACTIVE.reset(token)


# --- the operator a traced program calls --------------------------------------------------------
_LIBRARY = torch.library.Library("lrmp", "FRAGMENT")  # noqa: TOR901 (one library, defined once at import)
_LIBRARY.define("kv_cache(Tensor key, Tensor value, int layer, SymInt length) -> (Tensor, Tensor)")


def _kv_cache(key: torch.Tensor, value: torch.Tensor, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    store = _ACTIVE.get()
    if store is None:
        raise CacheError(
            f"layer {layer}'s key/value cache was used outside a generation: a program that writes a cache runs "
            "only as a step of generate()"
        )
    return store.update(layer, key, value, int(length))  # views of the store: the next step writes past them


def _kv_cache_meta(
    key: torch.Tensor, value: torch.Tensor, layer: int, length: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    return key.new_empty((*key.shape[:-2], length, key.shape[-1])), value.new_empty(
        (*value.shape[:-2], length, value.shape[-1])
    )


_LIBRARY.impl("kv_cache", _kv_cache, "CompositeExplicitAutograd")
_LIBRARY.impl("kv_cache", _kv_cache_meta, "Meta")

#: lrmp's own operators of this module, which a traced program may name (``lrmp::NAME``).
OPERATORS = {"kv_cache": torch.ops.lrmp.kv_cache}


# --- the caches transformers' code sees -----------------------------------------------------------
@functools.cache
def _classes() -> tuple[type, type]:
    """The two caches below, each a transformers ``DynamicCache``: made once, at the first use
    (transformers is imported only by a run that generates)."""
    from transformers.cache_utils import DynamicCache

    class TracingCache(DynamicCache):  # type: ignore[misc]
        def __init__(self, length: Any, new: Any, layers: int) -> None:
            super().__init__()
            # Names of lrmp's own: DynamicCache has ``layers`` (its per-layer caches) of its own.
            self._lrmp_length, self._lrmp_new, self._lrmp_layers = length, new, layers

        def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
            return torch.ops.lrmp.kv_cache(key_states, value_states, layer_idx, self._lrmp_length)

        def get_seq_length(self, layer_idx: int = 0) -> Any:
            return self._lrmp_length - self._lrmp_new

        def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> tuple[Any, int]:
            return self._lrmp_length, 0

        def __len__(self) -> int:
            return self._lrmp_layers

    class CountingCache(DynamicCache):  # type: ignore[misc]
        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.tokens = 0
            self.generation: int | None = None  # its id on the stages, from its first step
            self.remote: Any = None  # the pipeline whose stages hold it
            self._reorder: torch.Tensor | None = None

        def update(self, *args: Any, **kwargs: Any) -> Any:
            raise LrmpError("a generation's cache lives on the workers; its keys and values are not on the driver")

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.tokens

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return self.tokens + query_length, 0

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            rows = beam_idx.detach().to("cpu", torch.long)
            self._reorder = rows if self._reorder is None else self._reorder[rows]

        def take_reorder(self) -> torch.Tensor | None:
            rows, self._reorder = self._reorder, None
            return rows

        def crop(self, tokens_to_remove: int) -> None:
            raise LrmpError("a generation through lrmp's workers cannot drop cached tokens (assisted decoding)")

    return TracingCache, CountingCache


def tracing_cache(length: Any, new: Any, layers: int) -> Any:
    """The cache a model is traced with for generation: ``update`` is ``lrmp::kv_cache``; ``length``
    tokens in all (the attention mask's width, a symbolic size), ``new`` of them this step's."""
    return _classes()[0](length, new, layers)


def counting_cache(capacity: int) -> Any:
    """The cache ``generate()`` holds on the driver: how many tokens the stages' caches hold, and
    the beam reordering to send with the next step (`take_reorder`)."""
    return _classes()[1](capacity)


def is_counting_cache(cache: Any) -> bool:
    """Whether ``cache`` is a `counting_cache` (without importing transformers for a call that has none)."""
    return cache is not None and _classes.cache_info().currsize > 0 and isinstance(cache, _classes()[1])
