"""The spool's forwarder: reads the spooled log in order and delivers it, in a process of its own.

Why a process: the gateway spools (appends and fsyncs) on its request path; delivering to Kafka
with kafka-python costs as much Python per record again, and in the gateway's process it competes
with the HTTP handlers for the interpreter lock. `feedback.spool.Spool` starts
`python -m feedback.forwarder CONFIG` (or, for an in-process `deliver` callable, a thread running
the same `Forwarder`) and talks to it over one AF_UNIX SOCK_SEQPACKET socket pair:

  gateway -> forwarder, fixed 9-byte messages (`spool.COMMAND`): SPOOLED n (records below n are
    fsynced and may be read), HOLD, RELEASE, STOP. A reader thread here takes them off the socket
    at once, so the gateway's non-blocking sends never find it full while a delivery is slow.
  forwarder -> gateway, pickled tuples: ("ready", forwarded), ("forwarded", n) after each batch the
    broker acknowledged and whose position is saved, ("failed", failures, text) for a retried
    delivery failure, ("held", hold number, forwarded) when HOLD n took effect (no batch in
    flight), ("died", exception) before it exits on an error that is not retriable.

The forwarder owns, in the spool folder, `forwarded.json` (replaced atomically at most every
`SAVE_EVERY_S` while delivering, see there), the deletion of fully forwarded log segments, and
`forwarder.lock` (an flock: one forwarder per spool; a restarted one waits for a previous one still
finishing its batch). It only reads the log (`SegmentReader`), never past the durable end the
gateway announced. It exits when told to STOP or when the socket reaches end of file (the gateway is
gone): no orphans; its batch in flight ends first (deliveries are bounded by the target's timeouts;
a watchdog ends it otherwise).

The delivery target is built here from `spool.ProcessTarget`: `factory` ("module:function") is
called with `kwargs` and returns an object with `deliver(batch)`, `retriable` (exception types
retried with capped exponential backoff, forever) and `close()`.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import itertools
import json
import logging
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from feedback.log import LogCorrupted, next_frame, segments
from feedback.spool import COMMAND, HOLD, RELEASE, SPOOLED, STOP, SpooledRecord, decode, read_position

log = logging.getLogger("feedback.forwarder")  # also when run as __main__
READ_CHUNK = 1 << 20
ORPHAN_GRACE_S = 60.0  # after the gateway is gone, the batch in flight may take this long
# forwarded.json is written (a new file renamed over the old) at most this often while batches keep
# coming, and at once when the forwarder idles that long, is held, stops, or is about to delete
# segments — fsynced only in the last three cases (`Forwarder._save_position`). Writing and fsyncing it
# after every batch (~50/s at 5000 events/s in 100-event requests) cost the forwarder ~20% of its CPU
# and put a file creation + journal commit per batch on the disk the gateway fsyncs its spool on. A
# crash re-sends at most this long's batches: consumers drop them by event id.
SAVE_EVERY_S = 0.1


class Target(Protocol):
    retriable: tuple[type[BaseException], ...]

    def deliver(self, batch: list[SpooledRecord]) -> None: ...

    def close(self) -> None: ...


class SegmentReader:
    """Reads records of the spool's log (`<folder>/<base>.log` segments, framed as in `feedback.log`)
    forward from an offset. Read-only: the gateway's `DurableLog` writes them."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._f: Any = None
        self.segment = 0  # base offset of the open segment
        self._next = 0  # offset of the record at _buf[_i:]
        self._buf, self._i, self._buf_pos = b"", 0, 0  # bytes read; next record's index; _buf[0]'s file position
        self._mark: tuple[int, int, int] | None = None  # (offset, segment, byte position) of the last read

    def _open(self, base: int, byte_pos: int, offset: int) -> None:
        if self._f is not None:
            self._f.close()
        try:
            self._f = open(self.folder / f"{base:020d}.log", "rb")  # noqa: SIM115 (open across reads; see close)
        except FileNotFoundError:
            raise RuntimeError(f"{self.folder}: the segment holding durable record {offset} is missing") from None
        self._f.seek(byte_pos)
        self.segment, self._next, self._buf, self._i, self._buf_pos = base, offset, b"", 0, byte_pos

    def _seek(self, start: int) -> None:
        if (self._mark is not None and self._mark[0] == start  # the same batch again (a retry)
                and (self.folder / f"{self._mark[1]:020d}.log").is_file()):
            self._open(self._mark[1], self._mark[2], start)
            return
        bases = [base for base, _ in segments(self.folder)]
        below = [b for b in bases if b <= start]
        if not below:
            raise RuntimeError(f"{self.folder}: no segment holds durable record {start} (first: {bases[:1]})")
        self._open(below[-1], 0, below[-1])
        while self._next < start:  # from the segment's start to the record (once, at start-up)
            if self._frame() is None:
                raise RuntimeError(f"{self.folder}: durable record {start} is missing from the log")

    def _frame(self) -> bytes | None:
        """The next record's payload in the open segment (None at its end)."""
        while True:
            frame = next_frame(self._buf, self._i)
            if frame is not None:
                payload, end, good = frame
                if not good:
                    raise LogCorrupted(f"{self.folder}/{self.segment:020d}.log: record {self._next} fails "
                                       f"its checksum")
                self._i, self._next = end, self._next + 1
                return payload
            have = len(self._buf) - self._i
            more = self._f.read(READ_CHUNK)  # a longer record takes several reads
            if not more:
                if have:
                    raise LogCorrupted(f"{self.folder}/{self.segment:020d}.log: torn record {self._next} below "
                                       f"the durable end")
                return None
            self._buf, self._buf_pos, self._i = self._buf[self._i:] + more, self._buf_pos + self._i, 0

    def read(self, start: int, end: int, max_records: int, max_bytes: int) -> list[SpooledRecord]:
        """Records [start, end): at most `max_records` and `max_bytes` of keys and values (at least one)."""
        if self._f is None or start != self._next:
            self._seek(start)
        self._mark = (start, self.segment, self._buf_pos + self._i)
        batch: list[SpooledRecord] = []
        size = 0
        while self._next < end and len(batch) < max_records:
            before = self._buf_pos + self._i
            payload = self._frame()
            if payload is None:  # the segment is complete: the record is the next segment's first
                self._open(self._next, 0, self._next)
                continue
            rec = decode(self._next - 1, payload)
            size += len(rec.key) + len(rec.value)
            if batch and size > max_bytes:  # put it back: it starts the next batch
                self._next, self._i = self._next - 1, before - self._buf_pos
                break
            batch.append(rec)
        return batch

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class Forwarder:
    def __init__(self, folder: str | Path, target: Target, sock: socket.socket, *, batch_size: int = 500,
                 max_batch_bytes: int = 1 << 20, backoff_s: tuple[float, float] = (0.05, 2.0),
                 fsync: bool = True, linger_s: float = 0.0):
        """`linger_s`: a batch short of `batch_size` waits up to this long (from when its first record
        became durable) for more records; stopping or holding ends the wait."""
        self.folder, self.target, self._sock = Path(folder), target, sock
        self.batch_size, self.max_batch_bytes, self.backoff_s, self.fsync, self.linger_s = (
            batch_size, max_batch_bytes, backoff_s, fsync, linger_s)
        self._pos_path = self.folder / "forwarded.json"
        self._reader = SegmentReader(self.folder / "log")
        self._cond = threading.Condition()
        self._durable = 0
        self._held = self._stop = self.orphaned = False
        self._hold_seq = 0  # number of the latest HOLD
        self._send_lock = threading.Lock()
        self.failures = 0
        self.error: BaseException | None = None  # what ended `run()`, if anything did

    # ---- the socket ---------------------------------------------------------------------------
    def _send(self, *msg: Any) -> None:
        with self._send_lock:
            self._sock.sendall(pickle.dumps(msg))

    def _commands(self) -> None:
        """Take the gateway's messages off the socket as they come (a thread); EOF means it is gone."""
        while True:
            try:
                data = self._sock.recv(COMMAND.size)
            except OSError:
                data = b""
            if not data:
                with self._cond:
                    self._stop = self.orphaned = True
                    self._cond.notify_all()
                return
            op, n = COMMAND.unpack(data)
            with self._cond:
                if op == SPOOLED:
                    self._durable = max(self._durable, n)
                elif op == HOLD:
                    self._held, self._hold_seq = True, n
                elif op == RELEASE:
                    self._held = False
                elif op == STOP:
                    self._stop = True
                self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        """Forward until told to stop. A fatal error is logged, reported to the spool (which raises
        it from `flush()`) and kept in `error`; then it returns."""
        threading.Thread(target=self._commands, name="forwarder-commands", daemon=True).start()
        lock = self._lock()
        if lock is None:
            return
        try:
            forwarded = read_position(self._pos_path)
            first = self._first_segment()
            if first is not None and forwarded < first:  # a position older than the segments kept
                log.warning("spool %s: saved position %d is below the first segment (%d), whose records were "
                            "all forwarded before it was deleted: resuming there", self.folder, forwarded, first)
                forwarded = first
            self._send("ready", forwarded)
            self._forward(forwarded)
        except BaseException as e:
            log.exception("spool %s: forwarder died", self.folder)
            self.error = e
            with contextlib.suppress(OSError):
                self._send("died", _picklable(e))
        finally:
            self._reader.close()
            os.close(lock)

    def _lock(self) -> int | None:
        """Take `forwarder.lock` (an fd; closing it releases the lock), waiting for a previous
        forwarder still finishing its batch; None when told to stop meanwhile."""
        fd = os.open(self.folder / "forwarder.lock", os.O_RDWR | os.O_CREAT, 0o644)
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if not waited:
                    log.info("spool %s: waiting for the previous forwarder to finish", self.folder)
                    waited = True
            with self._cond:
                if self._stop:
                    os.close(fd)
                    return None
                self._cond.wait(0.1)

    def _lingers(self, forwarded: int, since: float) -> bool:
        """Whether a short batch waits on for more records (caller holds `_cond`)."""
        return self._durable - forwarded < self.batch_size and time.monotonic() < since + self.linger_s

    def _first_segment(self) -> int | None:
        segs = segments(self.folder / "log")
        return segs[0][0] if segs else None

    def _save_position(self, forwarded: int, durable: bool = False) -> None:
        """Replace forwarded.json. Fsynced only when `durable` (before segments are deleted, when
        held or stopping): a position lost to a power cut is an older one, whose records go again
        (consumers drop them by event id); one older than the first segment kept resumes there."""
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix="forwarded.json.")
        with os.fdopen(fd, "w") as f:
            json.dump({"forwarded": forwarded}, f)
            f.flush()
            if self.fsync and durable:
                os.fsync(f.fileno())
        os.replace(tmp, self._pos_path)

    def _forward(self, forwarded: int) -> None:
        delay, attempt, held_said = self.backoff_s[0], 0, -1
        self._delete_forwarded_segments(forwarded)  # a previous forwarder may have stopped before it did
        segment = -1
        saved, saved_at = forwarded, time.monotonic()  # the position in forwarded.json, and when written
        waiting_since: float | None = None  # when records were first seen waiting (for `linger_s`)
        while True:
            with self._cond:
                while not self._stop and (self._held or forwarded >= self._durable or self._lingers(
                        forwarded, waiting_since := waiting_since or time.monotonic())):
                    if forwarded != saved and (self._held or time.monotonic() - saved_at >= SAVE_EVERY_S):
                        self._save_position(forwarded, durable=self._held)
                        saved, saved_at = forwarded, time.monotonic()
                    if self._held and held_said != self._hold_seq:  # no batch in flight: say so
                        self._send("held", self._hold_seq, forwarded)
                        held_said = self._hold_seq
                    due = 1.0 if forwarded == saved else SAVE_EVERY_S - (time.monotonic() - saved_at)
                    if waiting_since is not None and not self._held and forwarded < self._durable:
                        due = min(due, waiting_since + self.linger_s - time.monotonic())
                    self._cond.wait(timeout=max(0.001, due))
                waiting_since = None
                if self._stop:
                    if forwarded != saved:
                        self._save_position(forwarded, durable=True)
                    return
                start, end = forwarded, self._durable
            batch = self._reader.read(start, end, self.batch_size, self.max_batch_bytes)
            if not batch or batch[0].offset != start:
                raise RuntimeError(f"spool {self.folder}: durable record {start} is missing from the log")
            try:
                self.target.deliver(batch)
            except self.target.retriable as e:
                attempt += 1
                self.failures += 1
                log.warning("spool %s: delivering %d records from offset %d failed (attempt %d, backlog %d), "
                            "retrying in %.2fs: %r", self.folder, len(batch), start, attempt, end - start, delay, e)
                self._send("failed", self.failures, repr(e)[:2000])
                deadline = time.monotonic() + delay
                with self._cond:  # SPOOLED messages wake it up too: wait out the whole delay
                    while not self._stop and not self._held and (left := deadline - time.monotonic()) > 0:
                        self._cond.wait(timeout=left)
                delay = min(delay * 2, self.backoff_s[1])
                continue
            if attempt:
                log.info("spool %s: delivering again after %d failed attempts", self.folder, attempt)
            delay, attempt = self.backoff_s[0], 0
            forwarded = start + len(batch)
            moved = self._reader.segment != segment  # to a new segment: the ones below may go, once saved
            if moved or time.monotonic() - saved_at >= SAVE_EVERY_S:
                self._save_position(forwarded, durable=moved)
                saved, saved_at = forwarded, time.monotonic()
            self._send("forwarded", forwarded)
            if moved:
                segment = self._reader.segment
                self._delete_forwarded_segments(forwarded)

    def _delete_forwarded_segments(self, forwarded: int) -> None:
        """Delete whole segments below `forwarded`; the active (last) segment always stays."""
        folder = self.folder / "log"
        segs = segments(folder)
        for (base, path), (next_base, _) in itertools.pairwise(segs):
            if next_base <= forwarded:
                path.unlink()
                log.debug("spool %s: deleted forwarded segment %s (offsets %d..%d)", self.folder, path.name,
                          base, next_base - 1)


