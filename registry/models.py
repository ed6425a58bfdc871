"""Registry tables and their API shapes: model versions, the audit log of their lifecycle, the
registry's meta row, the replicas' heartbeats, the gate's lease and the API keys (`ApiKey`: every
gateway reads the one table, `registry.keys.KeyStore`).

A Base → Create → table → Public ladder (as in full-stack-fastapi-template): `ModelVersionCreate` is
what the learner hands in and is validated (pydantic, so mistakes are `ValueError`s naming the value);
`ModelVersion` is the row; `ModelVersionPublic` is what the registry hands out (detached, typed, safe to
return from an API route). Same for `AuditEntry`, `ReplicaHeartbeat` and `GateLease`.

JSON columns hold what has no fixed shape in SQL:
- `data_range`: the training data a version learnt from, as half-open offset ranges per topic and
  partition: `{"feedback.samples": {0: (1200, 1850), 1: (0, 40)}}` (JSON object keys are strings on
  disk; the Public model turns them back into ints).
- `metrics`: whatever the learner and the evals report (`{"reward_mean": 0.41, "eval": {...}}`).
- `files`: `[{path, sha256, bytes, kind: snapshot|delta}]`; a delta applies to `delta_base_id`. The
  version's *artifact* is the one file replicas load and report the hash of (`artifact_of`).
- `gate`: the gate's persisted progress and verdicts, one JSON object per key: `offline`
  (`OfflineVerdict`), `canary` (`CanaryProgress`), others free-form; each carries `format_version`.
- `audit_entry.details`: the numbers behind a change, if its writer gave any.

`status` is a plain string column (no database enum type to migrate); `Status` lists the values. The
partial unique indexes `one_promoted` and `one_in_flight` let the database itself refuse a second
`promoted` row and a second version in evaluating / canary / awaiting_approval. `registry_meta` holds
the schema version (`SCHEMA_VERSION`) and the audit sequence counter. Owned by `registry.registry`;
`registry.db.ensure_schema` creates the tables and checks their version.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator, model_validator
from pydantic import Field as PField
from sqlalchemy import JSON, BigInteger, DateTime, Index, String, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

JSONType = JSON().with_variant(JSONB(), "postgresql")
UTCDateTime = DateTime(timezone=True)
VERSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SHA256 = r"^[0-9a-f]{64}$"
SCHEMA_VERSION = 5
"""Version of the registry's tables (stored in `registry_meta`); a database of another version is refused.
Bump it, with a migration in `registry.db`, for any change to the tables once a release has shipped."""
ROLLOUT_SUFFIX = ".rollout"
"""The id of every `rollout` version ends so, and no other's: a gateway refuses it by name alone."""
GATE_FORMAT_VERSION = 1
"""`format_version` of the records in `model_version.gate`."""
WEIGHT_STORE_SUFFIXES = (".snapshot.fws", ".delta.fws")
"""serving.weight_store's file suffixes (copied, not imported: the registry's tables load without torch)."""


def utcnow() -> datetime:
    return datetime.now(UTC)


class Status(StrEnum):
    """Lifecycle states of a version (see docs/design.md, "Version lifecycle")."""

    candidate = "candidate"
    evaluating = "evaluating"
    rejected = "rejected"
    canary = "canary"
    aborted = "aborted"
    awaiting_approval = "awaiting_approval"
    promoted = "promoted"
    rolled_back = "rolled_back"
    superseded = "superseded"
    withdrawn = "withdrawn"
    rollout = "rollout"
    """The learner's current weights, registered only for its group rollouts on lent replicas
    (`learner.lent_rollouts`): hash-checked like any version, never gated, no user ever routed to it;
    withdrawn once its jobs are over."""


IN_FLIGHT = (Status.evaluating, Status.canary, Status.awaiting_approval)
"""In the gate's hands; at most one version at a time (index `one_in_flight`)."""
WAITING = (Status.candidate, *IN_FLIGHT)
"""Not yet decided: what a newer candidate may replace, or a failed ancestor withdraws."""
_IN_FLIGHT_SQL = "status IN ('evaluating', 'canary', 'awaiting_approval')"


class FileEntry(BaseModel):
    """One weight file of a version, as shipped by the weight store."""

    path: str = PField(min_length=1, description="Path relative to the weight store root.")
    sha256: str = PField(pattern=SHA256, description="Lowercase hex SHA-256 of the file's bytes.")
    bytes: int = PField(ge=0, description="File size.")
    kind: Literal["snapshot", "delta"] = PField(description="Full snapshot, or lossless delta on delta_base_id.")


