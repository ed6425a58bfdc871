"""The gate's evidence on a version and the approval that rests on it (`registry.gate_evidence`): what
`record_gate` stores and refuses, and what `approve` checks. On SQLite and PostgreSQL, with the
fixtures of test_registry.py."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from tests.gating.test_registry import base, files, pg_database, reg, sha, snapshot, url, verdict  # noqa: F401


@pytest.mark.parametrize(
    "spoil,match",
    [
        (None, "no offline verdict"),
        ({"passed": False}, "did not pass"),
        ({"incumbent_id": "old"}, "incumbent 'old', but 'base' is promoted now"),
        ({"artifact_sha256": "0" * 64}, "is '" + sha("v1") + "', not the '" + "0" * 64),
        ("files", "is '" + "1" * 64 + "', not the '" + sha("v1")),
        ("status", "it is 'canary', not 'awaiting_approval'"),
    ],
)
def test_approve_checks_the_evidence(reg, spoil, match):
    reg.register(version_id="old", files=files("old"))
    base(reg)
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    for st in ("evaluating", "canary") + (() if spoil == "status" else ("awaiting_approval",)):
        reg.transition("v1", st, "gate", st)
    if isinstance(spoil, dict):
        reg.record_gate("v1", "offline", verdict(reg, "v1", **spoil), "gate")
    elif spoil is not None:
        reg.record_gate("v1", "offline", verdict(reg, "v1"), "gate")
    if spoil == "files":  # the artifact changed after it was evaluated
        with reg.engine.begin() as c:
            c.execute(
                text("UPDATE model_version SET files = :f WHERE id = 'v1'"),
                {"f": f'[{{"path": "v1/x", "sha256": "{"1" * 64}", "bytes": 1, "kind": "snapshot"}}]'},
            )
    before = snapshot(reg)
    with pytest.raises(ValueError, match=f"cannot approve 'v1': .*{match}"):
        reg.approve("v1", "alice", "ship it")
    assert snapshot(reg) == before


def test_record_gate(reg):
    base(reg)
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    reg.transition("v1", "evaluating", "gate", "go")
    reg.record_gate("v1", "offline", verdict(reg, "v1"), "gate")
    reg.transition("v1", "canary", "gate", "go")
    step = {"step": 1, "share": 0.05, "started_at": "2025-01-02T03:04:05Z", "counts": {"users": [40, 760]}}
    v = reg.record_gate("v1", "canary", step, "gate", reason="ramp to 5%")
    assert v.gate["canary"] == {**step, "format_version": 1} and "offline" in v.gate
    reg.record_gate("v1", "notes_1", {"p": 0.5}, "gate")
    assert reg.get("v1").gate["notes_1"] == {"p": 0.5}
    last = reg.audit("v1")[-2]
    assert (last.from_status, last.to_status, last.reason, last.details["key"]) == (
        "canary",
        "canary",
        "ramp to 5%",
        "canary",
    )
    before = snapshot(reg)
    for call, match in [
        (lambda: reg.record_gate("v1", "canary", {**step, "share": 1.5}, "gate"), "share"),
        (lambda: reg.record_gate("v1", "canary", {**step, "format_version": 9}, "gate"), "format_version 9"),
        (
            lambda: reg.record_gate("v1", "offline", verdict(reg, "v1", incumbent_id="nope"), "gate"),
            "unknown incumbent 'nope'",
        ),
        (lambda: reg.record_gate("v1", "Bad-Key", {}, "gate"), "gate key 'Bad-Key'"),
        (lambda: reg.record_gate("v1", "x", {"p": float("nan")}, "gate"), "finite numbers"),
        (lambda: reg.record_gate("base", "x", {}, "gate"), "it is 'promoted'"),
        (lambda: reg.record_gate("v404", "x", {}, "gate"), "unknown version 'v404'"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()
    assert snapshot(reg) == before
