"""Creating tables on a database several processes open at once.

On PostgreSQL, `CREATE TABLE IF NOT EXISTS` is not safe against a concurrent one: two processes
that both find a table missing both create it, and the loser fails on the catalog's unique index
(`pg_type_typname_nsp_index`) or with "relation already exists". `create_tables` takes one
transaction-scoped advisory lock first, so the processes of a deployment that start together (the
gateways, the joiner, the learner, the gate) create the schema one after the other; each later one
finds the tables and creates nothing. On SQLite the same holds with the database's write lock: two
connections that both found a table missing collide there too ("table ... already exists").
"""

from __future__ import annotations

from sqlalchemy import MetaData, text
from sqlalchemy.engine import Connection

# One lock for every Flywheel schema in a database: the key is arbitrary but fixed.
SCHEMA_LOCK_KEY = 0x666C7977  # "flyw"


def lock_schema(conn: Connection) -> None:
    """Hold the schema lock until `conn`'s transaction ends: on PostgreSQL an advisory lock; on
    SQLite the database's write lock (`BEGIN IMMEDIATE`; call it before any statement of the
    transaction: the sqlite3 driver has not begun one by itself then)."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": SCHEMA_LOCK_KEY})
    elif conn.dialect.name == "sqlite":
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def create_tables(metadata: MetaData, conn: Connection) -> None:
    """Create `metadata`'s missing tables in `conn`'s transaction, under the schema lock."""
    lock_schema(conn)
    metadata.create_all(conn)
