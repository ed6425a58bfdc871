"""Which completions exist, and whose they are; which feedback events were already accepted.

`CompletionIndex(path)` is a durable map `completion_id → (tenant, model_version, ts)` that the
gateway fills right after a completion is recorded (before the response is sent), so feedback
ingestion can refuse ids that do not exist or belong to another tenant. The same SQLite file holds
a bounded record of accepted feedback `event_id`s (a TTL and a row cap), so that a retried request
is acknowledged again without being published twice.

Idempotency is a claim protocol: `claim()` inserts each id as *pending*; the caller publishes what
it claimed, then `confirm()`s it (now *done*: a retry is a duplicate) or `release()`s it (the publish
failed: a retry may claim it again). A pending claim older than `stale_claim_s` (its holder died)
may be claimed again.

This is the embedded default: SQLite (stdlib `sqlite3`) in WAL mode, one connection behind a lock,
`synchronous=NORMAL` — an entry survives a crash of the process; a power loss may lose the last
few, which are still in the fsynced completion log. WAL checkpoints (copying the log back into the
database, with its fsync) run on a thread of their own every `checkpoint_every_s`, never inside a
request's transaction: SQLite's automatic checkpoint would run them in whichever commit crossed
1000 pages, and under load those commits took 9-17 ms at p99 (measured with bench/feedback.py). Production replicas would share the same two
tables through PostgreSQL. Every call is a short transaction; the gateway calls them through
`asyncio.to_thread` so the event loop never waits on the disk. Called by `api/`.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)
PENDING, DONE = 0, 1
_SQLITE_VARS = 500  # ids per `IN (...)` query, well under SQLite's bound-parameter limit


class CompletionEntry(NamedTuple):
    tenant: str
    model_version: str
    ts: float


class Claim(NamedTuple):
    """What `claim()` found: ids now held by the caller, ids already done (and their fingerprints),
    and ids another request is still publishing."""

    claimed: list[str]
    done: dict[str, str]
    pending: list[str]


class CompletionIndex:
    def __init__(self, path: str | Path, accepted_ttl_s: float = 7 * 24 * 3600.0,
                 accepted_max: int = 1_000_000, stale_claim_s: float = 60.0, prune_every: int = 1000,
                 checkpoint_every_s: float = 1.0):
        if accepted_ttl_s <= 0:
            raise ValueError(f"accepted_ttl_s must be > 0, got {accepted_ttl_s}")
        if accepted_max < 1:
            raise ValueError(f"accepted_max must be >= 1, got {accepted_max}")
        if not checkpoint_every_s > 0:
            raise ValueError(f"checkpoint_every_s must be > 0, got {checkpoint_every_s}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.accepted_ttl_s, self.accepted_max = accepted_ttl_s, accepted_max
        self.stale_claim_s, self.prune_every = stale_claim_s, prune_every
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints: `_checkpoint_loop`, off the request path
        self._db.executescript("""
            CREATE TABLE IF NOT EXISTS completions (
                completion_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, model_version TEXT NOT NULL,
                ts REAL NOT NULL) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS accepted_events (
                event_id TEXT PRIMARY KEY, state INTEGER NOT NULL, fingerprint TEXT NOT NULL,
                ts REAL NOT NULL);
            CREATE INDEX IF NOT EXISTS accepted_events_ts ON accepted_events (ts);
        """)
        self._claims_since_prune = 0
        self._closed = False
        self.checkpoint_every_s = checkpoint_every_s
        self.checkpoint_errors = 0
        self._stop_checkpoints = threading.Event()
        self._checkpointer = threading.Thread(target=self._checkpoint_loop, name=f"checkpoint:{self.path.name}",
                                              daemon=True)
        self._checkpointer.start()

    def _checkpoint_loop(self) -> None:
        """PASSIVE checkpoints (they never wait for, nor block, the request connection's transactions)
        on a connection of this thread's own."""
        db = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
        try:
            while not self._stop_checkpoints.wait(self.checkpoint_every_s):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as e:  # e.g. the disk is full: counted, tried again next time
                    self.checkpoint_errors += 1
                    log.warning("completion index %s: checkpoint failed: %r", self.path, e)
        finally:
            db.close()

    def _tx(self):
        if self._closed:
            raise RuntimeError(f"completion index {self.path} is closed")
        return _Tx(self._lock, self._db)

    # ---- completions ------------------------------------------------------------------------
    def add(self, completion_id: str, tenant: str, model_version: str, ts: float | None = None) -> None:
        """Record one completion (a second add of the same id replaces it)."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO completions VALUES (?, ?, ?, ?)",
                       (completion_id, tenant, model_version, time.time() if ts is None else ts))

    def get(self, completion_id: str) -> CompletionEntry | None:
        with self._tx() as db:
            row = db.execute("SELECT tenant, model_version, ts FROM completions WHERE completion_id = ?",
                             (completion_id,)).fetchone()
        return CompletionEntry(*row) if row else None

    def get_many(self, completion_ids: list[str]) -> dict[str, CompletionEntry]:
        """The entries of the ids that exist (absent ids are simply missing from the result)."""
        ids = list(dict.fromkeys(completion_ids))
        out: dict[str, CompletionEntry] = {}
        with self._tx() as db:
            for i in range(0, len(ids), _SQLITE_VARS):
                chunk = ids[i:i + _SQLITE_VARS]
                rows = db.execute("SELECT completion_id, tenant, model_version, ts FROM completions "
                                  f"WHERE completion_id IN ({','.join('?' * len(chunk))})", chunk)
                out.update((r[0], CompletionEntry(*r[1:])) for r in rows)
        return out

    # ---- accepted feedback events (idempotency) ---------------------------------------------
    def claim(self, fingerprints: dict[str, str], now: float | None = None) -> Claim:
        """Try to claim each `event_id → fingerprint` (what the event says, to detect a key reused
        for a different event). Returns what was claimed, what is done, what is still pending."""
        now = time.time() if now is None else now
        ids = list(fingerprints)
        claimed, done, pending = [], {}, []
        with self._tx() as db:
            db.execute("BEGIN IMMEDIATE")
            for i in range(0, len(ids), _SQLITE_VARS):
                chunk = ids[i:i + _SQLITE_VARS]
                existing = {r[0]: r[1:] for r in db.execute(
                    "SELECT event_id, state, fingerprint, ts FROM accepted_events "
                    f"WHERE event_id IN ({','.join('?' * len(chunk))})", chunk)}
                for eid in chunk:
                    row = existing.get(eid)
                    if row is None or (row[0] == PENDING and now - row[2] > self.stale_claim_s):
                        claimed.append(eid)
                    elif row[0] == DONE:
                        done[eid] = row[1]
                    else:
                        pending.append(eid)
            db.executemany("INSERT OR REPLACE INTO accepted_events VALUES (?, ?, ?, ?)",
                           [(eid, PENDING, fingerprints[eid], now) for eid in claimed])
            db.execute("COMMIT")
            self._claims_since_prune += len(claimed)
            if self._claims_since_prune >= self.prune_every:
                self._claims_since_prune = 0
                self._prune(db, now)
        return Claim(claimed, done, pending)

    def confirm(self, event_ids: list[str], now: float | None = None) -> None:
        """The claimed events are published: from now on a retry is a duplicate."""
        now = time.time() if now is None else now
        with self._tx() as db:  # one transaction for all of them (autocommit would commit per row)
            db.execute("BEGIN IMMEDIATE")
            db.executemany("UPDATE accepted_events SET state = ?, ts = ? WHERE event_id = ?",
                           [(DONE, now, eid) for eid in event_ids])
            db.execute("COMMIT")

    def release(self, event_ids: list[str]) -> None:
        """The claimed events were not published: a retry may claim them again."""
        with self._tx() as db:
            db.execute("BEGIN IMMEDIATE")
            db.executemany("DELETE FROM accepted_events WHERE event_id = ? AND state = ?",
                           [(eid, PENDING) for eid in event_ids])
            db.execute("COMMIT")

    def accepted_count(self) -> int:
        with self._tx() as db:
            return db.execute("SELECT count(*) FROM accepted_events").fetchone()[0]

    def prune(self, now: float | None = None) -> None:
        """Forget done events older than the TTL, then the oldest beyond the row cap."""
        with self._tx() as db:
            self._prune(db, time.time() if now is None else now)

    def _prune(self, db: sqlite3.Connection, now: float) -> None:
        db.execute("DELETE FROM accepted_events WHERE state = ? AND ts < ?",
                   (DONE, now - self.accepted_ttl_s))
        n = db.execute("SELECT count(*) FROM accepted_events").fetchone()[0]
        if n > self.accepted_max:
            db.execute("DELETE FROM accepted_events WHERE event_id IN (SELECT event_id FROM accepted_events "
                       "WHERE state = ? ORDER BY ts LIMIT ?)", (DONE, n - self.accepted_max))

    def close(self) -> None:
        self._stop_checkpoints.set()
        self._checkpointer.join()
        with self._lock:
            if not self._closed:
                self._closed = True
                try:
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # leave no log behind
                finally:
                    self._db.close()


class _Tx:
    """Holds the index's lock for one short sequence of statements (autocommit unless BEGIN)."""

    def __init__(self, lock: threading.Lock, db: sqlite3.Connection):
        self._lock, self._db = lock, db

    def __enter__(self) -> sqlite3.Connection:
        self._lock.acquire()
        return self._db

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None and self._db.in_transaction:
                self._db.execute("ROLLBACK")
        finally:
            self._lock.release()
