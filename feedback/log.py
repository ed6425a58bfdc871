"""A durable, append-only local log: the embedded default behind the record sink and the event bus.

Owns one folder per log. Records are framed as `[u32 length][u32 crc32][payload]` in segment
files named by their first offset; every record has a dense offset starting at 0. Appends go
through one writer thread that group-commits: all records waiting are written, the file is
fsynced once, then every waiter is released, so an acknowledged record survives a crash of the
process or the machine. On open, a torn or corrupt tail (a crash mid-write) is cut off at the
last whole record; corruption in the middle of a segment is an error, never skipped silently.

Called by `feedback.sink.LogSink` (completion records) and the embedded event bus.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<II")
SEGMENT_BYTES = 64 << 20


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


class DurableLog:
    def __init__(self, folder: str | Path, segment_bytes: int = SEGMENT_BYTES, fsync: bool = True):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.segment_bytes, self.fsync = segment_bytes, fsync
        self._cond = threading.Condition()
        self._pending: list[tuple[list[bytes], Future]] = []
        self._closed = False
        self._cursors: dict[int, tuple[int, int]] = {}  # offset -> (segment base, byte position)
        self._cursor_lock = threading.Lock()
        self._next = self._recover()
        self._writer_error: BaseException | None = None
        self._thread = threading.Thread(target=self._write_loop, name=f"log-{self.folder.name}", daemon=True)
        self._thread.start()

    # ---- segments -------------------------------------------------------------------------
    def _segments(self) -> list[tuple[int, Path]]:
        segs = []
        for p in self.folder.glob("*.log"):
            try:
                segs.append((int(p.stem), p))
            except ValueError:
                continue
        return sorted(segs)

    def _recover(self) -> int:
        segs = self._segments()
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
        self._fh = open(path, "ab")
        self._seg_base, self._seg_size = base, good_bytes
        return base + count

    def _open_segment(self, base: int) -> None:
        self._fh = open(self.folder / f"{base:020d}.log", "ab")
        self._seg_base, self._seg_size = base, 0
        if self.fsync:
            dfd = os.open(self.folder, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    # ---- writing --------------------------------------------------------------------------
    def append_async(self, payloads: list[bytes]) -> Future:
        """Queue records; the future resolves to their first offset once they are on disk."""
        fut: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"log {self.folder} is closed")
            if self._writer_error is not None:
                raise RuntimeError(f"log {self.folder} writer failed: {self._writer_error!r}")
            self._pending.append((list(payloads), fut))
            self._cond.notify()
        return fut

    def append(self, payloads: list[bytes], timeout: float | None = 30.0) -> int:
        return self.append_async(payloads).result(timeout=timeout)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if not self._pending and self._closed:
                    return
                batch, self._pending = self._pending, []
            try:
                firsts = []
                for payloads, _ in batch:
                    firsts.append(self._next)
                    for p in payloads:
                        if self._seg_size >= self.segment_bytes:
                            self._fh.flush()
                            if self.fsync:
                                os.fsync(self._fh.fileno())
                            self._fh.close()
                            self._open_segment(self._next)
                        frame = _HEADER.pack(len(p), zlib.crc32(p)) + p
                        self._fh.write(frame)
                        self._seg_size += len(frame)
                        self._next += 1
                self._fh.flush()
                if self.fsync:
                    os.fsync(self._fh.fileno())
            except BaseException as e:  # nothing acknowledged past this point; every waiter hears it
                with self._cond:
                    self._writer_error = e
                for _, fut in batch:
                    fut.set_exception(e)
                raise
            for (_, fut), first in zip(batch, firsts):
                fut.set_result(first)

    @property
    def end_offset(self) -> int:
        """Offset the next record will get (records below it are durable or in flight)."""
        return self._next

    # ---- reading --------------------------------------------------------------------------
    def read(self, start: int = 0, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        """(offset, payload) for durable records from `start` on (a snapshot of what is written).

        Sequential readers (consumers, the spool's forwarder) ask for the offset where their last read
        ended: a small cache of (offset -> segment, byte position) lets that read seek straight there
        instead of parsing the segment from its start.
        """
        segs = self._segments()
        hint = self._cursors.get(start)
        n = 0
        for i, (base, path) in enumerate(segs):
            nxt = segs[i + 1][0] if i + 1 < len(segs) else None
            if nxt is not None and nxt <= start:
                continue
            pos0, off = (hint[1], start) if hint is not None and hint[0] == base else (0, base)
            with open(path, "rb") as f:
                f.seek(pos0)
                data = f.read()
            pos = 0
            while (frame := next_frame(data, pos)) is not None:  # None: the last one is being written
                payload, end, good = frame
                if not good:
                    raise LogCorrupted(f"{path}: record at offset {off} fails its checksum")
                pos, off = end, off + 1
                if off - 1 >= start:
                    yield off - 1, payload
                    n += 1
                    if limit is not None and n >= limit:
                        self._remember(off, base, pos0 + pos)
                        return
            self._remember(off, base, pos0 + pos)

    def _remember(self, offset: int, segment: int, byte_pos: int) -> None:
        with self._cursor_lock:
            if len(self._cursors) >= 64:
                self._cursors.pop(next(iter(self._cursors)))
            self._cursors[offset] = (segment, byte_pos)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)
        self._fh.close()
