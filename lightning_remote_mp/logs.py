"""Where lrmp's messages show when Lightning drives the run: where Lightning's own do.

Lightning prints its INFO messages ("GPU available: ...") without any logging set-up: its
``lightning.pytorch`` logger is at INFO and has a stderr handler unless the root logger had one
first. lrmp's messages (which layers went where, the local workers it started, the predicted stage
times, its warnings) belong to the same run, so once ``lightning.pytorch`` is imported:

- the ``lightning_remote_mp`` logger takes its level from ``lightning.pytorch`` unless it has one of
  its own: ``logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)`` quiets both, and
  ``logging.getLogger("lightning_remote_mp").setLevel(...)`` sets lrmp's alone;
- each record is shown once: by the root logger's handlers when the program configured logging
  (``logging.basicConfig``, before or after importing Lightning), else where Lightning's own go.

The ``lrmp-worker`` process never imports Lightning and keeps its own set-up (``--log-level``).

>>> import logging
>>> follow_lightning()
>>> logging.getLogger("lightning_remote_mp").parent.name
'lightning.pytorch'
"""

from __future__ import annotations

import logging

LOGGER = "lightning_remote_mp"
LIGHTNING_LOGGER = "lightning.pytorch"


class _ShowOnce(logging.Handler):
    """Passes a record to the root logger's handlers if there are any, else to Lightning's logger's.

    Deciding per record, not at import, keeps a ``basicConfig`` made after ``import lightning``
    from printing each line twice. Handlers attached to our logger itself have had the record
    already (pytest attaches its capture handlers to every non-propagating logger), so they are skipped.
    """

    def emit(self, record: logging.LogRecord) -> None:
        root = logging.getLogger()
        handlers = _handlers_up_from(root if root.handlers else logging.getLogger(LIGHTNING_LOGGER))
        if not handlers and logging.lastResort is not None:
            handlers = [logging.lastResort]  # no handler anywhere: warnings still reach stderr, as without us
        called = logging.getLogger(LOGGER).handlers
        for handler in handlers:
            if handler not in called and record.levelno >= handler.level:
                handler.handle(record)


def _handlers_up_from(logger: logging.Logger | None) -> list[logging.Handler]:
    """The handlers a record logged at ``logger`` reaches, found as ``logging.Logger.callHandlers`` does."""
    found: list[logging.Handler] = []
    while logger is not None:
        found += logger.handlers
        logger = logger.parent if logger.propagate else None
    return found


def follow_lightning() -> None:
    """Show lrmp's messages as Lightning's are shown (module docstring). Safe to call again."""
    logger = logging.getLogger(LOGGER)
    if any(isinstance(h, _ShowOnce) for h in logger.handlers):
        return
    # The parent supplies the level when ours is unset; propagation stops here and _ShowOnce
    # picks the handlers instead, so the parent's handlers are not also called.
    logger.parent = logging.getLogger(LIGHTNING_LOGGER)
    logger.propagate = False
    logger.addHandler(_ShowOnce())
    logger.setLevel(logger.level)  # clears the loggers' cached levels, which the new parent changes
