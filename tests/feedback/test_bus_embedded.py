"""The embedded bus's own storage: one log per topic with a partition index, the earlier layout's
migration, and the shared group-commit writer."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

import feedback.log as flog
from feedback.bus_embedded import EmbeddedBus, partition_for
from feedback.log import DurableLog, LogWriter

TOPIC = "flywheel.feedback"


def drain(consumer, want: int, max_records: int = 500):
    got = []
    for _ in range(50):
        got += consumer.poll(max_records=max_records, timeout_s=0.2)
        if len(got) >= want:
            break
    return got


def test_partition_offsets_are_dense_in_order_and_survive_reopening(tmp_path):
    bus = EmbeddedBus(tmp_path, partitions=3)
    keys = [f"c{i}" for i in range(12)]
    for round_ in range(5):
        bus.publish_many(TOPIC, [(k, f"{k}:{round_}".encode()) for k in keys])
    c = bus.consumer(TOPIC, "g")
    got = drain(c, 60, max_records=7)  # small polls: each must deliver a prefix of every partition
    assert len(got) == 60
    per_partition = defaultdict(list)
    for r in got:
        assert r.partition == partition_for(r.key, 3)
        per_partition[r.partition].append(r.offset)
    for offsets in per_partition.values():
        assert offsets == list(range(len(offsets)))  # dense, from 0, in order
    for k in keys:  # per-key order
        assert [r.value for r in got if r.key == k] == [f"{k}:{i}".encode() for i in range(5)]
    c.commit(got[:20])
    positions = {p: o for (_, p), o in c._positions(got[:20]).items()}
    c.close()
    bus.close()

    bus = EmbeddedBus(tmp_path, partitions=3)  # the index is rebuilt from the topic log
    c = bus.consumer(TOPIC, "g")
    expected = [(r.partition, r.offset, r.key, r.value) for r in got if r.offset >= positions.get(r.partition, 0)]
    again = drain(c, len(expected))
    assert sorted((r.partition, r.offset, r.key, r.value) for r in again) == sorted(expected)
    assert len(expected) == 40
    c.close()
    bus.close()
    other = EmbeddedBus(tmp_path, partitions=2)
    with pytest.raises(ValueError, match="partitions"):
        other.publish(TOPIC, "c1", b"x")
    other.close()


def test_earlier_layout_is_migrated_with_offsets_and_commits_unchanged(tmp_path):
    # What earlier versions wrote: one DurableLog per partition, records `{"k": key}\n` + value.
    legacy = defaultdict(list)
    for i in range(30):
        key = f"c{i % 7}"
        legacy[partition_for(key, 4)].append((key, f"v{i}".encode()))
    for p, recs in legacy.items():
        log = DurableLog(tmp_path / TOPIC / f"p{p}")
        log.append([json.dumps({"k": k}).encode() + b"\n" + v for k, v in recs])
        log.close()
    (tmp_path / "_groups").mkdir()
    first = min(legacy)
    (tmp_path / "_groups" / f"g--{TOPIC}.json").write_text(json.dumps({str(first): 2}))

    bus = EmbeddedBus(tmp_path, partitions=4)
    c = bus.consumer(TOPIC, "g")
    got = drain(c, 28)
    assert not list((tmp_path / TOPIC).glob("p*"))  # the old folders are gone
    by_p = defaultdict(list)
    for r in got:
        by_p[r.partition].append((r.offset, r.key, r.value))
    for p, recs in legacy.items():
        skip = 2 if p == first else 0  # committed before the migration: not delivered again
        assert by_p[p] == [(skip + i, k, v) for i, (k, v) in enumerate(recs[skip:])]
    c.close()
    bus.close()


def test_reads_in_chunks_and_a_record_larger_than_a_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(flog, "READ_CHUNK", 64)
    log = DurableLog(tmp_path)
    payloads = [b"a" * 10, b"b" * 500, b"c" * 3, b"d" * 129]
    log.append(payloads)
    assert [p for _, p in log.read()] == payloads
    assert [p for _, p in log.read(1, limit=2)] == payloads[1:3]
    assert [p for _, p in log.read(3)] == payloads[3:]  # a seek to the position the last read remembered
    log.close()


def test_shared_writer_orders_callbacks_and_isolates_a_failed_log(tmp_path):
    writer = LogWriter()
    a, b = DurableLog(tmp_path / "a", writer=writer), DurableLog(tmp_path / "b", writer=writer)
    seen = []
    futs = [a.append_async([b"x"] * 3, then=lambda first, i=i: seen.append((i, first))) for i in range(20)]
    assert [f.result(10) for f in futs] == list(range(0, 60, 3))
    assert seen == [(i, 3 * i) for i in range(20)]  # in offset order, before each future resolved

    import os
    os.close(b._fd)  # b's file is gone from under it: its writes fail, a's go on
    with pytest.raises(OSError):
        b.append_async([b"y"]).result(10)
    with pytest.raises(RuntimeError, match="writer failed"):
        b.append_async([b"z"])
    assert a.append([b"w"]) == 60
    b._fd = os.open(os.devnull, os.O_WRONLY)  # something for close() to close
    a.close()
    b.close()
    writer.close()


def test_a_cancelled_append_is_written_and_the_writer_goes_on(tmp_path):
    log = DurableLog(tmp_path)
    indexed = []
    with log._writer._cond:  # the writer cannot take the queue yet
        fut = log.append_async([b"a"], then=indexed.append)
        assert fut.cancel()  # its waiter went away (e.g. a cancelled request)
    assert log.append([b"b"]) == 1  # the writer thread survived setting the cancelled future
    assert indexed == [0] and [p for _, p in log.read()] == [b"a", b"b"]
    log.close()
