"""The gate's evidence on a version and the approval that rests on it: `GateEvidence`, the part of
`registry.registry.Registry` that stores the gate's records (`record_gate`: the offline verdict, the
canary's progress, others free-form) and promotes on them (`approve`).

Only `approve` promotes a candidate, and only on the gate's passed offline verdict on its current
artifact against the current promoted version, which becomes `superseded` in the same transaction.
Called through `Registry`: `approve` by the admin API (`api.routes.admin`), `record_gate` by the gate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from registry.db import session
from registry.models import (
    GATE_RECORDS,
    WAITING,
    FileEntry,
    ModelVersion,
    ModelVersionPublic,
    OfflineVerdict,
    Status,
    artifact_of,
)
from registry.store import Change, RegistryConflict, RegistryStore, UnknownVersion, json_object, need

S = Status
_GATE_KEY = re.compile(r"[a-z][a-z0-9_]{0,63}")
WATCH_KEY = "watch"
"""`gate[WATCH_KEY]`: the post-promotion guardrails of a promoted version (`gating.gate`)."""


class GateEvidence(RegistryStore):
    """`record_gate` and `approve` (mixed into `Registry`)."""

    def record_gate(
        self,
        version_id: str,
        key: str,
        payload: Mapping[str, Any],
        actor: str,
        reason: str | None = None,
        *,
        audit: bool = True,
    ) -> ModelVersionPublic:
        """Store the gate's record `key` on a waiting version (`gate[key] = payload`, replacing it), audited.

        `offline` is an `OfflineVerdict` and `canary` a `CanaryProgress` (validated, `format_version`
        added); other keys any JSON object. `watch` (the post-promotion guardrails) is recorded on the
        promoted version only. Not a status change: the audit row's from and to are equal. `audit=False`
        stores progress (a look of the canary, new counts) without an audit row: the trail holds the
        gate's decisions, not every look."""
        actor = need("actor", actor)
        if not isinstance(key, str) or not _GATE_KEY.fullmatch(key):
            raise ValueError(f"gate key {key!r} must be 1-64 lowercase letters, digits or '_'")
        model = GATE_RECORDS.get(key)
        value = json_object(f"gate record {key!r}", payload)
        if model is not None:
            value = model.model_validate(value).model_dump(mode="json")
        with session(self.engine) as s:
            ch = Change(s)
            row = self._row(s, version_id)
            status = S(row.status)
            if key == WATCH_KEY and status is not S.promoted:
                raise ValueError(f"cannot record gate {key!r} on {version_id!r}: it is {status.value!r}, not promoted")
            if key != WATCH_KEY and status not in WAITING:
                raise ValueError(
                    f"cannot record gate {key!r} on {version_id!r}: it is {status.value!r}; the gate "
                    "records only on a candidate, evaluating, canary or awaiting_approval version"
                )
            if key == "offline" and s.get(ModelVersion, value["incumbent_id"]) is None:
                raise UnknownVersion(f"unknown incumbent {value['incumbent_id']!r} in the offline verdict")
            row.gate = {**row.gate, key: value}
            s.add(row)
            if audit:
                ch.audit(
                    version_id,
                    status,
                    status,
                    actor,
                    reason or f"gate {key} recorded",
                    "record_gate",
                    {"key": key, "record": value},
                )
            ch.commit()
            return self._public(s, version_id)

    def approve(
        self, version_id: str, actor: str, reason: str, details: Mapping[str, Any] | None = None
    ) -> ModelVersionPublic:
        """A person approves: awaiting_approval → `promoted`, the previous promoted → `superseded`.

        ValueError naming what is wrong unless the version awaits approval, its stored offline verdict
        (`gate["offline"]`) passed, was against the version promoted now, and on the artifact it has now.
        """
        actor, reason = need("actor", actor), need("reason", reason)
        extra = json_object("details", details)
        with session(self.engine) as s:
            ch = Change(s)  # first: the evidence and the incumbent read below are the latest
            row = self._row(s, version_id)
            verdict = self._approvable(s, row)
            current = verdict.incumbent_id
            facts = {
                "incumbent_id": current,
                "artifact_sha256": verdict.artifact_sha256,
                "suite_version": verdict.suite_version,
                **extra,
            }
            try:
                self._move(
                    ch,
                    current,
                    S.promoted,
                    S.superseded,
                    actor,
                    f"superseded by {version_id}: {reason}",
                    "approve",
                    {"by": version_id},
                    racing=version_id,
                )
                self._move(ch, version_id, S.awaiting_approval, S.promoted, actor, reason, "approve", facts)
                ch.commit()
            except IntegrityError as e:
                s.rollback()
                raise RegistryConflict(
                    f"cannot promote {version_id!r}: another version was promoted concurrently; reload and retry"
                ) from e
            return self._public(s, version_id)

    def why_not_approve(self, version_id: str) -> str | None:
        """The reason `approve` would refuse `version_id` now, or None (read only: the dashboard's
        Approve button says it before anyone presses it)."""
        with session(self.engine) as s:
            row = s.get(ModelVersion, version_id)
            if row is None:
                return f"unknown version {version_id!r}"
            try:
                self._approvable(s, row)
            except ValueError as e:
                return str(e)
        return None

    def _approvable(self, s: Session, row: ModelVersion) -> OfflineVerdict:
        vid = row.id
        if row.status != S.awaiting_approval:
            raise ValueError(f"cannot approve {vid!r}: it is {row.status!r}, not 'awaiting_approval'")
        if "offline" not in row.gate:
            raise ValueError(f"cannot approve {vid!r}: no offline verdict is recorded (gate 'offline')")
        verdict = OfflineVerdict.model_validate(row.gate["offline"])
        if not verdict.passed:
            raise ValueError(f"cannot approve {vid!r}: its offline verdict did not pass")
        current = self._promoted_id(s)
        if verdict.incumbent_id != current:
            raise ValueError(
                f"cannot approve {vid!r}: its offline verdict compared it with incumbent "
                f"{verdict.incumbent_id!r}, but {current!r} is promoted now; evaluate it again"
            )
        sha = artifact_of([FileEntry.model_validate(f) for f in row.files])
        if sha is None or sha.sha256 != verdict.artifact_sha256:
            raise ValueError(
                f"cannot approve {vid!r}: its artifact sha256 is {sha and sha.sha256!r}, not the "
                f"{verdict.artifact_sha256!r} its offline verdict evaluated; evaluate it again"
            )
        return verdict
