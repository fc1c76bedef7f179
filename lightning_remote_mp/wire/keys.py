"""CURVE key files: creating, reading and checking them.

The files are ZeroMQ's certificate format (``zmq.auth.create_certificates``): ``NAME.key`` holds a
public key and may be shared freely; ``NAME.key_secret`` holds the key pair and must stay private
(lrmp writes it readable by its owner only). Keys are 40-character Z85 strings.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> public_file, secret_file = generate_keypair(d, "driver")
>>> pair = load_keypair(secret_file)
>>> pair.public == load_public_key(public_file)
True
>>> sorted(load_authorized_keys(d)) == [pair.public]
True
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from lightning_remote_mp.errors import KeyFileError

log = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
#: Where ``lrmp-worker keygen`` writes without a directory, as ssh-keygen writes into ~/.ssh.
DEFAULT_KEY_DIR = "~/.lrmp"


@dataclasses.dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, both keys Z85-encoded (40 bytes)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"KeyPair(public={self.public.decode()!r})"


def is_z85_key(key: object) -> bool:
    """Whether ``key`` (str or bytes) is a 40-character Z85 encoding of a 32-byte CURVE key."""
    if isinstance(key, str):
        if not key.isascii():
            return False
        key = key.encode("ascii")
    if not isinstance(key, bytes) or len(key) != 40:
        return False
    try:
        return len(z85.decode(key)) == 32
    except Exception:  # z85.decode raises several types on bad input
        return False


def _check_key(key: bytes | None, what: str, path: Path) -> bytes:
    if key is None:
        raise KeyFileError(f"{path}: no {what} found; is this a key file written by `lrmp-worker keygen`?")
    if not is_z85_key(key):
        raise KeyFileError(f"{path}: the {what} is not a 40-character Z85 CURVE key")
    return key


def _read(path: str | os.PathLike[str], what: str) -> tuple[Path, bytes | None, bytes | None]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise KeyFileError(f"{what} file {p} does not exist (create one with `lrmp-worker keygen --name NAME`)")
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as err:
        raise KeyFileError(f"{what} file {p} cannot be read: {err}") from None
    return p, public, secret


def load_keypair(path: str | os.PathLike[str]) -> KeyPair:
    """Read a ``.key_secret`` file. Warns when other users may read it."""
    p, public, secret = _read(path, "secret key")
    if secret is None:
        raise KeyFileError(
            f"{p} holds only a public key; give the {SECRET_SUFFIX} file written next to it by `lrmp-worker keygen`"
        )
    try:
        mode = p.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("secret key file %s is readable by other users; run: chmod 600 %s", p, p)
    except OSError:
        pass
    return KeyPair(public=_check_key(public, "public key", p), secret=_check_key(secret, "secret key", p))


def load_public_key(path: str | os.PathLike[str]) -> bytes:
    """Read the public key of a ``.key`` (or ``.key_secret``) file."""
    p, public, _ = _read(path, "public key")
    return _check_key(public, "public key", p)


def load_authorized_keys(directory: str | os.PathLike[str]) -> set[bytes]:
    """The public keys of every ``*.key`` file in ``directory``; malformed files are skipped with a warning."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise KeyFileError(f"authorized keys directory {d} does not exist or is not a directory")
    keys = set()
    for f in sorted(d.glob("*" + PUBLIC_SUFFIX)):
        try:
            keys.add(load_public_key(f))
        except KeyFileError as err:
            log.warning("ignoring %s", err)
    return keys


def write_public_key(path: str | os.PathLike[str], public: bytes) -> Path:
    """Write a public key file in the same format as ``zmq.auth.create_certificates``."""
    p = Path(path)
    p.write_text(f'metadata\ncurve\n    public-key = "{public.decode()}"\n')
    return p


def generate_keypair(directory: str | os.PathLike[str], name: str, *, overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (owner-only) into ``directory``.

    A directory that does not exist yet is created readable by its owner only (as ``~/.ssh``): it
    holds secret keys. An existing one keeps its permissions.
    """
    d = Path(directory).expanduser()
    if not name or "/" in name or name.startswith("."):
        raise KeyFileError(f"key name {name!r} must be a plain file name, like 'worker1'")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_file, secret_file = d / (name + PUBLIC_SUFFIX), d / (name + SECRET_SUFFIX)
    existing = [str(f) for f in (public_file, secret_file) if f.exists()]
    if existing and not overwrite:
        raise KeyFileError(f"{', '.join(existing)} already exist; pick another --name or pass --force to replace them")
    # The secret file is created owner-only before any key is written into it.
    old = os.umask(0o077)
    try:
        for f in (public_file, secret_file):
            f.unlink(missing_ok=True)
        zmq.auth.create_certificates(d, name)
    finally:
        os.umask(old)
    os.chmod(secret_file, 0o600)
    os.chmod(public_file, 0o644)
    return public_file, secret_file
