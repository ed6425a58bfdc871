"""The gate's lease: no candidate gets users unless a gate is alive to watch its canary.

A running gate (`gating.lease.GateLease`, started by `gating.gate_process.run_gate`) beats every
`beat_s` into `gate_lease`, one row per gate process (`gate_id`, host, pid, its first and latest beat,
`lease_s` = `LAPSE_AFTER` beats). A lease is live while its latest beat is at most `lease_s` old;
gateways (`api.fleet.GatewayFleet.canary`) route nobody to a canary while no lease is live. Times are
UTC from the writer's and the reader's clocks, as for the replicas' heartbeats
(`registry.fleet_state`): the hosts' clocks must agree to well within a lease (NTP does).

`GateLeases`, the `Registry` methods on the table (`beat_gate`, `release_gate`, `gate_leases`,
`gate_lease`), is mixed into `registry.registry.Registry`. Beats are not audited and take no seq.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlmodel import col, delete, select

from registry.db import session
from registry.models import GateLease, GateLeaseCreate, GateLeasePublic, utcnow
from registry.store import RegistryStore

LAPSE_AFTER = 3
"""Missed beats after which a gate's lease lapses."""
FORGET_AFTER = timedelta(days=1)
"""A lease lapsed this long is deleted by the next gate that starts (gate ids are per process)."""


def write_beat(engine: Engine, lease: GateLeaseCreate, at: datetime) -> GateLeasePublic:
    """Upsert a gate's row; `started_at` is kept from its first beat."""
    if at.tzinfo is None:
        raise ValueError(f"beat_at {at!r} needs a timezone")
    row = {**lease.model_dump(), "started_at": at, "beat_at": at}
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    stmt = insert(GateLease.__table__).values(**row)  # type: ignore[attr-defined]
    kept = ("gate_id", "started_at")
    upsert = stmt.on_conflict_do_update(
        index_elements=["gate_id"], set_={k: stmt.excluded[k] for k in row if k not in kept}
    ).returning(*GateLease.__table__.c)  # type: ignore[attr-defined]
    with session(engine) as s:
        written = s.connection().execute(upsert).mappings().one()
        s.commit()
    return GateLeasePublic.model_validate(dict(written))


class GateLeases(RegistryStore):
    """The gate's lease (mixed into `Registry`): beats in, the live lease out."""

    def beat_gate(
        self,
        gate_id: str,
        *,
        host: str,
        pid: int,
        beat_s: float,
        lease_s: float | None = None,
        at: datetime | None = None,
    ) -> GateLeasePublic:
        """Renew `gate_id`'s lease until `lease_s` (default `LAPSE_AFTER` × `beat_s`) after `at` (now)."""
        lease_s = LAPSE_AFTER * beat_s if lease_s is None else lease_s
        lease = GateLeaseCreate(gate_id=gate_id, host=host, pid=pid, beat_s=beat_s, lease_s=lease_s)
        return write_beat(self.engine, lease, at or utcnow())

    def release_gate(self, gate_id: str) -> bool:
        """Drop a gate's lease (it stops); False if it had none."""
        with session(self.engine) as s:
            done = s.exec(delete(GateLease).where(col(GateLease.gate_id) == gate_id))
            s.commit()
            return done.rowcount == 1

    def forget_lapsed_gates(self, now: datetime | None = None) -> int:
        """Delete the leases lapsed for more than `FORGET_AFTER`; how many."""
        now = now or utcnow()
        gone = [g.gate_id for g in self.gate_leases() if g.age_s(now) > g.lease_s + FORGET_AFTER.total_seconds()]
        return sum(self.release_gate(g) for g in gone)

    def gate_leases(self) -> list[GateLeasePublic]:
        """Every gate's row, live or lapsed, the latest beat first."""
        with session(self.engine) as s:
            q = select(GateLease).order_by(col(GateLease.beat_at).desc(), col(GateLease.gate_id))
            return [GateLeasePublic.model_validate(r) for r in s.exec(q)]

    def gate_lease(self, now: datetime | None = None) -> GateLeasePublic | None:
        """The live lease with the latest beat, or None: no gate is watching (`GateLeasePublic.live`)."""
        now = now or utcnow()
        return next((g for g in self.gate_leases() if g.live(now)), None)
