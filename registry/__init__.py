"""The model registry: every version, its files and hashes, its lifecycle status and the audit log
(SQLModel, SQLite by default, PostgreSQL in production), the gateways' heartbeats and the gate's
persisted evidence. Below both the learner (which registers candidates) and the gate (which moves
them through the lifecycle), so neither depends on the other."""
