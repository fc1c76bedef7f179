"""Every exception lrmp raises on purpose, each carrying where the problem is (layer, stage,
replica, worker address). Errors about the user's own input are also ``ValueError``s."""

from __future__ import annotations


class LrmpError(RuntimeError):
    """Base class of every error lrmp raises on purpose."""


class SpecError(LrmpError, ValueError):
    """A layer spec is malformed: a bad entry, an unknown class or a broken residual wiring."""


class ConfigurationError(LrmpError, ValueError):
    """The strategy's arguments cannot work together; raised at construction, before any file is
    read or worker contacted, naming the arguments and what to change."""


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


class RefusedClassError(LrmpError):
    """A worker was asked to build a class outside its allowlist."""


class RefusedOperatorError(RefusedClassError):
    """A traced graph that arrived calls an operator outside the worker's allowlist (ATen and prims
    operators, and a few Python operators on shapes); nothing of it was run."""


class TraceError(LrmpError, ValueError):
    """An ``nn.Module`` could not be traced into stages: ``torch.export`` failed on it, or its graph
    cannot be cut the way it was asked. The message names the module and what to change."""


class WorkerError(LrmpError):
    """An exception raised on a worker, relayed to the driver.

    Attributes:
        address: the worker's address.
        stage: the stage number the worker holds (``None`` before stages are assigned).
        replica: the data-parallel replica the worker belongs to (``None`` without replicas).
        layer: global index of the layer that failed, when the failure is inside a layer.
        remote_type: the exception's class name on the worker.
        remote_message: the exception's message on the worker.
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
        super().__init__(message)
        self.address = address
        self.stage = stage
        self.replica = replica
        self.layer = layer
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        #: Further fields of the worker's error reply (plain values), e.g. a busy worker's ``expires_in``.
        self.details = dict(details or {})


class WorkerLostError(LrmpError):
    """A worker died, stopped answering, or could not be reached in time.

    Attributes:
        address: the worker's address.
        stage: the stage number the worker holds (``None`` before stages are assigned).
        replica: the data-parallel replica the worker belongs to (``None`` without replicas).
    """

    def __init__(self, message: str, *, address: str, stage: int | None = None, replica: int | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.stage = stage
        self.replica = replica


class AuthenticationError(LrmpError):
    """A worker refused this driver's CURVE key, or the keys of the two sides do not fit together.

    Attributes:
        address: the worker's address.
        stage: the stage number the worker holds (``None`` before stages are assigned).
        replica: the data-parallel replica the worker belongs to (``None`` without replicas).
    """

    def __init__(self, message: str, *, address: str, stage: int | None = None, replica: int | None = None) -> None:
        super().__init__(message)
        self.address = address
        self.stage = stage
        self.replica = replica


class KeyFileError(LrmpError, ValueError):
    """A key file or key directory is missing, unreadable or malformed."""


class WorkerStartError(LrmpError):
    """A local ``lrmp-worker`` process exited, or never said it was ready, while starting."""


class PeerUnreachableError(LrmpError):
    """A stage could not hand a message to the worker of another stage in time (raised on the worker,
    reported to the driver as a `WorkerError`)."""
