"""Gating: the model registry and version lifecycle, the A/B statistics, and (to come) the evals and
the gate that decide whether a candidate may replace the promoted version.

- `gating.models`: registry tables (SQLModel) — versions with parent, training data range, metrics,
  files and hashes, status and the gate's evidence; the audit log; the schema version; replica
  heartbeats.
- `gating.db`: engines from a URL (SQLite file by default, PostgreSQL via psycopg 3); schema version
  and migration.
- `gating.registry`: `Registry`, the only writer of these tables; it enforces the lifecycle of
  docs/design.md ("Version lifecycle"): one promoted version, one candidate in flight, approval only
  on the gate's evidence, an audit row with a change number (`seq`) for every change.
- `gating.fleet_state`: replicas' heartbeats against what the registry says they should serve.
- `gating.stats`: the gate's statistics (non-inferiority, SRM, confidence sequences, guardrails).

Gating never trains: it reads what the learner published and decides.
"""
