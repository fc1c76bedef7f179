"""A stage's generation caches: the key/value cache of each generation the driver runs, per
micro-batch, kept between its steps (`lightning_remote_mp.model.kv_cache`).

A generation's first step creates its stores, with the capacity the driver says (the prompt and
``max_new_tokens``), and each store allocates a layer's keys and values at the layer's first token:
a generation that does not fit fails before it makes a token. Every later step writes to the same
stores; beam search's reordering comes with the step that follows it. The stores are freed when the
driver releases the generation (``generate()`` returned or failed), and all of them when its session
ends. Stages that run other call signatures of the same weights (``Setup.borrows``: a prefill and a
decode program) share their lender's caches, so a decode step finds what the prefill wrote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from lightning_remote_mp.errors import LrmpError
from lightning_remote_mp.model.kv_cache import KVStore, active
from lightning_remote_mp.wire.messages import Generation
from lightning_remote_mp.worker.allocator import device_memory

#: The most generations (per micro-batch) a stage keeps at once: a driver that never releases its
#: generations is stopped here rather than filling the worker's memory.
MAX_STORES = 256


#: The share of its device's available memory a new generation's cache may take.
SHARE = 0.8


class GenerationCaches:
    """The stores of one stage (and the stages that borrow its weights), by (generation, micro-batch).

    Args:
        device: where the stage runs: a new store may take `SHARE` of its available memory.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stores: dict[tuple[int, int], KVStore] = {}

    def __len__(self) -> int:
        return len(self._stores)

    @property
    def nbytes(self) -> int:
        return sum(store.nbytes for store in self._stores.values())

    @contextlib.contextmanager
    def step(self, generation: Generation, mb: int) -> Iterator[None]:
        """While a decoding step (a D action) of micro-batch ``mb`` runs: the store of its
        ``generation`` (`messages.Forward.generation`) is the one ``lrmp::kv_cache`` writes to, and
        torch is in inference mode (a decode step is never differentiated: autograd's bookkeeping per
        operator skipped made the 22 M Llama's decode step over two stages 1.1 ms faster, 21.7 to 20.5 ms)."""
        ident, capacity, rows = generation.id, generation.capacity, generation.rows
        store = self._stores.get((ident, mb))
        if store is None:
            if len(self._stores) >= MAX_STORES:
                raise LrmpError(
                    f"this stage keeps {MAX_STORES} generations' caches already; the driver releases each when "
                    "generate() returns"
                )
            free, _ = device_memory(self.device)
            store = self._stores[(ident, mb)] = KVStore(capacity, int(free * SHARE) if free else None)
        with torch.inference_mode(), active(store):
            if rows is not None:
                store.reorder(torch.tensor(rows, dtype=torch.long))
            yield

    def release(self, generations: Iterable[int]) -> None:
        """Free the stores of ``generations``."""
        gone = set(generations)
        for held in [k for k in self._stores if k[0] in gone]:
            del self._stores[held]

    def clear(self) -> None:
        self._stores.clear()
