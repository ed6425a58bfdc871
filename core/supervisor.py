"""The one process supervisor: every place that starts service processes (`flywheel up`, `flywheel demo`,
the tests and the benchmarks) starts them through `Supervisor`, and every such process calls
`child_setup()` (or `die_with_parent()`) first.

The contract:
- **Children die with their parent.** On Linux a child asks for the parent-death signal
  (`PR_SET_PDEATHSIG`, SIGTERM); a watcher thread in the child also polls its parent's pid, for the
  cases the signal misses (a parent on another OS, or a child whose parent died before it asked).
  A SIGKILLed supervisor therefore takes its whole tree down within about a second.
- **SIGINT or SIGTERM to the parent stops every child** within `stop_timeout_s` (8 s): SIGTERM to
  each, then SIGKILL to what is left. A child's SIGTERM raises `KeyboardInterrupt` in its main
  thread (`child_setup`), so its `finally` blocks run and its own children are stopped in turn.
- **A child that dies unasked is reported by name and exit code, and everything stops**: the
  supervisor logs the death, stops the other children and the parent exits non-zero
  (`exit_code()`). No restart: a process manager above (systemd, Kubernetes, a test) decides what
  follows, and a half-running loop (a gateway whose learner is dead) never looks healthy.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

PARENT_ENV = "FLYWHEEL_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_WATCH_S = 0.25


def _request_parent_death_signal(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d; relying on the parent watcher", ctypes.get_errno())


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """End this process when its parent dies: the parent-death signal plus a watcher thread.

    `parent_pid` is the supervisor's pid (from `FLYWHEEL_PARENT_PID` when the supervisor set it;
    the variable is removed so grandchildren do not inherit a stale one), else `os.getppid()`."""
    env_pid = os.environ.pop(PARENT_ENV, None)
    expected = parent_pid or (int(env_pid) if env_pid else os.getppid())
    _request_parent_death_signal(sig)
    if os.getppid() != expected:
        if not _alive(expected):  # the supervisor died before the signal was asked for
            os._exit(128 + sig)
        expected = os.getppid()  # a launcher in between (torchrun, a shell): it is the parent to follow

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(_WATCH_S)
        log.error("parent %d is gone; ending process %d", expected, os.getpid())
        os.kill(os.getpid(), sig)
        time.sleep(5.0)  # a graceful stop that hangs still ends
        os._exit(128 + sig)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def child_setup() -> None:
    """First call of a supervised service process: die with the parent, and let SIGTERM end the
    process the way Ctrl-C does (a `KeyboardInterrupt` in the main thread, so `finally` blocks run)."""
    die_with_parent()
    interrupt_on_sigterm()


def interrupt_on_sigterm() -> None:
    """For a supervisor's own main thread: SIGTERM (what a process manager sends) stops it as Ctrl-C
    does, so its `finally` stops the children. SIGINT is set to raise `KeyboardInterrupt` too: a
    process started in the background by a non-interactive shell inherits SIGINT ignored, and would
    otherwise not stop on it."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


