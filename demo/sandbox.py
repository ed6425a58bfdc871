"""Runs untrusted, model-generated code in a separate, hardened process.

Called by `demo.checker` (and anything else that must execute completions). One call runs a whole
batch in ONE child process, for speed; the child is `python -I -S`, with an empty environment, a
fresh temporary working directory and, where `unshare --net` works, no network namespace at all.

Inside the child, before any user code runs:
  * resource limits: CPU seconds, 512 MiB address space, no file writes (RLIMIT_FSIZE=0), few file
    descriptors, no new processes, no core dumps;
  * an audit hook (`sys.addaudithook`) that refuses sockets, subprocesses, fork/exec/spawn/system,
    writing opens, filesystem changes (remove/rename/mkdir/...), ctypes and raising the limits.
    A refused action fails the item with error "blocked: <what> (<event>)" even if the user code
    catches the exception;
  * fd 1 and 2 point at /dev/null and sys.stdout/sys.stderr at throw-away buffers, so user prints
    never reach the protocol; results go back as JSON lines, prefixed with a random marker, on a
    private duplicate of the original stdout.

Time limits: each item (defining `f` and all its calls) has `timeout_s`, enforced in the child with
a repeating SIGALRM timer. As a backstop, the parent waits at most `timeout_s + grace` for each
result; a child that hangs (a C-level loop, a swallowed alarm) or dies is killed, its current item
gets error "timeout" (or "crashed: ..."), and a fresh child continues with the remaining items.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

MEMORY_LIMIT_BYTES = 512 * 1024 * 1024
# Interpreter start-up, before the first item's clock starts. Generous: a child that dies says so at
# once (its pipe closes); this only bounds one that is alive and silent, and a niced checker on a loaded
# machine (the gate beside live traffic, a benchmark beside the suite) was seen to take over 10 s.
_STARTUP_TIMEOUT_S = 60.0
_GRACE_S = 0.5  # parent-side slack on top of the in-child per-item timer


@dataclass
class ExecResult:
    """The outcome of one item: its source defined `f` and `f` was called once per args tuple."""

    ok: bool
    """True iff the source loaded and every call returned a JSON-serialisable value."""
    results: list | None
    """JSON-normalised return values (tuples become lists), one per call, None where a call failed;
    None as a whole when the source did not load (SyntaxError, timeout, blocked, crash)."""
    error: str | None
    """The item-level error, else the first call's error: "timeout", "SyntaxError: ...",
    "blocked: network (socket.__new__)", "crashed: exit code -9", ..."""
    call_errors: list[str | None] = field(default_factory=list)
    """Per-call errors, parallel to `results` (empty when the source did not load)."""


# The child program. It reads {"marker", "timeout", "items"} as JSON from stdin.
_CHILD_SOURCE = r"""
import builtins, io, json, os, resource, signal, sys

