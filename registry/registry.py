"""The model registry: every version, where it came from, and its lifecycle with an audit trail.

`Registry(url)` owns the registry database (SQLite file by default, PostgreSQL in production; see
`registry.db`). `bootstrap` promotes the base model (cold start); the learner `register`s candidates and
asks `base_for_next_candidate` what to train on; the gate moves them through the lifecycle of
docs/design.md and stores its progress with `record_gate`; a person `approve`s, `reject`s or
`rollback`s; replicas `heartbeat` and the dashboard reads the `fleet`. `LIFECYCLE` lists every edge:

    candidate → evaluating → (rejected | canary) → (aborted | awaiting_approval) → (rejected | promoted)
    promoted → (rolled_back | superseded);  superseded → promoted (rollback);  candidate → promoted (bootstrap)
    candidate | evaluating | canary | awaiting_approval → withdrawn (replaced by a newer candidate,
        or an ancestor was rejected, aborted or rolled back)
    rollout → withdrawn (the learner's weights for lent rollouts only, `register(status="rollout")`:
        never gated or routed to; withdrawn once its rollout jobs are over)

- Only `approve` promotes a candidate, on the gate's evidence (`registry.gate_evidence`). `rollback`
  restores a superseded version in the same transaction as it demotes the promoted one, so once there
  is a promoted version there always is one. Nothing is evaluated before there is one (`NoIncumbent`).
- At most one version is promoted, and at most one in flight (evaluating, canary, awaiting
  approval): checked, and refused by partial unique indexes.
- Every change writes audit rows (who, what, from and to which status, why, the numbers) in its
  transaction, each with a `seq` in commit order (`registry.store.Change`; `changes_since(seq)` never
  skips one; on PostgreSQL each change is also NOTIFYed on `flywheel_registry`).
- Status writes are compare-and-set on the status read: of two racing writers one commits; the other
  gets `RegistryConflict` (or, where it reads after the lock, a `ValueError` saying what changed) and
  writes nothing.

This module holds the versions, their lifecycle and the reads; `Registry` mixes in the gate's evidence
(`registry.gate_evidence.GateEvidence`), the replicas' heartbeats (`registry.fleet_state.Heartbeats`),
the gate's lease (`registry.gate_lease.GateLeases`) and the producers' bus watermarks
(`registry.watermarks.Watermarks`) over `registry.store.RegistryStore`. User
mistakes (unknown version or status, illegal step, bad input) are `ValueError`s naming the value;
`UnknownVersion` is the one an API maps to 404. Methods return detached `*Public` models. Called by
the learner (`learner.service`), the gateway's API (`api.deps`, `api.routes.admin`) and the CLI.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from sqlalchemy import literal
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from registry.db import session
from registry.fleet_state import Heartbeats
from registry.gate_evidence import GateEvidence
from registry.gate_lease import GateLeases
from registry.models import (
    ROLLOUT_SUFFIX,
    WAITING,
    AuditEntry,
    AuditEntryPublic,
    FileEntry,
    ModelVersion,
    ModelVersionCreate,
    ModelVersionPublic,
    RegistryMeta,
    Status,
    artifact_of,
)

# The errors live with the write primitives; callers import them from here, with Registry.
from registry.store import (
    SEQ_KEY,
    Change,
    NoIncumbent,
    RegistryConflict,
    UnknownVersion,
    json_object,
    need,
    parse_status,
)
from registry.watermarks import Watermarks

S = Status
LIFECYCLE: dict[Status, frozenset[Status]] = {
    S.candidate: frozenset({S.evaluating, S.withdrawn, S.promoted}),
    S.evaluating: frozenset({S.rejected, S.canary, S.withdrawn}),
    S.canary: frozenset({S.aborted, S.awaiting_approval, S.withdrawn}),
    S.awaiting_approval: frozenset({S.promoted, S.rejected, S.withdrawn}),
    S.promoted: frozenset({S.rolled_back, S.superseded}),
    S.superseded: frozenset({S.promoted}),  # only by rollback()
    S.rollout: frozenset({S.withdrawn}),
    **{final: frozenset() for final in (S.rejected, S.aborted, S.rolled_back, S.withdrawn)},
}
"""Every edge of the lifecycle (for docs and the dashboard). `transition` takes those not listed below."""

_BY_OTHER_MEANS = {
    (S.candidate, S.promoted): "only bootstrap() promotes without the gate: a base model, when nothing is promoted",
    (S.awaiting_approval, S.promoted): "use approve(), which checks the gate's evidence",
    (S.promoted, S.superseded): "a promoted version is superseded by promoting another one",
    (S.promoted, S.rolled_back): "use rollback() so that a previous version is promoted in its place",
    (S.superseded, S.promoted): "use rollback() to restore a superseded version",
}
FAILED = frozenset({S.rejected, S.aborted, S.rolled_back})
"""Entering one of these withdraws the version's waiting descendants: the learner rebases."""
LIVE = frozenset({*WAITING, S.promoted})
"""A learner lineage ending in one of these goes on; any other rebases onto the promoted version."""


