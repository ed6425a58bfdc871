"""The completion index on SQLite (default) and PostgreSQL (marked `postgres`): completions, claims
of idempotency keys (ON CONFLICT DO NOTHING), confirm/release/stale claims, TTL pruning, the format
version, and two gateways' indexes sharing one PostgreSQL database."""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa

from feedback.completion_index import CompletionEntry, CompletionIndex

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _pg_available() -> bool:
    try:
        with sa.create_engine(PG_URL, connect_args={"connect_timeout": 2}).connect():
            return True
    except Exception:  # no server, or no such database: the tests say so and skip
        return False


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield str(tmp_path / "index.db")
        return
    if not _pg_available():
        pytest.skip(f"no PostgreSQL at {PG_URL}")
    schema = "t_" + uuid.uuid4().hex[:10]  # each test its own schema: runs do not see each other's rows
    engine = sa.create_engine(PG_URL)
    with engine.begin() as db:
        db.execute(sa.text(f"CREATE SCHEMA {schema}"))
    yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    with engine.begin() as db:
        db.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    engine.dispose()


def test_completions_are_added_found_and_replaced(url):
    idx = CompletionIndex(url)
    idx.add("c1", "acme", "v1", ts=5.0, user_id="u-hash", arm="canary")
    idx.add("c2", "acme", "v1", ts=6.0)
    assert idx.get_many(["c1", "c2", "nope"]) == {
        "c1": CompletionEntry("acme", "v1", 5.0, "u-hash", "canary"),
        "c2": CompletionEntry("acme", "v1", 6.0, None, None),
    }
    idx.add("c2", "other", "v2", ts=9.0)  # a second add replaces
    assert idx.get("c2") == ("other", "v2", 9.0, None, None) and idx.get("nope") is None
    idx.close()
    again = CompletionIndex(url)
    assert again.get("c1").user_id == "u-hash"
    again.close()
    with pytest.raises(RuntimeError, match="closed"):
        again.get("c1")


def test_many_completions_go_in_one_insert_and_a_repeated_id_takes_its_last_row(url):
    idx = CompletionIndex(url)
    idx.add_many([])
    idx.add("c0", "acme", "v0", ts=1.0)
    rows = [(f"c{i}", "acme", "v1", float(i), f"u{i}", None) for i in range(300)]
    rows.append(("c7", "other", "v2", 7.5, None, "canary"))  # the same id again in the batch: the last wins
    idx.add_many(rows)
    got = idx.get_many([f"c{i}" for i in range(300)])
    assert len(got) == 300 and got["c0"] == CompletionEntry("acme", "v1", 0.0, "u0", None)  # c0 replaced
    assert got["c7"] == CompletionEntry("other", "v2", 7.5, None, "canary")
    idx.close()


def test_claims_confirm_release_stale_and_mismatched(url):
    idx = CompletionIndex(url, stale_claim_s=10)
    c = idx.claim({"a": "fa", "b": "fb"}, now=100)
    assert c.claimed == ["a", "b"] and not c.done and not c.pending and not c.mismatched
    assert idx.claim({"a": "fa"}, now=101).pending == ["a"]  # still being published by the first claimer
    assert idx.claim({"a": "other"}, now=101).mismatched == ["a"]  # the same key for another event
    idx.confirm(["a"], now=102)
    idx.release(["b"])
    again = idx.claim({"a": "fa", "b": "fb"}, now=103)
    assert again.done == {"a": "fa"} and again.claimed == ["b"]
    assert idx.claim({"b": "fb"}, now=120).claimed == ["b"]  # its claimer died: claimable again
    idx.release(["a"])  # done ids are never released
    assert idx.claim({"a": "fa"}, now=121).done == {"a": "fa"}
    idx.close()


def test_accepted_keys_and_old_completions_are_pruned_by_ttl(url):
    idx = CompletionIndex(url, accepted_ttl_s=50, completion_ttl_s=500)
    for i in range(30):
        eid = f"e{i}"
        assert idx.claim({eid: "f"}, now=1000 + i).claimed == [eid]
        idx.confirm([eid], now=1000 + i)
    idx.add("old", "t", "v1", ts=100.0)
    idx.add("new", "t", "v1", ts=1000.0)
    assert idx.accepted_count() == 30
    idx.prune(now=1060)  # e0..e9 were accepted more than 50 s before
    assert idx.accepted_count() == 20
    assert idx.claim({"e0": "f"}, now=1060).claimed == ["e0"] and idx.claim({"e29": "f"}, now=1060).done
    assert idx.get("old") is None and idx.get("new") is not None
    idx.close()
    with pytest.raises(ValueError, match="accepted_ttl_s"):
        CompletionIndex(url, accepted_ttl_s=0)


def test_an_index_of_another_format_version_is_refused(tmp_path):
    path = tmp_path / "index.db"
    CompletionIndex(path).close()
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.begin() as db:
        db.execute(sa.text("UPDATE flywheel_meta SET value = '0' WHERE name = 'completion_index_version'"))
    engine.dispose()
    with pytest.raises(ValueError, match="format version 0"):
        CompletionIndex(path)
    with pytest.raises(ValueError, match="mysql"):
        CompletionIndex("mysql://nobody@127.0.0.1/none")


def test_two_indexes_on_one_database_share_completions_and_never_both_claim_a_key(url):
    """As two gateways would: what one adds the other finds, and of many concurrent claims of one
    key exactly one wins (INSERT ... ON CONFLICT DO NOTHING)."""
    a, b = CompletionIndex(url), CompletionIndex(url)
    try:
        a.add("served-by-a", "acme", "v1", ts=1.0, user_id="u")
        assert b.get("served-by-a") == ("acme", "v1", 1.0, "u", None)
        wins: list[str] = []
        barrier = threading.Barrier(8)

        def claim(idx: CompletionIndex) -> None:
            barrier.wait()
            wins.extend(idx.claim({"the-key": "fp"}).claimed)

        threads = [threading.Thread(target=claim, args=(a if i % 2 else b,)) for i in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert wins == ["the-key"]
    finally:
        a.close()
        b.close()


def test_gateways_opening_a_new_index_at_once_all_open_it(url):
    """The gateways of a deployment start together on one empty database: each creates the index's
    tables if missing. On PostgreSQL two concurrent CREATEs of one table collide in the catalog; the
    schema lock (core/sql.py) makes them take turns, so every opener succeeds."""
    n = 8
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def open_one() -> None:
        barrier.wait()
        try:
            CompletionIndex(url).close()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
