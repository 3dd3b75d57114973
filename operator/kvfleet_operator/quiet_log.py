"""kopf logs "Handler 'X' succeeded." at INFO after every handler call. For the watch-event handlers
(``kopf.on.event``: one call per watch event of every InferenceService and child) that is most of the
operator's log at scale: 5,000 of its 9,000 lines while 1,000 InferenceServices are created, each line
formatted and written on the event loop. Those lines are demoted to DEBUG (shown with ``--verbose``);
the reconcile handler's own success and failure lines, and every warning and error, stay as they are."""
from __future__ import annotations

import logging
from collections.abc import Iterable

KOPF_OBJECTS = "kopf.objects"  # the logger of kopf's per-object messages


class DemoteWatchSuccess(logging.Filter):
    """Filter on ``kopf.objects``: "Handler '<id>' succeeded." for ``handler_ids`` becomes a DEBUG record
    (dropped unless the logger is enabled for DEBUG)."""

    def __init__(self, handler_ids: Iterable[str]):
        super().__init__()
        self.messages = frozenset(f"Handler {i!r} succeeded." for i in handler_ids)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not isinstance(record.msg, str) or record.msg not in self.messages:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def install(handler_ids: Iterable[str]) -> DemoteWatchSuccess:
    """Put the filter on kopf's per-object logger, replacing one installed before (idempotent)."""
    logger = logging.getLogger(KOPF_OBJECTS)
    for old in [f for f in logger.filters if isinstance(f, DemoteWatchSuccess)]:
        logger.removeFilter(old)
    new = DemoteWatchSuccess(handler_ids)
    logger.addFilter(new)
    return new