def artifact_of(files: list[FileEntry]) -> FileEntry | None:
    """The file replicas load a version from and report the SHA-256 of: the one weight-store file
    (`*.snapshot.fws` / `*.delta.fws`), or the only file of a version with one file; else None."""
    shipped = [f for f in files if f.path.endswith(WEIGHT_STORE_SUFFIXES)]
    if len(shipped) == 1:
        return shipped[0]
    return files[0] if not shipped and len(files) == 1 else None


def _aware(ts: datetime) -> datetime:
    # SQLite hands back naive datetimes even for DateTime(timezone=True); everything stored is UTC.
    return ts.replace(tzinfo=UTC) if ts.tzinfo is None else ts


UTCTime = Annotated[datetime, AfterValidator(_aware)]
"""A time read back from the database, as stored: UTC (the `*Public` models' times)."""


class ModelVersionBase(SQLModel):
    parent_id: str | None = Field(
        default=None,
        foreign_key="model_version.id",
        index=True,
        description="The version this one was trained from; None for a base model.",
    )
    data_range: dict[str, dict[int, tuple[int, int]]] = Field(
        default_factory=dict,
        sa_type=JSONType,
        description="Training data: topic -> partition -> half-open offset range [start, end).",
    )
    metrics: dict[str, Any] = Field(
        default_factory=dict, sa_type=JSONType, description="Training and eval metrics (JSON-serialisable)."
    )
    files: list[FileEntry] = Field(
        default_factory=list, sa_type=JSONType, description="Weight files with their hashes."
    )
    delta_base_id: str | None = Field(
        default=None,
        foreign_key="model_version.id",
        description="The version the delta file applies to (default: parent).",
    )
    notes: str = Field(default="", sa_type=String, description="Free text for people.")


