"""Replica heartbeats and the fleet summary; registry change numbers and their notification; the
registry's schema version. On SQLite and PostgreSQL, with the fixtures of test_registry.py."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import inspect

from registry.db import make_engine
from registry.fleet_state import summarize
from registry.models import SCHEMA_VERSION, WEIGHT_STORE_SUFFIXES
from registry.registry import Registry
from tests.gating.test_registry import advance, base, files, pg_database, reg, sha, url  # noqa: F401

T0 = datetime(2026, 1, 1, tzinfo=UTC)
IV = 5.0  # heartbeat interval, seconds


def beat(
    reg: Registry,
    rid: str,
    at_s: float,
    serves: dict[str, float],
    holds: dict[str, str] | None = None,
    error: str | None = None,
):
    """Replica `rid` reports at T0 + at_s; by default it holds what it serves, under the registry's hashes."""
    holds = holds if holds is not None else {v: reg.get(v).artifact_sha256 for v in serves}
    return reg.heartbeat(
        rid,
        gateway_id="gw-1",
        host=f"host-{rid}",
        holds=holds,
        serves=serves,
        error=error,
        reported_at=T0 + timedelta(seconds=at_s),
    )


def at(reg: Registry, s: float):
    return reg.fleet(T0 + timedelta(seconds=s), IV)


def test_two_replicas_follow_a_promotion_and_one_goes_silent(reg):
    base(reg)
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    beat(reg, "r1", 0, {"base": 1.0})
    beat(reg, "r2", 0, {"base": 1.0})
    f = at(reg, 1)
    assert (f.state, f.complete, f.split, f.up, f.down) == ("complete", True, False, ["r1", "r2"], [])
    assert f.promoted_id == "base" and f.target == {"base": sha("base")} and f.canary_id is None
    assert [(r.replica_id, r.status, r.age_s, r.serves_promoted) for r in f.replicas] == [
        ("r1", "up", 1.0, True),
        ("r2", "up", 1.0, True),
    ]

    # A canary: r1 carries the candidate for 5% of its users, r2 does not. Neither is a split.
    advance(reg, "v1", "canary")
    beat(reg, "r1", 5, {"base": 0.95, "v1": 0.05})
    beat(reg, "r2", 5, {"base": 1.0}, error="CUDA out of memory loading v1")
    f = at(reg, 6)
    assert (f.state, f.canary_id, f.target) == ("complete", "v1", {"base": sha("base"), "v1": sha("v1")})
    assert f.errors == {"r2": "CUDA out of memory loading v1"}

    # v1 is promoted; r1 switches, r2 goes silent. Until r2 has missed 3 heartbeats the fleet is split.
    advance(reg, "v1", "promoted")
    beat(reg, "r1", 10, {"v1": 1.0}, holds={"base": sha("base"), "v1": sha("v1")})
    for now in (12, 20):  # r2's last heartbeat is 7 s, then exactly 3 intervals old: still up
        f = at(reg, now)
        assert (f.state, f.complete, f.split, f.up, f.promoted_id) == ("split", False, True, ["r1", "r2"], "v1")
    assert [r.serves_promoted for r in f.replicas] == [True, False]
    f = at(reg, 20.5)
    assert (f.state, f.complete, f.up, f.down) == ("complete", True, ["r1"], ["r2"])
    assert f.replicas[1].status == "down" and f.errors == {"r2": "CUDA out of memory loading v1"}

    # r1 now reports v1 under another hash: not complete, and named.
    beat(reg, "r1", 21, {"v1": 1.0}, holds={"v1": "0" * 64})
    f = at(reg, 22)
    assert (f.state, f.complete, f.mismatched) == ("pending", False, {"r1": ["v1"]})
    # A replica still serving the old version beside the promoted one is not done either.
    beat(reg, "r1", 23, {"v1": 0.5, "base": 0.5})
    assert at(reg, 24).state == "pending"
    assert reg.forget_replica("r2") and not reg.forget_replica("r2")
    assert [r.replica_id for r in at(reg, 24).replicas] == ["r1"]
    assert at(reg, 100).state == "empty"


def test_heartbeats_are_validated_and_replace_the_last_one(reg):
    beat(reg, "r1", 0, {}, holds={})
    hb = reg.heartbeat("r1", gateway_id="gw-2", host="h", holds={"x": sha("x")}, serves={"x": 1.0})
    assert hb.reported_at.tzinfo is not None and hb.serves == {"x": 1.0}
    f = reg.fleet(interval_s=IV)
    assert [(r.replica_id, r.gateway_id, r.holds, r.status) for r in f.replicas] == [
        ("r1", "gw-2", {"x": sha("x")}, "up")
    ]
    assert f.promoted_id is None and f.state == "pending"  # no promoted version: nothing is complete
    ok = {"gateway_id": "g", "host": "h", "holds": {"x": sha("x")}, "serves": {"x": 1.0}}
    for over, match in [
        ({"holds": {"x": "abc"}}, "'abc' is not a lowercase hex SHA-256"),
        ({"serves": {"y": 1.0}}, "serves 'y', which holds does not list"),
        ({"serves": {"x": 1.5}}, "share 1.5"),
        ({"holds": {"x": sha("x"), "y": sha("y")}, "serves": {"x": 0.6, "y": 0.6}}, "add up to"),
        ({"host": ""}, "host"),
        ({"reported_at": datetime(2026, 1, 1)}, "needs a timezone"),
    ]:
        with pytest.raises(ValueError, match=match):
            reg.heartbeat("r2", **{**ok, **over})
    with pytest.raises(ValueError, match="interval_s"):
        reg.fleet(interval_s=0)
    with pytest.raises(ValueError, match="needs a timezone"):
        summarize([], [], datetime(2026, 1, 1))
    assert len(reg.fleet().replicas) == 1


