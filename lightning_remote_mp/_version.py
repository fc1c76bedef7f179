"""The package's version, alone in a module of its own: every layer may import it (the wire says it
in its greeting, a worker logs it) without importing the package's face. pyproject.toml reads it
from here without importing anything."""

# 0.MINOR.PATCH before 1.0: MINOR is the wire protocol's version, PATCH counts releases that keep it
# (the policy is at the top of CHANGELOG.md, whose newest heading names this version).
__version__ = "0.18.0"
