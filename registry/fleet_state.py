"""What the fleet reports against what the registry says it should serve.

Each replica heartbeats (`Registry.heartbeat`): the versions it holds (version id → SHA-256 of the
artifact it loaded, `ModelVersionPublic.artifact_sha256`: the weight-store file), those it serves with
their shares, and its last error. `summarize` turns the latest heartbeats and the registry's versions
into a `FleetState`:

- a replica is `up` while its last heartbeat is at most `DOWN_AFTER` intervals old, else `down`; only
  up replicas count below, down ones are listed;
- the *target*: the promoted version, plus the version in `canary` if there is one;
- `complete`: at least one replica is up, and every up replica serves the promoted version, serves
  nothing outside the target, and holds each version it serves under the registry's hash;
- `split`: up replicas serve different sets of (version, hash), the canary version aside (during a
  canary some replicas may carry it and others not);
- `mismatched`: replicas holding a version under a hash other than the registry's;
- `state`: `empty` (none up), `split`, `complete`, else `pending` (they agree, on something else:
  the rollout of a promotion has not started or is stuck);
- `errors`: the last error of every replica that reports one.
`summarize` is a pure function. Also here: the heartbeat table's reads and writes, and `Heartbeats`,
the `Registry` methods on them (`heartbeat`, `forget_replica`, `fleet`), mixed into
`registry.registry.Registry`; replicas' gateways and the admin API call them through it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Literal

from pydantic import BaseModel
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlmodel import col, delete, select

from registry.db import session
from registry.models import (
    HeartbeatCreate,
    ModelVersion,
    ModelVersionPublic,
    ReplicaHeartbeat,
    ReplicaHeartbeatPublic,
    Status,
    utcnow,
)
from registry.store import RegistryStore

HEARTBEAT_INTERVAL_S = 5.0
DOWN_AFTER = 3
"""Missed heartbeats after which a replica counts as down."""


class ReplicaState(ReplicaHeartbeatPublic):
    status: Literal["up", "down"]
    age_s: float
    serves_promoted: bool


class FleetState(BaseModel):
    at: datetime
    interval_s: float
    promoted_id: str | None
    canary_id: str | None
    target: dict[str, str | None]  # version id -> the artifact SHA-256 replicas must report
    replicas: list[ReplicaState]
    up: list[str]
    down: list[str]
    complete: bool
    split: bool
    state: Literal["empty", "split", "complete", "pending"]
    mismatched: dict[str, list[str]]  # replica id -> versions held under another hash than the registry's
    errors: dict[str, str]  # replica id -> its last error


def summarize(
    beats: Iterable[ReplicaHeartbeatPublic],
    versions: Iterable[ModelVersionPublic],
    now: datetime,
    interval_s: float = HEARTBEAT_INTERVAL_S,
) -> FleetState:
    """`beats`: the latest heartbeat of each replica; `versions`: at least the promoted and canary ones
    and those the replicas name (their hashes come from here)."""
    if not interval_s > 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
    if now.tzinfo is None:
        raise ValueError(f"now {now!r} needs a timezone")
    by_id = {v.id: v for v in versions}
    sha = {vid: v.artifact_sha256 for vid, v in by_id.items()}
    promoted = next((v.id for v in by_id.values() if v.status is Status.promoted), None)
    canary = next((v.id for v in by_id.values() if v.status is Status.canary), None)
    target = {vid: sha[vid] for vid in (promoted, canary) if vid is not None}

    replicas, mismatched = [], {}
    for b in beats:
        age = (now - b.reported_at).total_seconds()
        status: Literal["up", "down"] = "down" if age > DOWN_AFTER * interval_s else "up"
        wrong = sorted(vid for vid, h in b.holds.items() if vid in sha and sha[vid] != h)
        if wrong:
            mismatched[b.replica_id] = wrong
        ok_promoted = promoted is not None and promoted in b.serves and b.holds.get(promoted) == sha[promoted]
        replicas.append(ReplicaState(**b.model_dump(), status=status, age_s=age, serves_promoted=ok_promoted))

    live = [r for r in replicas if r.status == "up"]
    complete = bool(live) and all(
        r.serves_promoted and set(r.serves) <= set(target) and all(r.holds.get(vid) == sha.get(vid) for vid in r.serves)
        for r in live
    )
    served = {frozenset((vid, r.holds.get(vid)) for vid in r.serves if vid != canary) for r in live}
    split = len(served) > 1
    state: Literal["empty", "split", "complete", "pending"] = (
        "empty" if not live else "split" if split else "complete" if complete else "pending"
    )
    return FleetState(
        at=now,
        interval_s=interval_s,
        promoted_id=promoted,
        canary_id=canary,
        target=target,
        replicas=replicas,
        up=[r.replica_id for r in live],
        down=[r.replica_id for r in replicas if r.status == "down"],
        complete=complete,
        split=split,
        state=state,
        mismatched=mismatched,
        errors={r.replica_id: r.error for r in replicas if r.error is not None},
    )


def write_heartbeat(engine: Engine, hb: HeartbeatCreate, at: datetime) -> ReplicaHeartbeatPublic:
    """Upsert a replica's row (one per replica: its latest report)."""
    if at.tzinfo is None:
        raise ValueError(f"reported_at {at!r} needs a timezone")
    row = {**hb.model_dump(), "reported_at": at}
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    stmt = insert(ReplicaHeartbeat.__table__).values(**row)  # type: ignore[attr-defined]
    stmt = stmt.on_conflict_do_update(
        index_elements=["replica_id"], set_={k: stmt.excluded[k] for k in row if k != "replica_id"}
    )
    with session(engine) as s:
        s.connection().execute(stmt)
        s.commit()
    return ReplicaHeartbeatPublic.model_validate(row)


