"""The model registry: every version, where it came from, and its lifecycle with an audit trail.

`Registry(url)` owns the registry database (SQLite file by default, PostgreSQL in production; see
`gating.db`). The learner `register`s candidates; the gate, the dashboard and the admin API move them
through the lifecycle of DESIGN.md:

    candidate → evaluating → (rejected | canary) → (aborted | awaiting_approval) → promoted
              → (rolled_back | superseded)

- `transition` takes one step of that table. Promoting a version demotes the current promoted one to
  `superseded` in the same transaction. `promoted → rolled_back` only happens through `rollback`, which
  restores a `superseded` version in the same transaction, so the fleet always has a promoted version
  once it had one.
- Every change writes an audit row (who, from what to what, why) in the transaction that makes it.
- Only one version is `promoted`: each write is a compare-and-set on the status it read
  (`UPDATE ... WHERE id = :id AND status = :read`), and a partial unique index refuses a second
  promoted row. When two promotions race, exactly one commits; the other gets `RegistryConflict`
  and writes nothing.

User mistakes (unknown version or status, illegal step, bad input) are `ValueError`s naming the value;
`UnknownVersion` is the one an API maps to 404. Methods return detached `*Public` models.
"""

from __future__ import annotations

import builtins
import re
from collections.abc import Iterable
from typing import Any, Self

from sqlalchemy import literal, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from gating.db import create_all, make_engine, session
from gating.models import (
    AuditEntry,
    AuditEntryPublic,
    FileEntry,
    ModelVersion,
    ModelVersionCreate,
    ModelVersionPublic,
    Status,
)

S = Status
LIFECYCLE: dict[Status, frozenset[Status]] = {
    S.candidate: frozenset({S.evaluating}),
    S.evaluating: frozenset({S.rejected, S.canary}),
    S.canary: frozenset({S.aborted, S.awaiting_approval}),
    S.awaiting_approval: frozenset({S.promoted}),
    S.promoted: frozenset({S.rolled_back, S.superseded}),
    S.rejected: frozenset(),
    S.aborted: frozenset(),
    S.rolled_back: frozenset(),
    S.superseded: frozenset({S.promoted}),  # only by rollback()
}
"""Every edge of the lifecycle (for docs and the dashboard). `transition` takes the ones below."""

_BY_OTHER_MEANS = {
    (S.promoted, S.superseded): "a promoted version is superseded by promoting another one",
    (S.promoted, S.rolled_back): "use rollback() so that a previous version is promoted in its place",
    (S.superseded, S.promoted): "use rollback() to restore a superseded version",
}
_AUTO_ID = re.compile(r"v(\d+)")
_AUTO_ID_TRIES = 5


class UnknownVersion(ValueError):
    """No version with that id (an API answers 404)."""


class RegistryConflict(RuntimeError):
    """Another writer changed the version first (a racing promotion); nothing was written. Reload, retry."""


def parse_status(value: str | Status) -> Status:
    try:
        return Status(value)
    except ValueError:
        raise ValueError(f"unknown status {value!r}; one of: {', '.join(s.value for s in Status)}") from None


