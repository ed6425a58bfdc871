"""Accepted idempotency ids: the completion index's layouts, one SQLite table each, same run.

`feedback.completion_index` keeps every accepted feedback event id (a TTL and a row cap) so that a
retried request is not published twice. It used to keep them in a table keyed by the random id
(`accepted_events`: `event_id TEXT PRIMARY KEY`, an index on `ts`), then appended them one row each
to `accepted_log` (`seq INTEGER PRIMARY KEY`, `json_each` inserts of 1000 rows); it now writes each
write-behind batch as one row of `accepted_batches` (`first_seq INTEGER PRIMARY KEY`, the batch's
ids, fingerprints and ms as one value: first a JSON text, now packed bytes -- both are measured);
lookups go through an in-memory hash -> seq map. This
writes, into one SQLite file per layout (WAL, synchronous=NORMAL, as the index), `--prefill` ids in
batches, then times `--batches` more batches of `--batch` random ids each (one transaction, then a
checkpoint, as the index's writer thread does) and reports CPU per batch and WAL bytes per id. Same
process, same machine, one run.

    .venv/bin/python bench/accepted_ids.py [--prefill 400000] [--batch 5000] [--batches 20]

Writes bench/results/accepted_ids.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import sqlite3
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from feedback.completion_index import _encode  # noqa: E402 (after the path)

LAYOUTS = {
    "keyed by event id (before)": (
        ("CREATE TABLE a (event_id TEXT PRIMARY KEY, state INTEGER NOT NULL, fingerprint TEXT NOT NULL, "
         "ts REAL NOT NULL); CREATE INDEX a_ts ON a (ts);"),
        ("INSERT OR REPLACE INTO a SELECT json_extract(value, '$[0]'), 1, json_extract(value, '$[1][0]'), "
         "json_extract(value, '$[1][1]') / 1000.0 FROM json_each(?)")),
    "append-only log, one row per id (before)": (
        "CREATE TABLE a (seq INTEGER PRIMARY KEY, event_id TEXT NOT NULL, fingerprint TEXT NOT NULL, ts REAL NOT NULL);",
        ("INSERT INTO a SELECT ? + key, json_extract(value, '$[0]'), json_extract(value, '$[1][0]'), "
         "json_extract(value, '$[1][1]') / 1000.0 FROM json_each(?)")),
    "one row per batch, JSON (before)": (
        ("CREATE TABLE a (first_seq INTEGER PRIMARY KEY, n INTEGER NOT NULL, first_ts REAL NOT NULL, "
         "last_ts REAL NOT NULL, ids TEXT NOT NULL);"),
        "INSERT INTO a VALUES (?, ?, ?, ?, ?)"),
    "one row per batch, packed (now)": (
        ("CREATE TABLE a (first_seq INTEGER PRIMARY KEY, n INTEGER NOT NULL, first_ts REAL NOT NULL, "
         "last_ts REAL NOT NULL, ids TEXT NOT NULL);"),
        "INSERT INTO a VALUES (?, ?, ?, ?, ?)"),
}


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(name: str, folder: Path, prefill: int, batch: int, batches: int) -> dict:
    schema, insert = LAYOUTS[name]
    path = folder / f"{abs(hash(name))}.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    db.executescript(schema)
    batch_rows = "VALUES" in insert
    appending = batch_rows or "?" in insert.split("SELECT", 1)[1].split(",", 1)[0]
    seq = 0

    def ids(n: int) -> list:
        ms = round(time.time() * 1000)
        return [(uuid.uuid4().hex, (os.urandom(9).hex(), ms)) for _ in range(n)]

    def write(items: list) -> None:
        nonlocal seq
        n = len(items)
        db.execute("BEGIN IMMEDIATE")
        if batch_rows:  # as CompletionIndex._insert: `feedback.completion_index._encode`
            db.execute(insert, (seq, *_encode(dict(items), pack="packed" in name)))
        for i in range(0, n if not batch_rows else 0, 1000):
            chunk = json.dumps(items[i:i + 1000])
            db.execute(insert, (seq + i, chunk) if appending else (chunk,))
        db.execute("COMMIT")
        seq += n

    while seq < prefill:
        write(ids(min(batch, prefill - seq)))
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    wal = path.with_name(path.name + "-wal")
    cpu = wall = 0.0
    wal_bytes = 0
    for _ in range(batches):
        items = ids(batch)  # made before the clock starts (the index gets them from requests)
        c0, w0 = cpu_s(), time.perf_counter()
        write(items)
        wal_bytes += wal.stat().st_size
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        cpu += cpu_s() - c0
        wall += time.perf_counter() - w0
    db.close()
    return {"layout": name, "prefill": prefill, "batch": batch, "batches": batches,
            "cpu_ms_per_batch": cpu / batches * 1e3, "wall_ms_per_batch": wall / batches * 1e3,
            "wal_bytes_per_id": wal_bytes / (batch * batches), "cpu_us_per_id": cpu / (batch * batches) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=400_000)
    ap.add_argument("--batch", type=int, default=5000)
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = ap.parse_args()
    for name, value in (("prefill", a.prefill), ("batch", a.batch), ("batches", a.batches)):
        if value < (0 if name == "prefill" else 1):
            raise ValueError(f"--{name} must be {'>= 0' if name == 'prefill' else '>= 1'}, got {value}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(name, Path(tmp), a.prefill, a.batch, a.batches) for name in LAYOUTS]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": f"{platform.platform()}, {os.cpu_count()} CPUs", "sqlite": sqlite3.sqlite_version,
            "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "accepted_ids.json").write_text(json.dumps({"rows": rows, **meta}, indent=2))
    lines = [f"# Accepted ids: {a.batch}-id batches into a table of {a.prefill} ids", "",
             "| layout | CPU ms per batch | wall ms per batch | CPU us per id | WAL bytes per id |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['layout']} | {r['cpu_ms_per_batch']:.0f} | {r['wall_ms_per_batch']:.0f} | "
              f"{r['cpu_us_per_id']:.1f} | {r['wal_bytes_per_id']:.0f} |" for r in rows]
    lines += ["", (f"Machine: {meta['machine']}; SQLite {meta['sqlite']}; {meta['date']}. Batches include the "
                   "Python side (encoding) and a checkpoint each, as the index's writer thread; the ids are made before.")]
    (out / "accepted_ids.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
