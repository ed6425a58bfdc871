"""The durable job queue for lent replicas, in the registry's database (so every gateway shares it).

A job (`registry.models.LendJob`) is offline work on one version: the gate's eval sampling (`eval`:
`samples_per_item` samples of each prompt) or the learner's group rollouts (`rollout`: a GRPO group of
`samples_per_item` per prompt). Its items (prompts, as the submitter describes them) are split into
shards (`LendShard`) of at most `shard_size` items.

- **Leases.** A worker takes a free shard (`lease`): one whose lease has run out, never one that is
  done. Taking it is a compare-and-set on the lease (`UPDATE ... WHERE lease_until <= now`), so two
  workers never both hold one; the lease lasts `lease_s` unless renewed. A reclaimed replica hands its
  shard back at once (`release`); a dead one's lease runs out.
- **Exactly once.** Each finished rollout is a row keyed (job, shard, item, sample), inserted with
  `ON CONFLICT DO NOTHING`: a rollout written twice (a worker that lost its lease and finished anyway)
  counts once. A shard taken again hands the new worker only the rollouts still missing (`Lease.todo`),
  so a shard cut short resumes where it stopped, later or elsewhere.
- **Done.** `finish` marks a shard done once all its rollouts are in (its holder only); the job is done
  when every shard is. `results` returns each rollout once, in (shard, item, sample) order, with the
  policy version and the worker that made it.

Called by the lending fleet manager's workers (`serving.lending`), the gate and the learner.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import and_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col, select

from registry.db import ensure_schema, make_engine
from registry.models import LendJob, LendRollout, LendShard

Kind = Literal["eval", "rollout"]
KINDS: tuple[str, ...] = ("eval", "rollout")


@dataclass(frozen=True)
class Lease:
    job_id: str
    shard: int
    worker: str
    kind: str
    version_id: str
    spec: dict[str, Any]
    items: list[Any]
    todo: list[tuple[int, int]]  # (item index within the shard, sample index) still missing
    until: float


class LeaseLost(RuntimeError):
    """The worker no longer holds the shard's lease (it ran out and another worker took it)."""


