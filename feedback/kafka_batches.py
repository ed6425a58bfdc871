"""Kafka record batches for the spool's forwarder: encoded here, sent through kafka-python's client.

The forwarder delivers one spool batch at a time (up to `bus_kafka.SPOOL_BATCH` records) and waits
for the broker's acknowledgement before it moves on, so it needs none of `KafkaProducer`'s
machinery per record (the accumulator, a future and callbacks per record, locks, a sender thread):
measured 52.7 us of CPU per ~250-byte record through `KafkaProducer.send` + `flush` against tansu,
6.9 us through `BatchSender` (2 cores, `bench/feedback.py`'s records, 500 per batch; the notes of
`bus_kafka.FORWARDER_IDLE` say what it changes end to end). What it does:

- encodes each partition's records as one Kafka v2 record batch (magic 2, no compression, the
  idempotent producer's id, epoch and base sequence, CRC-32C), byte for byte what kafka-python's
  `DefaultRecordBatchBuilder` writes for the same records (a test checks);
- partitions by key with the Java client's rule (`murmur2(key) & 0x7fffffff` modulo the partition
  count, `bus_kafka.KeyPartitioner`), so a completion and its feedback share a partition;
- sends one `ProduceRequest` (acks=all) per partition leader through kafka-python's network client
  (`kafka.net.compat.KafkaNetClient`: bootstrap, API version negotiation, metadata, connections),
  driven on the calling thread; it gets a producer id with `InitProducerIdRequest`;
- returns when every partition answered without error and raises otherwise (a `KafkaError`):
  the caller resends the whole batch through a new `BatchSender` (a new producer id: a broker
  restarted with empty storage knows neither the old id nor its sequence numbers). A partition
  that already took its part then holds it twice; consumers drop repeats by event id.
  `DUPLICATE_SEQUENCE_NUMBER` (the broker already has exactly that batch) counts as success.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Sequence

from crc32c import crc32c
from kafka.errors import KafkaConnectionError, KafkaTimeoutError, for_code
from kafka.net.compat import KafkaNetClient
from kafka.protocol.producer import InitProducerIdRequest, ProduceRequest
from kafka.structs import TopicPartition

log = logging.getLogger(__name__)

_DUPLICATE_SEQUENCE_NUMBER = 46
_INT32_MAX = 0x7FFFFFFF
# The v2 record batch header: baseOffset, batchLength, partitionLeaderEpoch, magic, crc, attributes,
# lastOffsetDelta, baseTimestamp, maxTimestamp, producerId, producerEpoch, baseSequence, recordCount.
_HEADER = struct.Struct(">qiibIhiqqqhii")
_CRC_AT, _CRC_FROM, _LENGTH_FROM = 17, 21, 12  # the CRC's place; it covers attributes onwards


def _zigzag_varint(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_VARINTS = [_zigzag_varint(i) for i in range(1 << 14)]  # 0..16383: every offset delta and most lengths


def _varint(n: int, table: list[bytes] = _VARINTS) -> bytes:
    return table[n] if n < len(table) else _zigzag_varint(n)


def next_sequence(sequence: int, count: int) -> int:
    """The base sequence after a batch of `count` records at `sequence` (wrapping past 2**31-1 to 0)."""
    if sequence > _INT32_MAX - count:
        return count - (_INT32_MAX - sequence) - 1
    return sequence + count


def encode_batch(records: Sequence[tuple[bytes, bytes]], *, producer_id: int, producer_epoch: int,
                 base_sequence: int, timestamp_ms: int) -> bytes:
    """One uncompressed v2 record batch of `records` (key, value), all stamped `timestamp_ms`
    (CreateTime), offset deltas 0..n-1, no headers."""
    if not records:
        raise ValueError("a record batch needs at least one record")
    varint = _varint
    parts: list[bytes] = []
    append = parts.append
    for i, (key, value) in enumerate(records):
        # attributes 0, timestamp delta 0, offset delta, key, value, no headers
        body = b"".join((b"\x00\x00", varint(i), varint(len(key)), key, varint(len(value)), value, b"\x00"))
        append(varint(len(body)))
        append(body)
    data = b"".join(parts)
    n = len(records)
    header = bytearray(_HEADER.pack(0, _HEADER.size - _LENGTH_FROM + len(data), 0, 2, 0, 0, n - 1, timestamp_ms,
                                    timestamp_ms, producer_id, producer_epoch, base_sequence, n))
    struct.pack_into(">I", header, _CRC_AT, crc32c(data, crc32c(memoryview(header)[_CRC_FROM:])))
    return bytes(header) + data


class BatchSender:
    """Sends batches of keyed records with acks=all as one idempotent producer (see the module
    docstring). Not thread-safe: one caller (the forwarder's loop) drives it."""

    def __init__(self, bootstrap: str, *, client_id: str, timeout_s: float,
                 partition_of: Callable[[bytes, int], int]):
        """`partition_of(key, partition_count)` -> partition index; `timeout_s` bounds connecting,
        each metadata wait and each `send()`."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_ms = int(timeout_s * 1000)
        self.partition_of = partition_of
        self._client = KafkaNetClient(bootstrap_servers=bootstrap, client_id=client_id,
                                      request_timeout_ms=self.timeout_ms)
        self._producer: tuple[int, int] | None = None  # (producer id, epoch)
        self._partitions: dict[str, list[int]] = {}  # topic -> sorted partition numbers
        self._leaders: dict[tuple[str, int], int] = {}  # (topic, partition) -> node id
        self._sequence: dict[tuple[str, int], int] = {}  # next base sequence per partition
        self._closed = False

    # ---- set-up ---------------------------------------------------------------------------------
    def _wait(self, future, deadline: float, what: str):
        while not future.is_done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KafkaTimeoutError(f"{what}: no answer within {self.timeout_ms} ms")
            self._client.poll(timeout_ms=int(left * 1000) + 1, future=future)
        if future.failed():
            raise future.exception
        return future.value

    def _init_producer(self, deadline: float) -> tuple[int, int]:
        if self._producer is None:
            self._client.check_version(timeout_ms=max(1, int((deadline - time.monotonic()) * 1000)))
            node = self._client.least_loaded_node(bootstrap_fallback=True)
            if node is None:
                raise KafkaConnectionError("no broker to ask for a producer id")
            request = InitProducerIdRequest(transactional_id=None, transaction_timeout_ms=60_000, producer_id=-1,
                                            producer_epoch=-1, max_version=4)
            response = self._wait(self._client.send(node, request), deadline, "InitProducerId")
            if response.error_code:
                raise for_code(response.error_code)(f"InitProducerId: error {response.error_code}")
            self._producer = (response.producer_id, response.producer_epoch)
            log.debug("kafka batches: producer id %d epoch %d", *self._producer)
        return self._producer

    def _topic(self, topic: str, deadline: float) -> list[int]:
        """The topic's partitions, its leaders known (metadata asked for on first use)."""
        parts = self._partitions.get(topic)
        if parts is not None:
            return parts
        cluster = self._client.cluster
        self._wait(cluster.add_topic(topic), deadline, f"metadata of {topic!r}")
        while True:
            found = cluster.partitions_for_topic(topic) or set()
            leaders = {p: cluster.leader_for_partition(TopicPartition(topic, p)) for p in found}
            if found and all(node is not None and node >= 0 for node in leaders.values()):
                break
            if time.monotonic() >= deadline:
                raise KafkaTimeoutError(f"topic {topic!r}: no leader for every partition within "
                                        f"{self.timeout_ms} ms (partitions {sorted(found)})")
            self._wait(cluster.request_update(), deadline, f"metadata of {topic!r}")
        parts = self._partitions[topic] = sorted(found)
        self._leaders.update({(topic, p): node for p, node in leaders.items()})
        return parts

    # ---- sending --------------------------------------------------------------------------------
    def send(self, records: Sequence[tuple[str, bytes, bytes]]) -> None:
        """Deliver `records` (topic, key, value), in order per partition; returns once every
        partition's leader acknowledged its part (acks=all), raises a `KafkaError` otherwise."""
        if self._closed:
            raise RuntimeError("sender is closed")
        if not records:
            return
        deadline = time.monotonic() + self.timeout_ms / 1000
        producer_id, epoch = self._init_producer(deadline)
        by_partition: dict[tuple[str, int], list[tuple[bytes, bytes]]] = {}
        partition_of = self.partition_of
        counts: dict[str, int] = {}
        for topic, key, value in records:
            n = counts.get(topic)
            if n is None:
                n = counts[topic] = len(self._topic(topic, deadline))
            tp = (topic, self._partitions[topic][partition_of(key, n)])
            part = by_partition.get(tp)
            if part is None:
                part = by_partition[tp] = []
            part.append((key, value))
        now_ms = int(time.time() * 1000)
        by_node: dict[int, dict[str, list]] = {}
        Topic = ProduceRequest.TopicProduceData
        Partition = Topic.PartitionProduceData
        for (topic, p), recs in by_partition.items():
            batch = encode_batch(recs, producer_id=producer_id, producer_epoch=epoch,
                                 base_sequence=self._sequence.get((topic, p), 0), timestamp_ms=now_ms)
            by_node.setdefault(self._leaders[topic, p], {}).setdefault(topic, []).append(
                Partition(index=p, records=batch))
        futures = []
        for node, topics in by_node.items():
            request = ProduceRequest(transactional_id=None, acks=-1, timeout_ms=self.timeout_ms,
                                     topic_data=[Topic(name=t, partition_data=ps) for t, ps in topics.items()],
                                     max_version=9)
            futures.append(self._client.send(node, request))
        answered: set[tuple[str, int]] = set()
        for future in futures:
            response = self._wait(future, deadline, "Produce")
            for topic_response in response.responses:
                for pr in topic_response.partition_responses:
                    code = pr.error_code
                    if code and code != _DUPLICATE_SEQUENCE_NUMBER:
                        raise for_code(code)(f"partition {topic_response.name}[{pr.index}]: produce error {code} "
                                             f"{pr.error_message or ''}".rstrip())
                    answered.add((topic_response.name, pr.index))
        missing = set(by_partition) - answered
        if missing:
            raise KafkaConnectionError(f"the brokers did not answer for partitions {sorted(missing)}")
        for tp, recs in by_partition.items():
            self._sequence[tp] = next_sequence(self._sequence.get(tp, 0), len(recs))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()
