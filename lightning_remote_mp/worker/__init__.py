"""The ``lrmp-worker`` process: a plain PyTorch process (no Lightning) that serves stages."""

from lightning_remote_mp.worker.server import WorkerServer

__all__ = ["WorkerServer"]