class Registry(GateEvidence, Heartbeats, GateLeases, Watermarks):
    """Versions and their lifecycle in one database. Thread-safe: every call uses its own session.

    `record_gate` and `approve` come from `GateEvidence`, `heartbeat`, `forget_replica` and `fleet` from
    `Heartbeats`, `beat_gate`, `release_gate` and `gate_lease` from `GateLeases`, `report_watermark` and
    `bus_watermark` from `Watermarks`, the constructor,
    `close` and the row steps from `RegistryStore`."""

    # -- versions -------------------------------------------------------------------------------

    def register(
        self,
        *,
        version_id: str | None = None,
        parent_id: str | None = None,
        data_range: dict | None = None,
        metrics: dict[str, Any] | None = None,
        files: Iterable[FileEntry | dict[str, Any]] | None = None,
        delta_base_id: str | None = None,
        notes: str = "",
        actor: str = "learner",
        reason: str = "registered",
        status: Literal["candidate", "rollout"] = "candidate",
    ) -> ModelVersionPublic:
        """Add a version as `candidate` (with its audit row). `version_id` None: the next `vNNNN`.
        `status="rollout"`: weights for lent rollouts only (`Status.rollout`), which need an artifact.

        Fields as in `ModelVersionCreate`; `files` as dicts or `FileEntry`s.
        """
        spec = self._spec(version_id, parent_id, data_range, metrics, files, delta_base_id, notes)
        actor, reason = need("actor", actor), need("reason", reason)
        first = parse_status(status)
        if first not in (S.candidate, S.rollout):
            raise ValueError(f"register takes status 'candidate' or 'rollout', got {status!r}")
        if (first == S.rollout) != (spec.id or "").endswith(ROLLOUT_SUFFIX):
            raise ValueError(
                f"cannot register {version_id!r} as {first.value!r}: the ids of rollout versions, and only "
                f"theirs, end in {ROLLOUT_SUFFIX!r}"
            )
        if first == S.rollout and artifact_of(spec.files) is None:
            raise ValueError(f"cannot register {version_id!r} for rollouts: its files need one artifact to load")
        with session(self.engine) as s:
            ch = Change(s)  # first: concurrent registers queue here, so the next free id is really free
            for what, ref in (("parent", spec.parent_id), ("delta base", spec.delta_base_id)):
                if ref is not None and s.get(ModelVersion, ref) is None:
                    raise UnknownVersion(f"unknown {what} {ref!r}: register it first")
            vid = spec.id or self._next_id(s)
            if s.get(ModelVersion, vid) is not None:
                raise ValueError(f"version id {vid!r} already exists")
            row = self._insert(s, spec, vid, first)
            ch.audit(vid, None, first, actor, reason, "register")
            ch.commit()
            return ModelVersionPublic.model_validate(row)

    def bootstrap(
        self,
        version_id: str,
        *,
        files: Iterable[FileEntry | dict[str, Any]],
        data_range: dict | None = None,
        metrics: dict[str, Any] | None = None,
        notes: str = "",
        actor: str = "bootstrap",
        reason: str = "cold start: the base model",
    ) -> ModelVersionPublic:
        """Register the base model (no parent) and promote it: one transaction, one audit row.

        Idempotent when that version is already promoted with the same files (no new row). A parentless
        `candidate` of that id with the same files (a base registered with `register`) is promoted.
        ValueError if another version is promoted, or the files have no artifact (`artifact_of`)."""
        spec = self._spec(version_id, None, data_range, metrics, files, None, notes)
        actor, reason = need("actor", actor), need("reason", reason)
        if artifact_of(spec.files) is None:
            raise ValueError(
                f"cannot bootstrap {version_id!r}: its files need one artifact for replicas to load "
                "(one *.snapshot.fws file, or a single file)"
            )
        with session(self.engine) as s:
            ch = Change(s)  # first: what is read below is the latest
            current, row = self._promoted_id(s), s.get(ModelVersion, version_id)
            if row is not None:
                same = [FileEntry.model_validate(f) for f in row.files] == spec.files
                if row.status == S.promoted and same:
                    return ModelVersionPublic.model_validate(row)  # done before: nothing to write
                if not same:
                    raise ValueError(f"cannot bootstrap {version_id!r}: it is registered with other files")
            if current is not None:
                raise ValueError(f"cannot bootstrap {version_id!r}: {current!r} is promoted already")
            if row is None:
                self._insert(s, spec, version_id, S.promoted)
                ch.audit(version_id, None, S.promoted, actor, reason, "bootstrap")
            elif row.status == S.candidate and row.parent_id is None:
                self._move(ch, version_id, S.candidate, S.promoted, actor, reason, "bootstrap")
            else:
                raise ValueError(
                    f"cannot bootstrap {version_id!r}: it is {row.status!r}"
                    f"{' with a parent' if row.parent_id else ''}, not a new base model"
                )
            ch.commit()
            return self._public(s, version_id)

    def transition(
        self,
        version_id: str,
        to_status: str | Status,
        actor: str,
        reason: str,
        details: Mapping[str, Any] | None = None,
    ) -> ModelVersionPublic:
        """Move a version one step along the lifecycle (the gate's steps). Entering `evaluating` needs a
        promoted version and nothing else in flight; entering rejected / aborted withdraws the waiting
        descendants."""
        return self._step(version_id, parse_status(to_status), actor, reason, "transition", details)

    def reject(
        self, version_id: str, actor: str, reason: str, details: Mapping[str, Any] | None = None
    ) -> ModelVersionPublic:
        """A person (or the gate) says no: evaluating or awaiting_approval → `rejected`."""
        return self._step(
            version_id, S.rejected, actor, reason, "reject", details, only_from=(S.evaluating, S.awaiting_approval)
        )

    def supersede(self, version_id: str, by: str, actor: str, reason: str) -> ModelVersionPublic:
        """A newer `candidate` `by` replaces a waiting version (candidate, evaluating, canary or
        awaiting_approval), which becomes `withdrawn` (final). Its descendants are left alone."""
        with session(self.engine) as s:
            new = self._row(s, by)
            old = self._row(s, version_id)
            if by == version_id or new.status != S.candidate or new.created_at <= old.created_at:
                raise ValueError(
                    f"cannot supersede {version_id!r} by {by!r}: that must be a newer candidate "
                    f"(it is {new.status!r}, registered {new.created_at})"
                )
        return self._step(version_id, S.withdrawn, actor, reason, "supersede", {"by": by}, only_from=WAITING)

    def rollback(
        self, to_version_id: str | None, actor: str, reason: str, details: Mapping[str, Any] | None = None
    ) -> ModelVersionPublic:
        """Current promoted → `rolled_back`, `to_version_id` (a superseded version) → `promoted`; the
        rolled-back version's waiting descendants are withdrawn.

        `to_version_id` None: the version superseded most recently (the "one click" rollback).
        """
        actor, reason = need("actor", actor), need("reason", reason)
        extra = json_object("details", details)
        with session(self.engine) as s:
            current = self._promoted_id(s)
            if current is None:
                raise ValueError("no version is promoted: there is nothing to roll back")
            if to_version_id is None:
                to_version_id = self._last_superseded(s)
                if to_version_id is None:
                    raise ValueError(f"cannot roll back {current!r}: no superseded version to restore")
            target = self._row(s, to_version_id)
            if target.status != S.superseded:
                raise ValueError(
                    f"cannot roll back to {to_version_id!r}: it is {target.status!r}; only a "
                    "superseded (previously promoted) version can be restored"
                )
            ch = Change(s)
            try:
                self._move(
                    ch,
                    current,
                    S.promoted,
                    S.rolled_back,
                    actor,
                    reason,
                    "rollback",
                    {"to": to_version_id, **extra},
                    racing=to_version_id,
                )
                self._move(
                    ch,
                    to_version_id,
                    S.superseded,
                    S.promoted,
                    actor,
                    f"rollback from {current}: {reason}",
                    "rollback",
                    {"from": current, **extra},
                )
                self._withdraw_descendants(ch, current, S.rolled_back, actor)
                ch.commit()
            except IntegrityError as e:
                s.rollback()
                raise RegistryConflict(
                    f"cannot roll back to {to_version_id!r}: another version was promoted "
                    "concurrently; reload and retry"
                ) from e
            return self._public(s, to_version_id)

    def add_metrics(self, version_id: str, metrics: dict[str, Any]) -> ModelVersionPublic:
        """Merge `metrics` into the version's metrics (top-level keys replace). Not a transition: no audit."""
        new = ModelVersionCreate(metrics=metrics).model_dump(mode="json")["metrics"]  # validated: a dict
        with session(self.engine) as s:
            row = self._row(s, version_id, for_update=True)
            row.metrics = {**row.metrics, **new}
            s.add(row)
            s.commit()
            return ModelVersionPublic.model_validate(row)

    # -- reads ----------------------------------------------------------------------------------

    def get(self, version_id: str) -> ModelVersionPublic:
        with session(self.engine) as s:
            return ModelVersionPublic.model_validate(self._row(s, version_id))

    def list(self, status: str | Status | None = None) -> builtins.list[ModelVersionPublic]:
        """All versions (optionally with one status), oldest first."""
        q = select(ModelVersion).order_by(col(ModelVersion.created_at), col(ModelVersion.id))
        if status is not None:
            q = q.where(ModelVersion.status == parse_status(status).value)
        with session(self.engine) as s:
            return [ModelVersionPublic.model_validate(r) for r in s.exec(q)]

    def lineage(self, version_id: str) -> builtins.list[ModelVersionPublic]:
        """The version, its parent, its parent's parent, ... up to a version without parent."""
        with session(self.engine) as s:
            self._row(s, version_id)
            vid, parent = col(ModelVersion.id), col(ModelVersion.parent_id)
            chain = select(vid, parent, literal(0).label("depth")).where(vid == version_id).cte("chain", recursive=True)
            chain = chain.union_all(
                select(vid, parent, (chain.c.depth + 1).label("depth")).where(vid == chain.c.parent_id)
            )
            q = select(ModelVersion).join(chain, col(ModelVersion.id) == chain.c.id).order_by(chain.c.depth)
            return [ModelVersionPublic.model_validate(r) for r in s.exec(q)]

    def promoted(self) -> ModelVersionPublic | None:
        """The version serving all users (outside canaries), or None before the first promotion."""
        with session(self.engine) as s:
            vid = self._promoted_id(s)
            return None if vid is None else self._public(s, vid)

    def incumbent(self) -> ModelVersionPublic:
        """The promoted version, which every candidate is compared with; `NoIncumbent` before bootstrap."""
        v = self.promoted()
        if v is None:
            raise NoIncumbent(
                "no version is promoted, so there is no incumbent to compare a candidate with: "
                "bootstrap the base model first (Registry.bootstrap)"
            )
        return v

    def in_flight(self) -> ModelVersionPublic | None:
        """The one version evaluating, in canary or awaiting approval, or None."""
        with session(self.engine) as s:
            row = self._in_flight(s)
            return None if row is None else ModelVersionPublic.model_validate(row)

    def base_for_next_candidate(self, current: str | None = None) -> ModelVersionPublic:
        """The version the learner's next candidate should be a child of: `current` (its lineage's tip)
        while that is candidate, in flight or promoted; otherwise (withdrawn, rejected, aborted, rolled
        back, superseded, or None) the promoted version, onto which the lineage rebases."""
        if current is not None:
            tip = self.get(current)
            if tip.status in LIVE:
                return tip
        return self.incumbent()

    def audit(self, version_id: str | None = None) -> builtins.list[AuditEntryPublic]:
        """Audit rows (of one version, or all), in commit order."""
        q = select(AuditEntry).order_by(col(AuditEntry.seq))
        with session(self.engine) as s:
            if version_id is not None:
                self._row(s, version_id)
                q = q.where(AuditEntry.version_id == version_id)
            return [AuditEntryPublic.model_validate(r) for r in s.exec(q)]

    def changes_since(self, seq: int, limit: int = 1000) -> builtins.list[AuditEntryPublic]:
        """Audit rows with a seq above `seq`, in order, at most `limit` (a follower passes the last it saw)."""
        if not isinstance(seq, int) or seq < 0 or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"changes_since needs seq >= 0 and limit >= 1, got {seq!r}, {limit!r}")
        q = select(AuditEntry).where(col(AuditEntry.seq) > seq).order_by(col(AuditEntry.seq)).limit(limit)
        with session(self.engine) as s:
            return [AuditEntryPublic.model_validate(r) for r in s.exec(q)]

    def last_seq(self) -> int:
        """The seq of the latest committed change (0 for none): where a new follower starts."""
        with session(self.engine) as s:
            return s.exec(select(RegistryMeta.value).where(RegistryMeta.name == SEQ_KEY)).one()

    # -- internals ------------------------------------------------------------------------------

    def _step(
        self,
        version_id: str,
        to: Status,
        actor: str,
        reason: str,
        action: str,
        details: Mapping[str, Any] | None,
        only_from: Iterable[Status] | None = None,
    ) -> ModelVersionPublic:
        actor, reason = need("actor", actor), need("reason", reason)
        extra = json_object("details", details)
        with session(self.engine) as s:
            row = self._row(s, version_id)
            frm = S(row.status)
            allowed = set(only_from) if only_from is not None else set(LIFECYCLE)
            if frm not in allowed:
                raise ValueError(
                    f"cannot {action} {version_id!r}: it is {frm.value!r}; only from {sorted(a.value for a in allowed)}"
                )
            if to not in LIFECYCLE[frm] or (frm, to) in _BY_OTHER_MEANS:
                hint = _BY_OTHER_MEANS.get((frm, to)) or (
                    f"from {frm.value!r} the next status is one of "
                    f"{sorted(s_.value for s_ in LIFECYCLE[frm] if (frm, s_) not in _BY_OTHER_MEANS) or 'none'}"
                )
                raise ValueError(f"illegal transition of {version_id!r} from {frm.value!r} to {to.value!r}: {hint}")
            if to is S.evaluating:
                if self._promoted_id(s) is None:
                    raise NoIncumbent(
                        f"cannot evaluate {version_id!r}: no version is promoted to compare it "
                        "with; bootstrap the base model first (Registry.bootstrap)"
                    )
                if (other := self._in_flight(s)) is not None:
                    raise ValueError(
                        f"cannot start evaluating {version_id!r}: {other.id!r} is {other.status!r} "
                        "and only one candidate is in flight at a time"
                    )
            ch = Change(s)
            try:
                self._move(ch, version_id, frm, to, actor, reason, action, extra)
                if to in FAILED:
                    self._withdraw_descendants(ch, version_id, to, actor)
                ch.commit()
            except IntegrityError as e:
                s.rollback()
                if to is not S.evaluating:
                    raise  # only the one-in-flight index is expected to fire: anything else is a bug
                raise RegistryConflict(
                    f"cannot start evaluating {version_id!r}: another version entered "
                    "evaluation concurrently; reload and retry"
                ) from e
            return self._public(s, version_id)

    def _withdraw_descendants(self, ch: Change, version_id: str, why: Status, actor: str) -> None:
        vid, parent, status = col(ModelVersion.id), col(ModelVersion.parent_id), col(ModelVersion.status)
        tree = select(vid, status).where(parent == version_id).cte("tree", recursive=True)
        tree = tree.union_all(select(vid, status).where(parent == tree.c.id))
        q = select(tree.c.id, tree.c.status).where(tree.c.status.in_([st.value for st in WAITING]))
        for child, st in ch.s.exec(q).all():
            self._move(
                ch,
                child,
                S(st),
                S.withdrawn,
                actor,
                f"{version_id} was {why.value}: its descendants are "
                "withdrawn and the learner rebases onto the promoted version",
                "withdraw",
                {"because": version_id},
            )

    @staticmethod
    def _spec(
        version_id: str | None,
        parent_id: str | None,
        data_range: dict | None,
        metrics: dict[str, Any] | None,
        files: Iterable[FileEntry | dict[str, Any]] | None,
        delta_base_id: str | None,
        notes: str,
    ) -> ModelVersionCreate:
        return ModelVersionCreate(
            id=version_id,
            parent_id=parent_id,
            data_range=data_range or {},
            metrics=metrics or {},
            delta_base_id=delta_base_id,
            notes=notes,
            files=[FileEntry.model_validate(f) for f in files or ()],
        )

    @staticmethod
    def _insert(s: Session, spec: ModelVersionCreate, vid: str, status: Status) -> ModelVersion:
        row = ModelVersion(id=vid, status=status.value, **spec.model_dump(mode="json", exclude={"id"}))
        s.add(row)
        s.flush()  # the version row before its audit row (no ORM relationship orders them)
        return row

    def last_superseded(self) -> str | None:
        """The version a one-click rollback (`rollback(None, ...)`) restores, or None."""
        with session(self.engine) as s:
            return self._last_superseded(s)

    @staticmethod
    def _last_superseded(s: Session) -> str | None:
        q = (
            select(AuditEntry.version_id)
            .join(ModelVersion, col(ModelVersion.id) == AuditEntry.version_id)
            .where(AuditEntry.to_status == S.superseded.value, ModelVersion.status == S.superseded.value)
            .order_by(col(AuditEntry.seq).desc())
        )
        return s.exec(q).first()

    @staticmethod
    def _next_id(s: Session) -> str:
        ids = s.exec(select(ModelVersion.id).where(col(ModelVersion.id).like("v%"))).all()
        nums = [int(m.group(1)) for i in ids if (m := re.fullmatch(r"v(\d+)", i))]
        return f"v{max(nums, default=0) + 1:04d}"
