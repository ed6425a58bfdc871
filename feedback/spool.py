"""The producer-side spool: never lose an event, never block the caller on the broker.

Owns `<folder>/log/` (a `feedback.log.DurableLog` of spooled records) and `<folder>/forwarded.json`
(how far the log has been delivered, replaced atomically after every delivered batch).
`Spool.publish()` returns once the record is fsynced in the local log — it never waits for the
broker. One forwarder thread reads the log in order and hands batches to a `deliver` callable
(for Kafka: `feedback.bus_kafka.KafkaBus._deliver`, which returns only after acks=all), so records
of one key reach the broker in publish order. A failure of `deliver` that is in `retriable`
(broker down, slow, restarting) is logged and retried with capped exponential backoff, forever;
anything else kills the forwarder loudly: the exception is logged and kept, `healthy` turns
False and `flush()` raises it (records stay spooled; a new `Spool` on the folder resumes them).

Delivery is at-least-once: a crash after the broker acknowledged a batch and before the position
was saved delivers that batch again, and producer retries can repeat records. Consumers drop
repeats by `event_id` with `Deduper`. Delivered log segments are deleted once fully forwarded.

Called by `feedback.bus_kafka.KafkaBus` (publish path) and by the consumers (`Deduper`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from feedback.log import DurableLog

log = logging.getLogger(__name__)

SPOOL_SEGMENT_BYTES = 4 << 20  # small segments: forwarded ones are deleted, reads stay cheap


@dataclass(frozen=True)
class SpooledRecord:
    offset: int  # position in the spool (dense, from 0, survives restarts)
    topic: str
    key: str
    value: bytes


Deliver = Callable[[list[SpooledRecord]], None]


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


def _encode(topic: str, key: str, value: bytes) -> bytes:
    return json.dumps([topic, key]).encode() + b"\n" + value  # json escapes newlines in the header


def _decode(offset: int, frame: bytes) -> SpooledRecord:
    head, _, value = frame.partition(b"\n")
    topic, key = json.loads(head)
    return SpooledRecord(offset, topic, key, value)


class Spool:
    def __init__(self, folder: str | Path, deliver: Deliver, *,
                 retriable: tuple[type[BaseException], ...] = (OSError,),
                 batch_size: int = 500, max_batch_bytes: int = 1 << 20, backoff_s: tuple[float, float] = (0.05, 2.0),
                 segment_bytes: int = SPOOL_SEGMENT_BYTES, fsync: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 < backoff_s[0] <= backoff_s[1]:
            raise ValueError(f"backoff_s must be (first, cap) with 0 < first <= cap, got {backoff_s}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._deliver, self._retriable = deliver, retriable
        self.batch_size, self.max_batch_bytes = batch_size, max_batch_bytes
        self.backoff_s, self.fsync = backoff_s, fsync
        self._log = DurableLog(self.folder / "log", segment_bytes=segment_bytes, fsync=fsync)
        self._pos_path = self.folder / "forwarded.json"
        self._cond = threading.Condition()
        self._forwarded = self._load_position()
        self._spooled = self._log.end_offset  # records below this are durable (and readable)
        if self._forwarded > self._spooled:
            raise RuntimeError(f"{self._pos_path} says {self._forwarded} forwarded but the spool "
                               f"holds only {self._spooled} records")
        self._held = self._busy = self._stop = False
        self._error: BaseException | None = None  # what killed the forwarder
        self.last_failure: BaseException | None = None  # latest retried delivery failure
        self.failures = 0  # delivery attempts that failed (and were retried), over the spool's life
        if self._spooled > self._forwarded:
            log.info("spool %s: %d records from a previous run still to forward (from offset %d)",
                     self.folder, self._spooled - self._forwarded, self._forwarded)
        self._thread = threading.Thread(target=self._run, name=f"spool-{self.folder.name}", daemon=True)
        self._thread.start()

    # ---- position ---------------------------------------------------------------------------
    def _load_position(self) -> int:
        if not self._pos_path.is_file():
            return 0
        return int(json.loads(self._pos_path.read_text())["forwarded"])

    def _save_position(self, forwarded: int) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix="forwarded.json.")
        with os.fdopen(fd, "w") as f:
            json.dump({"forwarded": forwarded}, f)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, self._pos_path)

    # ---- producer side ------------------------------------------------------------------------
    def publish(self, topic: str, key: str, value: bytes) -> int:
        """Spool one record durably (fsynced) and return its spool offset; never waits for the broker."""
        offset = self._log.append([_encode(topic, key, value)])
        with self._cond:
            self._spooled = max(self._spooled, offset + 1)
            self._cond.notify_all()
        return offset

    def publish_many(self, records: list[tuple[str, str, bytes]]) -> int:
        """Spool (topic, key, value) records with one fsync; returns the first one's spool offset."""
        offset = self._log.append([_encode(t, k, v) for t, k, v in records])
        with self._cond:
            self._spooled = max(self._spooled, offset + len(records))
            self._cond.notify_all()
        return offset

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
        """False once the forwarder died (see `error`); a broker outage alone keeps it True."""
        return self._error is None and (self._thread.is_alive() or self._stop)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"spool {self.folder}: forwarder died with {self._error!r}; "
                               f"{self.backlog} records stay spooled") from self._error
        if not self._thread.is_alive() and not self._stop:
            raise RuntimeError(f"spool {self.folder}: forwarder thread is not running")

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
                                       f"forwarded after {timeout_s}s (last failure: {self.last_failure!r})")
                self._cond.wait(timeout=min(left, 0.5))
        self._raise_if_dead()

    @contextlib.contextmanager
    def hold(self, timeout_s: float = 30.0) -> Iterator[int]:
        """Pause forwarding (broker maintenance): waits for the batch in flight, yields `forwarded`.

        Publishing keeps spooling while held; forwarding resumes on exit.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._held = True
            while self._busy:
                if time.monotonic() >= deadline:
                    self._held = False
                    raise TimeoutError(f"spool {self.folder}: batch in flight did not finish in {timeout_s}s")
                self._cond.wait(timeout=0.1)
            pos = self._forwarded
        try:
            yield pos
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Try to forward the backlog for up to `flush_timeout_s`, then stop; what is left stays spooled."""
        if self._thread.is_alive() and flush_timeout_s > 0:
            try:
                self.flush(flush_timeout_s)
            except TimeoutError:
                log.warning("spool %s: closing with %d records not forwarded; they are forwarded when "
                            "the spool is opened again", self.folder, self.backlog)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            log.error("spool %s: forwarder did not stop within 60s (stuck in deliver)", self.folder)
        self._log.close()

    # ---- forwarder ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._forward_loop()
        except BaseException as e:
            log.exception("spool %s: forwarder died; %d records stay spooled", self.folder, self.backlog)
            with self._cond:
                self._error = e
                self._busy = False
                self._cond.notify_all()

    def _forward_loop(self) -> None:
        delay, attempt = self.backoff_s[0], 0
        while True:
            with self._cond:
                while not self._stop and (self._held or self._forwarded >= self._spooled):
                    self._cond.wait(timeout=1.0)
                if self._stop:
                    return
                start, end = self._forwarded, self._spooled
                self._busy = True
            batch = self._read_batch(start, end)
            if not batch or batch[0].offset != start:
                raise RuntimeError(f"spool {self.folder}: durable record {start} is missing from the log")
            try:
                self._deliver(batch)
            except self._retriable as e:
                attempt += 1
                self.failures += 1
                self.last_failure = e
                log.warning("spool %s: delivering %d records from offset %d failed (attempt %d, backlog %d), "
                            "retrying in %.2fs: %r", self.folder, len(batch), start, attempt, self.backlog,
                            delay, e)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                    if not self._stop:
                        self._cond.wait(timeout=delay)
                delay = min(delay * 2, self.backoff_s[1])
                continue
            if attempt:
                log.info("spool %s: delivering again after %d failed attempts", self.folder, attempt)
            delay, attempt = self.backoff_s[0], 0
            done = start + len(batch)
            self._save_position(done)
            with self._cond:
                self._forwarded = done
                self._busy = False
                self._cond.notify_all()
            self._delete_forwarded_segments(done)

    def _read_batch(self, start: int, end: int) -> list[SpooledRecord]:
        """Records from `start` (before `end`): at most `batch_size` of them and `max_batch_bytes` of
        values (at least one record)."""
        batch: list[SpooledRecord] = []
        size = 0
        for off, frame in self._log.read(start, limit=min(self.batch_size, end - start)):
            rec = _decode(off, frame)
            size += len(rec.key) + len(rec.value)
            if batch and size > self.max_batch_bytes:
                break
            batch.append(rec)
        return batch

    def _delete_forwarded_segments(self, forwarded: int) -> None:
        """Delete whole segments below `forwarded`; the active (last) segment always stays."""
        segs = sorted((int(p.stem), p) for p in (self.folder / "log").glob("*.log") if p.stem.isdigit())
        for (base, path), (next_base, _) in zip(segs, segs[1:]):
            if next_base <= forwarded:
                path.unlink()
                log.debug("spool %s: deleted forwarded segment %s (offsets %d..%d)", self.folder, path.name,
                          base, next_base - 1)
