"""A durable, append-only local log of opaque records: the storage of the embedded bus and the spool.

Owns one folder of segments, `<base offset>.log`: an 8-byte header (magic, format version), then frames
`[u32 length][u32 crc32][payload]`. Offsets are dense from 0 and survive reopening. `append()` returns
once its records are written and fsynced (one write, one fsync, under a lock), so a caller may
acknowledge them. A crash mid-write leaves a torn last frame, which reopening cuts (it was never
acknowledged); a bad checksum anywhere else is an error, never skipped. `read()` does not block writers.

Processes share a log through its files: `read()` and `append()` first catch up with what other
processes appended (frames past the end this process knows, and segments they rolled to), so the
gateway, the joiner and the learner of `flywheel up` see each other's records. Each topic has one
writing process there; appends are O_APPEND, one write per batch.

Called by `feedback.bus_embedded` and `feedback.spool`.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from core.files import fsync_dir

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
HEADER = b"FWLOG" + bytes([0, 0, FORMAT_VERSION])  # 8 bytes at the start of every segment
_FRAME = struct.Struct("<II")  # payload length, crc32 of the payload
SEGMENT_BYTES = 64 << 20


class LogCorrupted(Exception):
    """A record fails its checksum (not at the torn tail), or a segment is not in this format."""


def segments(folder: Path) -> list[tuple[int, Path]]:
    """A log folder's segments, `(base offset, path)`, in offset order."""
    return sorted((int(p.stem), p) for p in folder.glob("*.log") if p.stem.isdigit())


def _crc(payload: bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(struct.pack("<I", len(payload))))  # the length is covered too


class SegmentReader:
    """Reads one segment file frame by frame from a byte position: the only parser of the format."""

    def __init__(self, path: Path, pos: int = 0, offset: int = 0):
        """`offset`: the offset of the record at `pos` (for error messages)."""
        self.path, self.offset = path, offset
        self._f = open(path, "rb")
        head = self._f.read(len(HEADER))
        if head != HEADER:
            self._f.close()
            raise LogCorrupted(f"{path}: not a version-{FORMAT_VERSION} Flywheel log segment (header {head!r})")
        self.pos = max(pos, len(HEADER))
        self._f.seek(self.pos)

    def next(self) -> bytes | None:
        """The next whole record, or None at the end (or at a torn tail: a partial last frame).
        A whole frame with a wrong checksum raises LogCorrupted."""
        head = self._f.read(_FRAME.size)
        n, crc = _FRAME.unpack(head) if len(head) == _FRAME.size else (0, None)
        payload = self._f.read(n)
        if crc is None or len(payload) < n:  # the end, or a partial frame
            self._f.seek(self.pos)
            return None
        if _crc(payload) != crc:
            raise LogCorrupted(f"{self.path}: record at offset {self.offset} fails its checksum")
        self.pos += _FRAME.size + n
        self.offset += 1
        return payload

    def close(self) -> None:
        self._f.close()


