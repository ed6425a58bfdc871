"""Which completions exist, whose they are; which feedback idempotency keys were already used.

`CompletionIndex(url)` holds two tables in one SQL database (SQLAlchemy Core):

* `completions`: each served completion's id, tenant, hashed user, served time, model version and
  experiment arm. The gateway adds a completion right after it is recorded, before it answers, so
  feedback ingestion can refuse ids that do not exist, belong to another tenant or another user,
  and clamp a feedback `ts` to the completion's served time.
* `idempotency_keys`: one row per keyed feedback event id, with the fingerprint of the event it
  stands for. A claim is an `INSERT … ON CONFLICT DO NOTHING`: the row is *pending* while its
  request publishes, then *done* (`confirm`), or deleted (`release`: the publish failed, a retry
  may claim it). A pending row older than `stale_claim_s` (its request died) may be claimed again.

SQLite (a file under FLYWHEEL_HOME) by default; PostgreSQL in production (`FLYWHEEL_INDEX_URL`),
where every gateway shares the tables, so any gateway accepts feedback for a completion another one
served, and two gateways never both claim one key. Rows older than their TTL are pruned. The
tables' format version is stored in `flywheel_meta`; an index of another version is refused.
Called by `feedback.ingest` and the gateway's completion route.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

FORMAT_VERSION = 1
PENDING, DONE = 0, 1

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


def _url(where: str | Path) -> str:
    text = str(where)
    return text if "://" in text else f"sqlite:///{text}"


class CompletionIndex:
    def __init__(
        self,
        url: str | Path,
        accepted_ttl_s: float = 7 * 24 * 3600.0,
        completion_ttl_s: float = 30 * 24 * 3600.0,
        stale_claim_s: float = 60.0,
        prune_every_s: float = 60.0,
    ):
        """`url`: a SQLAlchemy URL, or a path (a SQLite file)."""
        for name, v in (
            ("accepted_ttl_s", accepted_ttl_s),
            ("completion_ttl_s", completion_ttl_s),
            ("stale_claim_s", stale_claim_s),
            ("prune_every_s", prune_every_s),
        ):
            if not v > 0:
                raise ValueError(f"{name} must be > 0, got {v!r}")
        self.accepted_ttl_s, self.completion_ttl_s = accepted_ttl_s, completion_ttl_s
        self.stale_claim_s, self.prune_every_s = stale_claim_s, prune_every_s
        url = _url(url)
        if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
            Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        backend = sa.engine.make_url(url).get_backend_name()
        if backend not in ("sqlite", "postgresql"):
            raise ValueError(f"the completion index runs on SQLite or PostgreSQL, not {backend!r} ({url})")
        self.engine = sa.create_engine(url, connect_args={"timeout": 30} if backend == "sqlite" else {})
        if backend == "sqlite":
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self._insert = sqlite.insert if backend == "sqlite" else postgresql.insert
        self._closed = False
        self._last_prune = 0.0
        with self.engine.begin() as db:
            _meta.create_all(db)
            db.execute(
                self._insert(_meta_table)
                .values(name="completion_index_version", value=str(FORMAT_VERSION))
                .on_conflict_do_nothing()
            )
            stored = db.execute(
                sa.select(_meta_table.c.value).where(_meta_table.c.name == "completion_index_version")
            ).scalar_one()
        if stored != str(FORMAT_VERSION):
            raise ValueError(
                f"completion index at {self.engine.url!r} has format version {stored}, this build "
                f"reads {FORMAT_VERSION}"
            )

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
        row: dict[str, Any]
        row = {
            "completion_id": completion_id,
            "tenant": tenant,
            "user_id": user_id,
            "served_ts": time.time() if ts is None else ts,
            "model_version": model_version,
            "arm": arm,
        }
        stmt = self._insert(_completions).values(**row)
        with self._db() as db:
            db.execute(
                stmt.on_conflict_do_update(
                    index_elements=["completion_id"], set_={k: stmt.excluded[k] for k in row if k != "completion_id"}
                )
            )
        self._maybe_prune(row["served_ts"])

    def get(self, completion_id: str) -> CompletionEntry | None:
        return self.get_many([completion_id]).get(completion_id)

    def get_many(self, completion_ids: list[str]) -> dict[str, CompletionEntry]:
        c = _completions.c
        ids = list(dict.fromkeys(completion_ids))
        with self._db() as db:
            rows = (
                db.execute(
                    sa.select(c.completion_id, c.tenant, c.model_version, c.served_ts, c.user_id, c.arm).where(
                        c.completion_id.in_(ids)
                    )
                ).all()
                if ids
                else []
            )
        return {r[0]: CompletionEntry(*r[1:]) for r in rows}

    # ---- idempotency keys ---------------------------------------------------------------------
    def claim(self, fingerprints: dict[str, str], now: float | None = None) -> Claim:
        """Claim each event id (id -> fingerprint of the event it stands for)."""
        now = time.time() if now is None else now
        if not fingerprints:
            return Claim([], {}, [], [])
        k = _keys.c
        rows = [{"event_id": e, "fingerprint": f, "state": PENDING, "updated_ts": now} for e, f in fingerprints.items()]
        with self._db() as db:
            got = set(
                db.execute(self._insert(_keys).values(rows).on_conflict_do_nothing().returning(k.event_id)).scalars()
            )
            claimed = [e for e in fingerprints if e in got]
            done: dict[str, str] = {}
            pending, mismatched = [], []
            others = [e for e in fingerprints if e not in got]
            stored = (
                db.execute(
                    sa.select(k.event_id, k.fingerprint, k.state, k.updated_ts).where(k.event_id.in_(others))
                ).all()
                if others
                else []
            )
            for eid, fp, state, updated in stored:
                if fp != fingerprints[eid]:
                    mismatched.append(eid)
                elif state == DONE:
                    done[eid] = fp
                elif (
                    updated < now - self.stale_claim_s
                    and db.execute(
                        sa.update(_keys)
                        .where(k.event_id == eid, k.state == PENDING, k.updated_ts == updated)
                        .values(updated_ts=now)
                    ).rowcount
                    == 1
                ):
                    claimed.append(eid)  # its claimer died
                else:
                    pending.append(eid)
            pending += [e for e in others if e not in {r[0] for r in stored}]  # released meanwhile: ask again
        return Claim(claimed, done, pending, mismatched)

    def confirm(self, event_ids: list[str], now: float | None = None) -> None:
        """The claimed events are published: a retry is now a duplicate."""
        if event_ids:
            k = _keys.c
            with self._db() as db:
                db.execute(
                    sa.update(_keys)
                    .where(k.event_id.in_(event_ids), k.state == PENDING)
                    .values(state=DONE, updated_ts=time.time() if now is None else now)
                )

    def release(self, event_ids: list[str]) -> None:
        """The publish failed: a retry may claim these ids again."""
        if event_ids:
            k = _keys.c
            with self._db() as db:
                db.execute(sa.delete(_keys).where(k.event_id.in_(event_ids), k.state == PENDING))

    def accepted_count(self) -> int:
        with self._db() as db:
            return db.execute(sa.select(sa.func.count()).select_from(_keys).where(_keys.c.state == DONE)).scalar_one()

    def prune(self, now: float | None = None) -> None:
        """Forget keys accepted more than `accepted_ttl_s` ago and completions served more than
        `completion_ttl_s` ago (feedback for them is then refused as unknown)."""
        now = time.time() if now is None else now
        self._last_prune = now
        with self._db() as db:
            db.execute(sa.delete(_keys).where(_keys.c.state == DONE, _keys.c.updated_ts < now - self.accepted_ttl_s))
            db.execute(sa.delete(_completions).where(_completions.c.served_ts < now - self.completion_ttl_s))

    def _maybe_prune(self, now: float) -> None:
        if now - self._last_prune >= self.prune_every_s:
            self.prune(now)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.engine.dispose()


def _sqlite_pragmas(conn, _record) -> None:
    # WAL: readers do not wait for the writer. NORMAL: a commit survives a crash of the process (the
    # completion itself is also in the fsynced bus).
    cur = conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()
