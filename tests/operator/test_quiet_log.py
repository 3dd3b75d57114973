"""kopf's "Handler 'X' succeeded." for the watch-event handlers (one per watch event: most of the log
at scale) is DEBUG, shown with --verbose; the reconcile's own success line stays INFO."""
from __future__ import annotations

import logging

import kopf

from kmock_support import running_operator
from kvfleet_operator import handlers, quiet_log
from test_observed import AV, PL
from test_status_truth import _condition, _sample


def _record(msg: str) -> logging.LogRecord:
    return logging.LogRecord(quiet_log.KOPF_OBJECTS, logging.INFO, __file__, 1, msg, (), None)


def test_a_watch_handlers_success_is_dropped_at_info_and_kept_as_debug_with_verbose():
    f = quiet_log.DemoteWatchSuccess(["isvc_event"])
    logger = logging.getLogger(quiet_log.KOPF_OBJECTS)
    old = logger.level
    try:
        logger.setLevel(logging.INFO)
        watch, rec = _record("Handler 'isvc_event' succeeded."), _record("Handler 'reconcile' succeeded.")
        assert not f.filter(watch) and watch.levelno == logging.DEBUG and watch.levelname == "DEBUG"
        assert f.filter(rec) and rec.levelno == logging.INFO
        failed = _record("Handler 'isvc_event' failed with an exception and will try again in 60 seconds: x")
        assert f.filter(failed) and failed.levelno == logging.INFO
        assert f.filter(logging.LogRecord(quiet_log.KOPF_OBJECTS, logging.INFO, __file__, 1, {"a": 1}, (), None))
        logger.setLevel(logging.DEBUG)
        assert f.filter(_record("Handler 'isvc_event' succeeded."))
    finally:
        logger.setLevel(old)


def test_every_watch_handler_is_named():
    """A new ``kopf.on.event`` handler is demoted too (WATCH_HANDLERS is the registry's list)."""
    registered = {h.id for h in kopf.get_default_registry()._watching.get_all_handlers()}
    assert registered == set(handlers.WATCH_HANDLERS)


async def test_the_running_operator_logs_the_reconcile_at_info_and_watch_events_at_debug(api, emulator, caplog):
    caplog.set_level(logging.DEBUG, quiet_log.KOPF_OBJECTS)
    async with running_operator():
        await api.create(AV, PL, "default", _sample("logged", replicas=1))
        await _condition(api, "logged", "Ready", status="False")
    levels = {(r.getMessage(), r.levelno) for r in caplog.records if r.name == quiet_log.KOPF_OBJECTS}
    assert ("Handler 'reconcile' succeeded.", logging.INFO) in levels
    assert ("Handler 'isvc_event' succeeded.", logging.DEBUG) in levels
    assert ("Handler 'deployment_event' succeeded.", logging.DEBUG) in levels
    assert not any(m.startswith("Handler '") and m.endswith("_event' succeeded.") and lv == logging.INFO
                   for m, lv in levels)
