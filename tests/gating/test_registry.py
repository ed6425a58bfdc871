"""The model registry against real databases: a SQLite file, and PostgreSQL on 127.0.0.1:5432.

Every test runs on both. For PostgreSQL the run creates a scratch database (random name, dropped at
the end) and each test gets its own schema in it. The races are made deterministic with an engine
event: each racing thread stops at its first write until the other one has done all its reads.
"""

from __future__ import annotations

import threading
import uuid

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import IntegrityError

from gating.db import make_engine, normalize_url
from gating.models import Status
from gating.registry import LIFECYCLE, Registry, RegistryConflict, UnknownVersion

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
SHA = "ab" * 32
HAPPY = ["evaluating", "canary", "awaiting_approval", "promoted"]


@pytest.fixture(scope="session")
def pg_database():
    """A fresh database for this run, created through the `postgres` database and dropped after."""
    psycopg = pytest.importorskip("psycopg", reason="psycopg (PostgreSQL driver) is not installed")
    try:
        admin = psycopg.connect("host=127.0.0.1 port=5432 user=postgres dbname=postgres",
                                autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        pytest.skip(f"PostgreSQL at 127.0.0.1:5432 is unreachable: {e}")
    name = f"flywheel_test_{uuid.uuid4().hex[:10]}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    base = request.getfixturevalue("pg_database")
    schema = f"t_{uuid.uuid4().hex[:10]}"
    engine = make_engine(base)
    with engine.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()
    return f"{base}?options=-csearch_path%3D{schema}"


@pytest.fixture
def reg(url):
    r = Registry(url)
    yield r
    r.close()


def files(name: str, kind: str = "snapshot") -> list[dict]:
    return [{"path": f"{name}/model.safetensors", "sha256": SHA, "bytes": 1234, "kind": kind}]


def to_awaiting(reg: Registry, vid: str) -> None:
    for st in HAPPY[:-1]:
        reg.transition(vid, st, "gate", f"to {st}")


def snapshot(reg: Registry):
    """Everything observable: each version's status and the whole audit log."""
    return [(v.id, v.status) for v in reg.list()], reg.audit()


# -- register / get / list / lineage ------------------------------------------------------------


def test_register_get_list_lineage(reg):
    v1 = reg.register(version_id="v0001", files=files("v0001"), notes="base",
                      data_range={"completions": {0: (0, 0)}})
    v2 = reg.register(parent_id="v0001", files=files("v0002", "delta"),
                      data_range={"samples": {0: (0, 120), 3: (7, 9)}},
                      metrics={"reward_mean": 0.25, "eval": {"pass@1": 0.5}})
    v3 = reg.register(parent_id=v2.id)
    side = reg.register(version_id="exp-a.1", parent_id="v0001")
    assert (v1.id, v2.id, v3.id) == ("v0001", "v0002", "v0003")  # auto ids continue vNNNN
    assert all(v.status is Status.candidate for v in (v1, v2, v3, side))

    got = reg.get("v0002")
    assert got.parent_id == "v0001" and got.delta_base_id == "v0001"  # a delta defaults to its parent
    assert got.data_range == {"samples": {0: (0, 120), 3: (7, 9)}}  # int partitions survive JSON
    assert got.metrics == {"reward_mean": 0.25, "eval": {"pass@1": 0.5}}
    assert [(f.path, f.sha256, f.bytes, f.kind) for f in got.files] == [
        ("v0002/model.safetensors", SHA, 1234, "delta")]
    assert got.created_at.tzinfo is not None and got.created_at >= v1.created_at
    assert reg.get("v0001").notes == "base"

    assert [v.id for v in reg.list()] == ["v0001", "v0002", "v0003", "exp-a.1"]
    assert [v.id for v in reg.lineage("v0003")] == ["v0003", "v0002", "v0001"]
    assert [v.id for v in reg.lineage("exp-a.1")] == ["exp-a.1", "v0001"]
    assert [v.id for v in reg.lineage("v0001")] == ["v0001"]
    assert reg.promoted() is None

    reg.transition("v0002", "evaluating", "gate", "offline evals started")
    assert [v.id for v in reg.list("evaluating")] == ["v0002"]
    assert [v.id for v in reg.list(Status.candidate)] == ["v0001", "v0003", "exp-a.1"]
    assert reg.list("rejected") == []
    assert [(a.version_id, a.from_status, a.to_status, a.actor) for a in reg.audit("v0002")] == [
        ("v0002", None, Status.candidate, "learner"),
        ("v0002", Status.candidate, Status.evaluating, "gate")]


def test_registry_reopens_and_add_metrics(url):
    with Registry(url) as r:
        r.register(version_id="v0001", metrics={"loss": 1.0})
        r.add_metrics("v0001", {"eval": {"gsm": 0.4}})
    with Registry(url) as r:  # a second process on the same database: tables exist, data is there
        assert r.get("v0001").metrics == {"loss": 1.0, "eval": {"gsm": 0.4}}
        assert r.add_metrics("v0001", {"loss": 0.5}).metrics == {"loss": 0.5, "eval": {"gsm": 0.4}}
        assert r.register().id == "v0002"
        assert len(r.audit()) == 2  # metrics are not transitions


# -- lifecycle ----------------------------------------------------------------------------------


def test_happy_path_to_promoted_with_audit(reg):
    reg.register(version_id="v0001")
    for st in HAPPY:
        v = reg.transition("v0001", st, "alice" if st == "promoted" else "gate", f"because {st}")
        assert v.status == st and reg.get("v0001").status == st
    assert reg.promoted().id == "v0001"
    audit = reg.audit("v0001")
    assert [(a.from_status, a.to_status, a.actor, a.reason) for a in audit] == [
        (None, "candidate", "learner", "registered"),
        ("candidate", "evaluating", "gate", "because evaluating"),
        ("evaluating", "canary", "gate", "because canary"),
        ("canary", "awaiting_approval", "gate", "because awaiting_approval"),
        ("awaiting_approval", "promoted", "alice", "because promoted")]
    assert [a.at for a in audit] == sorted(a.at for a in audit)

    # The next promotion supersedes v0001 in the same step, with an audit row for each.
    reg.register(version_id="v0002", parent_id="v0001")
    to_awaiting(reg, "v0002")
    reg.transition("v0002", "promoted", "bob", "canary won")
    assert reg.promoted().id == "v0002" and reg.get("v0001").status is Status.superseded
    assert [v.id for v in reg.list("promoted")] == ["v0002"]
    tail = reg.audit()[-2:]
    assert [(a.version_id, a.from_status, a.to_status, a.actor) for a in tail] == [
        ("v0001", "promoted", "superseded", "bob"), ("v0002", "awaiting_approval", "promoted", "bob")]
    assert "v0002" in tail[0].reason and "canary won" in tail[0].reason


def test_dead_ends(reg):
    for vid, path in [("r", ["evaluating", "rejected"]), ("a", ["evaluating", "canary", "aborted"])]:
        reg.register(version_id=vid)
        for st in path:
            reg.transition(vid, st, "gate", "eval")
        assert reg.get(vid).status == path[-1] and not LIFECYCLE[Status(path[-1])]
        with pytest.raises(ValueError, match=f"'{path[-1]}' to 'evaluating'"):
            reg.transition(vid, "evaluating", "gate", "again")


@pytest.mark.parametrize("steps,to,why", [
    ([], "promoted", "next status is one of \\['evaluating'\\]"),
    ([], "canary", "next status"),
    (["evaluating"], "awaiting_approval", "next status is one of \\['canary', 'rejected'\\]"),
    (["evaluating", "canary"], "promoted", "next status"),
    (HAPPY, "superseded", "promoting another"),
    (HAPPY, "rolled_back", "rollback\\(\\)"),
    (HAPPY, "promoted", "next status"),
])
def test_illegal_transitions_refused_nothing_written(reg, steps, to, why):
    reg.register(version_id="v0001")
    for st in steps:
        reg.transition("v0001", st, "gate", "ok")
    frm = steps[-1] if steps else "candidate"
    before = snapshot(reg)
    with pytest.raises(ValueError, match=f"'v0001' from '{frm}' to '{to}'.*{why}"):
        reg.transition("v0001", to, "mallory", "skip the gate")
    assert snapshot(reg) == before


def test_database_itself_refuses_a_second_promoted(reg, url):
    for vid in ("v0001", "v0002"):
        reg.register(version_id=vid)
    reg.transition("v0001", "evaluating", "gate", "x")  # make sure writes work before going around them
    engine = make_engine(url)
    try:
        with engine.begin() as c:
            c.execute(text("UPDATE model_version SET status = 'promoted' WHERE id = 'v0001'"))
        with pytest.raises(IntegrityError), engine.begin() as c:
            c.execute(text("UPDATE model_version SET status = 'promoted' WHERE id = 'v0002'"))
        with pytest.raises(IntegrityError), engine.begin() as c:  # foreign keys are on (SQLite too)
            c.execute(text("INSERT INTO audit_entry (version_id, to_status, actor, reason, at) "
                           "VALUES ('nope', 'candidate', 'x', 'y', CURRENT_TIMESTAMP)"))
        if engine.dialect.name == "sqlite":
            with engine.connect() as c:
                assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        engine.dispose()
    assert [v.id for v in reg.list("promoted")] == ["v0001"]


def race(url: str, moves: list[tuple[str, str]]) -> tuple[list, list]:
    """Run `transition(vid, to)` for each move in its own thread and Registry (as two processes would),
    each thread held at its first write until all have read; returns (winners, errors)."""
    regs = [Registry(url, create=False) for _ in moves]
    barrier = threading.Barrier(len(moves), timeout=10)
    held = threading.local()

    def hold_first_write(conn, cursor, statement, *args):
        if getattr(held, "racing", False) and statement.lstrip().upper().startswith(("UPDATE", "INSERT")):
            held.racing = False
            barrier.wait()

    winners, errors = [], []

    def run(r: Registry, vid: str, to: str) -> None:
        held.racing = True
        try:
            winners.append(r.transition(vid, to, f"admin-{vid}", "ship it").id)
        except Exception as e:  # collected and asserted on by the test
            errors.append(e)

    for r in regs:
        event.listen(r.engine, "before_cursor_execute", hold_first_write)
    threads = [threading.Thread(target=run, args=(r, *move)) for r, move in zip(regs, moves, strict=True)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    [r.close() for r in regs]
    assert not any(t.is_alive() for t in threads), "a racing transition hung"
    return winners, errors


@pytest.mark.parametrize("previous", [None, "v0001"])
def test_concurrent_promotions_exactly_one_wins(reg, url, previous):
    if previous:
        reg.register(version_id=previous)
        to_awaiting(reg, previous)
        reg.transition(previous, "promoted", "alice", "first")
    for vid in ("v0002", "v0003"):
        reg.register(version_id=vid, parent_id=previous)
        to_awaiting(reg, vid)
    audit_before = len(reg.audit())

    winners, errors = race(url, [("v0002", "promoted"), ("v0003", "promoted")])

    assert len(winners) == 1 and len(errors) == 1, (winners, errors)
    (winner,), (err,) = winners, errors
    loser = ({"v0002", "v0003"} - {winner}).pop()
    assert isinstance(err, RegistryConflict) and "concurrently" in str(err) and loser in str(err)
    assert reg.promoted().id == winner and [v.id for v in reg.list("promoted")] == [winner]
    assert reg.get(loser).status is Status.awaiting_approval  # untouched, can be retried
    new = reg.audit()[audit_before:]
    assert {(a.version_id, a.to_status) for a in new} == (
        {(winner, "promoted")} | ({(previous, "superseded")} if previous else set()))
    assert all(a.actor == f"admin-{winner}" for a in new)
    if previous:
        assert reg.get(previous).status is Status.superseded
    # The loser retries against the new state and supersedes the winner.
    reg.transition(loser, "promoted", "admin", "retry")
    assert reg.promoted().id == loser and reg.get(winner).status is Status.superseded


def test_concurrent_steps_on_one_version_exactly_one_wins(reg, url):
    reg.register(version_id="v0001")
    for st in ("evaluating", "canary"):
        reg.transition("v0001", st, "gate", "x")
    winners, errors = race(url, [("v0001", "aborted"), ("v0001", "awaiting_approval")])
    assert len(winners) == 1 and len(errors) == 1 and isinstance(errors[0], RegistryConflict), errors
    final = reg.get("v0001").status
    assert final in ("aborted", "awaiting_approval")
    assert [a.to_status for a in reg.audit("v0001")][-1] == final
    assert len(reg.audit("v0001")) == 4


# -- rollback -----------------------------------------------------------------------------------


def test_rollback(reg):
    for i, vid in enumerate(("v0001", "v0002", "v0003")):
        reg.register(version_id=vid, parent_id=f"v000{i}" if i else None)
        to_awaiting(reg, vid)
        reg.transition(vid, "promoted", "alice", "good")
    with pytest.raises(ValueError, match="cannot roll back to 'v0003': it is 'promoted'"):
        reg.rollback("v0003", "ops", "oops")

    back = reg.rollback("v0001", "ops", "v0003 leaks memory")  # explicit target, two versions back
    assert back.id == "v0001" and back.status is Status.promoted
    assert reg.get("v0003").status is Status.rolled_back and reg.get("v0002").status is Status.superseded
    tail = reg.audit()[-2:]
    assert [(a.version_id, a.from_status, a.to_status, a.actor) for a in tail] == [
        ("v0003", "promoted", "rolled_back", "ops"), ("v0001", "superseded", "promoted", "ops")]
    assert tail[0].reason == "v0003 leaks memory" and "v0003" in tail[1].reason

    before = snapshot(reg)
    with pytest.raises(ValueError, match="cannot roll back to 'v0003': it is 'rolled_back'"):
        reg.rollback("v0003", "ops", "undo")
    with pytest.raises(ValueError, match="illegal transition of 'v0003' from 'rolled_back'"):
        reg.transition("v0003", "promoted", "ops", "undo")
    assert snapshot(reg) == before

    # One click: no target means the version superseded most recently that is still superseded.
    assert reg.rollback(None, "ops", "v0001 is worse after all").id == "v0002"
    assert reg.get("v0001").status is Status.rolled_back
    with pytest.raises(ValueError, match="no superseded version"):
        reg.rollback(None, "ops", "again")


def test_rollback_needs_a_promoted_version(reg):
    reg.register(version_id="v0001")
    with pytest.raises(ValueError, match="no version is promoted"):
        reg.rollback("v0001", "ops", "why")
    assert len(reg.audit()) == 1


# -- bad input ----------------------------------------------------------------------------------


def test_bad_input_is_a_value_error_naming_the_value(reg):
    reg.register(version_id="v0001")
    before = snapshot(reg)
    cases = [
        (lambda: reg.register(parent_id="v0404"), "unknown parent 'v0404'"),
        (lambda: reg.register(version_id="v0002", delta_base_id="v0999"), "unknown delta base 'v0999'"),
        (lambda: reg.register(version_id="v0001"), "version id 'v0001' already exists"),
        (lambda: reg.register(version_id="bad id!"), "bad id!"),
        (lambda: reg.register(files=files("x", "delta")), "delta file needs"),
        (lambda: reg.register(files=[{**files("x")[0], "sha256": "XYZ"}]), "XYZ"),
        (lambda: reg.register(files=[{**files("x")[0], "kind": "diff"}]), "diff"),
        (lambda: reg.register(files=files("x") * 2), "'x/model.safetensors' more than once"),
        (lambda: reg.register(data_range={"t": {0: (9, 3)}}), r"\[9, 3\)"),
        (lambda: reg.register(actor=" "), "actor"),
        (lambda: reg.transition("v0001", "shipped", "gate", "x"), "unknown status 'shipped'"),
        (lambda: reg.transition("v0001", "evaluating", "", "x"), "actor"),
        (lambda: reg.transition("v0001", "evaluating", "gate", ""), "reason"),
        (lambda: reg.transition("v0404", "evaluating", "gate", "x"), "unknown version 'v0404'"),
        (lambda: reg.list(status="live"), "unknown status 'live'"),
        (lambda: reg.get("v0404"), "unknown version 'v0404'"),
        (lambda: reg.lineage("v0404"), "unknown version 'v0404'"),
        (lambda: reg.audit("v0404"), "unknown version 'v0404'"),
        (lambda: reg.rollback("v0404", "ops", "x"), "no version is promoted"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    assert snapshot(reg) == before
    with pytest.raises(UnknownVersion):
        reg.get("v0404")


def test_urls():
    assert normalize_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert normalize_url("postgres://u:p@h:5/db") == "postgresql+psycopg://u:p@h:5/db"
    assert normalize_url("sqlite:///var/registry.db") == "sqlite:///var/registry.db"
    with pytest.raises(ValueError, match="'mysql'"):
        normalize_url("mysql://h/db")
    with pytest.raises(ValueError, match="'nonsense'"):
        normalize_url("nonsense")
    with Registry("sqlite://") as r:  # in memory: one shared connection
        r.register()
        assert r.register(parent_id="v0001").id == "v0002"


def test_processes_starting_together_on_an_empty_database_all_open_it(url):
    """The learner's ranks, the gateway and the dashboard may create the tables at the same moment:
    the losers of that race look again instead of failing (before the fix, 10 of 10 trials of 6
    threads on a new SQLite file failed)."""
    for trial in range(3):
        trial_url = url.replace("registry.db", f"registry-{trial}.db")
        start, errors = threading.Barrier(6), []

        def open_it() -> None:
            start.wait()
            try:
                Registry(trial_url).close()
            except Exception as e:  # collected and asserted on below
                errors.append(e)

        threads = [threading.Thread(target=open_it) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        r = Registry(trial_url)
        assert r.register(version_id=f"v{trial}", parent_id=None, files=files("v")).id == f"v{trial}"
        r.close()
