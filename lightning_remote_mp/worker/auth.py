"""Who may connect to a worker that runs with CURVE keys, and what each may send.

pyzmq's ZAP authenticator (``zmq.auth.thread.ThreadAuthenticator``) asks `WorkerAuth.callback`
about every client's public key during the handshake. A key is accepted

- as a **driver** when a ``*.key`` file in the ``--authorized-keys`` directory holds it (the
  directory is read again at every handshake, so a key added there works without a restart);
- as a **peer** when the authenticated driver of the current session announced it at SETUP as the
  key of a worker in the same pipeline. A peer may only send pipelined forward/backward messages of
  that session; it can neither start a session nor send any other request.

Every message a worker receives carries the key its connection proved (ZeroMQ's ``User-Id``
property), and the worker checks the role of that key for every message, not only at connect.
A key removed from the directory is refused on its next connection; a connection open already stays
open until the client disconnects or the worker restarts.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from lightning_remote_mp.wire.keys import load_authorized_keys
from lightning_remote_mp.wire.sockets import ZAP_DOMAIN
from lightning_remote_mp.worker.throttle import Throttle

log = logging.getLogger(__name__)

DRIVER = "driver"
PEER = "peer"


class WorkerAuth:
    """The ZAP handler of one worker process.

    Args:
        ctx: the ZeroMQ context of the worker's sockets.
        authorized_dir: directory of the public keys allowed to drive this worker.
        session_peers: returns the peer keys the current session announced (empty without a session).
    """

    def __init__(self, ctx: zmq.Context, authorized_dir: str | Path, session_peers: Callable[[], frozenset[bytes]]):
        self.authorized_dir = Path(authorized_dir)
        self.session_peers = session_peers
        self._lock = threading.Lock()
        if not load_authorized_keys(self.authorized_dir):
            log.warning(
                "no public key in %s: no driver can connect until one is added (a NAME.key file from "
                "`lrmp-worker keygen`)",
                self.authorized_dir,
            )
        self._roles: dict[str, str] = {}  # z85 key -> role granted at its last handshake
        self._throttle = Throttle(log)
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("lightning_remote_mp.worker.zap"))
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """Called by the ZAP thread with a connecting client's Z85 public key: may it connect?"""
        try:
            drivers = load_authorized_keys(self.authorized_dir)
        except Exception as err:  # a directory gone missing refuses everyone, it does not crash
            log.error("cannot read the authorized keys: %s", err)
            drivers = set()
        role = DRIVER if key in drivers else PEER if key in self.session_peers() else None
        text = key.decode("ascii", "replace")
        if role is None:
            self._throttle.warning(
                "refused",
                "refused a connection with public key %s: it is not in %s, nor a peer worker of the current session",
                text,
                self.authorized_dir,
            )
            return False
        with self._lock:
            self._roles[text] = role
        log.debug("accepted public key %s as %s", text, role)
        return True

    def role(self, user_id: str | None) -> str | None:
        """The role granted to a connection's key (``None``: not authenticated by this handler)."""
        if not user_id:
            return None
        with self._lock:
            return self._roles.get(user_id)

    def stop(self) -> None:
        self._auth.stop()
