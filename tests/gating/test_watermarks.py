"""The producers' bus watermarks in the registry (`registry.watermarks`), on SQLite and PostgreSQL
(test_registry.py's fixtures), and the gateway's report of its own (`api.main.report_watermarks`)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from api.main import report_watermarks
from api.metrics import Metrics
from feedback.ingest import InFlight
from registry.models import utcnow
from tests.gating.test_registry import pg_database, reg, url  # noqa: F401


def test_the_bus_watermark_is_the_smallest_of_the_live_producers(reg):
    t0 = utcnow()
    reg.report_watermark("g1", 100.0, at=t0)
    reg.report_watermark("g2", 90.0, at=t0)
    reg.report_watermark("g1", 120.0, at=t0 + timedelta(seconds=1))  # one row per producer
    w = reg.bus_watermark(60.0, now=t0 + timedelta(seconds=2))
    assert (w.value, w.live, w.stale) == (90.0, ("g1", "g2"), ())
    w = reg.bus_watermark(60.0, now=t0 + timedelta(seconds=60.5))  # g2 silent for 60.5 s: not waited for
    assert (w.value, w.live, w.stale) == (120.0, ("g1",), ("g2",))
    assert reg.bus_watermark(1.0, now=t0 + timedelta(seconds=90)).value is None
    assert reg.forget_stale_producers(now=t0 + timedelta(days=2)) == 2 and reg.watermarks() == []
    for bad, match in (("", "producer_id"), ("x" * 129, "producer_id")):
        with pytest.raises(ValueError, match=match):
            reg.report_watermark(bad, 1.0)
    with pytest.raises(ValueError, match="finite"):
        reg.report_watermark("g1", float("nan"))


def test_the_gateway_reports_the_oldest_of_what_it_holds(reg):
    """Nothing held: about now. A feedback request being accepted, or a record waiting in the spool,
    holds the watermark at its time."""
    pending = {"at": None}
    gw = SimpleNamespace(
        settings=SimpleNamespace(gateway_id="gw-a", heartbeat_s=0.02),
        in_flight=InFlight(),
        bus=SimpleNamespace(pending_since=lambda: pending["at"]),
        registry=reg,
        metrics=Metrics(),
    )
    stop = threading.Event()
    t = threading.Thread(target=report_watermarks, args=(gw, stop), daemon=True)
    t.start()
    try:

        def mark() -> float:
            time.sleep(0.1)
            return next(w.watermark for w in reg.watermarks() if w.producer_id == "gw-a")

        before = time.time()
        assert mark() >= before
        with gw.in_flight.hold(before - 30.0):
            assert mark() == before - 30.0
        pending["at"] = before - 10.0
        assert mark() == before - 10.0
        pending["at"] = None
        assert mark() >= before
    finally:
        stop.set()
        t.join(5)
