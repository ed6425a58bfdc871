"""The producer-side spool: never lose an event, never block the caller on the broker.

Owns `<folder>/log/` (a `feedback.log.DurableLog` of spooled records) on the producer's side.
`Spool.publish()` returns once the record is fsynced in the local log — it never waits for the
broker. A forwarder (`feedback.forwarder.Forwarder`) reads the log in order and hands batches to the
destination, so records of one key reach the broker in publish order; it owns `forwarded.json` (how
far the log has been delivered, replaced atomically after every delivered batch) and deletes
delivered segments. For Kafka (`feedback.bus_kafka.KafkaBus`) the forwarder is a process of its own
(`ProcessTarget`): kafka-python's producer then does not compete with the gateway's request
handlers for the interpreter lock. A plain `deliver` callable (tests, in-process destinations) runs
the same forwarder on a thread. Either way the spool talks to it over one socket pair (see
`feedback.forwarder` for the messages): it announces what is durable, and hears what was delivered.
The forwarder starts with the first publish (or at opening, when records wait): a bus that only
consumes never starts one.

A failure of the delivery that the destination calls retriable (broker down, slow, restarting) is
logged and retried with capped exponential backoff, forever; anything else kills the forwarder
loudly: the error is logged and kept, `healthy` turns False and `flush()` raises it (records stay
spooled; a new `Spool` on the folder resumes them). A forwarder process that vanishes (killed, out
of memory) is started again, after a backoff, and resumes from the saved position; `healthy` is
False until it is back. The forwarder process exits when the spool is closed or its process ends.

Delivery is at-least-once: a crash after the broker acknowledged a batch and before the position
was saved delivers that batch again, and producer retries can repeat records. Consumers drop
repeats by `event_id` with `Deduper`.

Called by `feedback.bus_kafka.KafkaBus` (publish path) and by the consumers (`Deduper`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from feedback.events import json_str
from feedback.log import DurableLog, settle

log = logging.getLogger(__name__)

SPOOL_SEGMENT_BYTES = 4 << 20  # small segments: forwarded ones are deleted, reads stay cheap
# Spool -> forwarder messages: (op, value), 9 bytes each.
COMMAND = struct.Struct("<BQ")
SPOOLED, HOLD, RELEASE, STOP = 1, 2, 3, 4  # SPOOLED n: records below n are durable; HOLD n: hold number n


@dataclass(frozen=True)
class SpooledRecord:
    offset: int  # position in the spool (dense, from 0, survives restarts)
    topic: str
    key: str
    value: bytes


Deliver = Callable[[list[SpooledRecord]], None]


@dataclass(frozen=True)
class ProcessTarget:
    """A destination built inside a forwarder process: `factory` ("module:function") is called
    there with `kwargs` (JSON values) and returns an object with `deliver(batch)`, `retriable`
    (exception types to retry) and `close()` (`feedback.forwarder.Target`)."""

    factory: str
    kwargs: dict[str, Any] = field(default_factory=dict)


class _CallableTarget:
    def __init__(self, deliver: Deliver, retriable: tuple[type[BaseException], ...]):
        self.deliver, self.retriable = deliver, retriable

    def close(self) -> None:
        pass


class Deduper:
    """Bounded memory of recently seen event ids (an LRU): `seen(id)` is True for a repeat.

    A repeat arrives soon after the original (a re-forwarded batch, a redelivered partition), so a
    window of the last `capacity` ids catches them; ~100 bytes per id, ~100 MB at the default 1M.
    """

    def __init__(self, capacity: int = 1_000_000):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def seen(self, event_id: str) -> bool:
        if event_id in self._ids:
            self._ids.move_to_end(event_id)
            return True
        self._ids[event_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return False

    def __len__(self) -> int:
        return len(self._ids)


def read_position(path: Path) -> int:
    """How far the spool was forwarded: `forwarded.json`, written by the forwarder (0 before that,
    and 0 when a power cut left it empty or torn: the forwarder then resumes at its first segment)."""
    try:
        return int(json.loads(path.read_text())["forwarded"])
    except FileNotFoundError:
        return 0
    except (ValueError, KeyError, TypeError):
        log.warning("spool: %s is unreadable; taking position 0", path)
        return 0




def encode(topic: str, key: str, value: bytes) -> bytes:
    """`json.dumps([topic, key])`, a newline (escaped in the header), the value; the header is built
    directly (json.dumps of a list goes through the slow path: 3 us of 5 per spooled record)."""
    return f"[{json_str(topic)}, {json_str(key)}]\n".encode() + value


def decode(offset: int, frame: bytes) -> SpooledRecord:
    head, _, value = frame.partition(b"\n")
    parts = head[2:-2].split(b'", "')  # `encode`'s header: ["topic", "key"]
    if len(parts) == 2 and b"\\" not in head:  # nothing escaped (json.loads: 3 us of a record's ~8)
        return SpooledRecord(offset, parts[0].decode(), parts[1].decode(), value)
    topic, key = json.loads(head)
    return SpooledRecord(offset, topic, key, value)


class Spool:
    def __init__(self, folder: str | Path, deliver: Deliver | ProcessTarget, *,
                 retriable: tuple[type[BaseException], ...] = (OSError,),
                 batch_size: int = 500, max_batch_bytes: int = 1 << 20, backoff_s: tuple[float, float] = (0.05, 2.0),
                 segment_bytes: int = SPOOL_SEGMENT_BYTES, fsync: bool = True,
                 restart_backoff_s: tuple[float, float] = (0.5, 30.0), forwarder_nice: int = 0,
                 forwarder_idle: bool = False, linger_s: float = 0.0):
        """`deliver`: a callable (its forwarder runs on a thread; `retriable` says what it may raise
        and be retried) or a `ProcessTarget` (a forwarder process; the target says what is retriable).
        `forwarder_nice`: added to the forwarder process's nice value (lower CPU priority than the
        process that spools, whose callers wait; the forwarder catches up when the CPU is free).
        `forwarder_idle`: the forwarder process runs under Linux's SCHED_IDLE policy (only on a CPU
        no other process wants; elsewhere `forwarder_nice` alone). `linger_s`: how long the forwarder
        lets a batch short of `batch_size` records wait for more (fewer, fuller deliveries)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= linger_s <= 10:
            raise ValueError(f"linger_s must be in [0, 10] seconds, got {linger_s}")
        for name, (first, cap) in (("backoff_s", backoff_s), ("restart_backoff_s", restart_backoff_s)):
            if not 0 < first <= cap:
                raise ValueError(f"{name} must be (first, cap) with 0 < first <= cap, got {(first, cap)}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._target = deliver if isinstance(deliver, ProcessTarget) else _CallableTarget(deliver, retriable)
        self.batch_size, self.max_batch_bytes = batch_size, max_batch_bytes
        self.backoff_s, self.restart_backoff_s, self.fsync = backoff_s, restart_backoff_s, fsync
        self.forwarder_nice, self.forwarder_idle, self.linger_s = forwarder_nice, forwarder_idle, linger_s
        self._log = DurableLog(self.folder / "log", segment_bytes=segment_bytes, fsync=fsync)
        self._pos_path = self.folder / "forwarded.json"
        self._cond = threading.Condition()
        self._forwarded = read_position(self._pos_path)
        self._spooled = self._log.end_offset  # records below this are durable (and readable)
        if self._forwarded > self._spooled:
            raise RuntimeError(f"{self._pos_path} says {self._forwarded} forwarded but the spool "
                               f"holds only {self._spooled} records")
        self._announced = -1  # the last SPOOLED value the forwarder was sent
        self._hold_seq, self._held_at = 0, None  # holds asked for; (hold number, position) of the last one granted
        self._held = self._stop = self._down = self._ready = False
        self._error: BaseException | None = None  # what killed the forwarder
        self.last_failure: str | None = None  # latest retried delivery failure
        self.failures = 0  # delivery attempts that failed (and were retried), over the spool's life
        self.restarts = 0  # forwarders started again after one vanished
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._started_at = 0.0
        self._monitor: threading.Thread | None = None  # hears the forwarder; None until one is started
        if self._spooled > self._forwarded:
            log.info("spool %s: %d records from a previous run still to forward (from offset %d)",
                     self.folder, self._spooled - self._forwarded, self._forwarded)
            self._start()

    def _start(self) -> None:
        """Start the forwarder and its monitor, once: at the first publish (or hold), or at opening
        when records wait. A bus that only consumes never starts one."""
        with self._cond:
            if self._monitor is not None or self._stop:
                return
            self._start_forwarder()
            self._monitor = threading.Thread(target=self._watch, name=f"spool-{self.folder.name}", daemon=True)
            self._monitor.start()

    # ---- producer side ------------------------------------------------------------------------
    def publish(self, topic: str, key: str, value: bytes) -> int:
        """Spool one record durably (fsynced) and return its spool offset; never waits for the broker."""
        return self.publish_many([(topic, key, value)])

    def publish_many(self, records: list[tuple[str, str, bytes]]) -> int:
        """Spool (topic, key, value) records with one fsync; returns the first one's spool offset."""
        return self.publish_many_async(records).result(timeout=30)

    def publish_many_async(self, records: list[tuple[str, str, bytes]]) -> Future:
        """`publish_many` without waiting: the future resolves to the first record's spool offset once
        they are fsynced (and announced to the forwarder), or to the write's error."""
        out: Future = Future()
        n = len(records)

        def written(f: Future) -> None:  # on the log's writer thread; also when `out` was cancelled
            try:
                offset = f.result()
                self._durable_to(offset + n)  # the forwarder hears of them either way
            except BaseException as e:
                settle(out, error=e)
            else:
                settle(out, offset)

        self._log.append_async([encode(t, k, v) for t, k, v in records]).add_done_callback(written)
        return out

    def publish_many_now(self, records: list[tuple[str, str, bytes]]) -> bool:
        """Spool the records on this thread when the spool's writer is idle (`DurableLog.append_now`):
        True once they are fsynced (announced to the forwarder without waiting for the spool's lock);
        False, nothing written, when a write is under way -- `publish_many_async` them -- or when the
        forwarder is not started yet (its first start, a process, belongs on the writer thread)."""
        if self._monitor is None:
            return False
        offset = self._log.append_now([encode(t, k, v) for t, k, v in records])
        if offset is None:
            return False
        if not self._durable_to(offset + len(records), blocking=False):
            # the lock is held (a command waiting for room in the forwarder's socket): not the caller's wait
            threading.Thread(target=self._durable_to, args=(offset + len(records),), daemon=True,
                             name=f"spool-{self.folder.name}-announce").start()
        return True

    def _durable_to(self, end: int, blocking: bool = True) -> bool:
        """Records up to `end` are durable: tell the forwarder (starting it if need be). False, with
        nothing done, when not `blocking` and the spool's lock is held elsewhere."""
        if not self._cond.acquire(blocking):
            return False
        try:
            self._spooled = max(self._spooled, end)
            if self._monitor is None:
                self._start()
            self._announce()
        finally:
            self._cond.release()
        return True

    @property
    def forwarded(self) -> int:
        """Spool offset up to which records are acknowledged by the broker (and the position saved)."""
        return self._forwarded

    @property
    def backlog(self) -> int:
        """Records spooled but not yet acknowledged by the broker."""
        return self._spooled - self._forwarded

    @property
    def healthy(self) -> bool:
        """False once the forwarder died (see `error`) or while a vanished one is being replaced;
        a broker outage alone keeps it True."""
        return self._error is None and not self._down

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def forwarder_pid(self) -> int | None:
        """The forwarder's process id (None for a forwarder thread, and before the first publish)."""
        return None if self._proc is None else self._proc.pid

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"spool {self.folder}: forwarder died with {self._error!r}; "
                               f"{self.backlog} records stay spooled") from self._error

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until everything published before the call is acknowledged by the broker.

        Raises TimeoutError (naming the backlog and the last delivery failure) when it is not done
        within `timeout_s`, and RuntimeError when the forwarder is dead.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            target = self._spooled
            while self._forwarded < target:
                self._raise_if_dead()
                if self._stop:
                    raise RuntimeError(f"spool {self.folder} is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"spool {self.folder}: {target - self._forwarded} records not "
                                       f"forwarded after {timeout_s}s (last failure: {self.last_failure})")
                self._cond.wait(timeout=min(left, 0.5))
        self._raise_if_dead()

    @contextlib.contextmanager
    def hold(self, timeout_s: float = 30.0) -> Iterator[int]:
        """Pause forwarding (broker maintenance): waits for the batch in flight, yields `forwarded`.

        Publishing keeps spooling while held; forwarding resumes on exit.
        """
        deadline = time.monotonic() + timeout_s
        self._start()
        with self._cond:
            if self._held:
                raise RuntimeError(f"spool {self.folder} is already held")
            self._held, self._hold_seq = True, self._hold_seq + 1
            self._command(HOLD, self._hold_seq)
            try:
                while self._held_at is None or self._held_at[0] != self._hold_seq:
                    self._raise_if_dead()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError(f"spool {self.folder}: batch in flight did not finish in {timeout_s}s")
                    self._cond.wait(timeout=min(left, 0.5))
            except BaseException:
                self._held = False
                self._command(RELEASE)
                raise
            pos = self._held_at[1]
        try:
            yield pos
        finally:
            with self._cond:
                self._held = False
                self._command(RELEASE)

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Try to forward the backlog for up to `flush_timeout_s`, then stop; what is left stays spooled."""
        if self._stop:
            return
        if self._error is None and flush_timeout_s > 0:
            try:
                self.flush(flush_timeout_s)
            except TimeoutError:
                log.warning("spool %s: closing with %d records not forwarded; they are forwarded when "
                            "the spool is opened again", self.folder, self.backlog)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            try:
                self._command(STOP)
            except TimeoutError:  # a forwarder that does not read (stopped?) is not waited for
                log.error("spool %s: the forwarder does not take messages; killing it", self.folder)
                if self._proc is not None:
                    self._proc.kill()
        if self._monitor is not None:
            self._monitor.join(timeout=60)  # the forwarder ends its batch in flight, then exits
        if self._monitor is not None and self._monitor.is_alive():
            log.error("spool %s: forwarder did not stop within 60s (stuck in deliver)", self.folder)
            if self._proc is not None:
                self._proc.kill()
                self._monitor.join(timeout=10)
        with self._cond:
            if self._sock is not None:
                self._sock.close()
                self._sock = None  # a hold still open sends nothing more
        self._log.close()

    # ---- the forwarder ------------------------------------------------------------------------
    def _start_forwarder(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        settings = {"folder": str(self.folder), "batch_size": self.batch_size, "max_batch_bytes": self.max_batch_bytes,
                    "backoff_s": list(self.backoff_s), "fsync": self.fsync, "linger_s": self.linger_s}
        if isinstance(self._target, ProcessTarget):
            cfg = {**settings, "factory": self._target.factory, "kwargs": self._target.kwargs,
                   "fd": theirs.fileno(), "log_level": logging.getLogger().getEffectiveLevel(),
                   "nice": self.forwarder_nice, "idle": self.forwarder_idle}
            root = str(Path(__file__).resolve().parents[1])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
            try:
                self._proc = subprocess.Popen([sys.executable, "-m", "feedback.forwarder", json.dumps(cfg)],
                                              pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, env=env)
            finally:
                theirs.close()  # the child has its copy: when it exits, ours reads end of file
        else:
            from feedback.forwarder import Forwarder  # it imports this module

            fwd = Forwarder(self.folder, self._target, theirs, batch_size=self.batch_size,
                            max_batch_bytes=self.max_batch_bytes, backoff_s=self.backoff_s, fsync=self.fsync,
                            linger_s=self.linger_s)
            self._thread = threading.Thread(target=_run_on_thread, args=(fwd, theirs), daemon=True,
                                            name=f"spool-forwarder-{self.folder.name}")
            self._thread.start()
        with self._cond:
            old, self._sock, self._announced, self._ready = self._sock, ours, -1, False
            if old is not None:
                old.close()
            self._started_at = time.monotonic()
            self._announce()
            if self._held:  # a hold that outlived the previous forwarder
                self._command(HOLD, self._hold_seq)

    def _announce(self) -> None:
        """Tell the forwarder what is durable (caller holds `_cond`). Never blocks: when the socket is
        full (a forwarder that does not read), the monitor sends it again."""
        if self._spooled <= self._announced or self._sock is None:
            return
        try:
            self._sock.send(COMMAND.pack(SPOOLED, self._spooled))
            self._announced = self._spooled
        except (BlockingIOError, BrokenPipeError, ConnectionResetError):
            pass  # full: sent again by `_watch`; gone: a new forwarder gets the position at its start

    def _command(self, op: int, value: int = 0) -> None:
        """Send a control message (caller holds `_cond`); waits up to 5 s for room in the socket."""
        msg, deadline = COMMAND.pack(op, value), time.monotonic() + 5
        while self._sock is not None:
            try:
                self._sock.send(msg)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"spool {self.folder}: the forwarder does not read its messages") from None
                select.select([], [self._sock], [], 0.1)
            except (BrokenPipeError, ConnectionResetError):
                return  # gone: a new forwarder starts with the spool's state (held or not)

    def _watch(self) -> None:
        """The monitor thread: hears the forwarder; starts another when one vanishes."""
        delay = self.restart_backoff_s[0]
        while True:
            self._listen()
            code = self._reap()
            with self._cond:
                ready, self._ready = self._ready, False
                if self._stop or self._error is not None:
                    self._cond.notify_all()
                    return
                if not ready:  # it never started: starting it again would fail the same way
                    self._error = RuntimeError(f"spool {self.folder}: the forwarder exited ({code}) before it "
                                               f"started; see its log")
                    log.error("%s", self._error)
                    self._cond.notify_all()
                    return
                self._down = True
                self._cond.notify_all()
                if time.monotonic() - self._started_at > 60:
                    delay = self.restart_backoff_s[0]
                self.restarts += 1
                log.error("spool %s: the forwarder exited unexpectedly (%s) with %d records not forwarded; "
                          "starting another in %.1fs", self.folder, code, self.backlog, delay)
                deadline = time.monotonic() + delay
                while not self._stop and (left := deadline - time.monotonic()) > 0:
                    self._cond.wait(timeout=left)
                if self._stop:
                    return
            delay = min(delay * 2, self.restart_backoff_s[1])
            try:
                self._start_forwarder()
            except BaseException as e:
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                raise
            with self._cond:
                self._down = False

    def _listen(self) -> None:
        """Apply the forwarder's messages until its end of the socket closes."""
        sock = self._sock
        assert sock is not None
        while True:
            readable, _, _ = select.select([sock], [], [], 0.5)
            if self._announced < self._spooled:
                with self._cond:
                    self._announce()
            if not readable:
                continue
            try:
                data = sock.recv(1 << 20)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                return
            if not data:
                return
            msg = pickle.loads(data)
            with self._cond:
                kind = msg[0]
                if kind == "forwarded":
                    self._forwarded = msg[1]
                elif kind == "failed":
                    self.failures += 1
                    self.last_failure = msg[2]
                elif kind == "held":
                    self._held_at = (msg[1], msg[2])
                elif kind == "ready":
                    self._forwarded, self._ready = msg[1], True
                elif kind == "died":
                    self._error = msg[1]
                else:
                    raise RuntimeError(f"spool {self.folder}: unknown message from the forwarder: {msg!r}")
                self._cond.notify_all()

    def _reap(self) -> str:
        """Wait for the forwarder that just closed its socket; how it ended, in words."""
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait(timeout=10)
            return f"process {self._proc.pid}, " + (f"signal {-code}" if code < 0 else f"exit code {code}")
        assert self._thread is not None
        self._thread.join(timeout=10)
        return f"thread {self._thread.name}"


def _run_on_thread(fwd, sock: socket.socket) -> None:
    try:
        fwd.run()  # a fatal error is logged there and reported to the spool
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # wakes its command reader; the spool reads end of file
        sock.close()
