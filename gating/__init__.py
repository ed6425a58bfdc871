"""Gating: the model registry and version lifecycle, the A/B statistics, the evals and the gate that
decide whether a candidate may replace the promoted version.

- `registry.models`: registry tables (SQLModel) — versions with parent, training data range, metrics,
  files and hashes, status and the gate's evidence; the audit log; the schema version; replica
  heartbeats.
- `registry.db`: engines from a URL (SQLite file by default, PostgreSQL via psycopg 3); the tables and
  their schema version (recorded on a new database, any other refused).
- `registry.registry`: `Registry`, the only writer of these tables; it enforces the lifecycle of
  docs/design.md ("Version lifecycle"): one promoted version, one candidate in flight, approval only
  on the gate's evidence, an audit row with a change number (`seq`) for every change. Its parts:
  `registry.store` (the engine, audited compare-and-set writes, the errors), `registry.gate_evidence`
  (`record_gate`, `approve`) and `registry.fleet_state` (`heartbeat`, `fleet`).
- `registry.fleet_state`: replicas' heartbeats against what the registry says they should serve.
- `gating.stats`: the gate's statistics (non-inferiority, SRM, confidence sequences, guardrails).
- `registry.publish`: cold start (the base published and promoted, actor `bootstrap`).
- `product.suites`, `gating.evals`, `gating.gate`: eval suites (data + a `Verifier`), the offline
  paired GRPO-style eval with its guardrails, and `flywheel gate`, which drives the lifecycle.

Gating never trains: it reads what the learner published and decides.
"""
