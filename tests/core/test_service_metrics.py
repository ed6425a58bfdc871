"""A service's consumed/produced counters: logged at most every interval, written as a Prometheus text
file, and several services' files merged into one valid exposition for the gateway's /metrics."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.service_metrics import ServiceMetrics, read_folder


def test_counts_are_logged_every_interval_and_written_as_a_metrics_file(tmp_path, caplog):
    now = [0.0]
    m = ServiceMetrics("learner", tmp_path, interval_s=30, clock=lambda: now[0])
    m.consume("flywheel.samples", 5)
    m.produce("flywheel.dead_letter")
    m.set_stats({"dropped_stale": 2})
    with caplog.at_level(logging.INFO, logger="flywheel.service"):
        assert m.report()
        m.consume("flywheel.samples", 3)
        now[0] = 10.0
        assert not m.report()  # within the interval: nothing
        now[0] = 31.0
        assert m.report()
    assert "learner: consumed 5 (+5)" in caplog.messages[0] and "consumed 8 (+3)" in caplog.messages[1]
    families = {f.name: f for f in text_string_to_metric_families((tmp_path / "learner.prom").read_text())}
    consumed = families["flywheel_service_consumed_records"].samples
    assert [(s.labels, s.value) for s in consumed if s.name.endswith("_total")] == [
        ({"service": "learner", "topic": "flywheel.samples"}, 8.0)
    ]
    assert families["flywheel_service_stat"].samples[0].value == 2.0


def test_several_services_merge_into_one_exposition(tmp_path):
    for name, n in (("joiner", 4), ("gate", 7)):
        m = ServiceMetrics(name, tmp_path, interval_s=0)
        m.consume("flywheel.samples", n)
        m.report()
    (tmp_path / "broken.prom").write_text("this is { not metrics")
    text = read_folder(tmp_path).decode()
    assert text.count("# TYPE flywheel_service_consumed_records_total counter") == 1
    totals = {
        s.labels["service"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "flywheel_service_consumed_records_total"
    }
    assert totals == {"joiner": 4.0, "gate": 7.0}
    assert read_folder(tmp_path / "none") == b""


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="service name"):
        ServiceMetrics("a b")
