"""How many bytes this process's TCP connections have moved: how the driver tells a large message on
a slow link from a pipeline in which nothing moves.

ZeroMQ hands a message over whole, once its last byte has arrived: a 130 MB message on a
100 Mbit/s link is 11 s in which no message arrives, no worker computes, and everything is fine.
The kernel knows better: for each TCP connection it counts the bytes the peer acknowledged and the
bytes received (``tcpi_bytes_acked``, ``tcpi_bytes_received``, Linux 4.1 and later). `Traffic` sums
them over this process's own sockets (those in ``/proc/self/fd``), asking through the netlink
socket-diagnostics interface that ``ss`` uses. A sample costs the kernel about 3 ms per address
family however few sockets there are (it walks its whole connection table), so a worker takes its
samples on a thread of their own (`Sampler`), never on the thread that runs its stages. Workers
report the total in their heartbeats, and the driver counts a transfer in progress as progress
(`lightning_remote_mp.wire.collect`).

Where the kernel does not tell (not Linux, or netlink refused), `Traffic.sample` returns ``None``,
and the driver judges a pipeline stalled only by ``call_timeout``.

>>> traffic = Traffic()
>>> first = traffic.sample()
>>> first is None or traffic.sample() >= first
True
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_INET_DIAG_INFO = 2
_HEADER = struct.Struct("=IHHII")  # nlmsghdr
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2, before its 48-byte socket id
_INODE_AT = 4 + 48 + 16  # in inet_diag_msg: family, state, timer, retrans; the id; expires, queues, uid
_MESSAGE = 72  # sizeof(inet_diag_msg): the attributes follow
_BYTES_AT = 120  # tcpi_bytes_acked and tcpi_bytes_received, two u64, in struct tcp_info
#: The least a transfer moves between two heartbeats (one second) to count as one: far above the
#: heartbeats' own few hundred bytes, far below any link (1 Mbit/s moves 125 kB a second).
MIN_PROGRESS = 16 * 1024


def _own_sockets() -> set[int]:
    """The inodes of this process's sockets."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def _tcp_bytes(family: int, inodes: set[int]) -> dict[int, int]:
    """Bytes acknowledged plus bytes received, by socket inode, for this process's TCP sockets of ``family``."""
    out: dict[int, int] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as s:
        s.settimeout(1.0)
        request = _REQUEST.pack(family, socket.IPPROTO_TCP, 1 << (_INET_DIAG_INFO - 1), 0, 0xFFFFFFFF) + bytes(48)
        s.send(
            _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
            + request
        )
        while True:
            data = s.recv(1 << 16)
            at = 0
            while at + _HEADER.size <= len(data):
                length, kind = _HEADER.unpack_from(data, at)[:2]
                if kind in (_NLMSG_DONE, _NLMSG_ERROR) or length < _HEADER.size:
                    return out
                body, end = at + _HEADER.size, at + length
                inode = struct.unpack_from("=I", data, body + _INODE_AT)[0]
                attr = body + _MESSAGE
                while inode in inodes and attr + 4 <= end:
                    size, kind = struct.unpack_from("=HH", data, attr)
                    if size < 4:
                        break
                    if kind == _INET_DIAG_INFO and size - 4 >= _BYTES_AT + 16:
                        acked, received = struct.unpack_from("=QQ", data, attr + 4 + _BYTES_AT)
                        out[inode] = acked + received
                    attr += (size + 3) & ~3
                at += (length + 3) & ~3


class Traffic:
    """A running count of the bytes this process's TCP connections have moved (see the module
    docstring). It only grows: connections that close keep what they moved."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}
        self._total = 0
        self._works = sys.platform.startswith("linux")

    def sample(self) -> int | None:
        """The bytes moved so far, or ``None`` where the kernel does not tell."""
        if not self._works:
            return None
        try:
            inodes = _own_sockets()
            now = {**_tcp_bytes(socket.AF_INET, inodes), **_tcp_bytes(socket.AF_INET6, inodes)}
        except OSError:
            self._works = False  # no netlink here (a sandbox): say so from now on
            return None
        self._total += sum(max(0, moved - self._last.get(inode, 0)) for inode, moved in now.items())
        self._last = now
        return self._total


class Sampler:
    """`Traffic` sampled on a thread of its own, for a thread that must not wait for the kernel (a
    worker's serving thread, which answers heartbeats between two micro-batches): `latest` returns
    the newest sample at once and asks for the next. A sample is thus one request old: bytes a
    transfer moves show one heartbeat later than they would, well within the heartbeat timeout that
    judges a stall.

    >>> sampler = Sampler()
    >>> first = sampler.latest()
    >>> first is None or sampler.latest() >= first
    True
    >>> sampler.close()
    """

    def __init__(self) -> None:
        self._traffic = Traffic()
        self._latest = self._traffic.sample()  # the first answer is a sample too: None would mean "cannot tell"
        self._wanted = threading.Event()
        self._closed = False
        threading.Thread(target=self._run, name="lrmp-traffic", daemon=True).start()

    def latest(self) -> int | None:
        """The newest sample (`Traffic.sample`); the next one is taken meanwhile."""
        self._wanted.set()
        return self._latest

    def close(self) -> None:
        self._closed = True
        self._wanted.set()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            if self._closed:
                return
            self._wanted.clear()
            self._latest = self._traffic.sample()
