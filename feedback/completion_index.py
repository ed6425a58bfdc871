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

Accepted ids are kept in confirmation order, one row per write-behind batch:
`accepted_batches(first_seq, n, first_ts, last_ts, ids)`, the ids numbered `first_seq`, `first_seq + 1`, ...
and stored as one value: packed bytes for the gateway's ids (see `_encode`), else one JSON text
(`[[event_id, ...], [fingerprint, ...], [ms, ...]]`, also every row written before packing); in memory,
`hash(event_id) → seq` for every id (read at start-up: ~110 MB per million ids, the default cap). A
claim looks each id up in memory, and only on a hit (a retry) reads that id's batch row to compare
the stored id (so two ids of one hash are never confused) and take its fingerprint. Pruning (TTL,
then the cap) deletes a prefix: whole rows, and the row the cut falls into keeps its newer part.
Why one row per batch: writing a batch is one INSERT of one value (~1.4 ms of CPU for 3000 packed
ids). Before, each id was a row of its own — first in a table keyed by the id (random ids all
over a B-tree: 237 ms of CPU per 5000-id batch with 400k ids stored), then appended by `seq` with
SQLite's `json_each` (54 ms); at the half rate of bench/feedback.py (~8500 ids/s) that was 12-14 ms
of CPU every 0.25 s, and the gateway's slowest requests lined up with those writes (timeline
traced; with the write switched off in an experiment, p99 went from ~20 ms to ~11 ms in most
runs). `bench/accepted_ids.py` compares the layouts (and JSON against packed batch rows). Every `write_every_s` (0.25 s) the
batch is written: what the writer thread does holding the interpreter lock is a pause of the
gateway's event loop, so batches are kept small. The same thread runs the pruning
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
import sys
import threading
import time
from array import array
from collections import OrderedDict, deque
from itertools import repeat
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)
DONE = 1  # the state of a done id in `accepted_events`, the first table of accepted ids (see `_migrate`)
_SQLITE_VARS = 500  # ids per `IN (...)` query, well under SQLite's bound-parameter limit
_MIGRATE_CHUNK = 10_000  # ids per batch row when rows of an earlier table move over


_INSERT_BATCH = "INSERT INTO accepted_batches (first_seq, n, first_ts, last_ts, ids) VALUES (?, ?, ?, ?, ?)"


_PACKED = 1  # the first byte of a packed batch row (a JSON row is text)


def _encode(batch: dict[str, tuple[str, int]], pack: bool = True) -> tuple[int, float, float, str | bytes]:
    """A batch row's (n, first_ts, last_ts, ids); first_ts/last_ts are the oldest/newest ms in
    seconds. `ids` is packed bytes when every id is 32 lowercase hex digits (the gateway's) and
    every fingerprint is as long as the others: `_PACKED`, the fingerprint width, the ids (16 bytes
    each), their ms (int64 little-endian), the fingerprints (ASCII), in confirmation order -- 42
    bytes an id with the gateway's fingerprints and 1.4 ms of CPU for 3100 ids, where the JSON of
    `[[event_id, ...], [fingerprint, ...], [ms, ...]]` (the form of any other batch, and of rows
    written before) takes ~73 bytes and 2.2 ms, most of it one `json.dumps` call holding the
    interpreter lock (2-core dev VM). `pack=False`: JSON always (bench/accepted_ids.py compares)."""
    fps, ms = zip(*batch.values())
    n, joined = len(batch), "".join(batch)
    first_ts, last_ts = min(ms) / 1000, max(ms) / 1000
    try:
        raw = bytes.fromhex(joined) if pack and set(map(len, batch)) == {32} else b""
        widths = set(map(len, fps))
        if raw.hex() == joined and len(widths) == 1 and 0 < (width := widths.pop()) < 256:  # lowercase, no spaces
            fp_text = "".join(fps)
            if fp_text.isascii():
                stamps = array("q", ms)
                if sys.byteorder != "little":
                    stamps.byteswap()
                return n, first_ts, last_ts, bytes((_PACKED, width)) + raw + stamps.tobytes() + fp_text.encode("ascii")
    except (ValueError, TypeError, OverflowError):  # not hex; ms not int64 integers: as JSON
        pass
    return n, first_ts, last_ts, json.dumps([list(batch), fps, ms])


