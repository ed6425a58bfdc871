"""Engines and sessions for the registry database: a SQLite file by default, PostgreSQL in production.

Owns the step from a URL (`core.settings.Settings.db_url`) to a configured SQLAlchemy engine:
- SQLite: the file's folder is created; every connection switches foreign keys on (SQLite leaves them
  off per connection), uses WAL (readers such as the dashboard never block the writer) and waits up to
  `SQLITE_BUSY_S` for the write lock instead of failing at once. pysqlite's own transaction handling is
  kept: it begins a transaction at the first write of a session, so a concurrent writer queues on the
  lock and then sees the latest commit. The registry's writes are compare-and-set, so they do not need
  the reads before them to be isolated.
- PostgreSQL: `postgresql://` (and `postgres://`) URLs get the psycopg 3 driver,
  `postgresql+psycopg://`, the only PostgreSQL driver Flywheel installs.

`ensure_schema` creates missing tables, records `registry.models.SCHEMA_VERSION` in `registry_meta` on a
new database and refuses a database of any other version (or of none, if it holds versions), naming
both versions; a database of another version is refused before any table is created in it. Called by
`registry.registry.Registry`.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.pool import StaticPool
from sqlmodel import Session, SQLModel, create_engine

from core.sql import create_tables

log = logging.getLogger(__name__)
SQLITE_BUSY_S = 30.0


def normalize_url(url: str) -> str:
    """The URL with the driver Flywheel uses; ValueError naming the URL's backend if unsupported."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    try:
        u = make_url(url)
    except ArgumentError as e:
        raise ValueError(f"database URL {url!r} is not a SQLAlchemy URL") from e
    backend = u.get_backend_name()
    if backend == "postgresql":
        if u.drivername != "postgresql+psycopg":
            u = u.set(drivername="postgresql+psycopg")
        return u.render_as_string(hide_password=False)
    if backend == "sqlite":
        return url
    raise ValueError(
        f"database backend {backend!r} of {u.render_as_string()!r} is not supported: "
        "use sqlite:///path or postgresql://..."
    )


def make_engine(url: str, echo: bool = False) -> Engine:
    """An engine for `url`, configured as the module docstring says."""
    url = normalize_url(url)
    u = make_url(url)
    if u.get_backend_name() == "postgresql":
        return create_engine(url, echo=echo, pool_pre_ping=True)

    memory = u.database in (None, "", ":memory:")
    if not memory:
        Path(str(u.database)).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        echo=echo,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_S},
        # One shared connection for an in-memory database, or each connection would get its own.
        **({"poolclass": StaticPool} if memory else {}),
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys = ON")
        if not memory:
            _switch_to_wal(cur)
        cur.close()

    return engine


def _switch_to_wal(cur, attempts: int = 50) -> None:
    """`PRAGMA journal_mode = WAL`, tried again while a new file is locked: switching needs the file to
    itself, and SQLite answers "database is locked" at once, without waiting out the busy timeout, while
    another process opening the same new file holds it (seen with six at once)."""
    for attempt in range(attempts):
        try:
            cur.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or attempt == attempts - 1:
                raise
            time.sleep(0.02)


def create_all(engine: Engine, attempts: int = 5) -> None:
    """Create the registry's tables (and any other imported SQLModel tables) that do not exist yet.

    Several processes may start on an empty database at once (the learner's ranks, the gateways, the
    promotion dashboard). On PostgreSQL they take turns under `core.sql`'s schema lock. On SQLite,
    a new file being switched to WAL may be found locked: the loser looks again, and finds the
    tables; an error that persists is raised."""
    import registry.models  # noqa: F401  (registers the tables on SQLModel.metadata)

    for attempt in range(attempts):
        try:
            with engine.begin() as conn:  # on PostgreSQL under the schema lock: no race to lose there
                create_tables(SQLModel.metadata, conn)
            return
        except (OperationalError, ProgrammingError, IntegrityError) as e:
            if attempt == attempts - 1:
                raise
            log.info("creating the registry tables raced another process (%s); looking again", e.orig)
            time.sleep(0.02 * (attempt + 1))


def session(engine: Engine) -> Session:
    """A session whose objects stay readable after commit (the registry returns detached copies)."""
    return Session(engine, expire_on_commit=False)


def ensure_schema(engine: Engine) -> None:
    """Create the tables, then check (or, on a new database, write) the schema version.

    Writing it is one locked transaction (SQLite `BEGIN IMMEDIATE`, PostgreSQL `LOCK TABLE`): of several
    processes opening a new database, one writes the version and the others then find it written.
    ValueError if the database holds another schema version than this build's, or versions without one."""
    from registry.models import SCHEMA_VERSION

    version = text("SELECT value FROM registry_meta WHERE name = 'schema_version'")
    with engine.connect() as c:  # a database of another version is refused before anything is created in it
        if inspect(c).has_table("registry_meta"):
            _check_version(engine, c.execute(version).scalar(), SCHEMA_VERSION)
    create_all(engine)
    with engine.connect() as c:
        stored = c.execute(version).scalar()
        if stored is None:
            c.rollback()
            c.exec_driver_sql(
                "BEGIN IMMEDIATE" if c.dialect.name == "sqlite" else "LOCK TABLE registry_meta IN EXCLUSIVE MODE"
            )
            stored = c.execute(version).scalar()
            if stored is None:
                # Rows without a version row predate the versioned schema: refuse rather than stamp them.
                if c.execute(text("SELECT 1 FROM model_version LIMIT 1")).first() is not None:
                    c.rollback()
                    raise ValueError(
                        f"the registry at {engine.url.render_as_string()!r} holds versions but no "
                        f"schema version (made before it was recorded); this build reads schema "
                        f"version {SCHEMA_VERSION}: start a new registry database"
                    )
                c.execute(
                    text("INSERT INTO registry_meta (name, value) VALUES ('schema_version', :v), ('audit_seq', 0)"),
                    {"v": SCHEMA_VERSION},
                )
                stored = SCHEMA_VERSION
            c.commit()
    _check_version(engine, stored, SCHEMA_VERSION)


def _check_version(engine: Engine, stored: int | None, expected: int) -> None:
    if stored is not None and stored != expected:
        raise ValueError(
            f"the registry at {engine.url.render_as_string()!r} has schema version {stored}; "
            f"this build reads {expected} (no migration between them: start a new registry database, "
            f"or run the build that wrote it)"
        )
