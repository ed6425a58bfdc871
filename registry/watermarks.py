"""Bus watermarks: how far each producer's records are known to be on the bus, so the joiner closes
no attribution window on feedback still on its way.

A gateway accepts feedback and records completions into its bus; on Kafka they wait in its spool while
the broker is away (`feedback.spool`). Every heartbeat it reports a *watermark*
(`api.main.report_watermark`): the receive time of its oldest record not yet on the bus (or of a
feedback request still being accepted), else now. Everything it accepted before its watermark is on
the bus. The joiner (`feedback.joiner.JoinerService`) closes a window only once the watermark of every
live producer has passed it, and reads the bus to its end after reading the watermarks.

A producer whose last report is older than `stale_s` (`rewards.producer_stale_s`) is taken for gone:
the joiner stops waiting for it, logs it and counts it, and feedback it still holds arrives late (as a
gateway killed for longer than that, then restarted, shows). A restarted gateway reports again under
its id (a new id, the default `<host>-<pid>`, is a new producer); while records it recovered from its
spool are not yet delivered, its watermark is the epoch (their times are unknown), so the joiner
waits for them. Reports are not audited and take no seq; rows are kept (one per
producer ever seen) until `forget_stale_producers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import col, delete, select

from registry.db import session
from registry.models import BusWatermark, BusWatermarkPublic, utcnow
from registry.store import RegistryStore

FORGET_AFTER = timedelta(days=1)


@dataclass(frozen=True)
class Watermark:
    """The bus's watermark over its live producers (`Watermarks.bus_watermark`)."""

    value: float | None  # the smallest live watermark; None when no producer is live
    live: tuple[str, ...]
    stale: tuple[str, ...]  # reported once, silent for more than `stale_s`: not waited for


class Watermarks(RegistryStore):
    """The producers' bus watermarks (mixed into `Registry`)."""

    def report_watermark(self, producer_id: str, watermark: float, at: datetime | None = None) -> None:
        """Upsert `producer_id`'s watermark (epoch seconds), reported `at` (now)."""
        if not producer_id or len(producer_id) > 128:
            raise ValueError(f"producer_id must be 1-128 characters, got {producer_id!r}")
        if not math.isfinite(watermark):
            raise ValueError(f"watermark must be finite epoch seconds, got {watermark!r}")
        at = at or utcnow()
        if at.tzinfo is None:
            raise ValueError(f"reported_at {at!r} needs a timezone")
        row = {"producer_id": producer_id, "watermark": float(watermark), "reported_at": at}
        insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert
        stmt = insert(BusWatermark.__table__).values(**row)  # type: ignore[attr-defined]
        upsert = stmt.on_conflict_do_update(
            index_elements=["producer_id"], set_={k: stmt.excluded[k] for k in row if k != "producer_id"}
        )
        with session(self.engine) as s:
            s.connection().execute(upsert)
            s.commit()

    def watermarks(self) -> list[BusWatermarkPublic]:
        with session(self.engine) as s:
            q = select(BusWatermark).order_by(col(BusWatermark.producer_id))
            return [BusWatermarkPublic.model_validate(r, from_attributes=True) for r in s.exec(q)]

    def bus_watermark(self, stale_s: float, now: datetime | None = None) -> Watermark:
        """The smallest watermark of the producers that reported within `stale_s` of `now`."""
        now = now or utcnow()
        live: list[BusWatermarkPublic] = []
        stale: list[BusWatermarkPublic] = []
        for w in self.watermarks():
            (live if (now - w.reported_at).total_seconds() <= stale_s else stale).append(w)
        value = min((w.watermark for w in live), default=None)
        return Watermark(value, tuple(w.producer_id for w in live), tuple(w.producer_id for w in stale))

    def forget_stale_producers(self, now: datetime | None = None) -> int:
        """Delete the rows of producers silent for more than `FORGET_AFTER`; how many."""
        cutoff = (now or utcnow()) - FORGET_AFTER
        with session(self.engine) as s:
            done = s.exec(delete(BusWatermark).where(col(BusWatermark.reported_at) < cutoff))
            s.commit()
            return int(done.rowcount or 0)
