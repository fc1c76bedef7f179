"""A CUDA stage's copies between the wire (host memory) and its GPU, off the compute stream.

What arrives views ZeroMQ's frames, in pageable memory, from which a copy to the GPU cannot run
asynchronously. `DeviceIO.upload` first copies a tensor into pinned memory (torch's caching host
allocator, so pinned buffers are reused once their copy is done), then to the GPU ``non_blocking``
on an *upload* stream; the compute stream waits for that copy (a stream-to-stream wait, no host
synchronisation). The upload of micro-batch i+1 thus runs while micro-batch i computes.

What leaves goes the other way: `download` queues a copy into a pinned buffer on a *download*
stream, which first waits for the point on the compute stream where the tensor was produced, and
`ready` records the event a send waits for. The worker sends a message once its event has
completed (`lightning_remote_mp.worker.server` holds it until then, reading and starting the next
requests meanwhile, and a thread that sleeps on the event wakes it): no ``torch.cuda.synchronize()``,
and the download of micro-batch i overlaps the compute of micro-batch i+1.

Memory stays safe by the usual rules: a tensor made on one stream and used on another is recorded
on the other (``record_stream``), so the caching allocator does not hand out its memory while that
stream may still read it; a pinned buffer lives as long as the ZeroMQ frame that views it.

>>> import torch
>>> if torch.cuda.is_available():
...     io = DeviceIO(torch.device("cuda"))
...     x = io.upload(torch.ones(4))
...     host = io.download(x * 2)
...     io.ready().synchronize()
...     assert host.is_pinned() and host.tolist() == [2.0] * 4
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree


class DeviceIO:
    """The upload and download streams of one CUDA device, and the copies through them."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"DeviceIO is for CUDA devices, not {device}")
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self._upload = torch.cuda.Stream(self.device)
        self._download = torch.cuda.Stream(self.device)

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on this device, copied there on the upload stream; the compute stream will wait for it."""
        if t.device == self.device:
            return t
        if t.device.type != "cpu":
            return t.to(self.device)  # from another GPU: not the wire's path, kept simple
        source = t
        if not t.is_pinned():
            source = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            source.copy_(t)
        compute = self._compute()
        with torch.cuda.stream(self._upload):
            out = source.to(self.device, non_blocking=True)
        compute.wait_stream(self._upload)
        out.record_stream(compute)  # made on the upload stream, used (and freed) on the compute stream
        return out

    def download(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of ``t``, being made on the download stream: read it only after the
        event of a later `ready` has completed."""
        if t.device.type != "cuda":
            return t
        if t.device != self.device:
            t = t.to(self.device)  # from another GPU: onto this one's compute stream first
        # A lazy conjugate or negation would be applied on the host before an asynchronous copy lands.
        t = t.resolve_conj().resolve_neg()
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self._download.wait_stream(self._compute())  # the point where t was produced
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

    def download_all(self, value: Any) -> Any:
        """`download` every tensor in a message body (nested dicts, lists and tuples)."""
        return pytree.tree_map_only(torch.Tensor, self.download, value)
