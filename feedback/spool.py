"""The producer-side spool: never lose an event, never block the caller on the broker.

Owns `<folder>/log/` (a `DurableLog` of spooled records) and `<folder>/forwarded.json` (how far it was
delivered). `publish_many()` returns once the records are fsynced locally. One forwarder thread reads
the log in order and hands batches to `deliver` (so one key's records arrive in publish order), then
advances the position and deletes delivered segments. A failure that `retriable` names is retried with
capped exponential backoff, forever, with the same batch; anything else stops the forwarder loudly
(`healthy` turns False, `flush()` raises; the records stay spooled for the next `Spool` on the folder).

Delivery is at-least-once: a crash between the broker's acknowledgement and the saved position, or a
retry of a batch the broker half took, delivers records again; consumers drop repeats with `Deduper`.

Called by `feedback.bus_kafka.KafkaBus` (publish path) and by the consumers (`Deduper`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import struct
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from core.files import atomic_write
from feedback.log import DurableLog

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
SEGMENT_BYTES = 4 << 20  # small segments: delivered ones are deleted soon
MAX_BATCH_BYTES = 1 << 20
_HEAD = struct.Struct("<HH")  # topic length, key length; then topic, key, value


@dataclass(frozen=True)
class SpooledRecord:
    offset: int  # position in the spool (dense, from 0, survives restarts)
    topic: str
    key: str
    value: bytes


def encode(topic: str, key: str, value: bytes) -> bytes:
    tb, kb = topic.encode(), key.encode()
    return _HEAD.pack(len(tb), len(kb)) + tb + kb + value


def decode(offset: int, frame: bytes) -> SpooledRecord:
    tlen, klen = _HEAD.unpack_from(frame)
    t, k = _HEAD.size + tlen, _HEAD.size + tlen + klen  # the ends of the topic and of the key
    return SpooledRecord(offset, frame[_HEAD.size : t].decode(), frame[t:k].decode(), frame[k:])


class Deduper:
    """Bounded memory of recently seen event ids (an LRU): `seen(id)` is True for a repeat. A repeat
    arrives soon after the original (a re-forwarded batch, a redelivered partition)."""

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


class Spool:
    def __init__(
        self,
        folder: str | Path,
        deliver: Callable[[list[SpooledRecord]], None],
        *,
        retriable: tuple[type[BaseException], ...] = (OSError,),
        batch_size: int = 500,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        segment_bytes: int = SEGMENT_BYTES,
        fsync: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.folder, self.fsync = Path(folder), fsync
        self.folder.mkdir(parents=True, exist_ok=True)
        self._deliver, self.retriable, self.batch_size, self.backoff_s = deliver, retriable, batch_size, backoff_s
        self._log = DurableLog(self.folder / "log", segment_bytes=segment_bytes, fsync=fsync)
        self._pos_path = self.folder / "forwarded.json"
        # A lost, torn or stale position resumes at the first segment kept: everything below it was
        # delivered before its segment was deleted (repeats, never a gap).
        self._forwarded = max(self._read_position(), self._log.first_offset)
        self._cond = threading.Condition()
        # (first offset, wall time) of each append still (partly) unforwarded: what `pending_since` reads.
        # Records recovered from disk were published at some unknown time before this open: dated 0.0,
        # so a producer's watermark stays at the epoch until they are delivered.
        self._appended: deque[tuple[int, float]] = deque()
        self._appending: list[float] = []  # appends under way (not yet in the log)
        if self._log.end_offset > self._forwarded:
            self._appended.append((self._forwarded, 0.0))
        self._held = self._in_flight = self._stop = False
        self.failures = 0
        self.last_failure: BaseException | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"spool-{self.folder.name}", daemon=True)
        self._thread.start()

    def _read_position(self) -> int:
        try:
            body = json.loads(self._pos_path.read_text())
            if body.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {body.get('version')!r}")
            return int(body["forwarded"])
        except FileNotFoundError:
            return 0
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            log.warning("spool: %s is unreadable (%r); resuming at the first segment kept", self._pos_path, e)
            return 0

    def publish(self, topic: str, key: str, value: bytes) -> int:
        return self.publish_many([(topic, key, value)])

    def publish_many(self, records: list[tuple[str, str, bytes]]) -> int:
        """Append (topic, key, value) records with one fsync; their first offset once durable."""
        if self._stop:
            raise RuntimeError(f"spool {self.folder} is closed")
        if not records:
            return self._log.end_offset
        at = time.time()  # before the append: a watermark read meanwhile stays below these records
        with self._cond:
            self._appending.append(at)
        try:
            first = self._log.append([encode(t, k, bytes(v)) for t, k, v in records])
        finally:
            with self._cond:
                self._appending.remove(at)
        with self._cond:
            self._appended.append((first, at))
            self._cond.notify_all()
        return first

    def _prune(self) -> None:
        """Forget the appends wholly forwarded (under `_cond`)."""
        while len(self._appended) > 1 and self._appended[1][0] <= self._forwarded:
            self._appended.popleft()  # the next append starts at or below the position: this one is done

    def pending_since(self) -> float | None:
        """The wall time its oldest record not yet acknowledged by the destination was published (or
        is being appended), None when there is none: every record published before this is delivered."""
        with self._cond:
            self._prune()
            pending = list(self._appending)
            if self._log.end_offset > self._forwarded and self._appended:
                pending.append(self._appended[0][1])  # the append holding the record at the position
            return min(pending, default=None)

    @property
    def forwarded(self) -> int:
        """Records below this offset are acknowledged by the destination."""
        return self._forwarded

    @property
    def backlog(self) -> int:
        return self._log.end_offset - self._forwarded

    @property
    def healthy(self) -> bool:
        """False once the forwarder stopped on an error that is not retriable."""
        return self._error is None

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until everything published before the call is delivered: TimeoutError (naming the
        backlog and the last failure) after `timeout_s`, RuntimeError when the forwarder is dead."""
        target = self._log.end_offset
        with self._cond:
            self._cond.wait_for(lambda: self._forwarded >= target or self._error is not None or self._stop, timeout_s)
        if self._error is not None:
            raise RuntimeError(f"spool {self.folder}: the forwarder died: {self._error!r}") from self._error
        if (left := target - self._forwarded) > 0:
            if self._stop:
                raise RuntimeError(f"spool {self.folder} is closed")
            why = f"after {timeout_s}s (last failure: {self.last_failure!r})"
            raise TimeoutError(f"spool {self.folder}: {left} records not forwarded {why}")

    @contextlib.contextmanager
    def hold(self, timeout_s: float = 30.0) -> Iterator[int]:
        """Pause forwarding (broker maintenance): waits for the batch in flight, yields `forwarded`.
        Publishing keeps spooling while held; forwarding resumes on exit."""
        with self._cond:
            if self._held:
                raise RuntimeError(f"spool {self.folder} is already held")
            self._held = True
            if not self._cond.wait_for(lambda: not self._in_flight, timeout_s):
                self._held = False
                raise TimeoutError(f"spool {self.folder}: the batch in flight did not finish in {timeout_s}s")
            pos = self._forwarded
        try:
            yield pos
        finally:
            with self._cond:
                self._held = False
                self._cond.notify_all()

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Try to forward the backlog for up to `flush_timeout_s`, then stop; what is left stays spooled."""
        if self._stop:
            return
        if self._error is None and flush_timeout_s > 0:
            try:
                self.flush(flush_timeout_s)
            except TimeoutError:
                log.warning("spool %s: %d records left to forward at the next open", self.folder, self.backlog)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=60)
        if self._thread.is_alive():
            log.error("spool %s: the forwarder did not stop within 60 s (stuck in deliver)", self.folder)
        self._log.close()

    # ---- the forwarder thread -----------------------------------------------------------------
    def _next_batch(self) -> list[SpooledRecord] | None:
        """Wait for records to forward (None: stopping)."""
        with self._cond:
            while not self._stop and (self._held or self._log.end_offset <= self._forwarded):
                self._cond.wait(timeout=1.0)
            if self._stop:
                return None
            self._in_flight = True
            start = self._forwarded
        batch: list[SpooledRecord] = []
        size = 0
        for off, frame in self._log.read(start, limit=self.batch_size):
            if batch and size + len(frame) > MAX_BATCH_BYTES:
                break
            batch.append(decode(off, frame))
            size += len(frame)
        return batch

    def _run(self) -> None:
        try:
            while (batch := self._next_batch()) is not None:
                self._send(batch)
        except BaseException as e:
            log.exception("spool %s: the forwarder died; records stay spooled", self.folder)
            self._error = e
        finally:
            with self._cond:
                self._in_flight = False
                self._cond.notify_all()

    def _send(self, batch: list[SpooledRecord]) -> None:
        """Deliver `batch`, retrying what `retriable` names until it is acknowledged (or stopping)."""
        delay = self.backoff_s[0]
        while True:
            try:
                self._deliver(batch)
                break
            except self.retriable as e:
                self.failures, self.last_failure = self.failures + 1, e
                log.warning("spool %s: a batch of %d failed (%r); retry in %.2fs", self.folder, len(batch), e, delay)
                with self._cond:
                    self._in_flight = False  # a hold may begin between attempts
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._stop, timeout=delay)
                    self._cond.wait_for(lambda: self._stop or not self._held)
                    if self._stop:
                        return
                    self._in_flight = True
                delay = min(delay * 2, self.backoff_s[1])
        end = batch[-1].offset + 1
        first_before = self._log.first_offset
        self._log.delete_before(end)
        deleted = self._log.first_offset != first_before
        # The position is fsynced only when segments were deleted: otherwise a lost position
        # resumes at the first segment kept, which only repeats records.
        body = json.dumps({"version": FORMAT_VERSION, "forwarded": end})
        atomic_write(self._pos_path, body, fsync=self.fsync and deleted)
        with self._cond:
            self._forwarded = end
            self._prune()
            self._in_flight = False
            self._cond.notify_all()
