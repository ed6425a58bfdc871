"""The Kafka event bus (kafka-python): a spooled at-least-once producer and consumer groups.

`publish_many()` appends the records to a `feedback.spool.Spool` and returns once they are fsynced,
never waiting for the broker. The spool's forwarder hands batches to `_deliver`: a `KafkaProducer`
(acks=all, murmur2 of the key: a completion and its feedback share a partition) that returns once
the broker acknowledged all of them. A failed batch is sent again whole with a fresh producer (a
restarted broker knows neither our producer id nor our topics): repeats, never reordering.

The producer is not idempotent (one request in flight per connection keeps a partition's order
through its own retries): every consumer already drops repeats by event id, and broker-side
deduplication can lose what it was meant to protect. The fault harness found it on tansu 0.6's S3
engine: killed mid-produce, the restarted broker acknowledged the producer's retry of a batch whose
two feedback events never reached the topic (most likely its sequence number was committed without
the records, so the retry read as a duplicate; docs/trust.md#faults). A broker that takes a retry
twice costs a repeat; one that drops it loses an event.
Topics are created on first use; consumers commit explicit offsets of what the caller processed.

Called by the gateway, the joiner and the learner when `FLYWHEEL_BUS=kafka`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition
from kafka.admin import KafkaAdminClient
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import CommitFailedError, KafkaConnectionError, KafkaError, for_code

from feedback.bus import Consumer, EventBus, Record, check_name, check_record, topic_list
from feedback.spool import Spool, SpooledRecord

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 900_000  # key + value; under Kafka's default message.max.bytes (1 MiB)
SPOOL_BATCH = 500  # records the forwarder sends before it waits for their acknowledgements
_TOPIC_ALREADY_EXISTS = 36
CONNECT_WAIT_S = 30.0  # how long a new bus waits for a broker that refuses connections (one restarting)
RETRIABLE = (KafkaError, OSError)  # broker down, slow or restarting: the spool retries the batch
PRODUCER_CONFIG = dict(acks="all", enable_idempotence=False, max_in_flight_requests_per_connection=1, linger_ms=5)
CONSUMER_CONFIG = dict(enable_auto_commit=False, auto_offset_reset="earliest", allow_auto_create_topics=False)
CONSUMER_CONFIG |= dict(session_timeout_ms=10_000, heartbeat_interval_ms=1_000)
JOIN_POLL_S = 1.0
"""The least a poll waits while the consumer has no partitions yet (joining its group)."""
# The range assignor, with topics of equal partition counts, gives a member the same partitions of each.
CONSUMER_CONFIG["partition_assignment_strategy"] = (RangePartitionAssignor,)


def _accepts(addr: str, timeout_s: float = 1.0) -> bool:
    host, _, port = addr.strip().rpartition(":")
    try:
        socket.create_connection((host or "localhost", int(port or 9092)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


class KafkaBus(EventBus):
    def __init__(
        self,
        bootstrap: str,
        spool_dir: str | Path | None,
        partitions: int = 12,
        client_id: str = "flywheel",
        *,
        replication: int = 1,
        send_timeout_s: float = 10.0,
        consumer_config: dict[str, Any] | None = None,
        spool_backoff_s: tuple[float, float] = (0.05, 2.0),
    ):
        """`send_timeout_s` bounds one delivery attempt (and connecting); `consumer_config` overrides
        kafka-python consumer settings (e.g. a short `session_timeout_ms` in tests). `spool_dir=None`:
        no spool, so no publishing (a bus that only consumes)."""
        for name, n in (("partitions", partitions), ("replication", replication)):
            if n < 1:
                raise ValueError(f"{name} must be >= 1, got {n}")
        if send_timeout_s < 2:
            raise ValueError(f"send_timeout_s must be >= 2 (a producer needs time to connect), got {send_timeout_s}")
        if not bootstrap:
            raise ValueError(f"bootstrap must name at least one host:port, got {bootstrap!r}")
        self.bootstrap, self.partitions, self.replication = bootstrap, partitions, replication
        self.client_id, self.send_timeout_s = client_id, send_timeout_s
        self._timeout_ms = ms = int(send_timeout_s * 1000)
        conn = {"bootstrap_servers": bootstrap, "bootstrap_timeout_ms": ms}
        self._consumer_config = CONSUMER_CONFIG | conn | {"client_id": f"{client_id}-consumer"}
        self._consumer_config.update(consumer_config or {})
        timeouts = {"max_block_ms": ms, "request_timeout_ms": ms, "delivery_timeout_ms": ms + 1000}
        self._producer_config = PRODUCER_CONFIG | conn | timeouts | {"client_id": f"{client_id}-producer"}
        self._producer: KafkaProducer | None = None
        self._admin: KafkaAdminClient | None = None
        self._admin_lock = threading.Lock()
        self._ready_topics: set[str] = set()  # created (or found) since the last delivery failure
        self._closed = False
        self.spool: Spool | None = None
        if spool_dir is not None:
            self.spool = Spool(
                spool_dir, self._deliver, retriable=RETRIABLE, batch_size=SPOOL_BATCH, backoff_s=spool_backoff_s
            )

    # ---- producing ------------------------------------------------------------------------------
    def pending_since(self) -> float | None:
        return None if self.spool is None else self.spool.pending_since()

    def publish_many(self, topic: str, records: list[tuple[str, bytes]]) -> None:
        """All of them into the spool with one fsync (all checked first: none is spooled if one is bad)."""
        if self._closed:
            raise RuntimeError("bus is closed")
        if self.spool is None:
            raise RuntimeError("this bus has no spool: it cannot publish")
        check_name("topic", topic)
        for key, value in records:
            check_record(key, value)
            if len(key.encode()) + len(value) > MAX_RECORD_BYTES:
                raise ValueError(f"record of key {key!r} is over the {MAX_RECORD_BYTES} bytes a Kafka record may hold")
        self.spool.publish_many([(topic, k, bytes(v)) for k, v in records])

    def flush(self, timeout_s: float = 30.0) -> None:
        if self.spool is not None:
            self.spool.flush(timeout_s)

    @property
    def healthy(self) -> bool:
        """False when the spool's forwarder died; not for a broker outage (that is retried)."""
        return self.spool is None or self.spool.healthy

    @property
    def backlog(self) -> int:
        return 0 if self.spool is None else self.spool.backlog

    def _deliver(self, batch: list[SpooledRecord]) -> None:
        """On the spool's thread: send `batch` and return once the broker acknowledged all of it."""
        try:
            new_topics = sorted({r.topic for r in batch} - self._ready_topics)
            for topic in new_topics:
                self.ensure_topic(topic)
                self._ready_topics.add(topic)
            if new_topics:
                # kafka-python 3.0's sender spins on topics created after its first metadata fetch (docs/benchmarks.md)
                self._drop_producer()
            if self._producer is None:
                self._producer = KafkaProducer(**self._producer_config)
            futures = [self._producer.send(r.topic, key=r.key.encode(), value=r.value) for r in batch]
            self._producer.flush(timeout=self.send_timeout_s + 2)
            for f in futures:
                f.get(timeout=0)  # raises the record's error, if any
        except BaseException:
            self._drop_producer()
            self._ready_topics.clear()
            raise

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.close(timeout=0)

    def ensure_topic(self, topic: str, wait_s: float = 0.0) -> None:
        """Create `topic` with the bus's partitions and replication unless it exists; `wait_s`: how long
        to wait for a broker that refuses connections (a consumer starting while it restarts)."""
        check_name("topic", topic)
        deadline = time.monotonic() + self.send_timeout_s
        layout = {"num_partitions": self.partitions, "replication_factor": self.replication}
        with self._admin_lock:
            admin = self._admin_client(wait_s)
            while True:
                try:
                    result = admin.create_topics({topic: layout}, raise_errors=False)
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
                admin.wait_for_topics([topic], timeout_ms=self._timeout_ms)
                log.info("kafka bus: created topic %s (%s)", topic, layout)
            elif code != _TOPIC_ALREADY_EXISTS:
                raise for_code(code)(f"creating topic {topic!r}: {result['topics'][0]['error_message']}")

    def _admin_client(self, wait_s: float = 0.0) -> KafkaAdminClient:
        """One admin client for the bus's life (it reconnects by itself after an outage). A refused
        connection is detected first with a plain socket: kafka-python leaves the I/O thread of an
        admin client whose bootstrap failed running."""
        if self._admin is None:
            deadline = time.monotonic() + wait_s
            while not any(_accepts(addr) for addr in self.bootstrap.split(",")):
                if time.monotonic() >= deadline:  # a service started while its broker restarts waits for it
                    raise KafkaConnectionError(f"no broker of {self.bootstrap!r} accepts connections")
                log.warning("kafka bus: no broker of %r accepts connections yet; waiting", self.bootstrap)
                time.sleep(1.0)
            ms, name = self._timeout_ms, f"{self.client_id}-admin"
            config = {"bootstrap_servers": self.bootstrap, "bootstrap_timeout_ms": ms, "request_timeout_ms": ms}
            self._admin = KafkaAdminClient(client_id=name, **config)
        return self._admin

    # ---- consuming ------------------------------------------------------------------------------
    def consumer(self, topics: str | Sequence[str], group: str) -> KafkaBusConsumer:
        """Join `group` on `topics` (of equal partition counts: checked)."""
        if self._closed:
            raise RuntimeError("bus is closed")
        names = topic_list(topics)
        check_name("group", group)
        for t in names:
            self.ensure_topic(t, wait_s=CONNECT_WAIT_S)
        c = KafkaConsumer(*names, group_id=group, **self._consumer_config)
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
        self._drop_producer()
        with self._admin_lock:
            if self._admin is not None:
                self._admin.close()
                self._admin = None


