"""Gating: the statistics, the evals and the gate that decide whether a candidate may replace the
promoted version.

- `gating.stats`: the gate's statistics (non-inferiority, SRM, confidence sequences, guardrails,
  the sticky canary assignment `assign_arm`), pure functions.
- `gating.evals`: the offline paired GRPO-style eval of a candidate against the incumbent on a
  product's suite (`product.suites`: data + a `Verifier`), with its guardrails.
- `gating.canary`: the online canary's state machine over joined samples.
- `gating.gate`, `gating.gate_process`: `flywheel gate`, which drives candidates through the
  lifecycle of docs/design.md ("Version lifecycle") up to `awaiting_approval`, resumably.

The registry the gate reads and writes (versions, lifecycle, audit, the gate's evidence) is
`registry/`, below both the gate and the learner. Gating never trains: it reads what the learner
published and decides.
"""
