"""The embedded bus's own storage: one durable log per partition, dense offsets that survive
reopening, and a folder that keeps the partition count it was made with."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from core.harness import wait_until
from feedback.bus_embedded import EmbeddedBus, partition_for

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
    got = drain(c, 60, max_records=7)  # small polls
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

    bus = EmbeddedBus(tmp_path, partitions=3)
    c = bus.consumer(TOPIC, "g")
    expected = [(r.partition, r.offset, r.key, r.value) for r in got if r.offset >= positions.get(r.partition, 0)]
    again = drain(c, len(expected))
    assert sorted((r.partition, r.offset, r.key, r.value) for r in again) == sorted(expected)
    assert len(expected) == 40
    c.close()
    bus.close()
    with pytest.raises(ValueError, match="3 partitions"):
        EmbeddedBus(tmp_path, partitions=2)


def test_a_busy_partition_does_not_starve_the_others(tmp_path):
    bus = EmbeddedBus(tmp_path, partitions=2)
    busy = next(k for k in (f"k{i}" for i in range(100)) if partition_for(k, 2) == 0)
    quiet = next(k for k in (f"k{i}" for i in range(100)) if partition_for(k, 2) == 1)
    bus.publish_many(TOPIC, [(busy, b"x")] * 50 + [(quiet, b"y")])
    c = bus.consumer(TOPIC, "g")
    seen = [r.key for _ in range(2) for r in c.poll(max_records=10, timeout_s=0.2)]
    assert quiet in seen
    c.close()
    bus.close()


def test_a_bus_folder_of_another_format_version_is_refused(tmp_path):
    EmbeddedBus(tmp_path).close()
    (tmp_path / "bus.json").write_text(json.dumps({"version": 0, "partitions": 4}))
    with pytest.raises(ValueError, match="version 0"):
        EmbeddedBus(tmp_path)


def test_a_consumer_sees_what_another_process_publishes_later(tmp_path):
    """`flywheel up` runs the gateway, the joiner and the learner as processes on one embedded bus:
    a consumer opened first (before the topic exists) gets what a second process publishes, also
    after that process rolls to a new segment."""
    import subprocess
    import sys

    bus = EmbeddedBus(tmp_path / "bus", partitions=1)
    consumer = bus.consumer("t", group="g")
    assert consumer.poll(timeout_s=0.1) == []
    code = (  # the bus's record format written straight to the partition's log, rolling segments often
        "import sys; from feedback.log import DurableLog\n"
        f"log = DurableLog({str(tmp_path / 'bus' / 't' / 'p0')!r}, segment_bytes=100)\n"
        "for i in range(int(sys.argv[1])): log.append([b'\\x01\\x00k' + b'%03d' % i])\n"
        "log.close()\n"
    )
    subprocess.run([sys.executable, "-c", code, "25"], check=True, timeout=60)
    got = []
    wait_until(lambda: got.extend(consumer.poll(timeout_s=0.2)) or len(got) >= 25, 20, what="25 records", interval_s=0)
    assert [r.value for r in got] == [b"%03d" % i for i in range(25)]
    assert [r.offset for r in got] == list(range(25))
    consumer.commit(got)
    subprocess.run([sys.executable, "-c", code, "3"], check=True, timeout=60)  # appends after the others
    more = consumer.poll(timeout_s=2.0)
    assert [(r.offset, r.value) for r in more] == [(25, b"000"), (26, b"001"), (27, b"002")]
    consumer.close()
    bus.close()