@dataclass
class Child:
    """One supervised process."""

    name: str
    proc: subprocess.Popen
    log_path: Path | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n_bytes: int = 2000) -> str:
        """The end of the child's log (for error messages), led by its first error when that lies
        before the end: a process that fails usually logs more (its shutdown) after the cause."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        size = self.log_path.stat().st_size
        with open(self.log_path, "rb") as f:
            f.seek(max(0, size - n_bytes))
            end = f.read().decode(errors="replace")
            if size <= n_bytes:
                return end
            f.seek(0)
            first = first_error(f.read(size - n_bytes).decode(errors="replace"))
        return f"{first}\n[...]\n{end}" if first else end


def first_error(log_text: str, max_lines: int = 40) -> str:
    """The first traceback or ERROR/CRITICAL record in `log_text` and the lines after it (at most
    `max_lines`), or "" when there is none."""
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        starts = line.startswith(("Traceback (most recent call last)", "ERROR:"))
        if starts or " ERROR " in line or " CRITICAL " in line:
            return "\n".join(lines[i : i + max_lines])
    return ""


class ChildDied(RuntimeError):
    """A supervised process exited without being asked to."""

    def __init__(self, name: str, code: int, tail: str = ""):
        self.name, self.code = name, code
        super().__init__(f"{name} exited with code {code}" + (f"; its log:\n{tail}" if tail else ""))


class Supervisor:
    """Starts service processes, watches them, and stops them all (module docstring).

    `on_death(child)` runs in the watcher thread when a child dies unasked (after it is logged);
    the default stops every other child and interrupts the main thread, so the parent's `finally`
    runs and `exit_code()` is non-zero."""

    def __init__(self, name: str = "flywheel", stop_timeout_s: float = 8.0):
        self.name = name
        self.stop_timeout_s = stop_timeout_s
        self.children: dict[str, Child] = {}
        self.died: ChildDied | None = None
        self._stopping = False
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._on_death: Callable[[Child], None] | None = None

    # ---- starting ---------------------------------------------------------------------------------

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log_path: Path | None = None,
        stdout: Any = None,
        stdin: Any = None,
    ) -> Child:
        """Start `argv` as the child `name`. Its output goes to `log_path` (appended) when given, else
        to `stdout` (default: this process's). The child must call `child_setup()` to die with us.
        Call it from a thread that outlives the child (the main thread, or one kept for starting): on
        Linux the parent-death signal fires when the *thread* that started the child ends."""
        if name in self.children and self.children[name].alive():
            raise ValueError(f"a child named {name!r} is already running")
        full_env = dict(os.environ if env is None else env)
        full_env[PARENT_ENV] = str(os.getpid())
        out: Any = stdout
        log_file = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = open(log_path, "ab")  # noqa: SIM115 (open for the child's life)
            out = log_file
        proc = subprocess.Popen(
            list(argv),
            env=full_env,
            cwd=cwd,
            stdin=stdin,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
        )
        child = Child(name, proc, log_path, log_file)
        with self._lock:
            self.children[name] = child
        log.info("%s: started %s (pid %d)", self.name, name, proc.pid)
        return child

    def start_flywheel(self, name: str, command: Sequence[str], **kwargs: Any) -> Child:
        """Start `flywheel <command...>` with this interpreter (`python -m cli`)."""
        return self.start(name, [sys.executable, "-m", "cli", *command], **kwargs)

    # ---- watching ---------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise `ChildDied` for the first child that has exited unasked (the caller's poll)."""
        if self.died is not None:
            raise self.died
        for child in list(self.children.values()):
            code = child.returncode
            if code is not None and not self._stopping and self._record_death(child, code):
                assert self.died is not None
                raise self.died

    def _record_death(self, child: Child, code: int) -> bool:
        """Record `child`'s death as unasked, unless one is recorded already or the child was stopped or
        killed on purpose since the caller's snapshot of the children; whether it recorded it."""
        with self._lock:
            if self.died is not None or self.children.get(child.name) is not child:
                return False
            self.died = ChildDied(child.name, code, child.tail())
        log.error("%s: %s (pid %d) exited with code %d; stopping everything", self.name, child.name, child.pid, code)
        return True

    def watch(self, on_death: Callable[[Child], None] | None = None) -> None:
        """Watch the children in a thread; the first unasked death calls `on_death` (default: stop the
        other children, then interrupt this process's main thread)."""
        self._on_death = on_death or self._default_on_death
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_loop, name=f"{self.name}-watch", daemon=True)
            self._watcher.start()

    def _watch_loop(self) -> None:
        while not self._stopping:
            for child in list(self.children.values()):
                code = child.returncode
                if code is not None and not self._stopping and self._record_death(child, code):
                    assert self._on_death is not None
                    self._on_death(child)
                    return
            time.sleep(0.1)

    def _default_on_death(self, child: Child) -> None:
        self.stop()
        os.kill(os.getpid(), signal.SIGINT)

    def exit_code(self) -> int:
        """Non-zero when a child died unasked."""
        return 1 if self.died is not None else 0

    # ---- stopping ---------------------------------------------------------------------------------

    def stop_child(self, name: str, timeout_s: float | None = None) -> int | None:
        """Stop one child (SIGTERM, then SIGKILL after the timeout); its exit code."""
        child = self.children.pop(name, None)
        if child is None:
            return None
        self._terminate([child], self.stop_timeout_s if timeout_s is None else timeout_s)
        return child.returncode

    def kill_child(self, name: str) -> int | None:
        """SIGKILL one child on purpose (a crash, for a fault harness): nothing flushed, and not an
        unasked death; it is forgotten until started again. Its exit code (None: no such child)."""
        with self._lock:
            child = self.children.pop(name, None)
        if child is None:
            return None
        child.proc.kill()
        child.proc.wait()
        return child.returncode

    def stop(self, timeout_s: float | None = None, keep: tuple[str, ...] = ()) -> None:
        """Stop every child but those named in `keep`, all at once: SIGTERM to each, then SIGKILL to any
        still running after the timeout."""
        self._stopping = not keep
        with self._lock:
            children = [c for name, c in self.children.items() if name not in keep]
            self.children = {name: c for name, c in self.children.items() if name in keep}
        self._terminate(children, self.stop_timeout_s if timeout_s is None else timeout_s)

    def _terminate(self, children: list[Child], timeout_s: float) -> None:
        for c in children:
            if c.alive():
                try:
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for c in children:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s: %s (pid %d) did not stop in %.0f s; killing it", self.name, c.name, c.pid, timeout_s)
                c.proc.kill()
                c.proc.wait()
            if c._log is not None:
                c._log.close()
            log.info("%s: %s stopped (code %s)", self.name, c.name, c.returncode)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