def main():
    if sys.platform.startswith("linux"):  # die with the process that asked (PR_SET_PDEATHSIG, SIGKILL)
        import ctypes
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)
    payload = json.loads(sys.stdin.buffer.read())
    if os.getppid() != payload["parent"]:  # it died before the signal was asked for
        os._exit(137)
    marker, timeout, items = payload["marker"], payload["timeout"], payload["items"]
    out_fd = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.close(devnull)

    def emit(obj):
        data = (marker + json.dumps(obj) + "\n").encode()
        while data:
            data = data[os.write(out_fd, data):]

    cpu = int(timeout * len(items)) + 5
    for limit, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (payload["memory"], payload["memory"])),
        (resource.RLIMIT_FSIZE, (0, 0)),
        (resource.RLIMIT_NOFILE, (32, 32)),
        (resource.RLIMIT_NPROC, (0, 0)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(limit, value)

    class Blocked(Exception):
        pass

    class Timeout(BaseException):
        pass

    blocked_prefixes = (
        ("socket.", "network"), ("urllib.", "network"), ("http.", "network"), ("ftplib.", "network"),
        ("subprocess.", "process"), ("os.system", "process"), ("os.exec", "process"),
        ("os.posix_spawn", "process"), ("os.spawn", "process"), ("os.fork", "process"),
        ("os.kill", "process"), ("pty.", "process"),
        ("os.remove", "filesystem"), ("os.rename", "filesystem"), ("os.rmdir", "filesystem"),
        ("os.mkdir", "filesystem"), ("os.symlink", "filesystem"), ("os.link", "filesystem"),
        ("os.chmod", "filesystem"), ("os.chown", "filesystem"), ("os.truncate", "filesystem"),
        ("os.utime", "filesystem"), ("shutil.", "filesystem"),
        ("ctypes.", "native code"), ("resource.", "limits"), ("sys.addaudithook", "audit"),
    )
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    violations = []

    def audit(event, args):
        what = None
        if event == "open":
            mode = args[1] if len(args) > 1 else None
            flags = args[2] if len(args) > 2 else 0
            if (isinstance(mode, str) and any(ch in mode for ch in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            ):
                what = "file write"
        else:
            for prefix, kind in blocked_prefixes:
                if event.startswith(prefix):
                    what = kind
                    break
        if what is not None:
            message = "blocked: %s (%s)" % (what, event)
            violations.append(message)
            raise Blocked(message)

    def on_alarm(signum, frame):
        raise Timeout()

    def describe(exc):
        if isinstance(exc, Blocked):
            return str(exc)
        try:
            text = str(exc)
        except BaseException:
            text = "<unprintable>"
        return type(exc).__name__ + (": " + text if text else "")

    signal.signal(signal.SIGALRM, on_alarm)
    emit({"ready": True})
    sys.addaudithook(audit)

    for index, (source, calls) in enumerate(items):
        del violations[:]
        sys.stdin, sys.stdout, sys.stderr = io.StringIO(), io.StringIO(), io.StringIO()
        values, errors, error, loaded, done = [None] * len(calls), [None] * len(calls), None, False, 0
        # Repeats every 0.1 s, so code that swallows one alarm still gets the next one.
        signal.setitimer(signal.ITIMER_REAL, timeout, 0.1)
        try:
            try:
                namespace = {"__name__": "__sandbox__", "__builtins__": builtins}
                exec(compile(source, "<completion>", "exec"), namespace)
                if not callable(namespace.get("f")):
                    raise NameError("the source does not define a function f")
                fn, loaded = namespace["f"], True
                for j, args in enumerate(calls):
                    try:
                        values[j] = fn(*args)
                    except Timeout:
                        raise
                    except BaseException as exc:
                        errors[j] = describe(exc)
                    done += 1
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except Timeout:
            error = "timeout"
            errors[done:] = ["timeout"] * (len(calls) - done)
        except BaseException as exc:
            error = describe(exc)
        for j, value in enumerate(values):
            if errors[j] is None:
                try:
                    text = json.dumps(value)
                except (TypeError, ValueError, RecursionError) as exc:
                    errors[j], values[j] = "unserialisable result: " + describe(exc), None
                else:
                    if len(text) > 100000:
                        errors[j], values[j] = "result too large", None
        if violations:
            error = violations[0]
        emit({"i": index, "values": values if loaded else None, "errors": errors if loaded else [],
              "error": error})

main()
"""


@functools.lru_cache(maxsize=1)
def network_isolation_prefix() -> tuple[str, ...]:
    """The `unshare` command prefix that gives the child an empty network namespace, or () if none
    works here (checked once: plain `--net` as root, else an unprivileged user namespace)."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    true_exe = shutil.which("true") or "/bin/true"
    for flags in (("--net",), ("--user", "--map-root-user", "--net")):
        try:
            done = subprocess.run([exe, *flags, true_exe], capture_output=True, timeout=5, check=False)
        except (OSError, subprocess.TimeoutExpired):  # deliberate: fall back to the next variant
            continue
        if done.returncode == 0:
            return (exe, *flags)
    return ()


def run_functions(items: list[tuple[str, list[tuple]]], timeout_s: float = 1.0) -> list[ExecResult]:
    """Run each (source defining `f`, args tuples) item; one ExecResult per item, in order."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    normalised = [(source, [list(args) for args in calls]) for source, calls in items]
    results: list[ExecResult] = []
    while len(results) < len(normalised):
        # Each child run makes progress: it finishes items, and the item it died on gets an error.
        results.extend(_run_child(normalised[len(results) :], timeout_s))
    return results


def _run_child(items: list[tuple[str, list[list]]], timeout_s: float) -> list[ExecResult]:
    """Run `items` in one child until they are done or it hangs/dies; results for a prefix (>= 1)."""
    marker = secrets.token_hex(8)
    payload = json.dumps(
        {"marker": marker, "timeout": timeout_s, "memory": MEMORY_LIMIT_BYTES, "items": items, "parent": os.getpid()}
    ).encode()
    command = [*network_isolation_prefix(), sys.executable, "-I", "-S", "-c", _CHILD_SOURCE]
    with tempfile.TemporaryDirectory(prefix="demo-sandbox-") as workdir:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=workdir,
            env={},
            start_new_session=True,
        )
        try:
            return _talk(proc, payload, marker, len(items), timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: only the child we started
            proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None and not stream.closed:
                    stream.close()


def _talk(proc: subprocess.Popen, payload: bytes, marker: str, n_items: int, timeout_s: float) -> list[ExecResult]:
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        proc.stdin.write(payload)
        proc.stdin.close()
    except BrokenPipeError:  # the child died at start-up; reported below, with its stderr
        pass
    reader = _LineReader(proc.stdout.fileno(), marker.encode())
    ready = reader.read(time.monotonic() + _STARTUP_TIMEOUT_S)
    if not isinstance(ready, dict) or not ready.get("ready"):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        stderr = proc.stderr.read().decode(errors="replace")[-2000:]
        raise RuntimeError(f"sandbox child failed to start (exit code {proc.returncode}): {stderr}")

    results: list[ExecResult] = []
    while len(results) < n_items:
        message = reader.read(time.monotonic() + timeout_s + _GRACE_S)
        if message is None:  # hung or died in the middle of an item: blame that item, stop here
            results.append(ExecResult(ok=False, results=None, error=_failure(proc, reader.eof)))
            return results
        assert message["i"] == len(results), message
        call_errors = message["errors"]
        error = message["error"] or next((e for e in call_errors if e is not None), None)
        results.append(ExecResult(ok=error is None, results=message["values"], error=error, call_errors=call_errors))
    return results


def _failure(proc: subprocess.Popen, eof: bool) -> str:
    """Why the child stopped answering: "timeout" (hung, or killed by the CPU limit) or a crash."""
    if eof:  # it closed the result pipe; normally because it exited
        try:
            code = proc.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:  # deliberate: alive but mute, handled as a crash below
            os.killpg(proc.pid, signal.SIGKILL)
            return "crashed: closed the result pipe"
        return "timeout" if code in (-signal.SIGXCPU, -signal.SIGKILL) else f"crashed: exit code {code}"
    os.killpg(proc.pid, signal.SIGKILL)
    return "timeout"


class _LineReader:
    """Reads marker-prefixed JSON lines from a pipe with a deadline; other lines are ignored."""

    def __init__(self, fd: int, marker: bytes):
        self.fd, self.marker, self.buffer, self.eof = fd, marker, b"", False
        self.poller = select.poll()  # not select.select: a busy server may hold fds above 1024
        self.poller.register(fd, select.POLLIN)

    def read(self, deadline: float) -> dict | None:
        """The next message, or None on EOF or when `deadline` (time.monotonic) passes first."""
        while True:
            line, newline, rest = self.buffer.partition(b"\n")
            if newline:
                self.buffer = rest
                if line.startswith(self.marker):
                    return json.loads(line[len(self.marker) :])
                continue
            remaining = deadline - time.monotonic()
            if self.eof or remaining <= 0:
                return None
            if self.poller.poll(remaining * 1000):
                chunk = os.read(self.fd, 1 << 16)
                self.eof = not chunk
                self.buffer += chunk
