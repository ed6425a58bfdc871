"""Registry tables and their API shapes: model versions and the audit log of their lifecycle.

A Base → Create → table → Public ladder (as in full-stack-fastapi-template): `ModelVersionCreate` is
what the learner hands in and is validated (pydantic, so mistakes are `ValueError`s naming the value);
`ModelVersion` is the row; `ModelVersionPublic` is what the registry hands out (detached, typed, safe to
return from an API route). Same for `AuditEntry`.

JSON columns hold what has no fixed shape in SQL:
- `data_range`: the training data a version learnt from, as half-open offset ranges per topic and
  partition: `{"feedback.samples": {0: (1200, 1850), 1: (0, 40)}}` (JSON object keys are strings on
  disk; the Public model turns them back into ints).
- `metrics`: whatever the learner and the evals report (`{"reward_mean": 0.41, "eval": {...}}`).
- `files`: `[{path, sha256, bytes, kind: snapshot|delta}]`; a delta applies to `delta_base_id`.

`status` is a plain string column (no database enum type to migrate); `Status` lists the values. The
partial unique index `one_promoted` lets the database itself refuse a second `promoted` row. Owned by
`gating.registry`; `gating.db.create_all` creates the tables.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, field_validator, model_validator
from pydantic import Field as PField
from sqlalchemy import JSON, DateTime, Index, String, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

JSONType = JSON().with_variant(JSONB(), "postgresql")
UTCDateTime = DateTime(timezone=True)
VERSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def utcnow() -> datetime:
    return datetime.now(UTC)


class Status(StrEnum):
    """Lifecycle states of a version (see DESIGN.md, "Version lifecycle")."""

    candidate = "candidate"
    evaluating = "evaluating"
    rejected = "rejected"
    canary = "canary"
    aborted = "aborted"
    awaiting_approval = "awaiting_approval"
    promoted = "promoted"
    rolled_back = "rolled_back"
    superseded = "superseded"


class FileEntry(BaseModel):
    """One weight file of a version, as shipped by the weight store."""

    path: str = PField(min_length=1, description="Path relative to the weight store root.")
    sha256: str = PField(pattern=r"^[0-9a-f]{64}$", description="Lowercase hex SHA-256 of the file's bytes.")
    bytes: int = PField(ge=0, description="File size.")
    kind: Literal["snapshot", "delta"] = PField(
        description="Full snapshot, or lossless delta on delta_base_id.")


def _aware(ts: datetime) -> datetime:
    # SQLite hands back naive datetimes even for DateTime(timezone=True); everything stored is UTC.
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts


class ModelVersionBase(SQLModel):
    parent_id: str | None = Field(default=None, foreign_key="model_version.id", index=True,
                                  description="The version this one was trained from; None for a base model.")
    data_range: dict[str, dict[int, tuple[int, int]]] = Field(
        default_factory=dict, sa_type=JSONType,
        description="Training data: topic -> partition -> half-open offset range [start, end).")
    metrics: dict[str, Any] = Field(default_factory=dict, sa_type=JSONType,
                                    description="Training and eval metrics (JSON-serialisable).")
    files: list[FileEntry] = Field(default_factory=list, sa_type=JSONType,
                                   description="Weight files with their hashes.")
    delta_base_id: str | None = Field(default=None, foreign_key="model_version.id",
                                      description="The version the delta file applies to (default: parent).")
    notes: str = Field(default="", sa_type=String, description="Free text for people.")


class ModelVersionCreate(ModelVersionBase):
    """What a publisher hands to `Registry.register`; validated here, existence checks in the registry."""

    id: str | None = Field(default=None, description="Version id such as 'v0007'; None: the next vNNNN.")

    @field_validator("id", "parent_id", "delta_base_id")
    @classmethod
    def _check_id(cls, v: str | None) -> str | None:
        if v is not None and not VERSION_ID.fullmatch(v):
            raise ValueError(f"version id {v!r} must be 1-64 characters of letters, digits, '.', '_', '-' "
                             "starting with a letter or digit")
        return v

    @field_validator("data_range")
    @classmethod
    def _check_ranges(cls, v: dict[str, dict[int, tuple[int, int]]]) -> dict[str, dict[int, tuple[int, int]]]:
        for topic, parts in v.items():
            if not topic:
                raise ValueError("data_range has an empty topic name")
            for p, (start, end) in parts.items():
                if p < 0 or not 0 <= start <= end:
                    raise ValueError(f"data_range {topic!r} partition {p}: range [{start}, {end}) needs "
                                     "partition >= 0 and 0 <= start <= end")
        return v

    @model_validator(mode="after")
    def _check_files(self) -> ModelVersionCreate:
        paths = [f.path for f in self.files]
        dupes = sorted({p for p in paths if paths.count(p) > 1})
        if dupes:
            raise ValueError(f"files lists {dupes[0]!r} more than once")
        if any(f.kind == "delta" for f in self.files) and self.delta_base_id is None:
            if self.parent_id is None:
                raise ValueError("a delta file needs delta_base_id or a parent_id to apply to")
            self.delta_base_id = self.parent_id
        return self


class ModelVersion(ModelVersionBase, table=True):
    __tablename__ = "model_version"
    __table_args__ = (
        # At most one promoted version, enforced by the database (both dialects support partial indexes).
        Index("one_promoted", "status", unique=True,
              sqlite_where=text("status = 'promoted'"), postgresql_where=text("status = 'promoted'")),
    )

    id: str = Field(primary_key=True, max_length=64)
    status: str = Field(default=Status.candidate.value, max_length=32, index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class ModelVersionPublic(ModelVersionBase):
    id: str
    status: Status
    created_at: datetime

    @field_validator("created_at")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        return _aware(v)


class AuditEntryBase(SQLModel):
    version_id: str = Field(foreign_key="model_version.id", index=True)
    from_status: str | None = Field(default=None, max_length=32,
                                    description="None for the registration itself.")
    to_status: str = Field(max_length=32)
    actor: str = Field(description="Who: a user, or a process such as 'learner' or 'gate'.")
    reason: str = Field(description="Why, in words (what is the transition itself).")


class AuditEntry(AuditEntryBase, table=True):
    __tablename__ = "audit_entry"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class AuditEntryPublic(AuditEntryBase):
    id: int
    from_status: Status | None
    to_status: Status
    at: datetime

    @field_validator("at")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        return _aware(v)
