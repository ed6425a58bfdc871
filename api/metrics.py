"""Prometheus metrics of the gateway: requests, tokens and latency, labelled by model version.

One registry per app (tests build several apps in one process). Served at `/metrics` in the
Prometheus text format. `RequestCounter` is the ASGI middleware that counts requests; it is plain
ASGI (no `BaseHTTPMiddleware`, which costs a task and a memory stream per request).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "flywheel_requests",
            "HTTP requests by endpoint, status and model version",
            ["endpoint", "status", "model_version"],
            registry=r,
        )
        self.prompt_tokens = Counter("flywheel_prompt_tokens", "Prompt tokens processed", ["model_version"], registry=r)
        self.completion_tokens = Counter(
            "flywheel_completion_tokens", "Tokens generated", ["model_version"], registry=r
        )
        self.latency = Histogram(
            "flywheel_request_latency_seconds",
            "End-to-end request latency",
            ["endpoint", "model_version"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "flywheel_time_to_first_token_seconds",
            "Time to first generated token",
            ["model_version"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.records = Counter(
            "flywheel_completion_records", "Completion records made durable", ["model_version"], registry=r
        )
        self.record_batches = Counter(
            "flywheel_completion_record_batches",
            "Group commits of completion records: one bus append and one index insert each",
            registry=r,
        )
        self.feedback_events = Counter(
            "flywheel_feedback_events", "Feedback events by outcome (accepted, duplicate)", ["outcome"], registry=r
        )
        self.canary_lapses = Counter(
            "flywheel_canary_lapses", "Canaries routed to nobody because no gate held a live lease", registry=r
        )
        self.lending_replicas: Gauge | None = None  # made when lending is on (`set_lending`)
        self.lending_totals: Gauge | None = None
        self.rate_limited = Counter(
            "flywheel_rate_limited", "Requests refused by a per-key rate limit (429), by route", ["route"], registry=r
        )
        self.canary_lapsed = Gauge(
            "flywheel_canary_lapsed", "1 while the canary is lapsed (no live gate lease), else 0", registry=r
        )
        self.bus_watermark_lag = Gauge(
            "flywheel_bus_watermark_lag_seconds",
            "How far this gateway's bus watermark is behind now: its oldest record not yet on the bus",
            registry=r,
        )

    def set_lending(self, states: Mapping[str, str], counters: Mapping[str, float]) -> None:
        """The lending loop's replica states and totals (`api.lending.LendingLoop.counters`)."""
        if self.lending_replicas is None:
            r = self.registry
            self.lending_replicas = Gauge(
                "flywheel_lending_replicas", "Replicas by lending state: serving, draining, lent", ["state"], registry=r
            )
            self.lending_totals = Gauge(
                "flywheel_lending_total",
                "Lending since the gateway started: lends, reclaims, panics, lent_seconds (replica-seconds), "
                "rollouts recorded, preempted shard runs",
                ["what"],
                registry=r,
            )
        for state in ("serving", "draining", "lent"):
            self.lending_replicas.labels(state).set(sum(s == state for s in states.values()))
        assert self.lending_totals is not None
        for k, v in counters.items():
            self.lending_totals.labels(k).set(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware: `requests{endpoint, status, model_version}` for every HTTP request that
    matched a route and got a response, once the response has started.

    `endpoint` is the route's path template, `model_version` the response's `version_header` (empty
    when absent); the metrics are those of the app's gateway (`app.state.gateway.metrics`), so
    nothing is counted before start-up has built it.
    """

    def __init__(self, app: Any, version_header: str):
        self.app = app
        self.version_header = version_header.lower().encode("latin-1")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, version = 0, ""

        async def send_and_see(message: dict) -> None:
            nonlocal status, version
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() == self.version_header:
                        version = value.decode("latin-1")
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            route = scope.get("route")
            gw = getattr(scope["app"].state, "gateway", None) if "app" in scope else None
            if status and route is not None and gw is not None:
                gw.metrics.requests.labels(getattr(route, "path", "?"), str(status), version).inc()
