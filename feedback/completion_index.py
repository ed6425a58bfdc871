"""Which completions exist, and whose they are; which feedback events were already accepted.

`CompletionIndex(path)` is a durable map `completion_id → (tenant, model_version, ts)` that the
gateway fills right after a completion is recorded (before the response is sent), so feedback
ingestion can refuse ids that do not exist or belong to another tenant. The same SQLite file holds
a bounded record of accepted feedback `event_id`s (a TTL and a row cap), so that a retried request
is acknowledged again without being published twice.

Idempotency is a claim protocol: `claim()` marks each id as *pending*; the caller publishes what
it claimed, then `confirm()`s it (now *done*: a retry is a duplicate) or `release()`s it (the publish
failed: a retry may claim it again). A pending claim older than `stale_claim_s` (its request hung)
may be claimed again.

This is the embedded default: SQLite (stdlib `sqlite3`) in WAL mode, `synchronous=NORMAL` — an
entry survives a crash of the process; a power loss may lose the last few, which are still in the
fsynced completion log. Pending claims live in memory only (they belong to requests of this
process, and die with it), and done ids are written behind, in batches, by a thread of the index's
own, at most `write_every_s` after `confirm()` (and on `flush()`/`close()`): a claim costs the request
no transaction. What this trades: if the process dies, ids confirmed in its last `write_every_s` are
forgotten, so a client's retry of one of them is published again — the consumers drop it by
`event_id` (the joiner's dedupe), so it still reaches the learner once.

Accepted ids are an append-only log, `accepted_log(seq, event_id, fingerprint, ts)`, keyed by `seq`
(confirmation order) and with no index on the id; in memory, `hash(event_id) → seq` for every row
(read at start-up: ~0.9 s and ~110 MB per million rows, the default row cap). A claim looks each id
up in memory, and only on a hit (a retry) reads that row by `seq` to compare the stored id (so two
ids of one hash are never confused) and take its fingerprint. Pruning (TTL, then the row cap)
deletes a prefix of the log. Why: the earlier table keyed by `event_id` took random ids into a
B-tree, so each batch dirtied index pages all over it and SQLite wrote whole pages (to the WAL, then
again at the checkpoint): with 400k ids in the table, a 5000-id batch took 237 ms of CPU and 3020 B
of WAL per id; appended, 54 ms and 74 B (`bench/accepted_ids.py`, the 2-core dev VM), and the
gateway's CPU per feedback event no longer grows with the table.

Every `write_every_s` (0.25 s): appending, a batch costs little more than its rows, so it is written
often and small — what the writer thread does holding the interpreter lock (~0.5 us an id) is a
pause of the gateway's event loop, and at 1 s batches of ~9000 ids (~30 ms of it, when rows were
built and floats formatted in Python) the slowest requests of bench/feedback.py lined up with them.
A batch is written with one INSERT per 1000 ids, each a JSON array (`json_each`), so SQLite stores
the rows without taking the interpreter lock back: `executemany` took it once per row, and under
load those hand-overs, thousands a second, held up the gateway's event loop (bench/feedback.py: the
wait for a publish went from ~2.5 ms at p90 to ~11 ms with them). The same thread runs the pruning
and the WAL checkpoints (copying the log back into the database, with its fsync) every
`checkpoint_every_s`, never inside a request's transaction: SQLite's automatic checkpoint would run
them in whichever commit crossed 1000 pages, and under load those commits took 9-17 ms at p99
(measured with bench/feedback.py). Production replicas would share the same two tables through
PostgreSQL. Writes (`add`, the write-behind, pruning) go through a connection and a lock of their
own, so the reads never wait for them (WAL readers do not block on the writer): `claim()` and
`get_many()` take ~0.2 ms for 100 ids and the gateway calls them on its event loop; `add()` it calls
through `asyncio.to_thread`. Called by `api/`.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)
DONE = 1  # the state of an accepted id in the table before `accepted_log` (see the migration)
_SQLITE_VARS = 500  # ids per `IN (...)` query, well under SQLite's bound-parameter limit
_INSERT_CHUNK = 1000  # accepted ids per INSERT statement of the write-behind


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
                 checkpoint_every_s: float = 1.0, write_every_s: float = 0.25, recent_max: int = 100_000):
        if accepted_ttl_s <= 0:
            raise ValueError(f"accepted_ttl_s must be > 0, got {accepted_ttl_s}")
        if accepted_max < 1:
            raise ValueError(f"accepted_max must be >= 1, got {accepted_max}")
        if not checkpoint_every_s > 0:
            raise ValueError(f"checkpoint_every_s must be > 0, got {checkpoint_every_s}")
        if not write_every_s > 0:
            raise ValueError(f"write_every_s must be > 0, got {write_every_s}")
        if recent_max < 0:
            raise ValueError(f"recent_max must be >= 0, got {recent_max}")
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.accepted_ttl_s, self.accepted_max = accepted_ttl_s, accepted_max
        self.stale_claim_s, self.prune_every = stale_claim_s, prune_every
        self.checkpoint_every_s, self.write_every_s = checkpoint_every_s, write_every_s
        self.recent_max = recent_max
        # The most recently added or asked-for completions, in memory: feedback is mostly about
        # recent completions, and each row a SELECT returns hands the interpreter lock back and forth
        # (under load, other threads kept a request's lookup of 48 rows waiting up to ~30 ms).
        self._recent: OrderedDict[str, CompletionEntry] = OrderedDict()
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA wal_autocheckpoint=0")  # checkpoints: `_background`, off the request path
        self._db.executescript("""
            CREATE TABLE IF NOT EXISTS completions (
                completion_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, model_version TEXT NOT NULL,
                ts REAL NOT NULL) WITHOUT ROWID;
            CREATE TABLE IF NOT EXISTS accepted_log (
                seq INTEGER PRIMARY KEY, event_id TEXT NOT NULL, fingerprint TEXT NOT NULL, ts REAL NOT NULL);
        """)
        self._pending: dict[str, tuple[str, float]] = {}  # claimed, being published: id -> (fingerprint, ts)
        self._unwritten: dict[str, tuple[str, int]] = {}  # confirmed, not yet in the table: id -> (fp, ms)
        self._writing: dict[str, tuple[str, int]] = {}  # confirmed, being written (its transaction open)
        self._migrate_accepted_events()
        # Every written id: hash(event_id) -> its row's seq (checked against the row on a hit).
        self._accepted: dict[int, int] = {}
        for seq, eid in self._db.execute("SELECT seq, event_id FROM accepted_log"):
            self._accepted[hash(eid)] = seq
        last = self._db.execute("SELECT max(seq), min(seq) FROM accepted_log").fetchone()
        self._next_seq = 0 if last[0] is None else last[0] + 1
        self._first_seq = self._next_seq if last[1] is None else last[1]  # rows: [_first_seq, _next_seq)
        self._written_since_prune = 0
        self._closed = False
        self.checkpoint_errors = self.write_errors = 0
        self._writer_lock = threading.Lock()  # one batch write (and prune) at a time
        self._wdb = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        try:  # SQLite's JSON functions (built in since 3.38, an option before)
            self._json_rows = self._wdb.execute("SELECT json_extract('[1]', '$[0]')").fetchone()[0] == 1
        except sqlite3.OperationalError:
            self._json_rows = False
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._background, name=f"index:{self.path.name}", daemon=True)
        self._thread.start()

    def _background(self) -> None:
        """Writes confirmed ids behind (every `write_every_s` while there are some), prunes, and runs
        PASSIVE checkpoints (they never wait for, nor block, the request connection's transactions)."""
        next_checkpoint = time.monotonic() + self.checkpoint_every_s
        checkpoints = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)  # this thread's own
        try:
            self._background_loop(checkpoints, next_checkpoint)
        finally:
            checkpoints.close()

    def _background_loop(self, checkpoints: sqlite3.Connection, next_checkpoint: float) -> None:
        while not self._stop.is_set():
            self._wake.wait(min(self.write_every_s, max(0.0, next_checkpoint - time.monotonic())))
            if self._stop.is_set():
                break
            if self._wake.is_set():
                self._stop.wait(self.write_every_s)  # gather what arrives meanwhile into one transaction
                self._wake.clear()
            try:
                self._write_behind()
            except sqlite3.Error as e:  # e.g. the disk is full: the ids stay in memory, tried again
                self.write_errors += 1
                log.warning("completion index %s: writing accepted ids failed: %r", self.path, e)
            if time.monotonic() >= next_checkpoint:
                next_checkpoint = time.monotonic() + self.checkpoint_every_s
                try:
                    checkpoints.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error as e:  # counted, tried again next time
                    self.checkpoint_errors += 1
                    log.warning("completion index %s: checkpoint failed: %r", self.path, e)

    def _write_behind(self, now: float | None = None) -> None:
        """Write the confirmed ids into the table in one transaction, then forget them in memory."""
        with self._writer_lock:
            with self._lock:  # O(1) under the lock the requests' claims take: the dicts are swapped
                batch, self._unwritten = self._unwritten, {}
                self._writing = batch
            if batch:
                first = self._next_seq
                try:
                    self._insert(self._wdb, first, batch)
                except BaseException:  # kept for the next try; ids confirmed meanwhile are newer
                    with self._lock:
                        batch.update(self._unwritten)
                        self._unwritten, self._writing = batch, {}
                    raise
                self._next_seq = first + len(batch)
                with self._lock:  # in C: ~0.1 us an id (a Python loop took 0.5 us)
                    self._accepted.update(zip(map(hash, batch), range(first, first + len(batch))))
                    self._writing = {}
                self._written_since_prune += len(batch)
            if self._written_since_prune >= self.prune_every:
                self._written_since_prune = 0
                self._prune(self._wdb, time.time() if now is None else now)

    def _insert(self, db: sqlite3.Connection, first: int, batch: dict[str, tuple[str, int]]) -> None:
        """One transaction appending the batch as rows `first`, `first + 1`, ...; with SQLite's JSON
        functions, one INSERT per `_INSERT_CHUNK` ids, each `json.dumps` of `[[id, [fingerprint,
        ms]], ...]` — the dict's own items: no row built in Python, no float to format (those took
        ~2.5 us an id, all holding the interpreter lock); SQLite then stores them without it."""
        items = list(batch.items())
        db.execute("BEGIN IMMEDIATE")
        try:
            if self._json_rows:
                for i in range(0, len(items), _INSERT_CHUNK):
                    db.execute("INSERT INTO accepted_log SELECT ? + key, json_extract(value, '$[0]'), "
                               "json_extract(value, '$[1][0]'), json_extract(value, '$[1][1]') / 1000.0 "
                               "FROM json_each(?)", (first + i, json.dumps(items[i:i + _INSERT_CHUNK])))
            else:
                db.executemany("INSERT INTO accepted_log VALUES (?, ?, ?, ?)",
                               [(seq, eid, fp, ms / 1000) for seq, (eid, (fp, ms)) in enumerate(items, first)])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _migrate_accepted_events(self) -> None:
        """Versions before `accepted_log` kept the ids in `accepted_events` (keyed by event id, a
        state column): their done rows move over, oldest first, once."""
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'accepted_events'").fetchone():
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                start = self._db.execute("SELECT coalesce(max(seq) + 1, 0) FROM accepted_log").fetchone()[0]
                self._db.execute("INSERT INTO accepted_log (seq, event_id, fingerprint, ts) "
                                 "SELECT ? + row_number() OVER (ORDER BY ts, event_id) - 1, event_id, fingerprint, ts "
                                 f"FROM accepted_events WHERE state = {DONE}", (start,))
                self._db.execute("DROP TABLE accepted_events")
            log.info("completion index %s: accepted ids moved to accepted_log", self.path)

    def _tx(self):
        if self._closed:
            raise RuntimeError(f"completion index {self.path} is closed")
        return _Tx(self._lock, self._db)

    # ---- completions ------------------------------------------------------------------------
    def add(self, completion_id: str, tenant: str, model_version: str, ts: float | None = None) -> None:
        """Record one completion (a second add of the same id replaces it). Written on the writer's
        connection: a write may wait for the write-behind transaction, and must not do so holding
        the lock that the readers (`claim`, `get_many`, called on the gateway's event loop) take."""
        with self._writer_lock:
            if self._closed:
                raise RuntimeError(f"completion index {self.path} is closed")
            entry = CompletionEntry(tenant, model_version, time.time() if ts is None else ts)
            self._wdb.execute("INSERT OR REPLACE INTO completions VALUES (?, ?, ?, ?)", (completion_id, *entry))
        with self._lock:
            self._remember(completion_id, entry)

    def get(self, completion_id: str) -> CompletionEntry | None:
        return self.get_many([completion_id]).get(completion_id)

    def get_many(self, completion_ids: list[str]) -> dict[str, CompletionEntry]:
        """The entries of the ids that exist (absent ids are simply missing from the result)."""
        out: dict[str, CompletionEntry] = {}
        with self._tx() as db:
            recent = self._recent
            ask = []
            for cid in dict.fromkeys(completion_ids):
                if (entry := recent.get(cid)) is not None:
                    out[cid] = entry
                    recent.move_to_end(cid)
                else:
                    ask.append(cid)
            for i in range(0, len(ask), _SQLITE_VARS):
                chunk = ask[i:i + _SQLITE_VARS]
                rows = db.execute("SELECT completion_id, tenant, model_version, ts FROM completions "
                                  f"WHERE completion_id IN ({','.join('?' * len(chunk))})", chunk).fetchall()
                for r in rows:
                    out[r[0]] = self._remember(r[0], CompletionEntry(*r[1:]))
        return out

    def _remember(self, completion_id: str, entry: CompletionEntry) -> CompletionEntry:
        """Keep `entry` among the recent completions (caller holds `_lock`)."""
        self._recent[completion_id] = entry
        self._recent.move_to_end(completion_id)
        if len(self._recent) > self.recent_max:
            self._recent.popitem(last=False)
        return entry

    # ---- accepted feedback events (idempotency) ---------------------------------------------
    def claim(self, fingerprints: dict[str, str], now: float | None = None) -> Claim:
        """Try to claim each `event_id → fingerprint` (what the event says, to detect a key reused
        for a different event). Returns what was claimed, what is done, what is still pending."""
        now = time.time() if now is None else now
        claimed, done, pending = [], {}, []
        with self._tx() as db:
            unwritten, writing, accepted = self._unwritten, self._writing, self._accepted
            ask: dict[int, str] = {}  # seq -> id: written rows that may be these ids (a hash matched)
            for eid in fingerprints:
                if eid not in self._pending and eid not in unwritten and eid not in writing:
                    if (seq := accepted.get(hash(eid))) is not None:
                        ask[seq] = eid
            stored: dict[str, str] = {}
            seqs = list(ask)
            for i in range(0, len(seqs), _SQLITE_VARS):
                chunk = seqs[i:i + _SQLITE_VARS]
                for seq, eid, fp in db.execute("SELECT seq, event_id, fingerprint FROM accepted_log "
                                               f"WHERE seq IN ({','.join('?' * len(chunk))})", chunk):
                    if ask[seq] == eid:  # not another id of the same hash
                        stored[eid] = fp
            for eid, fp in fingerprints.items():
                if (entry := unwritten.get(eid) or writing.get(eid)) is not None:
                    done[eid] = entry[0]
                elif eid in stored:
                    done[eid] = stored[eid]
                elif (entry := self._pending.get(eid)) is not None and now - entry[1] <= self.stale_claim_s:
                    pending.append(eid)
                else:
                    self._pending[eid] = (fp, now)
                    claimed.append(eid)
        return Claim(claimed, done, pending)

    def confirm(self, event_ids: list[str], now: float | None = None) -> None:
        """The claimed events are published: from now on a retry is a duplicate (written to the
        table within `write_every_s`). An id no longer claimed (a stale claim another request took
        over, and confirms itself) is left alone."""
        ms = round((time.time() if now is None else now) * 1000)  # stored to the millisecond
        with self._tx():
            for eid in event_ids:
                if (entry := self._pending.pop(eid, None)) is not None:
                    self._unwritten[eid] = (entry[0], ms)
        self._wake.set()

    def release(self, event_ids: list[str]) -> None:
        """The claimed events were not published: a retry may claim them again."""
        with self._tx():
            for eid in event_ids:
                self._pending.pop(eid, None)

    def flush(self) -> None:
        """Write every confirmed id into the table now (otherwise within `write_every_s`)."""
        if self._closed:
            raise RuntimeError(f"completion index {self.path} is closed")
        self._write_behind()

    def accepted_count(self) -> int:
        """Accepted (done) ids remembered, written or not."""
        self.flush()
        with self._tx() as db:
            return db.execute("SELECT count(*) FROM accepted_log").fetchone()[0]

    def prune(self, now: float | None = None) -> None:
        """Forget done events older than the TTL, then the oldest beyond the row cap."""
        self.flush()
        with self._writer_lock:
            self._prune(self._wdb, time.time() if now is None else now)

    def _prune(self, db: sqlite3.Connection, now: float) -> None:
        """On the writer's connection, holding `_writer_lock`: the rows are in confirmation order, so
        what goes is a prefix — those older than the TTL, then the oldest beyond the row cap."""
        fresh = db.execute("SELECT seq FROM accepted_log WHERE ts >= ? ORDER BY seq LIMIT 1",
                           (now - self.accepted_ttl_s,)).fetchone()  # scans the expired rows only
        cut = max(self._next_seq if fresh is None else fresh[0], self._next_seq - self.accepted_max)
        if cut <= self._first_seq:
            return
        gone = db.execute("SELECT seq, event_id FROM accepted_log WHERE seq < ?", (cut,)).fetchall()
        with self._lock:
            accepted = self._accepted
            for seq, eid in gone:
                if accepted.get(h := hash(eid)) == seq:
                    del accepted[h]
        db.execute("DELETE FROM accepted_log WHERE seq < ?", (cut,))
        self._first_seq = cut

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._closed:
            return
        try:
            self._write_behind()  # what was confirmed since the last write
        finally:
            with self._writer_lock, self._lock:
                self._closed = True
                self._wdb.close()
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
