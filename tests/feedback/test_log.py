"""The durable local log: offsets, appends from many threads, recovery from a torn tail, corruption."""

import threading

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
    data[18] ^= 0xFF  # inside the first payload (8-byte segment header, 8-byte frame head)
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
        assert log._cursor[0] == start  # the next sequential read will seek, not rescan
    assert chunks == full and len(full) == 500
    assert list(log.read(123, limit=3)) == full[123:126]  # an arbitrary start still works
    log.close()


def test_a_segment_of_another_format_is_refused(tmp_path):
    (tmp_path / f"{0:020d}.log").write_bytes(b"NOTALOG!" + b"x" * 20)
    with pytest.raises(LogCorrupted, match="version-1"):
        DurableLog(tmp_path)


def test_delete_before_keeps_the_active_segment_and_offsets(tmp_path):
    log = DurableLog(tmp_path, segment_bytes=64)
    for i in range(20):
        log.append([b"r%02d" % i])
    log.delete_before(15)
    assert 0 < log.first_offset <= 15
    assert [o for o, _ in log.read(log.first_offset)] == list(range(log.first_offset, 20))
    log.close()
    assert DurableLog(tmp_path, segment_bytes=64).end_offset == 20