def _decode(ids: str | bytes, ids_only: bool = False) -> list:
    """A batch row's `[[event_id, ...], [fingerprint, ...], [ms, ...]]`, whichever form it is stored in
    (`ids_only`: a packed row gives `[[event_id, ...]]`, as start-up needs). (Versions before packed
    rows read only JSON: an index that holds packed rows cannot be opened by them -- a downgrade
    starts that index afresh, or waits for the rows to age out.)"""
    if isinstance(ids, str) or not ids or ids[0] != _PACKED:
        return json.loads(ids)
    width = ids[1]
    n = (len(ids) - 2) // (16 + 8 + width)
    ms_at, fp_at = 2 + 16 * n, 2 + 24 * n
    hexed = ids[2:ms_at].hex()
    if ids_only:
        return [[hexed[i:i + 32] for i in range(0, 32 * n, 32)]]
    stamps = array("q", ids[ms_at:fp_at])
    if sys.byteorder != "little":
        stamps.byteswap()
    fp_text = ids[fp_at:].decode("ascii")
    return [[hexed[i:i + 32] for i in range(0, 32 * n, 32)], [fp_text[i:i + width] for i in range(0, width * n, width)],
            stamps.tolist()]


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
            CREATE TABLE IF NOT EXISTS accepted_batches (
                first_seq INTEGER PRIMARY KEY, n INTEGER NOT NULL, first_ts REAL NOT NULL, last_ts REAL NOT NULL,
                ids TEXT NOT NULL);
        """)
        if "first_ts" not in {c[1] for c in self._db.execute("PRAGMA table_info(accepted_batches)")}:
            # a table of this layout's first days, without it: 0 makes pruning read those rows' times
            self._db.execute("ALTER TABLE accepted_batches ADD COLUMN first_ts REAL NOT NULL DEFAULT 0")
        self._pending: dict[str, tuple[str, float]] = {}  # claimed, being published: id -> (fingerprint, ts)
        self._unwritten: dict[str, tuple[str, int]] = {}  # confirmed, not yet in the table: id -> (fp, ms)
        self._writing: dict[str, tuple[str, int]] = {}  # confirmed, being written (its transaction open)
        self._migrate()
        # Every written id: hash(event_id) -> its seq (checked against the stored id on a hit).
        self._accepted: dict[int, int] = {}
        # Batch rows a claim read lately, (first_seq, [ids, fingerprints, ms]): a retried batch asks
        # for many ids of one row. A seq names the same id for as long as it is kept, so they stay true.
        self._rows_read: deque[tuple[int, list]] = deque(maxlen=8)
        self._first_seq = self._next_seq = 0  # the ids written: seqs [_first_seq, _next_seq)
        for i, (first, ids) in enumerate(self._db.execute("SELECT first_seq, ids FROM accepted_batches "
                                                          "ORDER BY first_seq")):
            eids = _decode(ids, ids_only=True)[0]
            self._accepted.update(zip(map(hash, eids), range(first, first + len(eids))))
            self._first_seq = first if i == 0 else self._first_seq
            self._next_seq = first + len(eids)
        self._written_since_prune = 0
        self._closed = False
        self.checkpoint_errors = self.write_errors = 0
        self._writer_lock = threading.Lock()  # one batch write (and prune) at a time
        self._wdb = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
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
        """The batch as one row: seqs `first`, `first + 1`, ... (autocommit: one statement)."""
        db.execute(_INSERT_BATCH, (first, *_encode(batch)))

    def _migrate(self) -> None:
        """Earlier versions kept accepted ids one row each: in `accepted_events` (keyed by the id,
        with a state column), then in `accepted_log` (`seq, event_id, fingerprint, ts`). Their done
        ids move over into batch rows, oldest first, once."""
        tables = {name for (name,) in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table, select in (
                ("accepted_events", f"SELECT event_id, fingerprint, ts FROM accepted_events WHERE state = {DONE} "
                                    "ORDER BY ts, event_id"),
                ("accepted_log", "SELECT event_id, fingerprint, ts FROM accepted_log ORDER BY seq")):
            if table not in tables:
                continue
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                seq = self._db.execute("SELECT coalesce(max(first_seq + n), 0) FROM accepted_batches").fetchone()[0]
                rows = self._db.execute(select)
                while chunk := rows.fetchmany(_MIGRATE_CHUNK):
                    self._db.execute(_INSERT_BATCH,
                                     (seq, *_encode({eid: (fp, round(ts * 1000)) for eid, fp, ts in chunk})))
                    seq += len(chunk)
                self._db.execute(f"DROP TABLE {table}")
            log.info("completion index %s: accepted ids of %s moved to accepted_batches", self.path, table)

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
        with self._tx() as db:
            unwritten, writing, pending = self._unwritten, self._writing, self._pending
            ids = fingerprints.keys()
            # Set operations run in C: a batch of new ids (the common case) costs no Python loop here.
            in_memory = (ids & pending.keys()) | (ids & unwritten.keys()) | (ids & writing.keys())
            stored = self._stored_fingerprints(db, ids - in_memory if in_memory else ids)
            if not in_memory and not stored:
                pending.update(zip(ids, zip(fingerprints.values(), repeat(now))))
                return Claim(list(ids), {}, [])
            claimed, done, waiting = [], {}, []
            for eid, fp in fingerprints.items():
                if (entry := unwritten.get(eid) or writing.get(eid)) is not None:
                    done[eid] = entry[0]
                elif eid in stored:
                    done[eid] = stored[eid]
                elif (entry := pending.get(eid)) is not None and now - entry[1] <= self.stale_claim_s:
                    waiting.append(eid)
                else:
                    pending[eid] = (fp, now)
                    claimed.append(eid)
        return Claim(claimed, done, waiting)

    def _stored_fingerprints(self, db: sqlite3.Connection, ids) -> dict[str, str]:
        """The fingerprints of those of `ids` that are written (caller holds `_lock`)."""
        accepted = self._accepted
        by_hash = dict(zip(map(hash, ids), ids))
        shared = len(by_hash) < len(ids)  # two of the ids have one hash (~2^-64): keep every one
        if shared:
            by_hash = {}
            for eid in ids:
                by_hash.setdefault(hash(eid), []).append(eid)
        hits = by_hash.keys() & accepted.keys()  # a hit may be another id of the same hash: checked below
        if not hits:
            return {}
        ask: dict[int, list[str]] = {}  # seq -> the ids whose hash names it
        for h in hits:
            ask.setdefault(accepted[h], []).extend(by_hash[h] if shared else (by_hash[h],))
        stored: dict[str, str] = {}
        found = self._rows_read
        for seq in sorted(ask):
            row = next(((f, r) for f, r in found if f <= seq < f + len(r[0])), None)
            if row is None:
                hit = db.execute("SELECT first_seq, ids FROM accepted_batches WHERE first_seq <= ? "
                                 "ORDER BY first_seq DESC LIMIT 1", (seq,)).fetchone()
                if hit is None:
                    continue
                row = (hit[0], _decode(hit[1]))
                found.append(row)
            first, (eids, fps, _) = row
            if seq - first < len(eids) and (eid := eids[seq - first]) in ask[seq]:  # not another id of that hash
                stored[eid] = fps[seq - first]
        return stored

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
            return db.execute("SELECT coalesce(sum(n), 0) FROM accepted_batches").fetchone()[0]

    def prune(self, now: float | None = None) -> None:
        """Forget done events older than the TTL, then the oldest beyond the row cap."""
        self.flush()
        with self._writer_lock:
            self._prune(self._wdb, time.time() if now is None else now)

    def _prune(self, db: sqlite3.Connection, now: float) -> None:
        """On the writer's connection, holding `_writer_lock`: the ids are in confirmation order, so
        what goes is a prefix — those older than the TTL, then the oldest beyond the cap. Whole
        batch rows are deleted; the one the cut falls into keeps its newer part."""
        oldest_kept = now - self.accepted_ttl_s
        row = db.execute("SELECT first_seq, first_ts FROM accepted_batches WHERE last_ts >= ? ORDER BY first_seq "
                         "LIMIT 1", (oldest_kept,)).fetchone()  # scans the expired rows only
        cut = self._next_seq if row is None else row[0]
        if row is not None and row[1] < oldest_kept:  # the TTL falls inside this row: read its times
            ms = _decode(db.execute("SELECT ids FROM accepted_batches WHERE first_seq = ?",
                                       (row[0],)).fetchone()[0])[2]
            cut += next((i for i, m in enumerate(ms) if m / 1000 >= oldest_kept), len(ms))
        cut = max(cut, self._next_seq - self.accepted_max)
        if cut <= self._first_seq:
            return
        db.execute("BEGIN IMMEDIATE")
        try:
            gone: list[tuple[int, str]] = []
            for first, ids in db.execute("SELECT first_seq, ids FROM accepted_batches WHERE first_seq < ?",
                                         (cut,)).fetchall():
                eids, fps, ms = _decode(ids)
                keep = max(0, cut - first)
                gone += zip(range(first, first + min(keep, len(eids))), eids[:keep])
                db.execute("DELETE FROM accepted_batches WHERE first_seq = ?", (first,))
                if keep < len(eids):  # the cut falls inside: its newer ids stay, as a row from `cut`
                    rest = dict(zip(eids[keep:], zip(fps[keep:], ms[keep:])))
                    db.execute(_INSERT_BATCH, (cut, *_encode(rest)))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        with self._lock:
            accepted = self._accepted
            for seq, eid in gone:
                if accepted.get(h := hash(eid)) == seq:
                    del accepted[h]
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