def _need(what: str, value: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value.strip()


class Registry:
    """Versions and their lifecycle in one database. Thread-safe: every call uses its own session."""

    def __init__(self, url: str, *, create: bool = True, echo: bool = False):
        self.url = url
        self.engine: Engine = make_engine(url, echo=echo)
        if create:
            create_all(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- writes ---------------------------------------------------------------------------------

    def register(self, *, version_id: str | None = None, parent_id: str | None = None,
                 data_range: dict | None = None, metrics: dict[str, Any] | None = None,
                 files: Iterable[FileEntry | dict[str, Any]] | None = None, delta_base_id: str | None = None,
                 notes: str = "", actor: str = "learner", reason: str = "registered") -> ModelVersionPublic:
        """Add a version as `candidate` (with its audit row). `version_id` None: the next `vNNNN`.

        Fields as in `ModelVersionCreate`; `files` as dicts or `FileEntry`s.
        """
        spec = ModelVersionCreate(id=version_id, parent_id=parent_id, data_range=data_range or {},
                                  metrics=metrics or {}, delta_base_id=delta_base_id, notes=notes,
                                  files=[FileEntry.model_validate(f) for f in files or ()])
        actor, reason = _need("actor", actor), _need("reason", reason)
        fields = spec.model_dump(mode="json", exclude={"id"})
        for attempt in range(_AUTO_ID_TRIES):
            with session(self.engine) as s:
                for what, ref in (("parent", spec.parent_id), ("delta base", spec.delta_base_id)):
                    if ref is not None and s.get(ModelVersion, ref) is None:
                        raise UnknownVersion(f"unknown {what} {ref!r}: register it first")
                vid = spec.id or self._next_id(s)
                if spec.id is not None and s.get(ModelVersion, vid) is not None:
                    raise ValueError(f"version id {vid!r} already exists")
                row = ModelVersion(id=vid, status=S.candidate.value, **fields)
                try:
                    s.add(row)
                    s.flush()  # the version row before its audit row (no ORM relationship orders them)
                    s.add(AuditEntry(version_id=vid, from_status=None, to_status=S.candidate.value,
                                     actor=actor, reason=reason))
                    s.commit()
                except IntegrityError as e:
                    s.rollback()
                    if s.get(ModelVersion, vid) is None:
                        raise  # not the race below: a bug, say so loudly
                    # The id was taken between our check and the insert (a concurrent register).
                    if spec.id is not None or attempt == _AUTO_ID_TRIES - 1:
                        raise ValueError(f"version id {vid!r} already exists") from e
                    continue
                return ModelVersionPublic.model_validate(row)
        raise AssertionError("unreachable")

    def transition(self, version_id: str, to_status: str | Status, actor: str,
                   reason: str) -> ModelVersionPublic:
        """Move a version one step along the lifecycle; promoting supersedes the current promoted one."""
        to = parse_status(to_status)
        actor, reason = _need("actor", actor), _need("reason", reason)
        with session(self.engine) as s:
            row = self._row(s, version_id)
            frm = S(row.status)
            if to not in LIFECYCLE[frm] or (frm, to) in _BY_OTHER_MEANS:
                hint = _BY_OTHER_MEANS.get((frm, to)) or (
                    f"from {frm.value!r} the next status is one of "
                    f"{sorted(s_.value for s_ in LIFECYCLE[frm]) or 'none (final)'}")
                raise ValueError(f"illegal transition of {version_id!r} from {frm.value!r} "
                                 f"to {to.value!r}: {hint}")
            try:
                if to is S.promoted:
                    previous = self._promoted_id(s)
                    if previous is not None:
                        self._move(s, previous, S.promoted, S.superseded, actor,
                                   f"superseded by {version_id}: {reason}", racing=version_id)
                self._move(s, version_id, frm, to, actor, reason)
                s.commit()
            except IntegrityError as e:
                s.rollback()
                if to is not S.promoted:
                    raise  # only the one-promoted index is expected to fire: anything else is a bug
                raise RegistryConflict(f"cannot promote {version_id!r}: another version was promoted "
                                       "concurrently; reload and retry") from e
            return self._public(s, version_id)

    def rollback(self, to_version_id: str | None, actor: str, reason: str) -> ModelVersionPublic:
        """Current promoted → `rolled_back`, `to_version_id` (a superseded version) → `promoted`.

        `to_version_id` None: the version superseded most recently (the "one click" rollback).
        """
        actor, reason = _need("actor", actor), _need("reason", reason)
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
                raise ValueError(f"cannot roll back to {to_version_id!r}: it is {target.status!r}; only a "
                                 "superseded (previously promoted) version can be restored")
            try:
                self._move(s, current, S.promoted, S.rolled_back, actor, reason, racing=to_version_id)
                self._move(s, to_version_id, S.superseded, S.promoted, actor,
                           f"rollback from {current}: {reason}")
                s.commit()
            except IntegrityError as e:
                s.rollback()
                raise RegistryConflict(f"cannot roll back to {to_version_id!r}: another version was promoted "
                                       "concurrently; reload and retry") from e
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
            chain = (select(vid, parent, literal(0).label("depth"))
                     .where(vid == version_id).cte("chain", recursive=True))
            chain = chain.union_all(select(vid, parent, (chain.c.depth + 1).label("depth"))
                                    .where(vid == chain.c.parent_id))
            q = select(ModelVersion).join(chain, col(ModelVersion.id) == chain.c.id).order_by(chain.c.depth)
            return [ModelVersionPublic.model_validate(r) for r in s.exec(q)]

    def promoted(self) -> ModelVersionPublic | None:
        """The version serving all users (outside canaries), or None before the first promotion."""
        with session(self.engine) as s:
            vid = self._promoted_id(s)
            return None if vid is None else self._public(s, vid)

    def audit(self, version_id: str | None = None) -> builtins.list[AuditEntryPublic]:
        """Audit rows (of one version, or all), oldest first."""
        q = select(AuditEntry).order_by(col(AuditEntry.id))
        with session(self.engine) as s:
            if version_id is not None:
                self._row(s, version_id)
                q = q.where(AuditEntry.version_id == version_id)
            return [AuditEntryPublic.model_validate(r) for r in s.exec(q)]

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _row(s: Session, version_id: str, for_update: bool = False) -> ModelVersion:
        if not isinstance(version_id, str):
            raise UnknownVersion(f"unknown version {version_id!r}")
        q = select(ModelVersion).where(ModelVersion.id == version_id)
        row = s.exec(q.with_for_update() if for_update else q).first()
        if row is None:
            raise UnknownVersion(f"unknown version {version_id!r}")
        return row

    @staticmethod
    def _public(s: Session, version_id: str) -> ModelVersionPublic:
        row = s.exec(select(ModelVersion).where(ModelVersion.id == version_id)
                     .execution_options(populate_existing=True)).one()
        return ModelVersionPublic.model_validate(row)

    @staticmethod
    def _promoted_id(s: Session) -> str | None:
        return s.exec(select(ModelVersion.id).where(ModelVersion.status == S.promoted.value)).first()

    @staticmethod
    def _last_superseded(s: Session) -> str | None:
        q = (select(AuditEntry.version_id).join(ModelVersion, col(ModelVersion.id) == AuditEntry.version_id)
             .where(AuditEntry.to_status == S.superseded.value, ModelVersion.status == S.superseded.value)
             .order_by(col(AuditEntry.id).desc()))
        return s.exec(q).first()

    @staticmethod
    def _next_id(s: Session) -> str:
        ids = s.exec(select(ModelVersion.id).where(col(ModelVersion.id).like("v%"))).all()
        nums = [int(m.group(1)) for i in ids if (m := _AUTO_ID.fullmatch(i))]
        return f"v{max(nums, default=0) + 1:04d}"

    @staticmethod
    def _move(s: Session, version_id: str, frm: Status, to: Status, actor: str, reason: str,
              racing: str | None = None) -> None:
        """Compare-and-set one status, plus its audit row; RegistryConflict if the status moved meanwhile."""
        done = s.exec(update(ModelVersion).where(col(ModelVersion.id) == version_id,
                                                 col(ModelVersion.status) == frm.value)
                      .values(status=to.value))
        if done.rowcount != 1:
            s.rollback()
            who = f"cannot move {racing!r}: " if racing else ""
            raise RegistryConflict(f"{who}{version_id!r} is no longer {frm.value!r} (changed concurrently); "
                                   "nothing was written, reload and retry")
        s.add(AuditEntry(version_id=version_id, from_status=frm.value, to_status=to.value,
                         actor=actor, reason=reason))
