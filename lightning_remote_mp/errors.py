"""Every exception lrmp raises on purpose, each carrying where the problem is (layer, stage,
replica, worker address). Errors about the user's own input are also ``ValueError``s (or a
``TypeError``, for a value of the wrong type); errors that happened at one worker share the base
`LocatedError`, which names that worker the same way everywhere."""

from __future__ import annotations


class LrmpError(RuntimeError):
    """Base class of every error lrmp raises on purpose."""


class SpecError(LrmpError, ValueError):
    """A layer spec is malformed: a bad entry, an unknown class or a broken residual wiring."""


class ConfigurationError(LrmpError, ValueError):
    """Arguments (of the strategy, `LocalWorkers`, a worker and its flags) that cannot work
    together; raised at construction, before any file is read or worker contacted, naming the
    arguments and what to change."""


class WeightsError(LrmpError, ValueError):
    """Weights at rest cannot be used: a missing file or tensor, another shape, a checkpoint of another
    model, a directory a worker cannot read (`lightning_remote_mp.model.weights`). Names the tensor and
    the file."""


class ProtocolError(LrmpError):
    """A message could not be encoded or decoded (malformed, truncated, over a limit)."""


class ProtocolVersionError(ProtocolError):
    """The other side speaks another version of the wire protocol.

    Attributes:
        remote_version: the protocol version the other side speaks (``None`` if unreadable).
        info: what the other side said about itself (``lrmp`` and ``torch`` versions), when readable.
    """

    def __init__(self, message: str, *, remote_version: int | None = None, info: dict | None = None) -> None:
        super().__init__(message)
        self.remote_version = remote_version
        self.info = dict(info or {})


class LimitExceeded(ProtocolError):
    """A message is over one of the receiver's `lightning_remote_mp.wire.protocol.Limits` (``limit``
    names which, e.g. ``"max_message_bytes"``)."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class RefusedClassError(LrmpError):
    """A worker was asked to build a class outside its allowlist."""


class RefusedOperatorError(RefusedClassError):
    """A traced graph that arrived calls an operator outside the worker's allowlist (ATen and prims
    operators, and a few Python operators on shapes); nothing of it was run."""


class TraceError(LrmpError, ValueError):
    """An ``nn.Module`` could not be traced into stages: ``torch.export`` failed on it, or its graph
    cannot be cut the way it was asked. The message names the module and what to change."""


class RemoteInputError(LrmpError, TypeError):
    """A SpecSequential whose layers live on workers was called with what it cannot send them: it
    takes one tensor (a traced module: its tuple of tensors)."""


def worker_location(address: str, stage: int | None = None, replica: int | None = None) -> str:
    """How messages name a worker: ``"worker tcp://h:p (stage 1, replica 0)"``; the stage and the
    replica appear when known (the replica only with replicas)."""
    parts = [f"stage {stage}"] if stage is not None else []
    if replica is not None:
        parts.append(f"replica {replica}")
    return f"worker {address}" + (f" ({', '.join(parts)})" if parts else "")


class LocatedError(LrmpError):
    """An error that happened at one worker; its subclasses say what happened there.

    Attributes:
        address: the worker's address.
        stage: the stage number the worker holds (``None`` before stages are assigned).
        replica: the data-parallel replica the worker belongs to (``None`` without replicas).

    >>> err = WorkerLostError("gone", address="tcp://10.0.0.5:5555", stage=1, replica=0)
    >>> err.where
    'worker tcp://10.0.0.5:5555 (stage 1, replica 0)'
    """

    def __init__(self, message: str, *, address: str, stage: int | None = None, replica: int | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.stage = stage
        self.replica = replica

    @property
    def where(self) -> str:
        """The worker, as messages name it (`worker_location`)."""
        return worker_location(self.address, self.stage, self.replica)


class WorkerError(LocatedError):
    """An exception raised on a worker, relayed to the driver (which worker: `LocatedError`).

    Attributes:
        layer: global index of the layer that failed, when the failure is inside a layer.
        remote_type: the exception's class name on the worker.
        remote_message: the exception's message on the worker.
        remote_traceback: the traceback on the worker, when it sent one.
        details: further fields of the worker's error reply, e.g. a busy worker's ``expires_in``.
    """

    def __init__(
        self,
        message: str,
        *,
        address: str,
        stage: int | None = None,
        replica: int | None = None,
        layer: int | None = None,
        remote_type: str = "",
        remote_message: str = "",
        remote_traceback: str = "",
        details: dict | None = None,
    ) -> None:
        super().__init__(message, address=address, stage=stage, replica=replica)
        self.layer = layer
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        #: Further fields of the worker's error reply (plain values), e.g. a busy worker's ``expires_in``.
        self.details = dict(details or {})


class WorkerLostError(LocatedError):
    """A worker died, stopped answering, or could not be reached in time (which worker: `LocatedError`)."""


class AuthenticationError(LocatedError):
    """A worker refused this driver's CURVE key, or the keys of the two sides do not fit together
    (which worker: `LocatedError`)."""


class KeyFileError(LrmpError, ValueError):
    """A key file or key directory is missing, unreadable or malformed."""


class WorkerStartError(LrmpError):
    """A local ``lrmp-worker`` process exited, or never said it was ready, while starting."""


class PeerUnreachableError(LrmpError):
    """A stage could not hand a message to the worker of another stage in time (raised on the worker,
    reported to the driver as a `WorkerError`)."""


class GroupError(LrmpError):
    """Summing gradients with the other workers of a process group failed on a worker (reported to
    the driver as a `WorkerError`): often because another member stopped, which the driver then
    names instead (`lightning_remote_mp.wire.transport.blame_the_lost`)."""
