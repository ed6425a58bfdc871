"""The durable local log: offsets, group commit from many threads, recovery from a torn tail."""

import threading
import time

import pytest

from feedback.log import DurableLog, LogCorrupted


def test_append_read_and_reopen(tmp_path):
    log = DurableLog(tmp_path)
    assert log.append([b"a", b"b"]) == 0
    assert log.append([b"c"]) == 2
    log.close()
    log = DurableLog(tmp_path)
    assert log.end_offset == 3
    assert log.append([b"d"]) == 3
    assert list(log.read()) == [(0, b"a"), (1, b"b"), (2, b"c"), (3, b"d")]
    assert list(log.read(2, limit=1)) == [(2, b"c")]
    log.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.append([b"x"])


def test_many_threads_every_record_once_in_order_per_thread(tmp_path):
    log = DurableLog(tmp_path, segment_bytes=2048)  # small segments: exercise rollover
    def worker(t):
        for i in range(100):
            log.append([f"{t}:{i}".encode()])
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    records = list(log.read())
    assert [o for o, _ in records] == list(range(800))
    assert len(list(tmp_path.glob("*.log"))) > 1
    for t in range(8):
        mine = [int(p.decode().split(":")[1]) for _, p in records if p.decode().startswith(f"{t}:")]
        assert mine == list(range(100))
    log.close()


def test_torn_tail_is_cut_and_log_continues(tmp_path):
    log = DurableLog(tmp_path)
    log.append([b"one", b"two"])
    log.close()
    seg = next(tmp_path.glob("*.log"))
    seg.write_bytes(seg.read_bytes() + b"\x10\x00\x00\x00garbage")  # a crash mid-frame
    log = DurableLog(tmp_path)
    assert log.end_offset == 2
    log.append([b"three"])
    assert [p for _, p in log.read()] == [b"one", b"two", b"three"]
    log.close()


def test_corruption_in_the_middle_is_an_error(tmp_path):
    log = DurableLog(tmp_path)
    log.append([b"first-record", b"second-record"])
    seg = next(tmp_path.glob("*.log"))
    data = bytearray(seg.read_bytes())
    data[10] ^= 0xFF  # inside the first payload
    seg.write_bytes(bytes(data))
    with pytest.raises(LogCorrupted, match="offset 0"):
        list(log.read())
    log.close()


def test_sequential_chunked_reads_seek_and_agree_with_a_full_read(tmp_path):
    log = DurableLog(tmp_path, segment_bytes=4096)
    for i in range(50):
        log.append([f"r{i}-{j}".encode() * (1 + j % 7) for j in range(10)])
    full = list(log.read())
    chunks, start = [], 0
    while True:
        part = list(log.read(start, limit=37))
        if not part:
            break
        chunks += part
        start = part[-1][0] + 1
        assert start in log._cursors  # the next sequential read will seek, not rescan
    assert chunks == full and len(full) == 500
    assert list(log.read(123, limit=3)) == full[123:126]  # an arbitrary start still works
    log.close()


@pytest.mark.skipif(not getattr(__import__("os"), "O_DSYNC", 0), reason="the platform has no O_DSYNC")
def test_segments_are_written_synchronously_when_fsync_is_on(tmp_path):
    """With fsync on, every segment (the first, a reopened one, a rolled one) is opened O_DSYNC: a
    write is on disk when it returns, so the group commit needs no fsync of its own."""
    import fcntl
    import os

    log = DurableLog(tmp_path / "a", segment_bytes=64)
    assert fcntl.fcntl(log._fd, fcntl.F_GETFL) & os.O_DSYNC
    log.append([b"x" * 100])
    log.append([b"y"])  # the first segment is full: this one goes to a new segment
    assert len(list((tmp_path / "a").glob("*.log"))) == 2
    assert fcntl.fcntl(log._fd, fcntl.F_GETFL) & os.O_DSYNC
    log.close()
    again = DurableLog(tmp_path / "a")
    assert fcntl.fcntl(again._fd, fcntl.F_GETFL) & os.O_DSYNC
    assert [r for _, r in again.read(0)] == [b"x" * 100, b"y"]
    again.close()
    off = DurableLog(tmp_path / "b", fsync=False)
    assert not fcntl.fcntl(off._fd, fcntl.F_GETFL) & os.O_DSYNC
    off.close()


def test_append_now_writes_on_the_callers_thread_only_when_the_writer_is_idle(tmp_path):
    """`append_now` writes (and syncs) on the calling thread when nothing is queued or being
    written; while the writer thread is busy it writes nothing and returns None. Offsets stay
    dense and in order across both ways, `then` runs in offset order, and a mix of threads using
    both keeps every record once."""
    log = DurableLog(tmp_path, segment_bytes=4096)
    seen: list[tuple[str, int]] = []
    assert log.append_now([b"a", b"b"], then=lambda first: seen.append(("now", first))) == 0
    release = threading.Event()

    def hold(first: int) -> None:  # runs on the writer thread: it stays busy until released
        seen.append(("async", first))
        release.wait(10)

    fut = log.append_async([b"c"], then=hold)
    deadline = time.monotonic() + 10
    while not seen[1:] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert log.append_now([b"never"]) is None  # the writer is mid-commit: nothing written
    release.set()
    assert fut.result(timeout=10) == 2
    assert log.append_now([b"d"], then=lambda first: seen.append(("now", first))) == 3
    assert seen == [("now", 0), ("async", 2), ("now", 3)]

    def worker(t: int) -> None:
        for i in range(100):
            payload = [f"{t}:{i}".encode()]
            if (t + i) % 2 or log.append_now(payload) is None:
                log.append(payload)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    records = list(log.read())
    assert [o for o, _ in records] == list(range(604))
    assert [p for _, p in records[:4]] == [b"a", b"b", b"c", b"d"] and b"never" not in {p for _, p in records}
    for t in range(6):
        assert [int(p.split(b":")[1]) for _, p in records if p.startswith(f"{t}:".encode())] == list(range(100))
    log.close()
    reopened = DurableLog(tmp_path)
    assert [p for _, p in reopened.read()] == [p for _, p in records]
    reopened.close()
    with pytest.raises(RuntimeError, match="closed"):
        log.append_now([b"x"])