def forget(engine: Engine, replica_id: str) -> bool:
    with session(engine) as s:
        done = s.exec(delete(ReplicaHeartbeat).where(col(ReplicaHeartbeat.replica_id) == replica_id))
        s.commit()
        return done.rowcount == 1


def read(engine: Engine) -> tuple[list[ReplicaHeartbeatPublic], list[ModelVersionPublic]]:
    """Every replica's latest heartbeat, and the versions `summarize` needs (one read transaction)."""
    with session(engine) as s:
        beats = [
            ReplicaHeartbeatPublic.model_validate(r)
            for r in s.exec(select(ReplicaHeartbeat).order_by(col(ReplicaHeartbeat.replica_id)))
        ]
        named = sorted({v for b in beats for v in (*b.holds, *b.serves)})
        q = select(ModelVersion).where(
            col(ModelVersion.status).in_([Status.promoted.value, Status.canary.value]) | col(ModelVersion.id).in_(named)
        )
        return beats, [ModelVersionPublic.model_validate(r) for r in s.exec(q)]


class Heartbeats(RegistryStore):
    """The replicas' side of the registry (mixed into `Registry`): heartbeats in, the fleet's state out."""

    def heartbeat(
        self,
        replica_id: str,
        *,
        gateway_id: str,
        host: str,
        holds: Mapping[str, str],
        serves: Mapping[str, float],
        error: str | None = None,
        reported_at: datetime | None = None,
        traffic: Mapping[str, Mapping[str, float]] | None = None,
        lending: str | None = None,
    ) -> ReplicaHeartbeatPublic:
        """Record a replica's report, replacing its last one: the versions it holds (id → artifact
        SHA-256), those it serves (id → share), its last error, what it served since its previous
        report (`traffic`). Not audited, no seq."""
        hb = HeartbeatCreate(
            replica_id=replica_id,
            gateway_id=gateway_id,
            host=host,
            holds=dict(holds),
            serves=dict(serves),
            error=error,
            traffic={v: dict(t) for v, t in (traffic or {}).items()},
            lending=lending,
        )
        return write_heartbeat(self.engine, hb, reported_at or utcnow())

    def forget_replica(self, replica_id: str) -> bool:
        """Drop a decommissioned replica's heartbeat; False if there was none."""
        return forget(self.engine, replica_id)

    def fleet(self, now: datetime | None = None, interval_s: float = HEARTBEAT_INTERVAL_S) -> FleetState:
        """Every replica, `up` or `down` (no heartbeat for more than 3 intervals), and whether the
        promotion is complete or the fleet split (`summarize`)."""
        return summarize(*read(self.engine), now or utcnow(), interval_s)
