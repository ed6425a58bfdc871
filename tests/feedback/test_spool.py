"""The producer spool against a real broker (tansu) and while it is down: the backlog grows and
drains, a restarted spool resumes from its saved position (repeats possible, loss never), the
Deduper removes repeats, and a forwarder that dies says so."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter

import pytest

from core.harness import wait_until
from feedback.bus import Consumer
from feedback.bus_kafka import KafkaBus
from feedback.spool import Deduper, Spool, decode, encode
from tests.feedback.conftest import FAST_CONSUMER, read_until


def make_bus(broker, spool_dir) -> KafkaBus:
    return KafkaBus(
        broker.bootstrap,
        spool_dir,
        partitions=3,
        send_timeout_s=2,
        consumer_config=FAST_CONSUMER,
        spool_backoff_s=(0.05, 0.5),
    )


def publish(bus: KafkaBus, topic: str, start: int, n: int) -> list[str]:
    ids = []
    for i in range(start, start + n):
        ids.append(f"ev-{i:05d}")
        bus.publish(topic, f"cmp-{i % 5}", json.dumps({"event_id": ids[-1], "i": i}).encode())
    return ids


def read_all(c: Consumer, n: int, timeout_s: float = 30.0, quiet_s: float = 1.0) -> list[tuple[str, str]]:
    """(key, event_id) of every record delivered, repeats included: `n` of them, then `quiet_s` of nothing."""
    out: list[tuple[str, str]] = []

    def read() -> None:
        got = c.poll(timeout_s=0.2)
        out.extend((r.key, json.loads(r.value)["event_id"]) for r in got)
        c.commit(got)

    try:
        read_until(read, lambda: len(out) >= n, timeout_s, what=f"{n} records", quiet_s=quiet_s)
    finally:
        c.close()
    return out


def per_key(pairs) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for k, e in pairs:
        out.setdefault(k, []).append(e)
    return out


@pytest.mark.kafka
@pytest.mark.slow
def test_backlog_grows_while_down_and_drains_when_up(kafka_broker, tmp_path):
    topic = f"spool-{uuid.uuid4().hex[:8]}"
    kafka_broker.kill()
    bus = make_bus(kafka_broker, tmp_path / "spool")
    try:
        sent = publish(bus, topic, 0, 30)
        assert bus.backlog == 30
        wait_until(lambda: bus.spool.failures >= 1, 20, what="a failed delivery")  # the forwarder tried (and retries)
        sent += publish(bus, topic, 30, 20)
        assert bus.backlog == 50 and bus.healthy
        with pytest.raises(TimeoutError, match="50 records not forwarded"):
            bus.flush(timeout_s=0.3)

        kafka_broker.start()
        bus.flush(timeout_s=30)
        assert bus.backlog == 0 and bus.spool.forwarded == 50
        got = read_all(bus.consumer(topic, "g"), 50)
        assert sorted(e for _, e in got) == sent  # everything, once (a fresh producer after the outage)
        assert per_key(got) == per_key((f"cmp-{i % 5}", e) for i, e in enumerate(sent))
    finally:
        bus.close()


@pytest.mark.kafka
@pytest.mark.slow
def test_restart_without_flush_resumes_from_the_saved_position(running_broker, tmp_path):
    topic = f"spool-{uuid.uuid4().hex[:8]}"
    bus = make_bus(running_broker, tmp_path / "spool")
    sent = publish(bus, topic, 0, 10)
    bus.flush(30)
    running_broker.kill()
    sent += publish(bus, topic, 10, 40)  # spooled while the broker is down
    bus.close(flush_timeout_s=0)  # like a process that exits now: nothing more is forwarded
    assert bus.spool.forwarded == 10

    running_broker.start()  # empty again (memory storage): the first 10 are gone with the old broker
    bus = make_bus(running_broker, tmp_path / "spool")
    try:
        assert bus.backlog == 40  # read back from disk
        bus.flush(30)
        got = read_all(bus.consumer(topic, "g"), 40)
        assert sorted(e for _, e in got) == sent[10:]  # exactly the unforwarded ones: no loss, no repeat
    finally:
        bus.close()


@pytest.mark.kafka
@pytest.mark.slow
def test_crash_after_acks_before_position_save_repeats_and_deduper_removes_them(running_broker, tmp_path):
    topic = f"spool-{uuid.uuid4().hex[:8]}"
    spool_dir = tmp_path / "spool"
    bus = make_bus(running_broker, spool_dir)
    sent = publish(bus, topic, 0, 30)
    bus.flush(30)
    stale_position = (spool_dir / "forwarded.json").read_bytes()  # the position after 30
    sent += publish(bus, topic, 30, 30)
    bus.flush(30)
    bus.close(flush_timeout_s=0)
    # A crash after the broker acknowledged records 30..59 and before the position was saved leaves
    # exactly this on disk:
    (spool_dir / "forwarded.json").write_bytes(stale_position)

    bus = make_bus(running_broker, spool_dir)
    try:
        assert bus.backlog == 30
        bus.flush(30)
        got = read_all(bus.consumer(topic, "g"), 90)
    finally:
        bus.close()
    assert len(got) == 90  # 60 + the 30 re-forwarded
    dedupe = Deduper(capacity=1000)
    kept = [(k, e) for k, e in got if not dedupe.seen(e)]
    assert sorted(e for _, e in kept) == sent  # every event exactly once after dedupe
    counts = Counter(e for _, e in got)
    assert (
        sorted(e for e, n in counts.items() if n > 1) == sent[30:] and max(counts.values()) == 2
    )  # the repeats are the batch that was acknowledged but not recorded
    assert per_key(kept) == per_key((f"cmp-{i % 5}", e) for i, e in enumerate(sent))  # order survives


def test_deduper_is_bounded_and_remembers_recent_ids():
    d = Deduper(capacity=3)
    assert [d.seen(x) for x in "abca"] == [False, False, False, True]
    assert d.seen("d") is False  # evicts the least recently seen: "b"
    assert len(d) == 3
    assert d.seen("b") is False and d.seen("a") is True
    with pytest.raises(ValueError, match="0"):
        Deduper(capacity=0)


def test_a_dead_forwarder_fails_loudly_and_keeps_the_records(tmp_path):
    delivered: list[int] = []

    def deliver(batch):  # a consumer of the spool that chokes on a record it cannot parse
        for r in batch:
            json.loads(r.value)
        delivered.extend(r.offset for r in batch)

    spool = Spool(tmp_path / "spool", deliver, retriable=(OSError,), batch_size=1)
    spool.publish("t", "k", b'{"ok": 1}')
    spool.flush(10)
    spool.publish("t", "k", b"not json")
    with pytest.raises(RuntimeError, match="forwarder died") as err:
        spool.flush(10)
    assert isinstance(err.value.__cause__, json.JSONDecodeError)
    assert not spool.healthy and spool.backlog == 1 and delivered == [0]
    assert spool.publish("t", "k", b'{"ok": 2}') == 2  # still durable: nothing is lost
    spool.close(flush_timeout_s=0)

    reopened = Spool(tmp_path / "spool", lambda batch: delivered.extend(r.offset for r in batch))
    reopened.flush(10)
    assert delivered == [0, 1, 2]
    reopened.close()


def test_forwarded_segments_are_deleted_and_offsets_survive_reopening(tmp_path):
    delivered: list[tuple[int, str, str, bytes]] = []

    def deliver(batch):  # an in-process destination: records in the order they are delivered
        delivered.extend((r.offset, r.topic, r.key, r.value) for r in batch)

    spool = Spool(tmp_path / "spool", deliver, batch_size=7, segment_bytes=256)
    for i in range(50):
        spool.publish("flywheel.feedback", f"cmp-{i % 3}\n", b"x" * 30 + bytes([i]))
    spool.flush(10)
    spool.close()
    assert delivered == [(i, "flywheel.feedback", f"cmp-{i % 3}\n", b"x" * 30 + bytes([i])) for i in range(50)]
    segments = sorted(p.name for p in (tmp_path / "spool" / "log").glob("*.log"))
    assert len(segments) == 1 and int(segments[0].split(".")[0]) > 0  # only the active segment is left

    reopened = Spool(tmp_path / "spool", deliver, segment_bytes=256)
    assert reopened.backlog == 0 and reopened.forwarded == 50
    assert reopened.publish("t", "k", b"next") == 50
    reopened.flush(10)
    reopened.close()
    assert delivered[-1] == (50, "t", "k", b"next") and len(delivered) == 51


@pytest.mark.parametrize(
    ("topic", "key"),
    [
        ("feedback", "cmpl-00ab"),
        ("t", 'a", "b'),
        ("t", "back\\slash"),
        ("t", "ünïcode-ключ"),
        ("t", '"'),
        ("t.x-y_z", "k\n2"),
    ],
)
def test_spooled_record_header_round_trip(topic, key):
    value = b'{"any": "bytes"}\n\x00\xff'
    rec = decode(7, encode(topic, key, value))
    assert (rec.offset, rec.topic, rec.key, rec.value) == (7, topic, key, value)


@pytest.mark.parametrize("position", [b"", b'{"forwar', b'{"forwarded": 3}'])
def test_a_lost_or_stale_position_resumes_at_the_first_segment_kept(tmp_path, position):
    """forwarded.json is fsynced only when segments were deleted: after
    a power cut it may be empty, torn or older than the segments kept. The forwarder resumes at the
    first segment (all below it were forwarded before it was deleted): repeats, never a gap or a
    dead forwarder."""
    got: list[int] = []
    spool = Spool(
        tmp_path / "s", lambda batch: got.extend(r.offset for r in batch), segment_bytes=2000, batch_size=7, fsync=False
    )
    for i in range(60):
        spool.publish("t", f"k{i}", b"x" * 100)
    spool.flush(timeout_s=10)
    spool.close()
    assert got == list(range(60))
    first = min(int(p.stem) for p in (tmp_path / "s" / "log").glob("*.log"))
    assert 3 < first < 60  # segments below were deleted
    (tmp_path / "s" / "forwarded.json").write_bytes(position)
    again: list[int] = []
    spool = Spool(tmp_path / "s", lambda batch: again.extend(r.offset for r in batch), segment_bytes=2000, fsync=False)
    try:
        spool.publish("t", "k-new", b"y")
        spool.flush(timeout_s=10)
        assert spool.healthy
    finally:
        spool.close()
    assert again == list(range(first, 61))


def test_pending_since_is_the_publish_time_of_the_oldest_record_not_delivered(tmp_path):
    """The gateway's bus watermark reads this: None with nothing pending, the first undelivered
    append's time while the destination refuses, None again once it is delivered; what a reopened
    spool recovered dates from the epoch until it is delivered."""
    up = threading.Event()

    def deliver(batch):
        if not up.is_set():
            raise OSError("broker away")

    spool = Spool(tmp_path / "spool", deliver, retriable=(OSError,), backoff_s=(0.01, 0.05))
    assert spool.pending_since() is None
    before = time.time()
    spool.publish("t", "k", b"1")
    time.sleep(0.05)
    spool.publish("t", "k", b"2")
    first = spool.pending_since()
    assert first is not None and before <= first < before + 0.05  # the first append's time, not the second's
    spool.close(flush_timeout_s=0)

    spool = Spool(tmp_path / "spool", deliver, retriable=(OSError,), backoff_s=(0.01, 0.05))
    assert spool.pending_since() == 0.0  # recovered records were published at some unknown time: the epoch
    up.set()
    spool.flush(10)
    assert spool.pending_since() is None and spool.backlog == 0
    spool.close()
