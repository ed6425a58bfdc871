"""The forwarder's Kafka record batches: the encoding against kafka-python's own builder and reader,
and `BatchSender` against a real Kafka-protocol broker (tansu): every record arrives once, in order
per key, in the partition the key rule names; a broker that is down is a clear, retriable error."""

from __future__ import annotations

import os
import socket
import time

import pytest
from kafka import KafkaConsumer
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError
from kafka.partitioner import murmur2
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from feedback.bus_kafka import KeyPartitioner
from feedback.kafka_batches import BatchSender, encode_batch, next_sequence

def _records(n: int, value_sizes=(0, 1, 127, 128, 300, 16_383, 16_384, 70_000)) -> list[tuple[bytes, bytes]]:
    return [(f"cmpl-{i:08x}".encode() + os.urandom(i % 3), os.urandom(value_sizes[i % len(value_sizes)]))
            for i in range(n)]


@pytest.mark.parametrize(("n", "pid", "epoch", "seq"), [(1, 1, 0, 0), (37, 12345678901, 3, 2**31 - 10),
                                                        (500, 7, 0, 1000)])
def test_encoding_is_kafka_pythons_byte_for_byte(n, pid, epoch, seq):
    records = _records(n)
    ts = int(time.time() * 1000)
    ours = encode_batch(records, producer_id=pid, producer_epoch=epoch, base_sequence=seq, timestamp_ms=ts)
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False, producer_id=pid,
                                        producer_epoch=epoch, base_sequence=seq, batch_size=1 << 30)
    for i, (k, v) in enumerate(records):
        builder.append(i, timestamp=ts, key=k, value=v, headers=[])
    assert ours == bytes(builder.build())
    batch = DefaultRecordBatch(ours)  # and kafka-python's reader takes it: checksum, fields, records
    assert batch.validate_crc()
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (pid, epoch, seq)
    assert [(r.offset, r.timestamp, r.key, r.value) for r in batch] == [
        (i, ts, k, v) for i, (k, v) in enumerate(records)]


def test_encoding_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="at least one record"):
        encode_batch([], producer_id=1, producer_epoch=0, base_sequence=0, timestamp_ms=0)


def test_sequence_wraps_past_int32_max_to_zero():
    assert next_sequence(0, 500) == 500
    assert next_sequence(2**31 - 501, 500) == 2**31 - 1
    assert next_sequence(2**31 - 500, 500) == 0
    assert next_sequence(2**31 - 1, 3) == 2


def _consume(bootstrap: str, topic: str, expected: int, timeout_s: float = 30.0) -> list:
    c = KafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False,
                      consumer_timeout_ms=2000)
    got: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < expected and time.monotonic() < deadline:
            got.extend(c)  # until 2 s without a record
    finally:
        c.close()
    return got


@pytest.mark.kafka
def test_sender_delivers_every_record_once_in_order_per_key(kafka_broker):
    topic = f"batches-{os.getpid()}-{time.monotonic_ns()}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    admin.create_topics([NewTopic(topic, 5, 1)])
    admin.close()
    keys = [f"cmpl-{i:04x}".encode() for i in range(40)]
    sender = BatchSender(kafka_broker.bootstrap, client_id="test-batches", timeout_s=10,
                         partition_of=KeyPartitioner().partition_of)
    sent = []
    try:
        for b in range(6):  # several batches: each partition's sequence numbers advance
            batch = [(topic, keys[(b * 7 + i) % len(keys)], f"{b}:{i}".encode()) for i in range(120 + b)]
            sender.send(batch)
            sent.extend(batch)
        sender.send([])  # nothing to send: nothing sent
    finally:
        sender.close()
    got = _consume(kafka_broker.bootstrap, topic, len(sent))
    assert sorted(m.value for m in got) == sorted(v for _, _, v in sent)  # each exactly once
    for m in got:  # in the partition the Java client's rule (kafka-python's murmur2) names
        assert m.partition == (murmur2(m.key) & 0x7FFFFFFF) % 5
    for key in keys:  # in order per key
        assert [m.value for m in sorted(got, key=lambda m: m.offset) if m.key == key] == [
            v for _, k, v in sent if k == key]
    with pytest.raises(RuntimeError, match="closed"):
        sender.send(sent[:1])


def test_sender_to_a_broker_that_is_down_fails_retriably_within_its_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once it is closed
    sender = BatchSender(f"127.0.0.1:{port}", client_id="test-down", timeout_s=2,
                         partition_of=KeyPartitioner().partition_of)
    t0 = time.monotonic()
    with pytest.raises(KafkaError) as e:
        sender.send([("t", b"k", b"v")])
    assert e.value.retriable
    assert time.monotonic() - t0 < 10
    sender.close()
    with pytest.raises(ValueError, match="timeout_s"):
        BatchSender("127.0.0.1:1", client_id="x", timeout_s=0, partition_of=KeyPartitioner().partition_of)



@pytest.mark.kafka
def test_the_broker_checks_the_senders_sequence_numbers(kafka_broker):
    """The batches carry the idempotent producer's id and sequence: a gap in a partition's sequence
    (as if a batch had been lost) is refused by the broker, and the error reaches the caller."""
    topic = f"sequence-{os.getpid()}-{time.monotonic_ns()}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    sender = BatchSender(kafka_broker.bootstrap, client_id="test-sequence", timeout_s=10,
                         partition_of=KeyPartitioner().partition_of)
    try:
        sender.send([(topic, b"k", b"1"), (topic, b"k", b"2")])
        assert sender._sequence == {(topic, 0): 2}
        sender._sequence[topic, 0] = 5  # records 2..4 never sent
        with pytest.raises(KafkaError, match="produce error 45"):  # OUT_OF_ORDER_SEQUENCE_NUMBER
            sender.send([(topic, b"k", b"3")])
    finally:
        sender.close()
    assert [m.value for m in _consume(kafka_broker.bootstrap, topic, 2)] == [b"1", b"2"]
