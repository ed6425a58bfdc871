"""A durable, append-only local log: the embedded default behind the record sink and the event bus.

Owns one folder per log. Records are framed as `[u32 length][u32 crc32][payload]` in segment
files named by their first offset; every record has a dense offset starting at 0. Appends are
group-committed by a `LogWriter` thread: every batch waiting is written, each file written is
fsynced once, then every waiter is released, so an acknowledged record survives a crash of the
process or the machine. A log has a writer of its own unless it is given one: the embedded bus
gives all its partition logs one writer, so a request that touches several partitions wakes one
thread, not one per partition. The caller frames its records (`append_async`, a few microseconds a
record); the writer thread runs almost no Python, so it hardly competes with the caller's thread
for the interpreter lock (with one writer thread per partition log, that competition stalled the
gateway's event loop: bench/feedback.py). `append_now` writes on the caller's own thread when the
writer is idle (nothing queued, nothing being written), and returns None otherwise: the caller then
queues with `append_async` and joins the next group commit. It saves the two hand-offs between
threads (each may wait for the interpreter lock) when there is nothing to group. On open, a torn or
corrupt tail (a crash mid-write) is cut off at the last whole record; corruption in the middle of a
segment is an error, never skipped silently.

Called by `feedback.sink.LogSink` (completion records), the spool and the embedded event bus.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError
from pathlib import Path

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<II")
SEGMENT_BYTES = 64 << 20
READ_CHUNK = 1 << 20
_O_DSYNC = getattr(os, "O_DSYNC", 0)  # 0 where the platform has none: then write + fsync


class LogCorrupted(RuntimeError):
    """A record in the middle of a segment fails its checksum."""


def next_frame(data: bytes, pos: int) -> tuple[bytes, int, bool] | None:
    """The frame starting at `data[pos]`: (payload, position after it, checksum good), or None when
    `data` ends inside it. The one frame parser of the log's readers (`DurableLog`, the spool's
    forwarder)."""
    if pos + _HEADER.size > len(data):
        return None
    length, crc = _HEADER.unpack_from(data, pos)
    end = pos + _HEADER.size + length
    if end > len(data):
        return None
    payload = data[pos + _HEADER.size:end]
    return payload, end, zlib.crc32(payload) == crc


def fsync_dir(folder: str | Path) -> None:
    """Make the names in `folder` (a new or renamed file) durable."""
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def frames(payloads: list[bytes]) -> bytes:
    """`payloads` framed, back to back, as they lie in a segment."""
    parts = []
    for p in payloads:
        parts.append(_HEADER.pack(len(p), zlib.crc32(p)))
        parts.append(p)
    return b"".join(parts)


def settle(fut: Future, result=None, error: BaseException | None = None) -> None:
    """Resolve `fut` (to `error` when given), unless its waiter cancelled it (an asyncio task awaiting
    it through `asyncio.wrap_future` was cancelled): setting a cancelled future raises, and on a
    writer thread that would stop every later append of every log it serves. Used by the log
    writer, `feedback.bus.all_of` and the spool."""
    try:
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
    except InvalidStateError:
        pass


class LogWriter:
    """The group-commit thread of one or more `DurableLog`s.

    It takes every append waiting, in any of its logs, writes each log's appends with one write,
    fsyncs each log it wrote to, then resolves the appends' futures (their callbacks run on this
    thread). A write or fsync that fails fails that log (its waiters hear the error, later appends
    raise it); the other logs go on. Whoever makes a writer closes it, after its logs.
    """

    def __init__(self, name: str = "log-writer"):
        self._cond = threading.Condition()
        self._queue: list[tuple[DurableLog, bytes, int, Future, Callable[[int], None] | None]] = []
        self._closed = False
        self._busy = False  # a write is in progress (this thread's, or `_write_now`'s on its caller's)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _submit(self, target: DurableLog, data: bytes, count: int, then: Callable[[int], None] | None = None) -> Future:
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"log {target.folder}: its writer is closed")
            self._queue.append((target, data, count, fut, then))
            if len(self._queue) == 1:
                self._cond.notify()
        return fut

    def _write_now(self, target: DurableLog, data: bytes, count: int, then: Callable[[int], None] | None) -> int | None:
        """`_commit` of this one append on the caller's thread when nothing is being written or waits
        (its first offset, or the write's error raised), else None: the caller queues instead (a
        group commit is under way)."""
        with self._cond:
            if self._queue or self._busy or self._closed:
                return None
            self._busy = True
        fut: Future = Future()
        try:
            self._commit([(target, data, count, fut, then)])
        finally:
            with self._cond:
                self._busy = False
                if self._queue or self._closed:  # appends queued meanwhile, or a close waiting for this write
                    self._cond.notify()
        return fut.result()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or self._busy) and not self._closed:
                    self._cond.wait()
                while self._busy:  # closing while a `_write_now` is under way
                    self._cond.wait()
                if not self._queue:
                    return
                queue, self._queue = self._queue, []
                self._busy = True
            try:
                self._commit(queue)
            finally:
                with self._cond:
                    self._busy = False

    def _commit(self, queue: list) -> None:
        """Write every queued append, log by log, sync each log written, then resolve their futures."""
        per_log: dict[DurableLog, list[tuple[bytes, int, Future, Callable[[int], None] | None]]] = {}
        for target, data, count, fut, then in queue:
            per_log.setdefault(target, []).append((data, count, fut, then))
        written = []
        for target, batch in per_log.items():
            try:
                written.append((target, batch, target._write(batch)))
            except BaseException as e:  # nothing of this batch acknowledged; every waiter hears it
                target._fail(e, batch)
        synced = []
        for target, batch, firsts in written:
            try:
                target._sync()
            except BaseException as e:
                target._fail(e, batch)
            else:
                synced.append((batch, firsts))
        for batch, firsts in synced:
            for (_, _, fut, then), first in zip(batch, firsts):
                if then is not None:  # also for a cancelled waiter: the records are written
                    try:
                        then(first)
                    except BaseException as e:  # the caller's bookkeeping failed: its waiter hears it
                        log.exception("log writer: callback of an append at offset %d failed", first)
                        settle(fut, error=e)
                        continue
                settle(fut, first)

    def close(self) -> None:
        """Write what waits, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)


