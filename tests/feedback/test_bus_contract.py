"""The event-bus contract, one suite for both implementations: the embedded log and Kafka (tansu).

Per-key order, commit-after-processing, redelivery of what was not committed, committed positions
that outlive the bus, independent groups, a group's members splitting the partitions, and the
ValueErrors for user mistakes. Kafka runs marked `kafka` against a real broker.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter, defaultdict

import pytest
from kafka.partitioner import murmur2

from core.harness import wait_until
from feedback.bus import Consumer, EventBus, Record
from feedback.bus_embedded import EmbeddedBus, partition_for
from feedback.bus_kafka import KafkaBus
from feedback.events import TOPICS, CompletionEvent
from feedback.sink import CompletionSink
from tests.feedback.conftest import FAST_CONSUMER, completion_event, read_until

PARTITIONS = 4


class Harness:
    """A bus of one kind that can be closed and opened again on the same storage; it closes every
    consumer and bus it made (a Kafka consumer left open would hold its group)."""

    def __init__(self, kind: str, tmp_path, bootstrap: str | None):
        self.kind, self.tmp_path, self.bootstrap = kind, tmp_path, bootstrap
        self.consumers: list[Consumer] = []
        self.buses: list[EventBus] = []
        self.bus = self.open()
        self.quiet_s = 1.0 if kind == "kafka" else 0.2  # how long "nothing more arrives" is watched

    def open(self) -> EventBus:
        if self.kind == "embedded":
            bus: EventBus = EmbeddedBus(self.tmp_path / "bus", partitions=PARTITIONS)
        else:
            bus = KafkaBus(
                self.bootstrap,
                self.tmp_path / "spool",
                partitions=PARTITIONS,
                send_timeout_s=5,
                consumer_config=FAST_CONSUMER,
            )
        self.buses.append(bus)
        return bus

    def reopen(self) -> EventBus:
        self.bus.close()
        self.bus = self.open()
        return self.bus

    def consumer(self, topics, group: str) -> Consumer:
        c = self.bus.consumer(topics, group)
        self.consumers.append(c)
        return c

    @staticmethod
    def assignment(c: Consumer) -> list[int]:
        return [p for _, p in c.assignment()]

    def close(self) -> None:
        for c in self.consumers:
            c.close()
        for b in self.buses:
            b.close()


# On Kafka a consumer group takes seconds to settle: those variants are slow.
@pytest.fixture(params=["embedded", pytest.param("kafka", marks=[pytest.mark.kafka, pytest.mark.slow])])
def h(request, tmp_path):
    bootstrap = request.getfixturevalue("running_broker").bootstrap if request.param == "kafka" else None
    harness = Harness(request.param, tmp_path, bootstrap)
    yield harness
    harness.close()


def new_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def publish(bus: EventBus, topic: str, n: int, start: int = 0, keys: int = 10) -> list[Record]:
    """n events with unique ids; key = one of `keys` completion ids. Returns what was sent (no offsets)."""
    sent = []
    for i in range(start, start + n):
        key, value = f"cmp-{i % keys}", json.dumps({"event_id": f"ev-{i:06d}", "i": i}).encode()
        bus.publish(topic, key, value)
        sent.append(Record(topic, -1, -1, key, value))
    bus.flush(30)
    return sent


def drain(c: Consumer, n: int, quiet_s: float, commit: bool = False, timeout_s: float = 30.0) -> list[Record]:
    """Poll until `n` records came, then keep polling `quiet_s` more to catch any extra."""
    out: list[Record] = []

    def read() -> None:
        got = c.poll(max_records=100, timeout_s=0.2)
        out.extend(got)
        if commit and got:
            c.commit(got)

    read_until(read, lambda: len(out) >= n, timeout_s, what=f"{n} records", quiet_s=quiet_s)
    return out


def ids(records) -> list[str]:
    return [json.loads(r.value)["event_id"] for r in records]


def by_key(records) -> dict[str, list[str]]:
    out = defaultdict(list)
    for r in records:
        out[r.key].append(json.loads(r.value)["event_id"])
    return dict(out)


def test_per_key_order(h):
    topic = new_name("order")
    sent = publish(h.bus, topic, 200, keys=7)
    got = drain(h.consumer(topic, new_name("g")), 200, h.quiet_s)
    assert len(got) == 200
    assert by_key(got) == by_key(sent)  # same events per key, in publish order
    for p in {r.partition for r in got}:
        offsets = [r.offset for r in got if r.partition == p]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    # Each key in its bus's partition: crc32 (embedded), the Java client's murmur2 rule (Kafka).
    rule = (
        (lambda k: partition_for(k, PARTITIONS))
        if h.kind == "embedded"
        else (lambda k: (murmur2(k.encode()) & 0x7FFFFFFF) % PARTITIONS)
    )
    assert all(r.partition == rule(r.key) for r in got)


def test_group_that_commits_consumes_everything_exactly_once(h):
    topic = new_name("once")
    sent = publish(h.bus, topic, 120)
    group = new_name("g")
    a = h.consumer(topic, group)
    got = drain(a, 120, h.quiet_s, commit=True)
    assert Counter(ids(got)) == Counter(ids(sent))  # each once: no loss, no repeat
    a.close()
    b = h.consumer(topic, group)
    assert drain(b, 0, h.quiet_s + 0.5) == []  # everything was committed


def test_uncommitted_records_are_redelivered_to_the_next_member(h):
    topic = new_name("redeliver")
    sent = publish(h.bus, topic, 60)
    group = new_name("g")
    a = h.consumer(topic, group)
    first = wait_until(
        lambda: a.poll(max_records=15, timeout_s=0.5), 30, what="a first poll with records", interval_s=0
    )
    assert 0 < len(first) <= 15
    a.commit(first)  # processed; the rest is read but not committed
    rest = drain(a, 60 - len(first), 0.0)
    assert len(first) + len(rest) == 60
    a.close()

    committed = defaultdict(int)
    for r in first:
        committed[r.partition] = max(committed[r.partition], r.offset + 1)
    expected = [r for r in first + rest if r.offset >= committed[r.partition]]
    b = h.consumer(topic, group)
    again = drain(b, len(expected), h.quiet_s)
    assert sorted(ids(again)) == sorted(ids(expected))
    assert set(ids(again)) | set(ids(first)) == set(ids(sent))


def test_committed_position_survives_reopening_the_bus(h):
    topic = new_name("durable")
    publish(h.bus, topic, 40)
    group = new_name("g")
    a = h.consumer(topic, group)
    assert len(drain(a, 40, h.quiet_s, commit=True)) == 40
    a.close()
    h.reopen()
    later = publish(h.bus, topic, 25, start=40)
    b = h.consumer(topic, group)
    got = drain(b, 25, h.quiet_s)
    assert sorted(ids(got)) == sorted(ids(later))


def test_a_consumer_started_before_its_topic_exists_gets_what_is_published_later(h):
    """Services start in any order: a joiner or learner started on a fresh bus must not wait for a
    restart to see the topic its producer creates later."""
    topic = new_name("later")
    c = h.consumer(topic, new_name("g"))
    assert c.poll(10, timeout_s=0.1) == []
    sent = publish(h.bus, topic, 12)
    h.bus.flush()
    assert sorted(ids(drain(c, 12, h.quiet_s))) == sorted(ids(sent))


def test_two_groups_each_see_everything(h):
    topic = new_name("groups")
    sent = publish(h.bus, topic, 50)
    for group in (new_name("joiner"), new_name("audit")):
        got = drain(h.consumer(topic, group), 50, h.quiet_s, commit=True)
        assert Counter(ids(got)) == Counter(ids(sent)), group


def _two_members(h, n_topics: int) -> None:
    """Two members of one group on the same `n_topics` topics split the partitions, each getting
    the same partition numbers of every topic: records with one key on several topics reach one
    member (what the joiner's completions and feedback need). Together they get everything once."""
    topics, group = [new_name("split") for _ in range(n_topics)], new_name("g")
    members = [h.consumer(topics, group), h.consumer(topics, group)]
    got: dict[int, list[Record]] = {0: [], 1: []}
    assigned: dict[int, list[tuple[str, int]]] = {0: [], 1: []}
    stop = threading.Event()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            while not stop.is_set():
                recs = members[i].poll(max_records=50, timeout_s=0.2)
                assigned[i] = members[i].assignment()
                if recs:
                    got[i].extend(recs)
                    members[i].commit(recs)
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()

    def no_errors() -> None:
        assert not errors, errors

    try:
        wait_until(
            lambda: assigned[0] and assigned[1] and len(assigned[0]) + len(assigned[1]) == n_topics * PARTITIONS,
            60,
            what="the group settling",
            check=no_errors,
        )
        settled = {i: list(assigned[i]) for i in (0, 1)}
        sent = [r for k, t in enumerate(topics) for r in publish(h.bus, t, 120, start=1000 * k, keys=30)]
        wait_until(lambda: len(got[0]) + len(got[1]) >= len(sent), 30, what="every record", check=no_errors)
        time.sleep(h.quiet_s)  # the members go on reading: a repeat would arrive now
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert not errors, errors
    parts = [{t: {p for tt, p in settled[i] if tt == t} for t in topics} for i in (0, 1)]
    for i in (0, 1):
        assert all(parts[i][t] == parts[i][topics[0]] for t in topics), settled  # same numbers of each topic
        assert got[i], f"member {i} got nothing"
        assert {(r.topic, r.partition) for r in got[i]} <= set(settled[i])
        assert {r.topic for r in got[i]} == set(topics)
    assert parts[0][topics[0]] and parts[1][topics[0]] and not parts[0][topics[0]] & parts[1][topics[0]]
    assert Counter(ids(got[0] + got[1])) == Counter(ids(sent))  # together: everything, once
    keys = [{r.key for r in got[i]} for i in (0, 1)]
    assert not keys[0] & keys[1]  # every key, on every topic, went to one member


@pytest.mark.parametrize(
    "h", ["embedded", pytest.param("kafka", marks=[pytest.mark.kafka, pytest.mark.slow])], indirect=True
)
def test_two_members_split_the_partitions(h):
    _two_members(h, 1)


def test_bad_topic_or_value_is_a_value_error(h):
    with pytest.raises(ValueError, match="bad topic!"):
        h.bus.publish("bad topic!", "k", b"v")
    with pytest.raises(ValueError, match="str"):
        h.bus.publish("fine", "k", "not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="''"):
        h.bus.consumer("", "g")
    with pytest.raises(ValueError, match="a/b"):
        h.bus.consumer("fine", "a/b")
    with pytest.raises(ValueError, match="distinct"):
        h.bus.consumer([], "g")
    with pytest.raises(ValueError, match="distinct"):
        h.bus.consumer(["fine", "fine"], "g")


def test_concurrent_publish_many_is_durable_on_return_and_refuses_bad_records_whole(h):
    topic = new_name("many")
    batches = [
        [(f"cmp-{i % 5}", json.dumps({"event_id": f"ev-{b}-{i:03d}"}).encode()) for i in range(40)] for b in range(3)
    ]
    threads = [threading.Thread(target=h.bus.publish_many, args=(topic, batch)) for batch in batches]
    [t.start() for t in threads]  # in flight together
    [t.join() for t in threads]
    with pytest.raises(ValueError, match="bytes"):  # one bad record: none of the batch is written
        h.bus.publish_many(topic, [("cmp-0", b'{"event_id": "never"}'), ("cmp-1", "not bytes")])
    with pytest.raises(ValueError, match="key"):
        h.bus.publish_many(topic, [("cmp-0", b'{"event_id": "never"}'), ("", b"{}")])
    h.bus.publish_many(topic, [])
    h.bus.flush(30)
    got = drain(h.consumer(topic, new_name("g")), 120, h.quiet_s)
    assert sorted(ids(got)) == sorted(json.loads(v)["event_id"] for batch in batches for _, v in batch)
    for b, batch in enumerate(batches):  # per key, each batch's order
        for key in {k for k, _ in batch}:
            assert [e for e in by_key(got)[key] if e.startswith(f"ev-{b}-")] == [
                json.loads(v)["event_id"] for k, v in batch if k == key
            ]


def test_one_member_on_two_topics_consumes_and_commits_both(h):
    ta, tb, other = new_name("two-a"), new_name("two-b"), new_name("other")
    sent = publish(h.bus, ta, 40) + publish(h.bus, tb, 30, start=100)
    group = new_name("g")
    a = h.consumer([ta, tb], group)
    got = drain(a, 70, h.quiet_s, commit=True)
    assert Counter(ids(got)) == Counter(ids(sent))
    assert {r.topic for r in got} == {ta, tb}
    assert sorted(a.assignment()) == sorted((t, p) for t in (ta, tb) for p in range(PARTITIONS))
    with pytest.raises(ValueError, match=other):
        a.commit([Record(other, 0, 0, "k", b"")])
    a.close()
    later = publish(h.bus, tb, 5, start=200)
    b = h.consumer([ta, tb], group)  # both topics' positions were committed
    assert sorted(ids(drain(b, 5, h.quiet_s))) == sorted(ids(later))


@pytest.mark.parametrize(
    "h", ["embedded", pytest.param("kafka", marks=[pytest.mark.kafka, pytest.mark.slow])], indirect=True
)
def test_two_members_on_two_topics_own_the_same_partitions_of_both(h):
    _two_members(h, 2)


def test_completion_sink_publishes_completions_keyed_by_completion_id(h):
    import asyncio

    sink = CompletionSink(h.bus)
    events = [completion_event(i) for i in range(5)]

    async def record_all():
        for e in events:
            await sink.record(e)

    asyncio.run(record_all())
    sink.close()
    h.bus.flush(30)
    got = drain(h.consumer(TOPICS["completion"], new_name("sink")), 5, h.quiet_s)
    assert len(got) == 5
    assert {r.key: CompletionEvent.model_validate_json(r.value) for r in got} == {e.completion_id: e for e in events}


def test_reached_says_whether_a_member_has_read_up_to_the_ends_it_was_given(h):
    """An empty poll is no proof of the end (a Kafka fetch may be on its way): the joiner reads to the
    `ends()` it took after its clock, and `reached` says when it is there."""
    topic = new_name("reach")
    c = h.bus.consumer(topic, new_name("g"))
    try:
        wait_until(lambda: c.poll(timeout_s=1.0) == [] and c.assignment(), 60, what="the member joined", interval_s=0)
        publish(h.bus, topic, 30)
        ends = c.ends()
        assert ends is not None and sorted(p for _, p in ends) == h.assignment(c)
        if h.kind == "embedded":  # tansu 0.6 may list a partition's end short by its last batch (bus_kafka.py)
            assert sum(ends.values()) == 30
        assert 0 < sum(ends.values()) <= 30 and not c.reached(ends)
        drain(c, 30, quiet_s=0.2)
        assert c.reached(ends) and sum(c.positions().values()) == 30 and c.reached(c.ends())
        assert not c.reached(None)  # the bus could not say
    finally:
        c.close()