class DurableLog:
    def __init__(self, folder: str | Path, segment_bytes: int = SEGMENT_BYTES, fsync: bool = True):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.segment_bytes, self.fsync = segment_bytes, fsync
        self._lock = threading.Lock()
        self._closed = False
        self._cursor: tuple[int, int, int] | None = None  # (offset, segment base, byte position) of a read's end
        self._next = self._recover()

    def _recover(self) -> int:
        segs = segments(self.folder)
        if not segs:
            self._open_segment(0)
            return 0
        base, path = segs[-1]
        reader = SegmentReader(path, 0, base)
        size = path.stat().st_size
        count = 0
        try:
            while True:
                try:
                    if reader.next() is None:
                        break
                except LogCorrupted:
                    with open(path, "rb") as f:  # only the last frame may be torn this way
                        f.seek(reader.pos)
                        n = _FRAME.unpack(f.read(_FRAME.size))[0]
                    if reader.pos + _FRAME.size + n < size:
                        raise
                    break
                count += 1
        finally:
            reader.close()
        if reader.pos != size:
            log.warning("%s: cutting %d bytes of torn tail after offset %d", path, size - reader.pos, base + count)
            with open(path, "r+b") as f:
                f.truncate(reader.pos)
                os.fsync(f.fileno())
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self._seg_base, self._seg_size = base, reader.pos
        return base + count

    def _segment_path(self, base: int) -> Path:
        return self.folder / f"{base:020d}.log"

    def _open_segment(self, base: int) -> None:
        path = self._segment_path(base)
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # another process made it a moment ago: its header is on the way
            for _ in range(100):
                if path.stat().st_size >= len(HEADER):
                    break
                time.sleep(0.01)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            self._seg_base, self._seg_size = base, len(HEADER)
            return
        os.write(self._fd, HEADER)
        if self.fsync:
            os.fsync(self._fd)
            fsync_dir(self.folder)
        self._seg_base, self._seg_size = base, len(HEADER)

    @property
    def end_offset(self) -> int:
        """The offset the next record will get: every record below it is durable."""
        return self._next

    @property
    def first_offset(self) -> int:
        """The first offset still stored (segments below it were deleted)."""
        segs = segments(self.folder)
        return segs[0][0] if segs else self._next

    def _catch_up(self) -> None:
        """Count the whole frames other processes appended past the known end (lock held)."""
        path = self._segment_path(self._seg_base)
        try:
            grown, gone = path.stat().st_size > self._seg_size, False
        except FileNotFoundError:
            grown, gone = False, True
        if not (grown or gone) and self._next > self._seg_base and not self._segment_path(self._next).exists():
            # Nobody appended to the current segment since we last looked, so a segment another process
            # opened since can only start where the current one's records end: none there, none at all
            # (listing the folder on every append was 2.3 % of a loaded gateway's lock-holding time).
            return
        later = [seg for seg in segments(self.folder) if seg[0] > self._seg_base]
        if not grown and not later:
            return
        for base, seg_path in [(self._seg_base, path), *later]:
            if base != self._seg_base:
                if base != self._next:  # a segment starts where the previous one's records end
                    raise LogCorrupted(f"{seg_path}: starts at offset {base}, expected {self._next}")
                os.close(self._fd)
                self._fd = os.open(seg_path, os.O_WRONLY | os.O_APPEND)
                self._seg_base, self._seg_size = base, len(HEADER)
            reader = SegmentReader(seg_path, self._seg_size, self._next)
            try:
                while True:
                    try:
                        if reader.next() is None:
                            break
                    except LogCorrupted:
                        break  # the tail of a write still in progress: counted on a later call
                    self._next += 1
                self._seg_size = reader.pos
            finally:
                reader.close()

    def append(self, payloads: list[bytes]) -> int:
        """Write and fsync `payloads` in order; their first offset once they are durable."""
        data = b"".join(_FRAME.pack(len(p), _crc(p)) + p for p in payloads)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"log {self.folder} is closed")
            self._catch_up()
            if self._seg_size >= self.segment_bytes:
                os.close(self._fd)
                self._open_segment(self._next)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            if self.fsync:
                os.fdatasync(self._fd)
            first = self._next
            self._seg_size += len(data)
            self._next += len(payloads)
            return first

    def read(self, start: int = 0, limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        """(offset, payload) of the durable records from `start` on, at most `limit` of them. A reader
        that continues where its last read ended resumes at the remembered byte position."""
        with self._lock:
            if not self._closed:
                self._catch_up()
        end = self._next if limit is None else min(self._next, start + limit)
        if start >= end:
            return
        segs = segments(self.folder)
        for i, (base, path) in enumerate(segs):
            nxt = segs[i + 1][0] if i + 1 < len(segs) else None
            if (nxt is not None and nxt <= start) or base >= end:
                continue
            cur = self._cursor
            pos, off = (cur[2], cur[0]) if cur is not None and cur[1] == base and base <= cur[0] <= start else (0, base)
            reader = SegmentReader(path, pos, off)
            try:
                while off < end:
                    payload = reader.next()
                    if payload is None:
                        break
                    if off >= start:
                        yield off, payload
                    off += 1
                self._cursor = (off, base, reader.pos)
            finally:
                reader.close()
            if off >= end:
                return

    def delete_before(self, offset: int) -> None:
        """Delete the segments whose every record is below `offset` (never the one being written)."""
        segs = segments(self.folder)
        for (_, path), (nxt, _) in zip(segs, segs[1:]):
            if nxt <= offset:
                path.unlink()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._fd)