def _picklable(e: BaseException) -> BaseException:
    try:
        if len(pickle.dumps(e)) < 64 << 10:
            pickle.loads(pickle.dumps(e))
            return e
    except (pickle.PicklingError, TypeError, AttributeError, ValueError):
        pass  # an exception that does not survive pickling: its text does
    return RuntimeError(f"{type(e).__module__}.{type(e).__qualname__}: {str(e)[:2000]}")


def load_target(factory: str, kwargs: dict[str, Any]) -> Target:
    module, _, name = factory.partition(":")
    if not module or not name:
        raise ValueError(f"factory must be 'module:function', got {factory!r}")
    return getattr(importlib.import_module(module), name)(**kwargs)


def main(argv: list[str]) -> int:
    """`python -m feedback.forwarder CONFIG_JSON`; the socket is the inherited fd CONFIG["fd"]."""
    cfg = json.loads(argv[0])
    logging.basicConfig(level=cfg.get("log_level", logging.INFO),
                        format="%(asctime)s %(levelname)s forwarder[%(process)d] %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the gateway, which stops us in order
    if cfg.get("nice"):
        os.nice(cfg["nice"])
    if cfg.get("idle") and hasattr(os, "SCHED_IDLE"):  # Linux: run only on a CPU nothing else wants
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as e:
            log.warning("forwarder: SCHED_IDLE refused (%r); running at nice %s", e, cfg.get("nice"))
    sock = socket.socket(fileno=cfg["fd"])
    target = load_target(cfg["factory"], cfg["kwargs"])
    fwd = Forwarder(cfg["folder"], target, sock, batch_size=cfg["batch_size"], max_batch_bytes=cfg["max_batch_bytes"],
                    backoff_s=tuple(cfg["backoff_s"]), fsync=cfg["fsync"], linger_s=cfg["linger_s"])
    signal.signal(signal.SIGTERM, lambda *_: fwd.stop())

    def watchdog() -> None:  # the gateway is gone and the batch in flight does not end
        with fwd._cond:
            while not fwd.orphaned:
                fwd._cond.wait()
        time.sleep(ORPHAN_GRACE_S)
        log.error("spool %s: the gateway is gone and the forwarder did not stop in %.0fs; exiting", fwd.folder,
                  ORPHAN_GRACE_S)
        os._exit(3)

    threading.Thread(target=watchdog, name="forwarder-watchdog", daemon=True).start()
    try:
        fwd.run()
    finally:
        target.close()
    return 0 if fwd.error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
