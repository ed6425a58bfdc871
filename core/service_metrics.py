"""What a background service (joiner, learner, gate) consumed and produced: logged and exposed as metrics.

`ServiceMetrics(service, folder)` holds Prometheus counters in a registry of its own:
`flywheel_service_consumed_records_total{service, topic}`, `..._produced_records_total{service, topic}`
and `flywheel_service_stat{service, name}` (a service's own numbers: samples dropped as stale, batches
quarantined, alerts raised...). `report()` (called every round; acts at most every `interval_s`) logs one
line with the totals and the change since the last line, and writes `<folder>/<service>.prom`
atomically in the Prometheus text format: the gateway's `/metrics` includes every such file of its
home, and in production node_exporter's textfile collector reads the same folder. A service that logs
"consumed 0" for a minute is waiting for input, visibly, instead of sitting silent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from core.files import atomic_write

log = logging.getLogger("flywheel.service")
SUFFIX = ".prom"


class ServiceMetrics:
    def __init__(
        self,
        service: str,
        folder: str | Path | None = None,
        interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not service or not service.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"service name {service!r} must be letters, digits, '-' or '_'")
        if not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.service, self.interval_s, self.clock = service, interval_s, clock
        self.path = None if folder is None else Path(folder) / f"{service}{SUFFIX}"
        self.registry = CollectorRegistry()
        labels = ["service", "topic"]
        self._consumed = Counter(
            "flywheel_service_consumed_records", "Bus records a service consumed", labels, registry=self.registry
        )
        self._produced = Counter(
            "flywheel_service_produced_records", "Bus records a service produced", labels, registry=self.registry
        )
        self._stat = Gauge(
            "flywheel_service_stat", "A service's own counts", ["service", "name"], registry=self.registry
        )
        self.consumed: dict[str, int] = {}
        self.produced: dict[str, int] = {}
        self.stats: dict[str, float] = {}
        self._last_report = -float("inf")
        self._last_totals: tuple[int, int] = (0, 0)

    def consume(self, topic: str, n: int = 1) -> None:
        if n:
            self.consumed[topic] = self.consumed.get(topic, 0) + n
            self._consumed.labels(self.service, topic).inc(n)

    def produce(self, topic: str, n: int = 1) -> None:
        if n:
            self.produced[topic] = self.produced.get(topic, 0) + n
            self._produced.labels(self.service, topic).inc(n)

    def set_stats(self, stats: Mapping[str, float]) -> None:
        for name, value in stats.items():
            self.stats[name] = float(value)
            self._stat.labels(self.service, name).set(float(value))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def report(self, force: bool = False) -> bool:
        """Log the totals and write the metrics file, at most every `interval_s` unless `force`.
        True if it reported."""
        now = self.clock()
        if not force and now - self._last_report < self.interval_s:
            return False
        self._last_report = now
        totals = (sum(self.consumed.values()), sum(self.produced.values()))
        delta = (totals[0] - self._last_totals[0], totals[1] - self._last_totals[1])
        self._last_totals = totals
        log.info(
            "%s: consumed %d (+%d) %s; produced %d (+%d) %s",
            self.service,
            totals[0],
            delta[0],
            dict(sorted(self.consumed.items())),
            totals[1],
            delta[1],
            dict(sorted(self.produced.items())),
        )
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, self.render(), fsync=False)  # metrics: the latest is enough
        return True


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def read_folder(folder: str | Path) -> bytes:
    """Every service's metrics file in `folder`, merged into one exposition (for the gateway's
    `/metrics`: a family's samples of several services under one HELP and TYPE, as Prometheus needs)."""
    folder = Path(folder)
    merged: dict[str, Metric] = {}
    for path in sorted(folder.glob(f"*{SUFFIX}")) if folder.is_dir() else ():
        try:
            families = list(text_string_to_metric_families(path.read_text()))
        except (OSError, ValueError) as e:  # a file being replaced, or not ours: skipped, said
            log.warning("metrics file %s skipped: %r", path, e)
            continue
        for fam in families:
            if fam.name in merged:
                merged[fam.name].samples.extend(fam.samples)
            else:
                merged[fam.name] = fam
    if not merged:
        return b""
    registry = CollectorRegistry()
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)
