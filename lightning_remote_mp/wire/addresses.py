"""Worker addresses: what ``hosts`` may say, and where a socket for each actually connects.

A worker is reached at ``tcp://host:port`` (``host:port`` is normalised to that), or, when it
dials in (``lrmp-worker --connect``), by its name, ``dial://NAME``: this process then reaches it
through its switchboard (`lightning_remote_mp.wire.switchboard`), and another worker through the
driver's, at a ``relay://`` address. A socket for a ``dial://`` or ``relay://`` address carries a
routing id that tells the switchboard which worker it is for (`route`).

>>> normalize_address("10.0.0.5:5555"), normalize_address("dial://gpu-a")
('tcp://10.0.0.5:5555', 'dial://gpu-a')
>>> parse_relay(relay_address("gpu-b", "10.0.0.1:7000"))
('10.0.0.1:7000', 'gpu-b', None)
"""

from __future__ import annotations

import errno
import re
import socket
import uuid
from collections.abc import Iterable

from lightning_remote_mp.errors import ConfigurationError

#: A worker that dials in (``lrmp-worker --connect``), by the name it gives: ``dial://gpu-a``.
DIAL = "dial://"
#: Where a worker sends to a peer that dialed in: through the driver it dialed,
#: ``relay://host:port/NAME#KEY`` (``KEY``: the driver's public key, with CURVE; no host: the
#: driver this worker dialed itself).
RELAY = "relay://"
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")


def normalize_address(host: str) -> str:
    """``"host:port"`` becomes ``"tcp://host:port"``; ``tcp://``, ``ipc://``, ``inproc://`` and
    ``dial://NAME`` (a worker that dials in) pass."""
    if not isinstance(host, str) or not host.strip():
        raise ConfigurationError(f"worker address must be a non-empty string like 'tcp://10.0.0.5:5555', got {host!r}")
    host = host.strip()
    if "://" not in host:
        host = "tcp://" + host
    scheme, rest = host.split("://", 1)
    if scheme == "dial":
        if not WORKER_NAME.fullmatch(rest):
            raise ConfigurationError(
                f"worker address {host!r}: a dial-in worker's name (lrmp-worker --name) is letters, digits, '.', "
                "'_' and '-', at most 63 of them"
            )
        return host
    if scheme not in ("tcp", "ipc", "inproc"):
        raise ConfigurationError(f"worker address {host!r}: unsupported scheme {scheme!r}; use tcp://host:port")
    if scheme == "tcp":
        hostname, sep, port = rest.rpartition(":")
        if not sep or not hostname or not (port.isdigit() or port == "*"):
            raise ConfigurationError(f"worker address {host!r} needs a port, like tcp://10.0.0.5:5555")
    return host


def resolved(address: str) -> str:
    """``address`` with its hostname replaced by the IP address this machine resolves it to: what the
    driver tells a worker about its peers, which need not resolve the names the driver's host knows
    (an entry in the driver's /etc/hosts). An IP address, a non-TCP address, or a name that does not
    resolve here stays as it is.

    >>> resolved("tcp://localhost:5555"), resolved("tcp://10.0.0.5:5555")
    ('tcp://127.0.0.1:5555', 'tcp://10.0.0.5:5555')
    """
    if not address.startswith("tcp://"):
        return address
    host, _, port = address[len("tcp://") :].rpartition(":")
    name = host.strip("[]")
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return address
    ip = str(infos[0][4][0])
    if ip == name:
        return address
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


def dial_name(address: str) -> str | None:
    """The name of the worker a ``dial://NAME`` address means (``None`` for any other address)."""
    return address[len(DIAL) :] if address.startswith(DIAL) else None


def relay_address(name: str, via: str = "", key: bytes | None = None) -> str:
    """Where a worker reaches the dial-in worker ``name``: through the driver's switchboard at
    ``via`` (``"host:port"``; empty: the driver the sending worker dialed), checking its ``key``.

    >>> relay_address("gpu-b", "10.0.0.1:7000")
    'relay://10.0.0.1:7000/gpu-b'
    """
    return f"{RELAY}{via}/{name}" + (f"#{key.decode('ascii')}" if key is not None else "")


def parse_relay(address: str) -> tuple[str, str, bytes | None]:
    """``relay://host:port/NAME#KEY`` as ``(host:port, NAME, KEY)``."""
    rest = address[len(RELAY) :]
    via, _, name_key = rest.partition("/")
    name, _, key = name_key.partition("#")  # a name has no '#'; a Z85 key may
    return via, name, (key.encode("ascii") if key else None)


#: The switchboards of this process (`lightning_remote_mp.wire.switchboard`): the inproc endpoint
#: through which the driver's sockets reach each worker that dialed in, by its name.
_dialed_in: dict[str, str] = {}


def route_dialin(names: Iterable[str], endpoint: str | None) -> None:
    """Send what this process addresses to ``dial://NAME`` through ``endpoint`` (``None``: forget them)."""
    for name in names:
        if endpoint is None:
            _dialed_in.pop(name, None)
        else:
            _dialed_in[name] = endpoint


def address_towards(address: str) -> str:
    """This machine's IP address on the route to the host of ``address`` (no packet is sent)."""
    host = address.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    if host in ("localhost", "") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


def why_unreachable(address: str, timeout: float = 1.0) -> str | None:
    """Why a TCP connection to ``address`` fails, for a worker that cannot be reached: one attempt
    of this process's own, to read the error ZeroMQ's retries hide (``None``: it connects, or the
    attempt stays silent, as behind a firewall that drops it). A name that does not resolve is a
    `ConfigurationError`."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        return None
    except socket.gaierror as err:
        raise ConfigurationError(
            f"worker address {address!r}: this machine cannot resolve {host!r} ({err.strerror}); "
            "check the name in hosts"
        ) from None
    except OSError as err:
        if err.errno == errno.ECONNREFUSED:
            return (
                f"{host} refuses connections on port {port}: nothing listens there. Is lrmp-worker running on that "
                "machine with that port? A worker started without --bind listens on 127.0.0.1 only, which no other "
                "machine reaches: start it with --bind tcp://0.0.0.0:PORT"
            )
        if err.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"there is no route from this machine to {host} ({err.strerror}): is the address right?"
        return None


def is_loopback(address: str) -> bool:
    if not address.startswith("tcp://"):
        return True
    hostname = address[len("tcp://") :].rpartition(":")[0].strip("[]")
    return hostname in ("localhost", "::1") or hostname.startswith("127.")


def route(address: str) -> tuple[bytes | None, bytes | None]:
    """The routing id a client socket for ``address`` carries (``None``: any), and the CURVE
    server key it checks instead of the worker's (``None``: the worker's): a ``dial://`` worker is
    reached through this process's switchboard (``d:NAME/...``), a ``relay://`` one through the
    driver's (``r:NAME/...``), whose key CURVE checks."""
    if name := dial_name(address):
        return f"d:{name}/{uuid.uuid4().hex[:12]}".encode(), None
    if address.startswith(RELAY):
        _, name, key = parse_relay(address)
        return f"r:{name}/{uuid.uuid4().hex[:12]}".encode(), key
    return None, None


def endpoint_of(address: str) -> str:
    """The endpoint a client socket for ``address`` connects to."""
    if name := dial_name(address):
        endpoint = _dialed_in.get(name)
        if endpoint is None:
            raise ConfigurationError(f"no worker named {name!r} has dialed in to this process")
        return endpoint
    if address.startswith(RELAY):
        return "tcp://" + parse_relay(address)[0]
    return address
