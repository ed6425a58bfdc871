"""The Kafka bus's partitioner puts every keyed record where kafka-python's default (the Java
client's murmur2 rule) puts it, also once its cache of key hashes has been emptied."""

from __future__ import annotations

import os

import pytest
from kafka.partitioner import DefaultPartitioner

from feedback.bus_kafka import KeyPartitioner


class Cluster:
    """The two questions a partitioner asks of kafka-python's ClusterMetadata, for fixed topics."""

    def __init__(self, partitions: dict[str, int]):
        self._partitions = partitions

    def topics(self):
        return set(self._partitions)

    def partitions_for_topic(self, topic):
        return set(range(self._partitions[topic])) if topic in self._partitions else None

    def available_partitions_for_topic(self, topic):
        return self.partitions_for_topic(topic)


def test_same_partition_as_the_default_for_every_key():
    cluster = Cluster({"a": 12, "b": 7, "c": 1})
    ours, default = KeyPartitioner(cache_size=50), DefaultPartitioner()
    keys = [f"cmpl-{i:08x}".encode() for i in range(300)] + [os.urandom(n) for n in range(40)] + [b""]
    for _ in range(2):  # the second pass hits the cache (and overflows it: cleared, recomputed)
        for key in keys:
            for topic in ("a", "b", "c"):
                assert ours.partition(topic, key, key, None, b"v", cluster) == \
                    default.partition(topic, key, key, None, b"v", cluster)
    assert len(ours._hashes) <= 50
    assert ours.partition("a", None, None, None, b"v", cluster) in range(12)  # unkeyed: the default's choice
    with pytest.raises(ValueError, match="not found"):
        ours.partition("missing", b"k", b"k", None, b"v", cluster)
    with pytest.raises(ValueError, match="cache_size"):
        KeyPartitioner(cache_size=0)