def test_the_artifact_is_the_weight_store_file():
    import serving.weight_store as ws

    assert WEIGHT_STORE_SUFFIXES == (ws.SNAPSHOT_SUFFIX, ws.DELTA_SUFFIX)
    v = {"bytes": 1, "sha256": sha("a"), "kind": "snapshot"}
    reg = Registry("sqlite://")
    got = reg.register(
        files=[{**v, "path": "v1/model.safetensors"}, {**v, "path": "store/v1.snapshot.fws", "sha256": sha("b")}]
    )
    assert got.artifact_sha256 == sha("b")


# -- changes --------------------------------------------------------------------------------------


def test_changes_since(reg):
    assert reg.last_seq() == 0 and reg.changes_since(0) == []
    base(reg)
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    reg.register(version_id="v2", parent_id="v1", files=files("v2"))
    reg.add_metrics("v1", {"loss": 0.1})  # not a change
    beat(reg, "r1", 0, {"base": 1.0})  # nor this
    advance(reg, "v1", "evaluating")
    reg.reject("v1", "carol", "no")  # one transaction, two rows: v1 rejected, v2 withdrawn
    assert reg.last_seq() == 7
    assert [(c.seq, c.version_id, c.action) for c in reg.changes_since(4)] == [
        (5, "v1", "record_gate"),
        (6, "v1", "reject"),
        (7, "v2", "withdraw"),
    ]
    assert [c.seq for c in reg.changes_since(0, limit=2)] == [1, 2] and reg.changes_since(7) == []


def test_a_follower_never_skips_a_change(url, reg):
    """Writers in several processes commit in some order; a follower polling changes_since sees every
    seq exactly once, without gaps, because seqs follow commit order."""
    base(reg)
    done, seen, errors = threading.Event(), [], []

    def write(who: str) -> None:
        with Registry(url, create=False) as r:
            for i in range(10):
                r.register(version_id=f"{who}-{i}", parent_id="base")

    def follow() -> None:
        with Registry(url, create=False) as r:
            last = 0
            while True:
                finished = done.is_set()
                got = [c.seq for c in r.changes_since(last)]
                if got != list(range(last + 1, last + 1 + len(got))):
                    errors.append((last, got))
                seen.extend(got)
                last = got[-1] if got else last
                if finished and not got:
                    return
                time.sleep(0.002)  # a follower that spins holds the GIL, and on SQLite starves the writers

    follower = threading.Thread(target=follow)
    follower.start()
    writers = [threading.Thread(target=write, args=(w,)) for w in ("a", "b", "c")]
    [t.start() for t in writers]
    [t.join() for t in writers]
    done.set()
    follower.join(timeout=30)
    assert not errors and seen == list(range(1, 32)) and reg.last_seq() == 31


@pytest.mark.parametrize("url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_postgres_notifies_each_change_at_commit(reg):
    psycopg = pytest.importorskip("psycopg")
    listener = psycopg.connect(
        f"host=127.0.0.1 port=5432 user=postgres dbname={reg.engine.url.database}", autocommit=True
    )
    try:
        listener.execute("LISTEN flywheel_registry")
        base(reg)
        reg.register(version_id="v1", parent_id="base", files=files("v1"))
        reg.register(version_id="v2", parent_id="v1", files=files("v2"))
        reg.transition("v1", "evaluating", "gate", "go")
        with pytest.raises(ValueError, match="not 'awaiting_approval'"):
            reg.approve("v1", "alice", "rolled back: nothing is sent")
        beat(reg, "r1", 0, {"base": 1.0})
        reg.reject("v1", "carol", "no")  # one notification, for the transaction's last seq
        got = [n.payload for n in listener.notifies(timeout=5, stop_after=5)]
        assert got == ["1", "2", "3", "4", "6"] and reg.last_seq() == 6
        assert list(listener.notifies(timeout=0.2)) == []
    finally:
        listener.close()


# -- schema ---------------------------------------------------------------------------------------


def test_the_schema_version_is_recorded_and_another_refused(url):
    with Registry(url) as r:
        r.register(version_id="v1")
    engine = make_engine(url)
    with engine.connect() as c:
        meta = dict(c.exec_driver_sql("SELECT name, value FROM registry_meta").all())
    assert meta == {"schema_version": SCHEMA_VERSION, "audit_seq": 1} and SCHEMA_VERSION == 5
    with Registry(url) as r:  # opening it again changes nothing
        assert [a.seq for a in r.audit()] == [1] and r.last_seq() == 1
    with engine.begin() as c:  # a database of the schema before the bus watermarks
        c.exec_driver_sql("UPDATE registry_meta SET value = 4 WHERE name = 'schema_version'")
        c.exec_driver_sql("DROP TABLE bus_watermark")
    with pytest.raises(ValueError, match="has schema version 4; this build reads 5 .no migration"):
        Registry(url)
    assert not inspect(engine).has_table("bus_watermark")  # refused before anything was created in it
    with engine.begin() as c:  # versions, but no schema version row
        c.exec_driver_sql("DELETE FROM registry_meta")
    engine.dispose()
    with pytest.raises(ValueError, match="holds versions but no schema version"):
        Registry(url)
