"""Prometheus metrics of the gateway: requests, tokens and latency, labelled by model version.

One registry per app (tests build several apps in one process). Served at `/metrics` in the
Prometheus text format.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("flywheel_requests", "HTTP requests by endpoint, status and model version",
                                ["endpoint", "status", "model_version"], registry=r)
        self.prompt_tokens = Counter("flywheel_prompt_tokens", "Prompt tokens processed", ["model_version"],
                                     registry=r)
        self.completion_tokens = Counter("flywheel_completion_tokens", "Tokens generated", ["model_version"],
                                         registry=r)
        self.latency = Histogram("flywheel_request_latency_seconds", "End-to-end request latency",
                                 ["endpoint", "model_version"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("flywheel_time_to_first_token_seconds", "Time to first generated token",
                              ["model_version"], buckets=_LATENCY_BUCKETS, registry=r)
        self.records = Counter("flywheel_completion_records", "Completion records made durable",
                               ["model_version"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