class ModelVersionCreate(ModelVersionBase):
    """What a publisher hands to `Registry.register`; validated here, existence checks in the registry."""

    id: str | None = Field(default=None, description="Version id such as 'v0007'; None: the next vNNNN.")

    @field_validator("id", "parent_id", "delta_base_id")
    @classmethod
    def _check_id(cls, v: str | None) -> str | None:
        if v is not None and not VERSION_ID.fullmatch(v):
            raise ValueError(
                f"version id {v!r} must be 1-64 characters of letters, digits, '.', '_', '-' "
                "starting with a letter or digit"
            )
        return v

    @field_validator("data_range")
    @classmethod
    def _check_ranges(cls, v: dict[str, dict[int, tuple[int, int]]]) -> dict[str, dict[int, tuple[int, int]]]:
        for topic, parts in v.items():
            if not topic:
                raise ValueError("data_range has an empty topic name")
            for p, (start, end) in parts.items():
                if p < 0 or not 0 <= start <= end:
                    raise ValueError(
                        f"data_range {topic!r} partition {p}: range [{start}, {end}) needs "
                        "partition >= 0 and 0 <= start <= end"
                    )
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
        Index(
            "one_promoted",
            "status",
            unique=True,
            sqlite_where=text("status = 'promoted'"),
            postgresql_where=text("status = 'promoted'"),
        ),
        # At most one version in flight: a unique index on an expression that is true on every row it holds.
        Index(
            "one_in_flight",
            text(f"({_IN_FLIGHT_SQL})"),
            unique=True,
            sqlite_where=text(_IN_FLIGHT_SQL),
            postgresql_where=text(_IN_FLIGHT_SQL),
        ),
    )

    id: str = Field(primary_key=True, max_length=64)
    status: str = Field(default=Status.candidate.value, max_length=32, index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    gate: dict[str, Any] = Field(default_factory=dict, sa_type=JSONType)


class ModelVersionPublic(ModelVersionBase):
    id: str
    status: Status
    created_at: UTCTime
    gate: dict[str, Any] = {}

    @property
    def artifact(self) -> FileEntry | None:
        """The file replicas load and report (`artifact_of`)."""
        return artifact_of(self.files)

    @property
    def artifact_sha256(self) -> str | None:
        a = self.artifact
        return None if a is None else a.sha256


class _GateRecord(BaseModel):
    model_config = ConfigDict(extra="allow")  # the gate may store more than the registry reads

    format_version: int = GATE_FORMAT_VERSION

    @field_validator("format_version")
    @classmethod
    def _known(cls, v: int) -> int:
        if v != GATE_FORMAT_VERSION:
            raise ValueError(f"gate record format_version {v} is not the {GATE_FORMAT_VERSION} this build reads")
        return v


class OfflineVerdict(_GateRecord):
    """`gate["offline"]`: the offline suite's verdict on a candidate, what `Registry.approve` checks."""

    passed: bool
    incumbent_id: str = PField(min_length=1, description="The promoted version it was compared with.")
    artifact_sha256: str = PField(pattern=SHA256, description="The candidate artifact that was evaluated.")
    suite_version: str = PField(min_length=1, description="Version of the eval suite (prompts, verifier).")
    numbers: dict[str, Any] = PField(default_factory=dict, description="Estimates, bounds, p-values, n.")


class CanaryProgress(_GateRecord):
    """`gate["canary"]`: where the online A/B stands, so a restarted gate resumes it."""

    step: int = PField(ge=0, description="Index of the current ramp step.")
    share: float = PField(ge=0.0, le=1.0, description="Share of users assigned to the candidate.")
    started_at: datetime
    counts: dict[str, Any] = PField(default_factory=dict, description="Per-arm counts (requests, rewards).")

    @field_validator("started_at")
    @classmethod
    def _has_tz(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            raise ValueError(f"started_at {v.isoformat()!r} needs a timezone")
        return v


GATE_RECORDS: dict[str, type[_GateRecord]] = {"offline": OfflineVerdict, "canary": CanaryProgress}


class AuditEntryBase(SQLModel):
    version_id: str = Field(foreign_key="model_version.id", index=True)
    from_status: str | None = Field(default=None, max_length=32, description="None for the registration itself.")
    to_status: str = Field(max_length=32, description="Equal to from_status for a change that is no step.")
    actor: str = Field(description="Who: a user, or a process such as 'learner' or 'gate'.")
    reason: str = Field(description="Why, in words.")
    action: str = Field(
        default="transition",
        max_length=32,
        description="What: the registry call (register, bootstrap, transition, approve, reject, "
        "rollback, supersede, withdraw, record_gate).",
    )
    details: dict[str, Any] = Field(
        default_factory=dict, sa_type=JSONType, description="The numbers behind it, if the writer gave any."
    )


class AuditEntry(AuditEntryBase, table=True):
    __tablename__ = "audit_entry"

    id: int | None = Field(default=None, primary_key=True)
    seq: int = Field(
        sa_type=BigInteger,
        unique=True,
        index=True,
        description="Registry change number: increases by one per row, in commit order.",
    )
    at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class AuditEntryPublic(AuditEntryBase):
    id: int
    seq: int
    from_status: Status | None
    to_status: Status
    at: UTCTime


class RegistryMeta(SQLModel, table=True):
    """Named integers: `schema_version` (`SCHEMA_VERSION`), `audit_seq` (the last audit row's seq)."""

    __tablename__ = "registry_meta"

    name: str = Field(primary_key=True, max_length=64)
    value: int = Field(sa_type=BigInteger)


class HeartbeatBase(SQLModel):
    gateway_id: str = Field(min_length=1, max_length=128, description="The gateway driving the replica.")
    host: str = Field(min_length=1, max_length=255)
    holds: dict[str, str] = Field(
        default_factory=dict, sa_type=JSONType, description="Versions loaded: version id -> artifact SHA-256."
    )
    serves: dict[str, float] = Field(
        default_factory=dict, sa_type=JSONType, description="Versions it routes traffic to: version id -> share."
    )
    error: str | None = Field(default=None, description="Last error, or None.")
    traffic: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        sa_type=JSONType,
        description="Served since the previous heartbeat, per version: requests, errors, tokens, seconds "
        "(sum of end-to-end latencies) and window_s (the seconds they cover).",
    )
    lending: str | None = Field(
        default=None,
        max_length=16,
        description="Lending state (serving, draining or lent; `serving.lending`), None with lending off.",
    )


class HeartbeatCreate(HeartbeatBase):
    """What a replica reports (`Registry.heartbeat`); validated here."""

    replica_id: str = Field(min_length=1, max_length=128)

    @field_validator("holds")
    @classmethod
    def _hashes(cls, v: dict[str, str]) -> dict[str, str]:
        for vid, sha in v.items():
            if not re.fullmatch(SHA256, sha):
                raise ValueError(f"holds[{vid!r}]: {sha!r} is not a lowercase hex SHA-256")
        return v

    @model_validator(mode="after")
    def _shares(self) -> HeartbeatCreate:
        for vid, share in self.serves.items():
            if vid not in self.holds:
                raise ValueError(f"serves {vid!r}, which holds does not list")
            if not (math.isfinite(share) and 0.0 <= share <= 1.0):
                raise ValueError(f"serves[{vid!r}] share {share!r} is not within [0, 1]")
        if sum(self.serves.values()) > 1.0 + 1e-9:
            raise ValueError(f"serves shares add up to {sum(self.serves.values())!r} > 1")
        return self


class ReplicaHeartbeat(HeartbeatBase, table=True):
    __tablename__ = "replica_heartbeat"

    replica_id: str = Field(primary_key=True, max_length=128)
    reported_at: datetime = Field(sa_type=UTCDateTime, index=True)


class ReplicaHeartbeatPublic(HeartbeatBase):
    replica_id: str
    reported_at: UTCTime


class GateLeaseBase(SQLModel):
    host: str = Field(min_length=1, max_length=255)
    pid: int = Field(ge=0)
    beat_s: float = Field(gt=0, description="How often the gate beats.")
    lease_s: float = Field(gt=0, description="The lease lapses this long after the last beat.")


class GateLeaseCreate(GateLeaseBase):
    """A gate's beat (`Registry.beat_gate`); validated here."""

    gate_id: str = Field(min_length=1, max_length=128)

    @model_validator(mode="after")
    def _lease_covers_a_beat(self) -> GateLeaseCreate:
        if not (math.isfinite(self.lease_s) and self.lease_s >= self.beat_s):
            raise ValueError(f"lease_s {self.lease_s!r} must be finite and at least beat_s {self.beat_s!r}")
        return self


class GateLease(GateLeaseBase, table=True):
    __tablename__ = "gate_lease"

    gate_id: str = Field(primary_key=True, max_length=128)
    started_at: datetime = Field(sa_type=UTCDateTime, description="The gate's first beat.")
    beat_at: datetime = Field(sa_type=UTCDateTime, index=True)


class BusWatermark(SQLModel, table=True):
    """A producer's (a gateway's) bus watermark: everything it accepted before `watermark` (epoch
    seconds, its clock) is on the bus (`registry.watermarks`)."""

    __tablename__ = "bus_watermark"

    producer_id: str = Field(primary_key=True, max_length=128)
    watermark: float
    reported_at: datetime = Field(sa_type=UTCDateTime, index=True)


class BusWatermarkPublic(BaseModel):
    producer_id: str
    watermark: float
    reported_at: UTCTime


class GateLeasePublic(GateLeaseBase):
    gate_id: str
    started_at: UTCTime
    beat_at: UTCTime

    def age_s(self, now: datetime) -> float:
        return (now - self.beat_at).total_seconds()

    def live(self, now: datetime) -> bool:
        return self.age_s(now) <= self.lease_s


class ApiKey(SQLModel, table=True):
    """An API key (`registry.keys.KeyStore`): the SHA-256 of its token, never the token."""

    __tablename__ = "api_key"

    digest: str = Field(primary_key=True, min_length=64, max_length=64)
    key_id: str = Field(unique=True, max_length=32)
    tenant: str = Field(max_length=64)
    scopes: list[str] = Field(sa_type=JSONType)
    label: str = Field("", max_length=256)
    created: float
    revoked: float | None = None


class LendJob(SQLModel, table=True):
    """Offline work for lent replicas (`registry.jobs.JobQueue`): the gate's eval sampling (`eval`) or
    the learner's group rollouts (`rollout`) of one version, split into shards."""

    __tablename__ = "lend_job"

    job_id: str = Field(primary_key=True, max_length=64)
    kind: str = Field(max_length=16)
    version_id: str = Field(max_length=64, index=True)
    samples_per_item: int
    spec: dict[str, Any] = Field(sa_type=JSONType)
    shards: int
    created: float
    status: str = Field(default="open", max_length=16, index=True)  # open | done | cancelled


class LendShard(SQLModel, table=True):
    """A shard of a job: its work items, and the lease of the worker holding it (`lease_until` 0: free)."""

    __tablename__ = "lend_shard"

    job_id: str = Field(primary_key=True, foreign_key="lend_job.job_id", max_length=64)
    shard: int = Field(primary_key=True)
    items: list[Any] = Field(sa_type=JSONType)
    owner: str | None = Field(default=None, max_length=128)
    lease_until: float = 0.0
    attempts: int = 0
    done: bool = Field(default=False, index=True)


class LendRollout(SQLModel, table=True):
    """One finished rollout: sample `sample` of item `item` of a shard. The primary key makes a rollout
    count once, whoever wrote it and however often."""

    __tablename__ = "lend_rollout"

    job_id: str = Field(primary_key=True, foreign_key="lend_job.job_id", max_length=64)
    shard: int = Field(primary_key=True)
    item: int = Field(primary_key=True)
    sample: int = Field(primary_key=True)
    version_id: str = Field(max_length=64)
    worker: str = Field(max_length=128)
    result: dict[str, Any] = Field(sa_type=JSONType)
    created: float
