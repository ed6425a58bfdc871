"""The model registry against real databases: a SQLite file, and PostgreSQL on 127.0.0.1:5432.

Every test runs on both (test_gate_evidence.py and test_heartbeats.py use these fixtures too). For
PostgreSQL the run creates a scratch database (random name, dropped at the end) and each test gets its
own schema in it. The races are made deterministic with an engine
event: each racing thread stops at its first write until the other one has done all its reads.
"""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Callable

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import IntegrityError

from registry.db import make_engine, normalize_url
from registry.models import Status
from registry.registry import LIFECYCLE, NoIncumbent, Registry, RegistryConflict, UnknownVersion

PG_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432"
HAPPY = ["evaluating", "canary", "awaiting_approval", "promoted"]


@pytest.fixture(scope="session")
def pg_database():
    """A fresh database for this run, created through the `postgres` database and dropped after."""
    psycopg = pytest.importorskip("psycopg", reason="psycopg (PostgreSQL driver) is not installed")
    try:
        admin = psycopg.connect(
            "host=127.0.0.1 port=5432 user=postgres dbname=postgres", autocommit=True, connect_timeout=3
        )
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


def sha(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def files(name: str, kind: str = "snapshot") -> list[dict]:
    return [{"path": f"{name}/model.safetensors", "sha256": sha(name), "bytes": 1234, "kind": kind}]


def verdict(reg: Registry, vid: str, **over) -> dict:
    return {
        "passed": True,
        "incumbent_id": reg.incumbent().id,
        "artifact_sha256": reg.get(vid).artifact_sha256,
        "suite_version": "suite-1",
        "numbers": {"lower": -0.01, "n": 200},
        **over,
    }


def advance(reg: Registry, vid: str, to: str = "awaiting_approval", actor: str = "alice") -> None:
    """Take a version along the happy path from where it is up to `to`, as the gate (and a person, for
    promoted) would."""
    now = reg.get(vid).status
    for st in HAPPY[HAPPY.index(now) + 1 if now in HAPPY else 0 : HAPPY.index(to) + 1]:
        if st == "promoted":
            reg.approve(vid, actor, "canary won")
        else:
            reg.transition(vid, st, "gate", f"to {st}")
        if st == "evaluating":
            reg.record_gate(vid, "offline", verdict(reg, vid), "gate")


def base(reg: Registry, vid: str = "base") -> None:
    reg.bootstrap(vid, files=files(vid))


def snapshot(reg: Registry):
    """Everything observable: each version's status and gate records, and the whole audit log."""
    return [(v.id, v.status, v.gate) for v in reg.list()], reg.audit()


# -- register / get / list / lineage ------------------------------------------------------------


def test_register_get_list_lineage(reg):
    v1 = reg.register(version_id="v0001", files=files("v0001"), notes="base", data_range={"completions": {0: (0, 0)}})
    v2 = reg.register(
        parent_id="v0001",
        files=files("v0002", "delta"),
        data_range={"samples": {0: (0, 120), 3: (7, 9)}},
        metrics={"reward_mean": 0.25, "eval": {"pass@1": 0.5}},
    )
    v3 = reg.register(parent_id=v2.id)
    side = reg.register(version_id="exp-a.1", parent_id="v0001")
    assert (v1.id, v2.id, v3.id) == ("v0001", "v0002", "v0003")  # auto ids continue vNNNN
    assert all(v.status is Status.candidate for v in (v1, v2, v3, side))

    got = reg.get("v0002")
    assert got.parent_id == "v0001" and got.delta_base_id == "v0001"  # a delta defaults to its parent
    assert got.data_range == {"samples": {0: (0, 120), 3: (7, 9)}}  # int partitions survive JSON
    assert got.metrics == {"reward_mean": 0.25, "eval": {"pass@1": 0.5}}
    assert [(f.path, f.sha256, f.bytes, f.kind) for f in got.files] == [
        ("v0002/model.safetensors", sha("v0002"), 1234, "delta")
    ]
    assert got.artifact_sha256 == sha("v0002") and v3.artifact is None and got.gate == {}
    assert got.created_at.tzinfo is not None and got.created_at >= v1.created_at
    assert reg.get("v0001").notes == "base"

    assert [v.id for v in reg.list()] == ["v0001", "v0002", "v0003", "exp-a.1"]
    assert [v.id for v in reg.lineage("v0003")] == ["v0003", "v0002", "v0001"]
    assert [v.id for v in reg.lineage("exp-a.1")] == ["exp-a.1", "v0001"]
    assert [v.id for v in reg.lineage("v0001")] == ["v0001"]
    assert reg.promoted() is None

    # Nothing is evaluated without an incumbent; bootstrap promotes the parentless candidate v0001.
    with pytest.raises(NoIncumbent, match="bootstrap the base model first"):
        reg.transition("v0002", "evaluating", "gate", "offline evals started")
    assert reg.bootstrap("v0001", files=files("v0001")).status is Status.promoted
    reg.transition("v0002", "evaluating", "gate", "offline evals started")
    assert [v.id for v in reg.list("evaluating")] == ["v0002"]
    assert [v.id for v in reg.list(Status.candidate)] == ["v0003", "exp-a.1"]
    assert reg.list("rejected") == []
    assert [(a.version_id, a.from_status, a.to_status, a.actor, a.action) for a in reg.audit("v0002")] == [
        ("v0002", None, Status.candidate, "learner", "register"),
        ("v0002", Status.candidate, Status.evaluating, "gate", "transition"),
    ]
    assert [a.seq for a in reg.audit()] == list(range(1, 7)) and reg.last_seq() == 6


def test_registry_reopens_and_add_metrics(url):
    with Registry(url) as r:
        r.register(version_id="v0001", metrics={"loss": 1.0})
        r.add_metrics("v0001", {"eval": {"gsm": 0.4}})
    with Registry(url) as r:  # a second process on the same database: tables exist, data is there
        assert r.get("v0001").metrics == {"loss": 1.0, "eval": {"gsm": 0.4}}
        assert r.add_metrics("v0001", {"loss": 0.5}).metrics == {"loss": 0.5, "eval": {"gsm": 0.4}}
        assert r.register().id == "v0002"
        assert [a.seq for a in r.audit()] == [1, 2]  # metrics are not transitions


# -- lifecycle ----------------------------------------------------------------------------------


def test_bootstrap_is_one_audited_step_and_idempotent(reg):
    with pytest.raises(NoIncumbent, match="bootstrap"):
        reg.incumbent()
    with pytest.raises(NoIncumbent):
        reg.base_for_next_candidate()
    v = reg.bootstrap("base", files=files("base"), notes="pre-trained")
    assert v.status is Status.promoted and v.parent_id is None and reg.incumbent().id == "base"
    assert [(a.from_status, a.to_status, a.actor, a.action) for a in reg.audit()] == [
        (None, "promoted", "bootstrap", "bootstrap")
    ]
    assert reg.bootstrap("base", files=files("base")).id == "base" and len(reg.audit()) == 1  # idempotent
    before = snapshot(reg)
    for call, match in [
        (lambda: reg.bootstrap("base", files=files("other")), "registered with other files"),
        (lambda: reg.bootstrap("base2", files=files("base2")), "'base' is promoted already"),
        (lambda: reg.bootstrap("b3", files=[]), "one artifact"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    assert snapshot(reg) == before
    assert reg.base_for_next_candidate().id == "base"


def test_happy_path_to_promoted_with_audit(reg):
    base(reg)
    reg.register(version_id="v0001", parent_id="base", files=files("v0001"))
    advance(reg, "v0001", "promoted")
    assert reg.promoted().id == "v0001" and reg.get("base").status is Status.superseded
    audit = reg.audit()
    assert [(a.version_id, a.from_status, a.to_status, a.actor, a.action) for a in audit] == [
        ("base", None, "promoted", "bootstrap", "bootstrap"),
        ("v0001", None, "candidate", "learner", "register"),
        ("v0001", "candidate", "evaluating", "gate", "transition"),
        ("v0001", "evaluating", "evaluating", "gate", "record_gate"),
        ("v0001", "evaluating", "canary", "gate", "transition"),
        ("v0001", "canary", "awaiting_approval", "gate", "transition"),
        ("base", "promoted", "superseded", "alice", "approve"),
        ("v0001", "awaiting_approval", "promoted", "alice", "approve"),
    ]
    assert [a.seq for a in audit] == list(range(1, 9)) and [a.at for a in audit] == sorted(a.at for a in audit)
    assert audit[3].details["record"]["numbers"] == {"lower": -0.01, "n": 200}
    assert audit[-1].details == {"incumbent_id": "base", "artifact_sha256": sha("v0001"), "suite_version": "suite-1"}
    assert "v0001" in audit[-2].reason and "canary won" in audit[-2].reason
    assert reg.get("v0001").gate["offline"]["format_version"] == 1 and reg.in_flight() is None


def test_dead_ends(reg):
    base(reg)
    for vid, path in [
        ("r", ["evaluating", "rejected"]),
        ("a", ["evaluating", "canary", "aborted"]),
        ("p", ["evaluating", "canary", "awaiting_approval", "rejected"]),
        ("w", ["evaluating", "withdrawn"]),
    ]:
        reg.register(version_id=vid, parent_id="base", files=files(vid))
        for st in path:
            reg.transition(vid, st, "gate", "eval")
        assert reg.get(vid).status == path[-1] and not LIFECYCLE[Status(path[-1])]
        with pytest.raises(ValueError, match=f"'{path[-1]}' to 'evaluating'"):
            reg.transition(vid, "evaluating", "gate", "again")
    assert reg.in_flight() is None


@pytest.mark.parametrize(
    "upto,to,why",
    [
        (None, "promoted", "only bootstrap\\(\\)"),
        (None, "canary", "next status is one of \\['evaluating', 'withdrawn'\\]"),
        ("evaluating", "awaiting_approval", "next status is one of \\['canary', 'rejected', 'withdrawn'\\]"),
        ("canary", "promoted", "next status"),
        ("awaiting_approval", "promoted", "use approve\\(\\)"),
        ("promoted", "superseded", "promoting another"),
        ("promoted", "rolled_back", "rollback\\(\\)"),
        ("promoted", "withdrawn", "next status is one of none"),
    ],
)
def test_illegal_transitions_refused_nothing_written(reg, upto, to, why):
    base(reg)
    reg.register(version_id="v0001", parent_id="base", files=files("v0001"))
    if upto:
        advance(reg, "v0001", upto)
    before = snapshot(reg)
    with pytest.raises(ValueError, match=f"'v0001' from '{upto or 'candidate'}' to '{to}'.*{why}"):
        reg.transition("v0001", to, "mallory", "skip the gate")
    assert snapshot(reg) == before


def test_one_candidate_in_flight(reg):
    base(reg)
    for vid in ("v1", "v2"):
        reg.register(version_id=vid, parent_id="base", files=files(vid))
    reg.transition("v1", "evaluating", "gate", "go")
    assert reg.in_flight().id == "v1"
    for st in ("evaluating", "canary", "awaiting_approval"):
        if st != "evaluating":
            reg.transition("v1", st, "gate", "go")
        with pytest.raises(ValueError, match=f"'v1' is '{st}' and only one candidate is in flight"):
            reg.transition("v2", "evaluating", "gate", "me too")
    reg.reject("v1", "carol", "no", details={"why": "tone"})
    assert reg.audit("v1")[-1].details == {"why": "tone"} and reg.audit("v1")[-1].action == "reject"
    assert reg.transition("v2", "evaluating", "gate", "now").status is Status.evaluating


def test_supersede_a_waiting_candidate(reg):
    base(reg)
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    advance(reg, "v1", "awaiting_approval")
    reg.register(version_id="v2", parent_id="v1", files=files("v2"))
    before = snapshot(reg)
    for args, match in [
        (("v1", "v1"), "must be a newer candidate"),
        (("v2", "v1"), "must be a newer candidate"),
        (("base", "v2"), "cannot supersede 'base': it is 'promoted'"),
        (("v1", "v9"), "unknown version 'v9'"),
    ]:
        with pytest.raises(ValueError, match=match):
            reg.supersede(*args, "gate", "newer")
    assert snapshot(reg) == before
    assert reg.supersede("v1", "v2", "gate", "v2 has 400 more samples").status is Status.withdrawn
    last = reg.audit("v1")[-1]
    assert (last.from_status, last.to_status, last.action, last.details) == (
        "awaiting_approval",
        "withdrawn",
        "supersede",
        {"by": "v2"},
    )
    assert reg.in_flight() is None and reg.get("v2").status is Status.candidate  # not a verdict on v2
    assert reg.base_for_next_candidate("v2").id == "v2" and reg.base_for_next_candidate("v1").id == "base"
    with pytest.raises(ValueError, match="cannot approve 'v1': it is 'withdrawn'"):
        reg.approve("v1", "alice", "too late")


@pytest.mark.parametrize("upto,how", [("evaluating", "reject"), ("canary", "aborted"), ("awaiting_approval", "reject")])
def test_a_failed_parent_withdraws_its_waiting_descendants(reg, upto, how):
    base(reg)
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    advance(reg, "v1", upto)
    for vid, parent in (("v2", "v1"), ("v3", "v2"), ("side", "base")):
        reg.register(version_id=vid, parent_id=parent, files=files(vid))
    if how == "reject":
        reg.reject("v1", "carol", "worse on sql tasks")
    else:
        reg.transition("v1", "aborted", "gate", "guardrail: latency")
    assert [(v.id, v.status) for v in reg.list()] == [
        ("base", "promoted"),
        ("v1", "rejected" if how == "reject" else "aborted"),
        ("v2", "withdrawn"),
        ("v3", "withdrawn"),
        ("side", "candidate"),
    ]
    tail = reg.audit()[-2:]
    assert {(a.version_id, a.from_status, a.action, a.details["because"]) for a in tail} == {
        ("v2", "candidate", "withdraw", "v1"),
        ("v3", "candidate", "withdraw", "v1"),
    }
    assert reg.base_for_next_candidate("v3").id == "base"  # the learner rebases onto the incumbent
    assert reg.base_for_next_candidate("side").id == "side"


def test_database_itself_refuses_a_second_promoted_or_in_flight(reg, url):
    for vid in ("v0001", "v0002", "v0003", "v0004"):
        reg.register(version_id=vid)
    engine = make_engine(url)
    try:
        for first, second, st in (
            ("v0001", "v0002", "promoted"),
            ("v0003", "v0004", "evaluating"),
            ("v0003", "v0004", "awaiting_approval"),
        ):
            with engine.begin() as c:
                c.execute(text(f"UPDATE model_version SET status = '{st}' WHERE id = '{first}'"))
            with pytest.raises(IntegrityError), engine.begin() as c:
                c.execute(text(f"UPDATE model_version SET status = '{st}' WHERE id = '{second}'"))
        with pytest.raises(IntegrityError), engine.begin() as c:  # foreign keys are on (SQLite too)
            c.execute(
                text(
                    "INSERT INTO audit_entry (version_id, to_status, actor, reason, action, details, seq, at) "
                    "VALUES ('nope', 'candidate', 'x', 'y', 'register', '{}', 99, CURRENT_TIMESTAMP)"
                )
            )
        if engine.dialect.name == "sqlite":
            with engine.connect() as c:
                assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        engine.dispose()
    assert [v.id for v in reg.list("promoted")] == ["v0001"]


def race(url: str, calls: list[Callable[[Registry], object]]) -> tuple[list, list]:
    """Run each call in its own thread and Registry (as two processes would), each thread held at its
    first write until all have done their reads; returns (results, errors)."""
    regs = [Registry(url, create=False) for _ in calls]
    barrier = threading.Barrier(len(calls), timeout=10)
    held = threading.local()

    def hold_first_write(conn, cursor, statement, *args):
        if getattr(held, "racing", False) and statement.lstrip().upper().startswith(("UPDATE", "INSERT")):
            held.racing = False
            barrier.wait()

    winners, errors = [], []

    def run(r: Registry, call) -> None:
        held.racing = True
        try:
            winners.append(call(r))
        except Exception as e:  # collected and asserted on by the test
            errors.append(e)

    for r in regs:
        event.listen(r.engine, "before_cursor_execute", hold_first_write)
    threads = [threading.Thread(target=run, args=(r, c)) for r, c in zip(regs, calls, strict=True)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    [r.close() for r in regs]
    assert not any(t.is_alive() for t in threads), "a racing call hung"
    return winners, errors


def test_concurrent_bootstraps_exactly_one_wins(reg, url):
    winners, errors = race(url, [lambda r, v=v: r.bootstrap(v, files=files(v)).id for v in ("b1", "b2")])
    assert len(winners) == 1 and len(errors) == 1, (winners, errors)
    loser = ({"b1", "b2"} - set(winners)).pop()
    assert isinstance(errors[0], ValueError) and f"cannot bootstrap {loser!r}" in str(errors[0])
    assert [v.id for v in reg.list()] == winners and len(reg.audit()) == 1


def test_approval_racing_a_rollback_exactly_one_wins(reg, url):
    base(reg)
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    advance(reg, "v1", "promoted")
    reg.register(version_id="v2", parent_id="v1", files=files("v2"))
    advance(reg, "v2", "awaiting_approval")  # evaluated against v1
    n = len(reg.audit())
    winners, errors = race(
        url, [lambda r: r.approve("v2", "alice", "ship").id, lambda r: r.rollback(None, "ops", "v1 leaks").id]
    )
    assert len(winners) == 1 and len(errors) == 1, (winners, errors)
    if winners == ["v2"]:  # the rollback's compare-and-set on v1 found it superseded
        assert isinstance(errors[0], RegistryConflict) and "'v1' is no longer 'promoted'" in str(errors[0])
        assert [(v.id, v.status) for v in reg.list()][1:] == [("v1", "superseded"), ("v2", "promoted")]
    else:  # the approval, queued behind the rollback, found v2 withdrawn with its parent
        assert isinstance(errors[0], ValueError) and "it is 'withdrawn'" in str(errors[0])
        assert [(v.id, v.status) for v in reg.list()] == [
            ("base", "promoted"),
            ("v1", "rolled_back"),
            ("v2", "withdrawn"),
        ]
    assert [a.seq for a in reg.audit()] == list(range(1, len(reg.audit()) + 1)) and len(reg.audit()) - n in (2, 3)


def test_concurrent_evaluations_one_in_flight(reg, url):
    base(reg)
    for vid in ("v1", "v2"):
        reg.register(version_id=vid, parent_id="base", files=files(vid))
    winners, errors = race(url, [lambda r, v=v: r.transition(v, "evaluating", "gate", "go").id for v in ("v1", "v2")])
    assert len(winners) == 1 and len(errors) == 1 and isinstance(errors[0], RegistryConflict), errors
    assert "entered evaluation concurrently" in str(errors[0]) and reg.in_flight().id == winners[0]
    assert len(reg.audit()) == 4


def test_concurrent_steps_on_one_version_exactly_one_wins(reg, url):
    base(reg)
    reg.register(version_id="v0001", parent_id="base")
    for st in ("evaluating", "canary"):
        reg.transition("v0001", st, "gate", "x")
    winners, errors = race(
        url, [lambda r, to=to: r.transition("v0001", to, "gate", "x").id for to in ("aborted", "awaiting_approval")]
    )
    assert len(winners) == 1 and len(errors) == 1 and isinstance(errors[0], RegistryConflict), errors
    final = reg.get("v0001").status
    assert final in ("aborted", "awaiting_approval")
    assert [a.to_status for a in reg.audit("v0001")][-1] == final
    assert len(reg.audit("v0001")) == 4


# -- rollback -----------------------------------------------------------------------------------


def test_rollback(reg):
    base(reg, "v0001")
    for i, vid in enumerate(("v0002", "v0003")):
        reg.register(version_id=vid, parent_id=f"v000{i + 1}", files=files(vid))
        advance(reg, vid, "promoted")
    reg.register(version_id="v0004", parent_id="v0003", files=files("v0004"))  # the learner's next one
    with pytest.raises(ValueError, match="cannot roll back to 'v0003': it is 'promoted'"):
        reg.rollback("v0003", "ops", "oops")

    back = reg.rollback("v0001", "ops", "v0003 leaks memory", details={"rss_gb": 71.5})  # two versions back
    assert back.id == "v0001" and back.status is Status.promoted
    assert reg.get("v0003").status is Status.rolled_back and reg.get("v0002").status is Status.superseded
    assert reg.get("v0004").status is Status.withdrawn and reg.base_for_next_candidate("v0004").id == "v0001"
    tail = reg.audit()[-3:]
    assert [(a.version_id, a.from_status, a.to_status, a.actor, a.action) for a in tail] == [
        ("v0003", "promoted", "rolled_back", "ops", "rollback"),
        ("v0001", "superseded", "promoted", "ops", "rollback"),
        ("v0004", "candidate", "withdrawn", "ops", "withdraw"),
    ]
    assert tail[0].reason == "v0003 leaks memory" and "v0003" in tail[1].reason
    assert tail[0].details == {"to": "v0001", "rss_gb": 71.5}

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
        (lambda: reg.transition("v0001", "withdrawn", "gate", "x", details={"t": object()}), "JSON-serialisable"),
        (lambda: reg.transition("v0001", "withdrawn", "gate", "x", details=[1]), "JSON object"),
        (lambda: reg.transition("v0404", "evaluating", "gate", "x"), "unknown version 'v0404'"),
        (lambda: reg.reject("v0001", "carol", "no"), "cannot reject 'v0001': it is 'candidate'"),
        (lambda: reg.approve("v0404", "alice", "yes"), "unknown version 'v0404'"),
        (lambda: reg.list(status="live"), "unknown status 'live'"),
        (lambda: reg.get("v0404"), "unknown version 'v0404'"),
        (lambda: reg.lineage("v0404"), "unknown version 'v0404'"),
        (lambda: reg.audit("v0404"), "unknown version 'v0404'"),
        (lambda: reg.base_for_next_candidate("v0404"), "unknown version 'v0404'"),
        (lambda: reg.rollback("v0001", "ops", "x"), "no version is promoted"),
        (lambda: reg.changes_since(-1), "seq >= 0"),
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
    the losers of that race look again instead of failing (without the retry, 10 of 10 trials of 6
    threads on a new SQLite file fail)."""
    for trial in range(3):
        trial_url = url.replace("registry.db", f"registry-{trial}.db")
        start, errors = threading.Barrier(6), []

        def open_it(start=start, trial_url=trial_url, errors=errors) -> None:
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


def test_a_rollout_version_is_never_gated_and_only_withdrawn(reg):
    # The learner's weights for lent rollouts: registered as `rollout`, with an artifact; the gate's queue
    # (candidates) never sees it, it cannot enter the lifecycle, and it ends withdrawn.
    base(reg)
    with pytest.raises(ValueError, match="'candidate' or 'rollout', got 'promoted'"):
        reg.register(version_id="x", parent_id="base", files=files("x"), status="promoted")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="files need one artifact"):
        reg.register(version_id="x.rollout", parent_id="base", files=files("x") + files("y"), status="rollout")
    with pytest.raises(ValueError, match="the ids of rollout versions, and only theirs, end in '.rollout'"):
        reg.register(version_id="x", parent_id="base", files=files("x"), status="rollout")
    with pytest.raises(ValueError, match="end in '.rollout'"):
        reg.register(version_id="x.rollout", parent_id="base", files=files("x"))  # a candidate
    v = reg.register(version_id="v1.rollout", parent_id="base", files=files("v1"), status="rollout")
    assert v.status == "rollout" and reg.list("candidate") == [] and reg.base_for_next_candidate("base").id == "base"
    for to in ("evaluating", "candidate", "promoted", "canary"):
        with pytest.raises(ValueError):
            reg.transition("v1.rollout", to, "gate", "no")
    assert reg.transition("v1.rollout", "withdrawn", "learner", "its jobs are over").status == "withdrawn"
    assert [(a.from_status, a.to_status) for a in reg.audit() if a.version_id == "v1.rollout"] == [
        (None, "rollout"),
        ("rollout", "withdrawn"),
    ]
