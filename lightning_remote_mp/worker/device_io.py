"""A CUDA stage's copies between the wire (host memory) and its GPU.

Tensors below `OVERLAP_FROM` bytes, the common case, are copied synchronously: ``t.to(device)``
in, ``t.cpu()`` out, on the compute stream. Measured on an H100 (``benchmarks/README.md``, section
1c), that was faster than overlapping for every message size tried, up to 8 MiB: an asynchronous
copy needs a pinned buffer, an event, a thread that waits for it and a wake-up of the serving loop,
which costs more than a copy of a few MiB takes. The compute stream orders a synchronous copy
after the kernels that made the tensor, so it needs no other synchronisation.

A tensor of at least `OVERLAP_FROM` bytes is copied *off* the compute stream, so that its copy
overlaps the next micro-batch's compute:

- **in**, what arrives views ZeroMQ's frames, in pageable memory, from which a copy to the GPU
  cannot run asynchronously. `DeviceIO.upload` first copies it into pinned memory (torch's caching
  host allocator, so pinned buffers are reused once their copy is done), then to the GPU
  ``non_blocking`` on an *upload* stream; the compute stream waits for that copy (a
  stream-to-stream wait, no host synchronisation);
- **out**, `download` queues a copy into a pinned buffer on a *download* stream, which first waits
  for the point on the compute stream where the tensor was produced, and `to_host` returns the
  event the send waits for. The worker sends the message once the event has completed
  (`lightning_remote_mp.worker.server` holds it until then, reading and starting the next requests
  meanwhile, and a thread that sleeps on the event wakes it): no ``torch.cuda.synchronize()``.

Memory stays safe by the usual rules: a tensor made on one stream and used on another is recorded
on the other (``record_stream``), so the caching allocator does not hand out its memory while that
stream may still read it; a pinned buffer lives as long as the ZeroMQ frame that views it.

>>> import torch
>>> if torch.cuda.is_available():
...     io = DeviceIO(torch.device("cuda"), overlap_from=0)  # every copy off the compute stream
...     x = io.upload(torch.ones(4))
...     body, ready = io.to_host({"x": x * 2})
...     ready.synchronize()
...     assert body["x"].is_pinned() and body["x"].tolist() == [2.0] * 4
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

#: Tensors of at least this many bytes are copied between host and GPU off the compute stream,
#: overlapping compute; smaller ones synchronously, which costs less (see the module's docstring).
OVERLAP_FROM = 16 << 20


class DeviceIO:
    """The copies of one CUDA device's stage to and from the host.

    Args:
        device: the stage's GPU.
        overlap_from: tensors of at least this many bytes go through the side streams
            (default `OVERLAP_FROM`); smaller ones are copied synchronously.
    """

    def __init__(self, device: torch.device, overlap_from: int | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"DeviceIO is for CUDA devices, not {device}")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._upload = torch.cuda.Stream(self.device)
        self._download = torch.cuda.Stream(self.device)
        self.overlap_from = OVERLAP_FROM if overlap_from is None else overlap_from

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on this device. A large one is copied there on the upload stream, and the compute
        stream will wait for it."""
        if t.device == self.device:
            return t
        if t.device.type != "cpu" or t.nbytes < self.overlap_from:
            return t.to(self.device)  # on the compute stream; from another GPU too (not the wire's path)
        source = t
        if not t.is_pinned():
            source = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            source.copy_(t)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._upload):
            out = source.to(self.device, non_blocking=True)
        compute.wait_stream(self._upload)
        out.record_stream(compute)  # made on the upload stream, used (and freed) on the compute stream
        return out

    def download(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of ``t``, being made on the download stream, whatever its size: read
        it only after the event of a later `ready` has completed."""
        if t.device.type != "cuda":
            return t
        if t.device != self.device:
            t = t.to(self.device)  # from another GPU: onto this one's compute stream first
        # A lazy conjugate or negation would be applied on the host before an asynchronous copy lands.
        t = t.resolve_conj().resolve_neg()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._download.wait_stream(torch.cuda.current_stream(self.device))  # the point where t was produced
        with torch.cuda.stream(self._download):
            host.copy_(t, non_blocking=True)
        t.record_stream(self._download)  # its memory is not reused before the copy has read it
        return host

    def ready(self) -> torch.cuda.Event:
        """An event that completes once every download queued so far has. It is a blocking-sync
        event: a thread that waits for it sleeps instead of spinning on a core."""
        event = torch.cuda.Event(blocking=True)
        event.record(self._download)
        return event

    def to_host(self, body: Any) -> tuple[Any, torch.cuda.Event | None]:
        """Every tensor in a message body (nested dicts, lists and tuples) on the host, and the
        event to wait for before sending it: ``None`` when every copy is done (small tensors,
        copied synchronously), else the event of the large ones' downloads."""
        overlapped = False

        def to_host(t: torch.Tensor) -> torch.Tensor:
            nonlocal overlapped
            if t.device.type != "cuda":
                return t
            if t.nbytes < self.overlap_from:
                return t.resolve_conj().resolve_neg().cpu()
            overlapped = True
            return self.download(t)

        body = pytree.tree_map_only(torch.Tensor, to_host, body)
        return body, self.ready() if overlapped else None
