"""Which completions exist, whose they are; which feedback idempotency keys were already used.

Two tables in one SQL database (SQLAlchemy Core): `completions` (each served completion's id, tenant,
hashed user, served time, model version and experiment arm: added by the gateway before it answers,
so ingestion can refuse unknown or foreign ids and clamp a feedback `ts`) and `idempotency_keys` (one
row per keyed feedback event id with the fingerprint of its event). A claim is an `INSERT … ON
CONFLICT DO NOTHING`: the row is *pending* while its request publishes, then *done* (`confirm`) or
deleted (`release`: the publish failed); a pending row older than `stale_claim_s` (its request died)
may be claimed again. SQLite (a file) by default; PostgreSQL in production, where every gateway
shares the tables, so two gateways never both claim one key. Rows older than their TTL are pruned;
an index of another format version (`flywheel_meta`) is refused.

Called by `feedback.ingest` and the gateway's completion route.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from core.sql import create_tables

_SQLITE_BUSY_S = 30.0  # how long a SQLite connection waits for a lock

FORMAT_VERSION = 1
PENDING, DONE = 0, 1
PRUNE_EVERY_S = 60.0

_meta = sa.MetaData()
_meta_table = sa.Table(
    "flywheel_meta",
    _meta,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(256), nullable=False),
)
_completions = sa.Table(
    "completions",
    _meta,
    sa.Column("completion_id", sa.String(128), primary_key=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("user_id", sa.String(64)),  # hashed (feedback.events.hash_user); NULL: served without a user
    sa.Column("served_ts", sa.Float, nullable=False, index=True),
    sa.Column("model_version", sa.String(128), nullable=False),
    sa.Column("arm", sa.String(64)),  # experiment arm; NULL outside experiments
)
_keys = sa.Table(
    "idempotency_keys",
    _meta,
    sa.Column("event_id", sa.String(64), primary_key=True),
    sa.Column("fingerprint", sa.String(64), nullable=False),
    sa.Column("state", sa.SmallInteger, nullable=False),
    sa.Column("updated_ts", sa.Float, nullable=False, index=True),
)
_c, _k = _completions.c, _keys.c
_VERSION_KEY = "completion_index_version"
_IDS = sa.bindparam("ids", type_=sa.String, expanding=True)  # a list of ids (an empty one too)
_NOW, _BEFORE = sa.bindparam("now", type_=sa.Float), sa.bindparam("before", type_=sa.Float)
_GET_VERSION = sa.select(_meta_table.c.value).where(_meta_table.c.name == _VERSION_KEY)
_ENTRY = (_c.tenant, _c.model_version, _c.served_ts, _c.user_id, _c.arm)  # CompletionEntry's fields
_GET_COMPLETIONS = sa.select(_c.completion_id, *_ENTRY).where(_c.completion_id.in_(_IDS))
_GET_KEYS = sa.select(_keys).where(_k.event_id.in_(_IDS))
_RECLAIM = (  # a stale pending claim, unless another request reclaimed it meanwhile
    sa.update(_keys)
    .where(_k.event_id == sa.bindparam("eid"), _k.state == PENDING, _k.updated_ts == sa.bindparam("seen"))
    .values(updated_ts=_NOW)
)
_CONFIRM = sa.update(_keys).where(_k.event_id.in_(_IDS), _k.state == PENDING).values(state=DONE, updated_ts=_NOW)
_RELEASE = sa.delete(_keys).where(_k.event_id.in_(_IDS), _k.state == PENDING)
_COUNT_DONE = sa.select(sa.func.count()).select_from(_keys).where(_k.state == DONE)
_PRUNE_KEYS = sa.delete(_keys).where(_k.state == DONE, _k.updated_ts < _BEFORE)
_PRUNE_COMPLETIONS = sa.delete(_completions).where(_c.served_ts < _BEFORE)


class CompletionEntry(NamedTuple):
    tenant: str
    model_version: str
    ts: float  # served time, seconds since the epoch
    user_id: str | None = None
    arm: str | None = None


class Claim(NamedTuple):
    claimed: list[str]  # ids this call claimed: publish them, then confirm or release
    done: dict[str, str]  # ids already accepted with this fingerprint: duplicates
    pending: list[str]  # ids another request is publishing right now
    mismatched: list[str]  # ids already used for an event of another fingerprint


class CompletionIndex:
    def __init__(
        self,
        url: str | Path,
        accepted_ttl_s: float = 7 * 24 * 3600.0,
        completion_ttl_s: float = 30 * 24 * 3600.0,
        stale_claim_s: float = 60.0,
    ):
        """`url`: a SQLAlchemy URL, or a path (a SQLite file)."""
        self.accepted_ttl_s, self.completion_ttl_s, self.stale_claim_s = accepted_ttl_s, completion_ttl_s, stale_claim_s
        for name in ("accepted_ttl_s", "completion_ttl_s", "stale_claim_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        url = str(url) if "://" in str(url) else f"sqlite:///{url}"
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        backend = sa.engine.make_url(url).get_backend_name()
        if backend not in ("sqlite", "postgresql"):
            raise ValueError(f"the completion index runs on SQLite or PostgreSQL, not {backend!r} ({url})")
        self.engine = sa.create_engine(url, connect_args={"timeout": _SQLITE_BUSY_S} if backend == "sqlite" else {})
        if backend == "sqlite":
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self._insert = sqlite.insert if backend == "sqlite" else postgresql.insert
        # One statement for every add_many, run with a list of rows (executemany): compiled once and cached.
        # A multi-row VALUES built per call was compiled per call: 0.7 ms of CPU for one row, 2.5 ms for 16.
        ins = self._insert(_completions)
        cols = ("tenant", "user_id", "served_ts", "model_version", "arm")
        self._upsert_completions = ins.on_conflict_do_update(
            index_elements=["completion_id"], set_={k: ins.excluded[k] for k in cols}
        )
        self._closed, self._last_prune = False, 0.0
        ours = str(FORMAT_VERSION)
        with self.engine.begin() as db:
            create_tables(_meta, db)  # several gateways open one index at once
            db.execute(self._insert(_meta_table).values(name=_VERSION_KEY, value=ours).on_conflict_do_nothing())
            stored = db.execute(_GET_VERSION).scalar_one()
        if stored != ours:
            raise ValueError(f"completion index {self.engine.url!r}: format version {stored}, this build reads {ours}")

    def _db(self):
        if self._closed:
            raise RuntimeError("the completion index is closed")
        return self.engine.begin()

    # ---- completions --------------------------------------------------------------------------
    def add(
        self,
        completion_id: str,
        tenant: str,
        model_version: str,
        ts: float | None = None,
        user_id: str | None = None,
        arm: str | None = None,
    ) -> None:
        self.add_many([(completion_id, tenant, model_version, ts, user_id, arm)])

    def add_many(self, rows: list[tuple[str, str, str, float | None, str | None, str | None]]) -> None:
        """(completion_id, tenant, model_version, ts, user_id, arm) rows in one transaction, one upsert run
        over them (executemany); a completion id seen again takes the newer row (the last in `rows`)."""
        if not rows:
            return
        now = time.time()
        by_id: dict[str, dict[str, Any]] = {
            cid: dict(
                completion_id=cid,
                tenant=tenant,
                user_id=user_id,
                served_ts=now if ts is None else ts,
                model_version=version,
                arm=arm,
            )
            for cid, tenant, version, ts, user_id, arm in rows
        }
        with self._db() as db:
            db.execute(self._upsert_completions, list(by_id.values()))
        newest = max(float(r["served_ts"]) for r in by_id.values())
        if newest - self._last_prune >= PRUNE_EVERY_S:
            self.prune(newest)

    def get(self, completion_id: str) -> CompletionEntry | None:
        return self.get_many([completion_id]).get(completion_id)

    def get_many(self, completion_ids: list[str]) -> dict[str, CompletionEntry]:
        with self._db() as db:
            rows = db.execute(_GET_COMPLETIONS, {"ids": list(dict.fromkeys(completion_ids))}).all()
        return {r[0]: CompletionEntry(*r[1:]) for r in rows}

    # ---- idempotency keys ---------------------------------------------------------------------
    def claim(self, fingerprints: dict[str, str], now: float | None = None) -> Claim:
        """Claim each event id (id -> fingerprint of the event it stands for)."""
        now = time.time() if now is None else now
        claim = Claim([], {}, [], [])
        if not fingerprints:
            return claim
        rows = [{"event_id": e, "fingerprint": f, "state": PENDING, "updated_ts": now} for e, f in fingerprints.items()]
        insert = self._insert(_keys).values(rows).on_conflict_do_nothing().returning(_k.event_id)
        with self._db() as db:
            got = set(db.execute(insert).scalars())
            claim.claimed.extend(e for e in fingerprints if e in got)
            others = [e for e in fingerprints if e not in got]
            stored, stale = db.execute(_GET_KEYS, {"ids": others}).all(), now - self.stale_claim_s
            for eid, fp, state, updated in stored:
                if fp != fingerprints[eid]:
                    claim.mismatched.append(eid)
                elif state == DONE:
                    claim.done[eid] = fp
                elif updated < stale and db.execute(_RECLAIM, dict(eid=eid, seen=updated, now=now)).rowcount == 1:
                    claim.claimed.append(eid)  # its claimer died
                else:
                    claim.pending.append(eid)
            claim.pending.extend(e for e in others if e not in {r[0] for r in stored})  # released meanwhile: ask again
        return claim

    def confirm(self, event_ids: list[str], now: float | None = None) -> None:
        """The claimed events are published: a retry is now a duplicate."""
        if event_ids:
            with self._db() as db:
                db.execute(_CONFIRM, {"ids": event_ids, "now": time.time() if now is None else now})

    def release(self, event_ids: list[str]) -> None:
        """The publish failed: a retry may claim these ids again."""
        if event_ids:
            with self._db() as db:
                db.execute(_RELEASE, {"ids": event_ids})

    def accepted_count(self) -> int:
        with self._db() as db:
            return db.execute(_COUNT_DONE).scalar_one()

    def prune(self, now: float | None = None) -> None:
        """Forget keys accepted more than `accepted_ttl_s` ago and completions served more than
        `completion_ttl_s` ago (feedback for them is then refused as unknown)."""
        now = time.time() if now is None else now
        self._last_prune = now
        with self._db() as db:
            db.execute(_PRUNE_KEYS, {"before": now - self.accepted_ttl_s})
            db.execute(_PRUNE_COMPLETIONS, {"before": now - self.completion_ttl_s})

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.dispose()


def _sqlite_pragmas(conn, _record) -> None:
    # WAL: readers do not wait for the writer. NORMAL: a commit survives a crash of the process (the
    # completion itself is also in the fsynced bus).
    cur = conn.cursor()
    # Switching a new database to WAL takes an exclusive lock, and SQLite answers "database is locked"
    # at once there, without its busy handler (8 threads opening one new index together: 14 of 150
    # rounds failed so, 0 of 230 with this): retry for as long as the busy timeout would have waited.
    deadline = time.monotonic() + _SQLITE_BUSY_S
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as e:
            if getattr(e, "sqlite_errorcode", None) != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()
