"""The Kafka event bus (kafka-python): a spooled idempotent producer and consumer groups.

Owns the Kafka clients of one process: one admin client that creates topics on first use
(`partitions`, `replication`), and one `KafkaConsumer` per `consumer()` call. `publish()` validates
the record and appends it to a `feedback.spool.Spool` under `spool_dir` — it returns once the record
is fsynced locally and never waits for the broker; the spool's forwarder, a process of its own
(`feedback.forwarder`, so that delivering does not share the gateway's interpreter),
delivers spooled records in order (key = completion id, so a completion and its feedback share a
partition) and retries through outages. In that process `forward_target()` builds a `KafkaBus`
without a spool whose `_deliver` owns one `feedback.kafka_batches.BatchSender`: an idempotent
producer (acks=all) that encodes each partition's records as one Kafka record batch itself and
sends it through kafka-python's network client — a seventh of `KafkaProducer`'s CPU per record.

Per-key order through failures: each spool batch (at most `SPOOL_BATCH` records, `MAX_BATCH_BYTES`)
goes out as one record batch per partition, acknowledged all or nothing, and the next is sent only
after it. After any failure the sender is replaced (a restarted broker does not know its producer
id) and the whole batch is sent again: repeats are possible, reordering is not, and consumers drop
repeats by event id (`feedback.spool.Deduper`).

Consumers commit explicit offsets (last processed offset + 1 per partition) only when the caller
says it processed the records; a consumer closed without commit leaves them to the next member.

Called by the gateway, the joiner and the learner when `FLYWHEEL_BUS=kafka`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, OffsetAndMetadata, TopicPartition
from kafka.admin import KafkaAdminClient
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import CommitFailedError, KafkaConnectionError, KafkaError, for_code
from kafka.partitioner import DefaultPartitioner, Partitioner, murmur2

from feedback.bus import Consumer, EventBus, Record, all_of, topic_list
from feedback.bus_embedded import _check_name
from feedback.kafka_batches import BatchSender
from feedback.spool import ProcessTarget, Spool, SpooledRecord

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 900_000  # key + value; under Kafka's default message.max.bytes (1 MiB)
MAX_BATCH_BYTES = 1_000_000  # keys + values of one spool batch: with record overheads under a broker's 1 MiB batch limit
SPOOL_BATCH = 500  # records per spool batch (one produce round trip each)
# The forwarder process runs at a lower CPU priority than the gateway: under contention the request
# path (whose callers wait) goes first and the forwarder catches up from the spool when the CPU is
# free (so under sustained overload the backlog grows). Measured on 2 cores, 100-event batches at
# 4000 events/s: p99 32 -> 28 ms (mean of 3 runs); the closed-loop maximum rose by ~10-20%.
# On Linux it runs under SCHED_IDLE (only on CPU nothing else wants; nice 10 where that is refused):
# half-rate p99 (~11k events/s) 19.6-34.4 ms in the runs after, 108.9 ms in the run before
# (bench/feedback.py). With `BatchSender` (a seventh of KafkaProducer's CPU per record) it keeps up
# at the maximum rate too (README).
FORWARDER_NICE = 10
FORWARDER_IDLE = True
# A spool batch short of SPOOL_BATCH records waits this long for more: at ~80 requests/s each
# request's records went out as a delivery of their own (a produce round trip, a "forwarded" message
# the gateway's spool thread takes, all on a CPU the gateway shares); the learner reads hours later.
FORWARDER_LINGER_S = 0.05
_TOPIC_ALREADY_EXISTS = 36


class KeyPartitioner(Partitioner):
    """kafka-python's `DefaultPartitioner` for keyed records — partition `murmur2(key) & 0x7fffffff`
    modulo the partition count, the Java client's rule, so every key keeps its partition — with each
    key's hash remembered (up to `cache_size` keys, then forgotten at once). A completion's events
    share its id as their key; the default recomputes the pure-Python murmur2 for every record.
    The forwarder's `BatchSender` calls `partition_of`; `partition` is kafka-python's `Partitioner`
    interface (a `KafkaProducer` given this one places records where the forwarder does; unkeyed
    records: the default's choice)."""

    def __init__(self, cache_size: int = 1 << 16):
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.cache_size = cache_size
        self._default = DefaultPartitioner()
        self._hashes: dict[bytes, int] = {}

    def partition(self, topic, key, serialized_key, value, serialized_value, cluster):
        if serialized_key is None:
            return self._default.partition(topic, key, serialized_key, value, serialized_value, cluster)
        parts = cluster.partitions_for_topic(topic)
        if not parts:
            raise ValueError(f"Topic {topic} not found in ClusterMetadata")
        return sorted(parts)[self.partition_of(serialized_key, len(parts))]

    def partition_of(self, key: bytes, count: int) -> int:
        """The index, among a topic's `count` partitions in order, of the one `key` goes to."""
        h = self._hashes.get(key)
        if h is None:
            if len(self._hashes) >= self.cache_size:
                self._hashes.clear()
            h = self._hashes[key] = murmur2(key) & 0x7FFFFFFF
        return h % count


def _accepts(addr: str, timeout_s: float = 1.0) -> bool:
    host, _, port = addr.strip().rpartition(":")
    try:
        socket.create_connection((host or "localhost", int(port or 9092)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


class KafkaBus(EventBus):
    def __init__(self, bootstrap: str, spool_dir: str | Path | None, partitions: int = 12,
                 client_id: str = "flywheel", *, replication: int = 1, send_timeout_s: float = 10.0,
                 consumer_config: dict[str, Any] | None = None, spool_backoff_s: tuple[float, float] = (0.05, 2.0)):
        """`send_timeout_s` bounds one delivery attempt (and connecting); `consumer_config` overrides
        kafka-python consumer settings (e.g. a short `session_timeout_ms` in tests: a group settles
        in about half the session timeout on tansu). `spool_dir=None`: no spool, so no publishing —
        a bus that only consumes, or the forwarder process's, which only delivers (`forward_target`)."""
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        if replication < 1:
            raise ValueError(f"replication must be >= 1, got {replication}")
        if send_timeout_s < 2:
            raise ValueError(f"send_timeout_s must be >= 2 (a producer needs time to connect), got {send_timeout_s}")
        if not bootstrap:
            raise ValueError(f"bootstrap must name at least one host:port, got {bootstrap!r}")
        self.bootstrap, self.partitions, self.replication = bootstrap, partitions, replication
        self.client_id, self.send_timeout_s = client_id, send_timeout_s
        timeout_ms = int(send_timeout_s * 1000)
        self._partitioner = KeyPartitioner()
        self._consumer_config = {
            "bootstrap_servers": bootstrap, "client_id": f"{client_id}-consumer", "enable_auto_commit": False,
            "auto_offset_reset": "earliest", "allow_auto_create_topics": False, "session_timeout_ms": 10_000,
            "heartbeat_interval_ms": 1_000, "bootstrap_timeout_ms": timeout_ms}
        self._consumer_config.update(consumer_config or {})
        self._sender: BatchSender | None = None
        self._admin: KafkaAdminClient | None = None
        self._admin_lock = threading.Lock()
        self._ready_topics: set[str] = set()  # created (or found) since the last delivery failure
        self._closed = False
        target = ProcessTarget("feedback.bus_kafka:forward_target", {
            "bootstrap": bootstrap, "partitions": partitions, "client_id": client_id, "replication": replication,
            "send_timeout_s": send_timeout_s})
        self.spool = None if spool_dir is None else Spool(
            spool_dir, target, backoff_s=spool_backoff_s, batch_size=SPOOL_BATCH, max_batch_bytes=MAX_BATCH_BYTES,
            forwarder_nice=FORWARDER_NICE, forwarder_idle=FORWARDER_IDLE, linger_s=FORWARDER_LINGER_S)

    # ---- producing ------------------------------------------------------------------------------
    def _spool_for(self, topic: str) -> Spool:
        """The spool to publish `topic` to (after checking the name)."""
        if self._closed:
            raise RuntimeError("bus is closed")
        spool = self.spool
        if spool is None:
            raise RuntimeError("this bus has no spool: it cannot publish")
        _check_name("topic", topic)
        return spool

    @staticmethod
    def _check_record(key: str, value: bytes) -> None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str (the completion id), got {key!r}")
        if not isinstance(value, (bytes, bytearray)):  # a ValueError on both buses (the contract suite)
            raise ValueError(f"value must be bytes, got {type(value).__name__}")  # noqa: TRY004
        size = len(key.encode()) + len(value)
        if size > MAX_RECORD_BYTES:
            raise ValueError(f"record of key {key!r} is {size} bytes, more than the {MAX_RECORD_BYTES} a "
                             f"Kafka record may hold")

    def publish(self, topic: str, key: str, value: bytes) -> None:
        self.publish_many(topic, [(key, value)])

    def publish_many(self, topic: str, records: list[tuple[str, bytes]]) -> None:
        """All of them into the spool with one fsync (all checked first: none is spooled if one is bad)."""
        self.publish_many_async(topic, records).result(timeout=30)

    def publish_many_async(self, topic: str, records: list[tuple[str, bytes]]) -> Future:
        spool, spooled = self._spooled(topic, records)
        return all_of([spool.publish_many_async(spooled)] if spooled else [])

    def publish_many_now(self, topic: str, records: list[tuple[str, bytes]]) -> bool:
        spool, spooled = self._spooled(topic, records)
        return not spooled or spool.publish_many_now(spooled)

    def _spooled(self, topic: str, records: list[tuple[str, bytes]]) -> tuple[Spool, list[tuple[str, str, bytes]]]:
        """The topic's spool and the records as it takes them; a bad record raises ValueError first."""
        spool = self._spool_for(topic)
        for key, value in records:
            self._check_record(key, value)
        return spool, [(topic, k, bytes(v)) for k, v in records]

    def flush(self, timeout_s: float = 30.0) -> None:
        if self.spool is not None:
            self.spool.flush(timeout_s)

    @property
    def healthy(self) -> bool:
        """False when the spool's forwarder died (or is being restarted); not for a broker outage."""
        return self.spool is None or self.spool.healthy

    @property
    def backlog(self) -> int:
        return 0 if self.spool is None else self.spool.backlog

    def _deliver(self, batch: list[SpooledRecord]) -> None:
        """Send `batch` in order and return once the broker acknowledged all of it (acks=all)."""
        try:
            if self._sender is None:
                self._sender = BatchSender(self.bootstrap, client_id=f"{self.client_id}-producer",
                                           timeout_s=self.send_timeout_s, partition_of=self._partitioner.partition_of)
            for topic in sorted({r.topic for r in batch} - self._ready_topics):
                self.ensure_topic(topic)
                self._ready_topics.add(topic)
            self._sender.send([(r.topic, r.key.encode(), r.value) for r in batch])
        except BaseException:
            # Start afresh: a new producer id and sequence numbers, and topics checked again
            # (a broker restarted with empty storage has neither our producer id nor our topics).
            self._drop_sender()
            self._ready_topics.clear()
            raise

    def _drop_sender(self) -> None:
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def ensure_topic(self, topic: str) -> None:
        """Create `topic` with the bus's partitions and replication unless it exists."""
        _check_name("topic", topic)
        deadline = time.monotonic() + self.send_timeout_s
        with self._admin_lock:
            admin = self._admin_client()
            while True:
                try:
                    result = admin.create_topics(
                        {topic: {"num_partitions": self.partitions, "replication_factor": self.replication}},
                        raise_errors=False)
                    break
                except KafkaError as e:
                    # After a broker restart the admin client reconnects with backoff: its node is "not
                    # ready" for a while. Retriable errors are retried until send_timeout_s.
                    if not getattr(e, "retriable", False) or time.monotonic() >= deadline:
                        raise
                    log.info("kafka bus: creating topic %s: %r; retrying", topic, e)
                    time.sleep(0.2)
            code = result["topics"][0]["error_code"]
            if code == 0:
                admin.wait_for_topics([topic], timeout_ms=int(self.send_timeout_s * 1000))
                log.info("kafka bus: created topic %s (%d partitions, replication %d)", topic,
                         self.partitions, self.replication)
            elif code != _TOPIC_ALREADY_EXISTS:
                raise for_code(code)(f"creating topic {topic!r}: {result['topics'][0]['error_message']}")

    def _admin_client(self) -> KafkaAdminClient:
        """One admin client for the bus's life (it reconnects by itself after an outage).

        kafka-python leaves the I/O thread of an admin client whose bootstrap failed running, so
        a refused connection is detected first with a plain socket and raised as a KafkaError.
        """
        if self._admin is None:
            timeout_ms = int(self.send_timeout_s * 1000)
            if not any(_accepts(addr) for addr in self.bootstrap.split(",")):
                raise KafkaConnectionError(f"no broker of {self.bootstrap!r} accepts connections")
            self._admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id=f"{self.client_id}-admin",
                                           bootstrap_timeout_ms=timeout_ms, request_timeout_ms=timeout_ms)
        return self._admin

    # ---- consuming ------------------------------------------------------------------------------
    def consumer(self, topics: str | Sequence[str], group: str) -> KafkaBusConsumer:
        """Join `group` on `topics`. Members are assigned partitions by the range assignor only:
        with topics of equal partition counts (checked) it gives a member the same partition numbers
        of every topic, which co-partitioned consumers (the joiner) rely on."""
        if self._closed:
            raise RuntimeError("bus is closed")
        names = topic_list(topics)
        for t in names:
            _check_name("topic", t)
        _check_name("group", group)
        for t in names:
            self.ensure_topic(t)
        c = KafkaConsumer(*names, group_id=group, partition_assignment_strategy=(RangePartitionAssignor,),
                          **self._consumer_config)
        if len(names) > 1:
            counts = {t: len(c.partitions_for_topic(t) or ()) for t in names}
            if len(set(counts.values())) != 1:
                c.close(autocommit=False)
                raise ValueError(f"topics consumed together must have equal partition counts, got {counts}")
        return KafkaBusConsumer(names, c)

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Forward what can be forwarded within `flush_timeout_s` (the rest stays spooled), then stop."""
        if self._closed:
            return
        self._closed = True
        if self.spool is not None:
            self.spool.close(flush_timeout_s=flush_timeout_s)
        self._drop_sender()
        with self._admin_lock:
            if self._admin is not None:
                self._admin.close()
                self._admin = None


class _ForwardTarget:
    """What the spool's forwarder process delivers to (`feedback.forwarder.Target`)."""

    retriable = (KafkaError, OSError)

    def __init__(self, bus: KafkaBus):
        self.bus = bus

    def deliver(self, batch: list[SpooledRecord]) -> None:
        self.bus._deliver(batch)

    def close(self) -> None:
        self.bus.close()


def forward_target(**kwargs: Any) -> _ForwardTarget:
    """Called in the spool's forwarder process (`feedback.spool.ProcessTarget`): a bus without a
    spool, whose producer delivers the spooled batches."""
    return _ForwardTarget(KafkaBus(spool_dir=None, **kwargs))


class KafkaBusConsumer(Consumer):
    def __init__(self, topics: tuple[str, ...], consumer: KafkaConsumer):
        self.topics, self._c = topics, consumer
        self._committed: dict[tuple[str, int], int] = {}
        self._closed = False

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        if self._closed:
            raise RuntimeError("consumer is closed")
        got = self._c.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        return [Record(m.topic, m.partition, m.offset, m.key.decode() if m.key is not None else "", m.value)
                for tp in sorted(got, key=lambda tp: (tp.topic, tp.partition)) for m in got[tp]]

    def assignment(self) -> list[tuple[str, int]]:
        return sorted((tp.topic, tp.partition) for tp in self._c.assignment())

    def commit(self, records: list[Record]) -> None:
        positions = self._positions(records)
        offsets = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in positions.items()
                   if o > self._committed.get((t, p), 0)}
        if not offsets:
            return
        try:
            self._c.commit(offsets)
        except CommitFailedError as e:
            # The group rebalanced: these partitions belong to another member now, which starts from
            # the last committed position, so the records are delivered again (and deduplicated).
            log.warning("kafka bus: commit of %s failed after a rebalance; they will be redelivered: %r",
                        positions, e)
            return
        for tp, o in positions.items():
            self._committed[tp] = max(self._committed.get(tp, 0), o)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._c.close(autocommit=False)
