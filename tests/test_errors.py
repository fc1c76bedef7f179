"""The error taxonomy: one base for errors at a worker, lrmp errors where the user's input is at fault."""

from __future__ import annotations

import pytest
import torch

from lightning_remote_mp import (
    AuthenticationError,
    ConfigurationError,
    LimitExceeded,
    LocatedError,
    LrmpError,
    ProtocolError,
    RemoteInputError,
    WorkerError,
    WorkerLostError,
)
from lightning_remote_mp.errors import worker_location
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.transport import Connection

ADDRESS = "tcp://10.0.0.5:5555"


@pytest.mark.parametrize("cls", [WorkerError, WorkerLostError, AuthenticationError])
def test_errors_at_a_worker_share_one_located_base(cls):
    err = cls("it failed", address=ADDRESS, stage=1, replica=0)
    assert isinstance(err, LocatedError) and isinstance(err, LrmpError) and isinstance(err, RuntimeError)
    assert (err.address, err.stage, err.replica) == (ADDRESS, 1, 0)
    assert err.where == f"worker {ADDRESS} (stage 1, replica 0)"
    assert str(err) == "it failed"
    bare = cls("it failed", address=ADDRESS)
    assert (bare.stage, bare.replica, bare.where) == (None, None, f"worker {ADDRESS}")
    with pytest.raises(cls):  # an `except` for the subclass still catches it
        raise err


def test_worker_error_keeps_its_own_fields():
    err = WorkerError("x", address=ADDRESS, stage=0, layer=3, remote_type="ValueError", details={"expires_in": 2.0})
    assert (err.layer, err.remote_type, err.details) == (3, "ValueError", {"expires_in": 2.0})
    assert err.where == f"worker {ADDRESS} (stage 0)"


def test_a_relayed_worker_error_names_the_replica():
    conn = Connection(ADDRESS, stage=1, replica=1)
    try:
        err = conn._remote_error({"type": "ValueError", "message": "bad shape", "layer": 4}, "forward")
    finally:
        conn.close()
    assert str(err).startswith(f"worker {ADDRESS} (stage 1, replica 1), layer 4 raised ValueError during forward")
    assert (err.replica, err.stage, err.layer) == (1, 1, 4) and err.where == conn.where()
    assert conn.where() == worker_location(ADDRESS, 1, 1)


def test_limit_exceeded_lives_in_errors_and_in_protocol():
    assert protocol.LimitExceeded is LimitExceeded and issubclass(LimitExceeded, ProtocolError)
    with pytest.raises(LimitExceeded) as info:
        protocol.decode(protocol.encode("x", 1, "s", [torch.ones(1)] * 3), protocol.Limits(max_frames=2))
    assert info.value.limit == "max_frames"


def test_the_users_own_input_raises_lrmp_errors():
    with pytest.raises(ConfigurationError, match="limit max_frames must be a positive integer"):
        protocol.Limits(max_frames=0)
    with pytest.raises(ValueError):  # still a ValueError for code that catches those
        protocol.Limits(max_layers=-1)
    from lightning_remote_mp.driver.session import DriverSession
    from lightning_remote_mp.worker.server import WorkerServer

    with pytest.raises(ConfigurationError, match="CURVE needs both"):
        DriverSession(["127.0.0.1:1"], worker_keys={"127.0.0.1:1": b"k" * 40})
    with pytest.raises(ConfigurationError, match="--authorized-keys"):
        WorkerServer("tcp://127.0.0.1:*", authorized_keys="keys")


def test_a_remote_module_called_with_a_non_tensor_raises_a_type_error():
    from lightning_remote_mp.driver.pipeline import RemoteSpec, RemoteStage
    from lightning_remote_mp.model.partition import Stage

    conn = Connection(ADDRESS, stage=0)
    try:
        remote = RemoteSpec("net", [[RemoteStage("net", Stage(0, 0, 1, (), ()), conn)]])
        with pytest.raises(RemoteInputError, match="takes one tensor, got list") as info:
            remote([torch.ones(1)])
    finally:
        conn.close()
    assert isinstance(info.value, TypeError) and isinstance(info.value, LrmpError)
