"""Gating: the model registry and version lifecycle, and (to come) the evals and A/B statistics that
decide whether a candidate may replace the promoted version.

- `gating.models`: registry tables (SQLModel) — versions with parent, training data range, metrics,
  files and hashes, status — and the audit log.
- `gating.db`: engines from a URL (SQLite file by default, PostgreSQL via psycopg 3).
- `gating.registry`: `Registry`, the only writer of both tables; it enforces the lifecycle
  `candidate → evaluating → (rejected | canary) → (aborted | awaiting_approval) → promoted →
  (rolled_back | superseded)` and one promoted version at a time.

Gating never trains: it reads what the learner published and decides.
"""
