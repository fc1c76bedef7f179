"""The package's version, alone in a module of its own: every layer may import it (the wire says it
in its greeting, a worker logs it) without importing the package's face. pyproject.toml reads it
from here without importing anything."""

__version__ = "0.1.0"
