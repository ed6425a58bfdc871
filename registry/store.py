"""The registry's write primitives, shared by the classes that make up `registry.registry.Registry`.

- `RegistryStore`: the base class of `Registry` and its mixins (`registry.gate_evidence.GateEvidence`,
  `registry.fleet_state.Heartbeats`): the engine, row lookups, and `_move`, the compare-and-set of one
  status (`UPDATE ... WHERE id = :id AND status = :read`) with its audit row.
- `Change`: the audit rows of one write transaction, each with a `seq`. It locks the counter row first,
  so writers queue there and seqs follow commit order (`Registry.changes_since` never skips one). On
  PostgreSQL the transaction also sends `NOTIFY flywheel_registry, '<last seq>'`, delivered at commit.
- The registry's errors and input checks (`need`, `json_object`, `parse_status`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Self

from pydantic_core import to_jsonable_python
from sqlalchemy import text, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from registry.db import ensure_schema, make_engine
from registry.models import IN_FLIGHT, AuditEntry, ModelVersion, ModelVersionPublic, RegistryMeta, Status

S = Status
NOTIFY_CHANNEL = "flywheel_registry"
SEQ_KEY = "audit_seq"
"""The `registry_meta` row holding the last audit row's seq."""


class UnknownVersion(ValueError):
    """No version with that id (an API answers 404)."""


class NoIncumbent(ValueError):
    """No version is promoted yet: bootstrap the base model first."""


class RegistryConflict(RuntimeError):
    """Another writer changed the version first (a racing promotion); nothing was written. Reload, retry."""


def parse_status(value: str | Status) -> Status:
    try:
        return Status(value)
    except ValueError:
        raise ValueError(f"unknown status {value!r}; one of: {', '.join(s.value for s in Status)}") from None


def need(what: str, value: str) -> str:
    """`value` stripped; ValueError naming `what` unless it is a non-empty string."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value.strip()


def json_object(what: str, value: Mapping[str, Any] | None) -> dict[str, Any]:
    """A plain JSON object (finite numbers only: PostgreSQL's JSONB has no NaN); ValueError otherwise."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(dict(value), allow_nan=False, default=to_jsonable_python))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not JSON-serialisable with finite numbers: {e}") from None


class Change:
    """The audit rows of one write transaction. Created before the transaction's first other write: it
    locks the counter row, so writers queue here and seqs are handed out in commit order."""

    def __init__(self, s: Session):
        self.s = s
        where = col(RegistryMeta.name) == SEQ_KEY
        s.exec(update(RegistryMeta).where(where).values(value=col(RegistryMeta.value)))  # the lock
        self.start = self.seq = s.exec(select(RegistryMeta.value).where(where)).one()

    def audit(
        self,
        version_id: str,
        frm: Status | None,
        to: Status,
        actor: str,
        reason: str,
        action: str,
        details: dict[str, Any] | None = None,
    ) -> None:
        self.seq += 1
        self.s.add(
            AuditEntry(
                seq=self.seq,
                version_id=version_id,
                from_status=None if frm is None else frm.value,
                to_status=to.value,
                actor=actor,
                reason=reason,
                action=action,
                details=details or {},
            )
        )

    def commit(self) -> None:
        s = self.s
        s.exec(update(RegistryMeta).where(col(RegistryMeta.name) == SEQ_KEY).values(value=self.seq))
        if self.seq > self.start and s.get_bind().dialect.name == "postgresql":
            s.connection().execute(
                text("SELECT pg_notify(:channel, :seq)"), {"channel": NOTIFY_CHANNEL, "seq": str(self.seq)}
            )
        s.commit()


class RegistryStore:
    """The registry database and the row-level steps every part of `Registry` shares."""

    def __init__(self, url: str, *, create: bool = True, echo: bool = False):
        self.url = url
        self.engine: Engine = make_engine(url, echo=echo)
        if create:
            ensure_schema(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rows -----------------------------------------------------------------------------------

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
        row = s.exec(
            select(ModelVersion).where(ModelVersion.id == version_id).execution_options(populate_existing=True)
        ).one()
        return ModelVersionPublic.model_validate(row)

    @staticmethod
    def _in_flight(s: Session) -> ModelVersion | None:
        return s.exec(select(ModelVersion).where(col(ModelVersion.status).in_([st.value for st in IN_FLIGHT]))).first()

    @staticmethod
    def _promoted_id(s: Session) -> str | None:
        return s.exec(select(ModelVersion.id).where(ModelVersion.status == S.promoted.value)).first()

    @staticmethod
    def _move(
        ch: Change,
        version_id: str,
        frm: Status,
        to: Status,
        actor: str,
        reason: str,
        action: str,
        details: dict[str, Any] | None = None,
        racing: str | None = None,
    ) -> None:
        """Compare-and-set one status, plus its audit row; RegistryConflict if the status moved meanwhile."""
        s = ch.s
        done = s.exec(
            update(ModelVersion)
            .where(col(ModelVersion.id) == version_id, col(ModelVersion.status) == frm.value)
            .values(status=to.value)
        )
        if done.rowcount != 1:
            s.rollback()
            who = f"cannot move {racing!r}: " if racing else ""
            raise RegistryConflict(
                f"{who}{version_id!r} is no longer {frm.value!r} (changed concurrently); "
                "nothing was written, reload and retry"
            )
        ch.audit(version_id, frm, to, actor, reason, action, details)