class KafkaBusConsumer(Consumer):
    def __init__(self, topics: tuple[str, ...], consumer: KafkaConsumer):
        self.topics, self._c = topics, consumer
        self._committed: dict[tuple[str, int], int] = {}
        self._closed = False
        self.poll_errors = 0  # polls that failed on a retriable broker error (answered as empty)
        self._warned_at = float("-inf")

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        if self._closed:
            raise RuntimeError("consumer is closed")
        if not self._c.assignment():  # joining the group: kafka-python needs a poll that waits for the
            timeout_s = max(timeout_s, JOIN_POLL_S)  # join's answers (polls of 0.1 s never joined on tansu)
        try:
            got = self._c.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        except KafkaError as e:  # the broker down or moving (retriable): an empty poll, as long as it asked
            if not e.retriable:
                raise
            self.poll_errors += 1
            now = time.monotonic()
            if now - self._warned_at >= 10.0:  # once per 10 s: a broker restart fails every poll for a while
                self._warned_at = now
                log.warning("kafka bus: poll failed (%d so far), as if empty: %r", self.poll_errors, e)
            time.sleep(timeout_s)
            return []
        msgs = [m for tp in sorted(got, key=lambda tp: (tp.topic, tp.partition)) for m in got[tp]]
        return [Record(m.topic, m.partition, m.offset, m.key.decode() if m.key else "", m.value) for m in msgs]

    def assignment(self) -> list[tuple[str, int]]:
        return sorted((tp.topic, tp.partition) for tp in self._c.assignment())

    def ends(self) -> dict[tuple[str, int], int] | None:
        owned = list(self._c.assignment())
        if not owned:
            return {}
        try:
            listed = self._c.end_offsets(owned)
        except KafkaError as e:  # the broker is down or moving: the caller waits for a round that can tell
            log.warning("kafka bus: end offsets of %d partitions unknown: %r", len(owned), e)
            return None
        # The larger of the listed end and the high watermark of the last fetch: tansu 0.6 sometimes lists
        # the first offset of a partition's last batch as its end (a Kafka broker lists the true end).
        return {(tp.topic, tp.partition): max(int(o), self._c.highwater(tp) or 0) for tp, o in listed.items()}

    def positions(self) -> dict[tuple[str, int], int] | None:
        try:
            return {(tp.topic, tp.partition): int(self._c.position(tp)) for tp in self._c.assignment()}
        except KafkaError as e:
            log.warning("kafka bus: positions unknown: %r", e)
            return None

    def commit(self, records: list[Record]) -> None:
        positions = self._positions(records)
        if not (new := {tp: o for tp, o in positions.items() if o > self._committed.get(tp, 0)}):
            return
        try:
            self._c.commit({TopicPartition(*tp): OffsetAndMetadata(o, "", -1) for tp, o in new.items()})
        except CommitFailedError as e:
            # The group rebalanced: these partitions belong to another member now, which starts from
            # the last committed position, so the records are delivered again (and deduplicated).
            log.warning("kafka bus: commit of %s failed after a rebalance; they will be redelivered: %r", positions, e)
            return
        except KafkaError as e:  # the broker is unreachable: the next commit carries these positions too
            log.warning("kafka bus: commit of %d positions failed (%r); retried with the next commit", len(new), e)
            return
        self._committed.update(new)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._c.close(autocommit=False)