def segments(folder: Path) -> list[tuple[int, Path]]:
    """A log folder's segments, `(base offset, path)`, in offset order (`<base>.log` files)."""
    return sorted((int(p.stem), p) for p in folder.glob("*.log") if p.stem.isdigit())


class DurableLog:
    def __init__(self, folder: str | Path, segment_bytes: int = SEGMENT_BYTES, fsync: bool = True,
                 writer: LogWriter | None = None):
        """`writer`: a group-commit thread shared with other logs (closed by whoever made it);
        None: the log makes its own, and closes it."""
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.segment_bytes, self.fsync = segment_bytes, fsync
        # Segments are opened O_DSYNC: a write returns once its data (and the size) is on disk, as
        # write + fdatasync would, in one system call -- the writer thread takes the interpreter lock
        # back once per group commit instead of twice (each time it may wait up to the interpreter's
        # switch interval for the event loop): the wait for a publish at p99 under bench/feedback.py's
        # half rate went from 10.7-16.9 ms to 8.8-14.0 ms (three runs each, alternated).
        self._dsync = _O_DSYNC if fsync else 0
        self._fsync_after_write = fsync and not self._dsync
        self._closed = False
        self._error: BaseException | None = None  # a failed write or fsync: the log takes no more
        self._cursors: dict[int, tuple[int, int]] = {}  # offset -> (segment base, byte position)
        self._cursor_lock = threading.Lock()
        self._next = self._recover()
        self._own_writer = writer is None
        self._writer = LogWriter(f"log-{self.folder.name}") if writer is None else writer

    # ---- segments -------------------------------------------------------------------------
    def _recover(self) -> int:
        segs = segments(self.folder)
        if not segs:
            self._open_segment(0)
            return 0
        base, path = segs[-1]
        count, good_bytes = 0, 0
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while (frame := next_frame(data, pos)) is not None and frame[2]:
            pos, count = frame[1], count + 1
        good_bytes = pos
        if good_bytes != len(data):
            # A crash mid-write leaves a torn last frame: cut the log back to the last whole record.
            # Those bytes were never acknowledged (acks follow the fsync of a whole batch).
            log.warning("%s: cutting %d bytes of torn tail after offset %d", path, len(data) - good_bytes,
                        base + count)
            with open(path, "r+b") as f:
                f.truncate(good_bytes)
                f.flush()
                os.fsync(f.fileno())
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | self._dsync)
        self._seg_base, self._seg_size = base, good_bytes
        return base + count

    def _open_segment(self, base: int) -> None:
        self._fd = os.open(self.folder / f"{base:020d}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | self._dsync,
                           0o644)
        self._seg_base, self._seg_size = base, 0
        if self.fsync:
            fsync_dir(self.folder)

    # ---- writing --------------------------------------------------------------------------
    def append_async(self, payloads: list[bytes], then: Callable[[int], None] | None = None) -> Future:
        """Queue records; the future resolves to their first offset once they are on disk. Framed
        here, on the caller's thread. `then(first offset)`, if given, runs on the writer thread once
        they are on disk, before the future resolves, in offset order with every other append's
        (`append_now`'s run on its caller's thread; whoever indexes the records sees them in order)."""
        if self._closed:
            raise RuntimeError(f"log {self.folder} is closed")
        if self._error is not None:
            raise RuntimeError(f"log {self.folder} writer failed: {self._error!r}")
        return self._writer._submit(self, frames(payloads), len(payloads), then)

    def append_now(self, payloads: list[bytes], then: Callable[[int], None] | None = None) -> int | None:
        """`append_async` done on the caller's thread, when the writer is idle: their first offset once
        they are on disk; None (nothing written) when a write is under way or queued -- append_async them."""
        if self._closed:
            raise RuntimeError(f"log {self.folder} is closed")
        if self._error is not None:
            raise RuntimeError(f"log {self.folder} writer failed: {self._error!r}")
        return self._writer._write_now(self, frames(payloads), len(payloads), then)

    def append(self, payloads: list[bytes], timeout: float | None = 30.0) -> int:
        return self.append_async(payloads).result(timeout=timeout)

    def _write(self, batch: list[tuple[bytes, int, Future, Callable[[int], None] | None]]) -> list[int]:
        """On the writer thread, or `append_now`'s caller's: write framed appends (a new segment once
        this one is full, between appends); their first offsets. Not yet fsynced."""
        if self._error is not None:
            raise RuntimeError(f"log {self.folder} writer failed: {self._error!r}")
        firsts, run = [], []
        for data, count, _, _ in batch:
            if self._seg_size >= self.segment_bytes and self._seg_size:
                self._write_all(b"".join(run))
                run = []
                self._roll()
            firsts.append(self._next)
            run.append(data)
            self._seg_size += len(data)
            self._next += count
        self._write_all(run[0] if len(run) == 1 else b"".join(run))
        return firsts

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def _roll(self) -> None:
        if self._fsync_after_write:
            os.fsync(self._fd)
        os.close(self._fd)
        self._open_segment(self._next)

    def _sync(self) -> None:
        if self._fsync_after_write:
            os.fsync(self._fd)

    def _fail(self, error: BaseException, batch: list) -> None:
        log.error("log %s: write failed, the log takes no more records: %r", self.folder, error)
        self._error = error
        for _, _, fut, _ in batch:
            settle(fut, error=error)

    @property
    def end_offset(self) -> int:
        """Offset the next record will get (records below it are durable or in flight)."""
        return self._next

    # ---- reading --------------------------------------------------------------------------
    def read(self, start: int = 0, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        """(offset, payload) for the records written from `start` on (a snapshot of what is written:
        a record may be read before its fsync has returned; readers that must see only acknowledged
        records bound their reads, as the embedded bus does with its partition index).

        Segments are read in chunks of `READ_CHUNK` bytes (more for a larger record), so a reader
        that asks for a few records does not read the rest of a 64 MiB segment. Sequential readers
        (consumers, the spool's forwarder) ask for the offset where their last read ended: a small
        cache of (offset -> segment, byte position) lets that read seek straight there instead of
        parsing the segment from its start.
        """
        segs = segments(self.folder)
        hint = self._cursors.get(start)
        n = 0
        for i, (base, path) in enumerate(segs):
            nxt = segs[i + 1][0] if i + 1 < len(segs) else None
            if nxt is not None and nxt <= start:
                continue
            pos0, off = (hint[1], start) if hint is not None and hint[0] == base else (0, base)
            with open(path, "rb") as f:
                f.seek(pos0)
                buf, at, chunk = b"", pos0, READ_CHUNK  # `at`: the file position of buf[0]
                while more := f.read(chunk):
                    buf = buf + more if buf else more
                    pos = 0
                    while (frame := next_frame(buf, pos)) is not None:  # None: the rest is not read yet
                        payload, end, good = frame
                        if not good:
                            raise LogCorrupted(f"{path}: record at offset {off} fails its checksum")
                        pos, off = end, off + 1
                        if off - 1 >= start:
                            yield off - 1, payload
                            n += 1
                            if limit is not None and n >= limit:
                                self._remember(off, base, at + pos)
                                return
                    buf, at = buf[pos:], at + pos
                    chunk = READ_CHUNK if pos else chunk * 2  # no whole record in the buffer: read more at once
            self._remember(off, base, at)

    def _remember(self, offset: int, segment: int, byte_pos: int) -> None:
        with self._cursor_lock:
            if len(self._cursors) >= 64:
                self._cursors.pop(next(iter(self._cursors)))
            self._cursors[offset] = (segment, byte_pos)

    def close(self) -> None:
        """Wait for this log's appends queued so far, then release the file (and the writer, when
        the log made its own)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer._submit(self, b"", 0).exception(timeout=30)  # queued behind every append
        except RuntimeError:  # the shared writer was closed first: nothing of ours can be waiting
            pass
        except TimeoutError:
            log.warning("log %s: appends still unwritten after 30 s at close", self.folder)
        if self._own_writer:
            self._writer.close()
        os.close(self._fd)