class JobQueue:
    """The lending job tables of the database at `url`."""

    def __init__(self, url: str):
        self.engine = make_engine(url)
        ensure_schema(self.engine)
        self._insert = postgresql.insert if self.engine.dialect.name == "postgresql" else sqlite.insert

    def close(self) -> None:
        self.engine.dispose()

    def submit(
        self,
        kind: Kind,
        version_id: str,
        items: list[Any],
        samples_per_item: int,
        shard_size: int,
        spec: dict[str, Any] | None = None,
    ) -> str:
        """A new job of `items` (JSON values) on `version_id`; its id."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")
        if not items:
            raise ValueError("a job needs at least one item")
        if samples_per_item < 1 or shard_size < 1:
            raise ValueError(f"samples_per_item and shard_size must be >= 1, got {samples_per_item}, {shard_size}")
        job_id = f"{kind}-{uuid.uuid4().hex[:16]}"  # the version is a column of its own
        chunks = [items[i : i + shard_size] for i in range(0, len(items), shard_size)]
        with Session(self.engine) as s:
            s.add(
                LendJob(
                    job_id=job_id,
                    kind=kind,
                    version_id=version_id,
                    samples_per_item=samples_per_item,
                    spec=spec or {},
                    shards=len(chunks),
                    created=time.time(),
                )
            )
            s.flush()  # the job row before its shards (foreign key)
            s.add_all(LendShard(job_id=job_id, shard=i, items=chunk) for i, chunk in enumerate(chunks))
            s.commit()
        return job_id

    def lease(
        self,
        worker: str,
        lease_s: float,
        kinds: tuple[str, ...] = KINDS,
        now: float | None = None,
        versions: list[str] | None = None,
        job_id: str | None = None,
    ) -> Lease | None:
        """A free shard of an open job of `kinds` (on one of `versions`, if given: those the worker
        holds; of `job_id` only, if given), oldest job first, held by `worker` for `lease_s`; None if
        there is none."""
        now = time.time() if now is None else now
        query = (
            select(LendShard.job_id, LendShard.shard)
            .join(LendJob, col(LendJob.job_id) == col(LendShard.job_id))
            .where(col(LendJob.status) == "open", col(LendJob.kind).in_(kinds))
            .where(col(LendShard.done).is_(False), col(LendShard.lease_until) <= now)
        )
        if versions is not None:
            query = query.where(col(LendJob.version_id).in_(versions))
        if job_id is not None:
            query = query.where(col(LendJob.job_id) == job_id)
        with Session(self.engine) as s:
            free = s.exec(query.order_by(col(LendJob.created), col(LendShard.shard)).limit(16)).all()
        for job_id, shard in free:  # another worker may take one first: try the next
            with self.engine.begin() as c:
                taken = c.execute(
                    update(LendShard)
                    .where(
                        and_(
                            col(LendShard.job_id) == job_id,
                            col(LendShard.shard) == shard,
                            col(LendShard.done).is_(False),
                            col(LendShard.lease_until) <= now,
                        )
                    )
                    .values(owner=worker, lease_until=now + lease_s, attempts=col(LendShard.attempts) + 1)
                ).rowcount
            if taken == 1:
                return self._lease(job_id, shard, worker, now + lease_s)
        return None

    def _lease(self, job_id: str, shard: int, worker: str, until: float) -> Lease:
        with Session(self.engine) as s:
            job = s.get(LendJob, job_id)
            row = s.get(LendShard, (job_id, shard))
            assert job is not None and row is not None
            have = set(
                s.exec(
                    select(LendRollout.item, LendRollout.sample).where(
                        col(LendRollout.job_id) == job_id, col(LendRollout.shard) == shard
                    )
                ).all()
            )
        todo = [(i, k) for i in range(len(row.items)) for k in range(job.samples_per_item) if (i, k) not in have]
        return Lease(job_id, shard, worker, job.kind, job.version_id, job.spec, list(row.items), todo, until)

    def _held(self, lease: Lease, now: float):
        return and_(
            col(LendShard.job_id) == lease.job_id,
            col(LendShard.shard) == lease.shard,
            col(LendShard.owner) == lease.worker,
            col(LendShard.lease_until) >= now,
        )

    def renew(self, lease: Lease, lease_s: float, now: float | None = None) -> Lease:
        """The lease extended to `now + lease_s`; `LeaseLost` if it ran out and was taken."""
        now = time.time() if now is None else now
        with self.engine.begin() as c:
            ok = c.execute(update(LendShard).where(self._held(lease, now)).values(lease_until=now + lease_s)).rowcount
        if ok != 1:
            raise LeaseLost(f"{lease.worker} no longer holds shard {lease.shard} of {lease.job_id}")
        return Lease(**{**lease.__dict__, "until": now + lease_s})

    def record(self, lease: Lease, rollouts: list[tuple[int, int, dict[str, Any]]], now: float | None = None) -> int:
        """Store finished rollouts `(item, sample, result)` of the leased shard; how many were new (a
        rollout already stored, by this worker or another, is not stored again)."""
        now = time.time() if now is None else now
        n = len(lease.items)
        for item, sample, _ in rollouts:
            if not 0 <= item < n or sample < 0:
                raise ValueError(f"rollout ({item}, {sample}) is outside shard {lease.shard} ({n} items)")
        if not rollouts:
            return 0
        rows = [
            dict(
                job_id=lease.job_id,
                shard=lease.shard,
                item=item,
                sample=sample,
                version_id=lease.version_id,
                worker=lease.worker,
                result=result,
                created=now,
            )
            for item, sample, result in rollouts
        ]
        with self.engine.begin() as c:
            stmt = self._insert(LendRollout).values(rows).on_conflict_do_nothing()
            return len(c.execute(stmt.returning(col(LendRollout.item))).all())  # rowcount: -1 on psycopg

    def release(self, lease: Lease, now: float | None = None) -> None:
        """Hand the shard back at once (a reclaim): another worker may take it and do what is missing."""
        now = time.time() if now is None else now
        with self.engine.begin() as c:
            c.execute(update(LendShard).where(self._held(lease, now)).values(owner=None, lease_until=0.0))

    def finish(self, lease: Lease, now: float | None = None) -> bool:
        """Mark the shard done if all its rollouts are stored (then the job, if all its shards are);
        True if it is done. `LeaseLost` if the worker no longer holds it."""
        now = time.time() if now is None else now
        missing = self._lease(lease.job_id, lease.shard, lease.worker, lease.until).todo
        if missing:
            return False
        with self.engine.begin() as c:
            # The job's row first (PostgreSQL: FOR UPDATE; SQLite: one writer at a time anyway), so two
            # workers finishing its last two shards cannot each miss the other's and leave it open.
            c.execute(select(LendJob.job_id).where(col(LendJob.job_id) == lease.job_id).with_for_update())
            ok = c.execute(update(LendShard).where(self._held(lease, now)).values(done=True)).rowcount
            if ok != 1:
                raise LeaseLost(f"{lease.worker} no longer holds shard {lease.shard} of {lease.job_id}")
            c.execute(
                update(LendJob)
                .where(col(LendJob.job_id) == lease.job_id)
                .where(
                    ~select(LendShard.shard)
                    .where(col(LendShard.job_id) == lease.job_id, col(LendShard.done).is_(False))
                    .exists()
                )
                .values(status="done")
            )
        return True

    def open_jobs(self, kind: str) -> list[LendJob]:
        """The open jobs of `kind`, oldest first."""
        with Session(self.engine) as s:
            q = select(LendJob).where(col(LendJob.status) == "open", col(LendJob.kind) == kind)
            return list(s.exec(q.order_by(col(LendJob.created))).all())

    def open_versions(self, kinds: tuple[str, ...] = KINDS) -> list[str]:
        """The versions of open jobs of `kinds`, oldest job first, each once."""
        with Session(self.engine) as s:
            rows = s.exec(
                select(LendJob.version_id)
                .where(col(LendJob.status) == "open", col(LendJob.kind).in_(kinds))
                .order_by(col(LendJob.created))
            ).all()
        return list(dict.fromkeys(rows))

    def shard_items(self, job_id: str, shard: int) -> list[Any]:
        """The items of one shard of a job, as submitted."""
        with Session(self.engine) as s:
            row = s.get(LendShard, (job_id, shard))
        if row is None:
            raise ValueError(f"no shard {shard} of lending job {job_id!r}")
        return list(row.items)

    def cancel(self, job_id: str) -> None:
        """No shard of the job is handed out any more (its version was withdrawn, say)."""
        with self.engine.begin() as c:
            c.execute(update(LendJob).where(col(LendJob.job_id) == job_id).values(status="cancelled"))

    def job(self, job_id: str) -> LendJob:
        with Session(self.engine) as s:
            job = s.get(LendJob, job_id)
        if job is None:
            raise ValueError(f"no lending job {job_id!r}")
        return job

    def results(self, job_id: str) -> list[LendRollout]:
        """Every stored rollout of the job, once each, in (shard, item, sample) order."""
        with Session(self.engine) as s:
            return list(
                s.exec(
                    select(LendRollout)
                    .where(col(LendRollout.job_id) == job_id)
                    .order_by(col(LendRollout.shard), col(LendRollout.item), col(LendRollout.sample))
                ).all()
            )

    def progress(self, job_id: str) -> dict[str, int]:
        """Rollouts stored and wanted, shards done and in all."""
        job = self.job(job_id)
        with Session(self.engine) as s:
            shards = s.exec(select(LendShard).where(col(LendShard.job_id) == job_id)).all()
            stored = len(s.exec(select(LendRollout.item).where(col(LendRollout.job_id) == job_id)).all())
        wanted = sum(len(sh.items) for sh in shards) * job.samples_per_item
        return {
            "rollouts": stored,
            "wanted": wanted,
            "shards_done": sum(sh.done for sh in shards),
            "shards": len(shards),
        }
