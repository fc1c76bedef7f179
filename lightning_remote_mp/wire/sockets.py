"""Making ZeroMQ sockets, and sending on them. Every socket lrmp opens is made here: the driver's and
the workers' client sockets (`dealer`), a worker's serving socket (`bind_router`), and the in-process
channels that wake a thread's loop (`inproc_pull`, `inproc_push`, `wake`); every message lrmp sends
leaves through `send_frames`, the wake-ups' empty frames aside.

With CURVE keys (`Curve`), every socket encrypts and authenticates: a client socket proves its key
pair and checks the server's public key; a server socket asks the worker's ZAP handler
(`lightning_remote_mp.worker.auth`) whether the client's key may connect. `handshake_failure` says in
words why a handshake failed, from a socket monitor's event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import zmq

from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.addresses import dial_name, endpoint_of, route
from lightning_remote_mp.wire.keys import KeyPair


def context() -> zmq.Context:
    return zmq.Context.instance()


#: ZeroMQ's own heartbeat on every TCP connection lrmp keeps (ZMTP PING/PONG): a connection whose
#: peer went silent without closing it (a host powered off, a cable pulled: half-open TCP) is closed
#: after `ZMTP_TIMEOUT` seconds of silence, and a connecting socket dials again, instead of sending
#: into it until TCP gives up (minutes). A second net under lrmp's own heartbeats, which name a lost
#: worker; this one makes the link itself recover once the peer is back.
ZMTP_INTERVAL, ZMTP_TIMEOUT = 2.0, 10.0


def keep_alive(sock: zmq.Socket) -> zmq.Socket:
    """Turn ZeroMQ's heartbeat on for ``sock``'s TCP connections (`ZMTP_INTERVAL`, `ZMTP_TIMEOUT`)."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(ZMTP_INTERVAL * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(ZMTP_TIMEOUT * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(ZMTP_TIMEOUT * 1000))
    return sock


_SNDMORE = int(zmq.SNDMORE)


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """``sock.send_multipart(frames, flags, copy=False)``, with plain integers for the flags: pyzmq's
    own combines its flag enums in Python for every frame (a decode step's message of 6 frames sent
    in 28 µs against 55). As with it, a frame of under 64 kB is copied, a larger one is not, and with
    ``zmq.NOBLOCK`` only the first frame can fail (``zmq.Again``): a message goes whole or not at all."""
    more = int(flags) | _SNDMORE
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, more if i < last else int(flags), copy=False)


#: The ZAP domain of lrmp's server sockets (what the worker's authenticator is configured for).
ZAP_DOMAIN = "lrmp"


@dataclasses.dataclass(frozen=True)
class Curve:
    """A client's CURVE settings for one server: its own key pair and the server's public key."""

    keys: KeyPair
    server_key: bytes


def inproc_pull(endpoint: str) -> zmq.Socket:
    """The receiving end of an in-process channel between threads (bound here)."""
    sock = context().socket(zmq.PULL)
    sock.bind(endpoint)
    return sock


def inproc_push(endpoint: str) -> zmq.Socket:
    """The sending end of an in-process channel between threads (connected here)."""
    sock = context().socket(zmq.PUSH)
    sock.connect(endpoint)
    return sock


def wake(endpoint: str) -> None:
    """Wake a loop polling an inproc PULL socket bound at ``endpoint`` (from any thread).

    A courtesy only: if the loop's end cannot take the message (it is already closing), the loop
    still sees its stop flag within one poll interval.
    """
    sock = inproc_push(endpoint)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        sock.send(b"", zmq.NOBLOCK)
    except zmq.Again:
        pass
    sock.close()


def bind_router(
    address: str, *, keys: KeyPair | None = None, limits: protocol.Limits = protocol.DEFAULT_LIMITS
) -> tuple[zmq.Socket, str]:
    """A worker's serving socket; returns it with the endpoint actually bound (port ``*`` resolved).

    With ``keys`` the socket is a CURVE server: clients must know its public key, and their own keys
    are checked by the ZAP handler of this process (which must be running before any client comes).
    """
    sock = keep_alive(context().socket(zmq.ROUTER))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting driver takes its identity back
    sock.setsockopt(zmq.MAXMSGSIZE, limits.frame_cap)  # an oversized frame drops its sender as it arrives
    if keys is not None:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()
    sock.bind(address)
    return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def dealer(
    address: str,
    *,
    curve: Curve | None = None,
    immediate: bool = False,
    limits: protocol.Limits | None = None,
    connect: bool = True,
) -> zmq.Socket:
    """A client socket. ``immediate``: queue messages only on a completed connection (and handshake),
    so a send that cannot be delivered is seen as such instead of waiting in a queue. With
    ``connect=False`` the caller connects it (after attaching a monitor, say)."""
    sock = context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    routing_id, via_key = route(address)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    if dial_name(address):
        curve = None  # this process's switchboard, in-process: the worker's own link is encrypted
    elif curve is not None and via_key is not None:
        curve = Curve(curve.keys, via_key)
    if immediate:
        sock.setsockopt(zmq.IMMEDIATE, 1)
    if limits is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, limits.frame_cap)
    if curve is not None:
        sock.curve_secretkey = curve.keys.secret
        sock.curve_publickey = curve.keys.public
        sock.curve_serverkey = curve.server_key
    keep_alive(sock)  # (an in-process link has no ZMTP connection to watch: the options do nothing there)
    if connect:
        sock.connect(endpoint_of(address))
    return sock


#: The socket monitor events a `lightning_remote_mp.wire.transport.Connection` watches for.
HANDSHAKE_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def handshake_failure(event: Mapping[str, Any], curve: Curve | None) -> str | None:
    """Why a handshake failed, in words, from a socket monitor event (``None`` if it did not fail)."""
    kind, value = event["event"], event["value"]
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        if curve is None:
            return f"the worker refused this connection (ZAP status {value})"
        return (
            f"the worker refused this driver's public key {curve.keys.public.decode()} (ZAP status {value}): "
            "put the driver's public key file (NAME.key from `lrmp-worker keygen`) into the worker's "
            "--authorized-keys directory"
        )
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if curve is None:
                return (
                    "the worker requires CURVE encryption and authentication (it runs with --secret-key), "
                    "but this driver has no keys: give the strategy curve=CurveOptions(secret_key, worker_public_keys)"
                )
            return (
                "the worker does not use CURVE encryption (it runs without --secret-key), but this driver has "
                "keys configured: start the worker with --secret-key and --authorized-keys, or drop the keys here"
            )
        return f"the ZeroMQ handshake failed (protocol error {value:#x}): is this address an lrmp-worker?"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        if curve is not None:
            # libzmq reports a worker without CURVE this way too when the connection drops before the
            # mechanism mismatch is read (a race), so both causes are named.
            return (
                f"the CURVE handshake failed: the public key configured for this worker "
                f"({curve.server_key.decode()}) is probably not the public key of the --secret-key it runs with, "
                "unless the worker does not use CURVE encryption at all (it runs without --secret-key)"
            )
        # A worker that requires CURVE drops a plaintext client; libzmq names the mismatch, or, when
        # the connection drops first (a race), says nothing more than this.
        return (
            "the ZeroMQ handshake failed: the worker probably requires CURVE encryption and authentication "
            "(it runs with --secret-key) while this driver has no keys (give the strategy curve=CurveOptions(...)), "
            "unless something other than an lrmp-worker listens at this address"
        )
    return None
