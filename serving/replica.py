"""A replica: one engine serving what the registry says, and reporting what it serves.

`Replica(replica_id, gateway_id, engine, store, registry, fetcher, template)`:

- `sync()` reads the registry: the *promoted* version, and the candidate while it is in `canary` or
  `awaiting_approval` (kept loaded after its canary so that approval switches at once; it is served
  only in `canary`). Each wanted version the engine does not hold yet is fetched into the local
  `WeightStore` (its artifact and, for a delta, the artifacts of its base chain down to a snapshot,
  each checked against the SHA-256 and size the *registry* recorded: `serving.fetch`), rebuilt and
  verified tensor by tensor by the store, written as a checkpoint folder (the `template`'s
  config.json and tokenizer, the rebuilt weights) and loaded beside the versions held
  (`engine.add_version`). Then the promoted version becomes the default and every other version
  held is retired (`retire_version(wait=False)`: requests in flight finish on the version they
  started on, `serving.versions`). A version that fails to fetch, verify or load is not served: the
  replica keeps what it serves, remembers the error (`last_error`, reported in the heartbeat) and
  tries again at the next change or after `retry_s`.
- Restarts: a replica starts empty and its first `sync` makes it what the registry says, whatever it
  was doing when its process died. A `.part` left by an interrupted download is continued from
  where it ends (`serving.fetch`); one that does not verify is deleted and the artifact downloaded
  again whole, once, in the same sync. Nothing is loaded before its bytes matched the registry's
  hash, and the checkpoint folders it serves from are always rewritten from the verified store.
- Each sync that loads, switches or retires something logs one line, `replica <id>: sync {json}`:
  its `SyncResult.timeline()` (when it began, per loaded version `LoadTimes`: fetch with the bytes
  downloaded, verify, write, load; when the new default took new requests). `bench/swap_load.py`
  reads these lines.
- A dead engine (its process killed or its loop failed): with `make_engine` the next sync (the
  follower loop notices within a poll) starts a fresh engine and loads what the registry says, as
  at a start; without, the replica reports that it holds nothing and why. While the engine is dead
  the heartbeat never claims versions it cannot serve.
- Lending: `lend_version(vid)` makes the replica also hold a registered version a lent job needs (an
  eval candidate, or the learner's weights registered as a `rollout` version): fetched, verified and
  loaded like any other, never served (not the default, no share), so the fleet check sees it held
  under the registry's hash; `lend_version(None)` retires it. Applied at the follower loop's next look.
- `heartbeat()`: `registry.heartbeat(replica_id, gateway_id, host, holds={version: artifact
  SHA-256}, serves={version: share}, error=last_error)`. The default version serves `1 - share` of
  the canary (its `gate["canary"]["share"]`), the canary version that share.
- `run(stop)`: the follower loop. It polls `changes_since(last seq)` once per `poll_s` (at least one
  second; the spec forbids polling more often), or sooner when a `notifier` (`PgNotifier`: LISTEN
  flywheel_registry on PostgreSQL) wakes it, syncs after any change and heartbeats every
  `heartbeat_s` (and after each sync).

Weights: the weight store holds HF Mixtral names (`shipping_state`), the names of a checkpoint
folder, so they are written out unchanged; the served dtype is the template's (`dtype` overrides),
and shipped tensors of another dtype are cast to it. Only float32 shipping served in float32 keeps
serving bit-exact with a float32 trainer; bf16 shipping is served as its bf16 values.

`registry` is any object with the methods of `ReplicaRegistry` (`registry.registry.Registry` has them;
`serving` does not import `gating`). Called by the gateway that drives the replicas on its machine.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from serving.checkpoint import CONFIG, TOKENIZER, WEIGHTS, args_to_config, read_config
from serving.fetch import Fetcher, HashMismatch
from serving.interface import Engine
from serving.weight_store import DELTA_SUFFIX, SNAPSHOT_SUFFIX, WeightStore

log = logging.getLogger(__name__)
LENDABLE = ("candidate", "evaluating", "canary", "awaiting_approval", "promoted", "rollout")  # lent work may load

MIN_POLL_S = 1.0
TEMPLATE_FILES = (TOKENIZER, "tokenizer_config.json", "generation_config.json")
SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOADED_DIR = ".loaded"  # inside the store folder (a name WeightStore never lists)
PART_SUFFIX = ".part"  # a download in progress (`serving.fetch`)


_STORE_LOCKS: dict[Path, threading.Lock] = {}
_STORE_LOCKS_GUARD = threading.Lock()


def _store_lock(folder: Path) -> threading.Lock:
    """One lock per store folder in this process (the fetcher's `flock` covers other processes)."""
    with _STORE_LOCKS_GUARD:
        return _STORE_LOCKS.setdefault(folder.resolve(), threading.Lock())


# -- what the replica reads from the registry (registry.registry.Registry has all of it) ----------------


class ArtifactLike(Protocol):
    @property
    def path(self) -> str: ...
    @property
    def sha256(self) -> str: ...
    @property
    def bytes(self) -> int: ...


class VersionLike(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def delta_base_id(self) -> str | None: ...
    @property
    def gate(self) -> Mapping[str, Any]: ...
    @property
    def artifact(self) -> ArtifactLike | None: ...


class ChangeLike(Protocol):
    @property
    def seq(self) -> int: ...


class ReplicaRegistry(Protocol):
    def promoted(self) -> VersionLike | None: ...
    def in_flight(self) -> VersionLike | None: ...
    def get(self, version_id: str) -> VersionLike: ...
    def changes_since(self, seq: int) -> Sequence[ChangeLike]: ...
    def last_seq(self) -> int: ...
    def heartbeat(
        self,
        replica_id: str,
        *,
        gateway_id: str,
        host: str,
        holds: Mapping[str, str],
        serves: Mapping[str, float],
        error: str | None = None,
        traffic: Mapping[str, Mapping[str, float]] | None = None,
        lending: str | None = None,
    ) -> object: ...


class Notifier(Protocol):
    def wait(self, timeout_s: float) -> bool:
        """Block up to `timeout_s`; True when the registry announced a change meanwhile."""


class ReplicaError(RuntimeError):
    """A version the registry names cannot be served as it is (no artifact, a broken chain)."""


@dataclass
class LoadTimes:
    """Where the time of loading one version went (seconds; bytes actually downloaded by this replica)."""

    version: str
    fetch_s: float = 0.0  # the artifacts of its chain into the local store, each checked (waits for the lock too)
    fetched_bytes: int = 0
    verify_s: float = 0.0  # rebuilt through its chain by the store, every tensor's SHA-256 checked
    write_s: float = 0.0  # the checkpoint folder written in the served dtype
    load_s: float = 0.0  # engine.add_version: loaded beside the versions served


@dataclass
class SyncResult:
    default: str | None
    held: dict[str, str]  # version -> artifact SHA-256
    loaded: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    error: str | None = None
    started_at: float = 0.0  # wall clock (time.time()) when the sync began
    loads: list[LoadTimes] = field(default_factory=list)
    switched_at: float | None = None  # wall clock when a new default took new requests
    ended_at: float = 0.0

    def timeline(self) -> dict[str, Any]:
        """What a log line or a benchmark reads: the times of this sync's stages."""
        return {
            "started_at": self.started_at,
            "default": self.default,
            "loads": [vars(t) for t in self.loads],
            "switched_at": self.switched_at,
            "retired": self.retired,
            "ended_at": self.ended_at,
            "error": self.error,
        }


class Replica:
    def __init__(
        self,
        replica_id: str,
        gateway_id: str,
        engine: Engine,
        store: WeightStore,
        registry: ReplicaRegistry,
        fetcher: Fetcher,
        template: str | Path,
        *,
        host: str | None = None,
        dtype: torch.dtype | None = None,
        work_dir: str | Path | None = None,
        heartbeat_s: float = 5.0,
        poll_s: float = MIN_POLL_S,
        retry_s: float = 10.0,
        notifier: Notifier | None = None,
        make_engine: Callable[[], Engine] | None = None,
    ):
        if not poll_s >= MIN_POLL_S:
            raise ValueError(f"poll_s must be >= {MIN_POLL_S} (changes are not polled more often), got {poll_s!r}")
        if not (heartbeat_s > 0 and retry_s > 0):
            raise ValueError(f"heartbeat_s and retry_s must be > 0, got {heartbeat_s!r}, {retry_s!r}")
        self.replica_id, self.gateway_id = replica_id, gateway_id
        self.engine, self.store, self.registry, self.fetcher = engine, store, registry, fetcher
        self.template = Path(template)
        self.args, template_dtype = read_config(self.template)  # the architecture every version shares
        self.dtype = dtype or template_dtype
        if self.dtype not in SERVED_DTYPES:
            raise ValueError(f"dtype must be one of {SERVED_DTYPES}, got {self.dtype}")
        self.host = host or socket.gethostname()
        self.work_dir = Path(work_dir) if work_dir is not None else store.folder / LOADED_DIR / replica_id
        self.heartbeat_s, self.poll_s, self.retry_s = heartbeat_s, poll_s, retry_s
        self.notifier = notifier
        self.make_engine = make_engine  # a fresh engine when this one has died (None: stay down)
        self.traffic_source: Callable[[Any], dict[str, dict[str, float]]] | None = None
        self._traffic_total: dict[str, dict[str, float]] = {}
        self._beat_at = time.monotonic()
        self.restarts = 0
        self.last_error: str | None = None
        self._held: dict[str, str] = {}  # loaded by this replica and not retired: version -> artifact SHA-256
        self._retiring: set[str] = set()
        self._lock = threading.RLock()
        self._lent_version: str | None = None  # held for lent work (`lend_version`), never served
        self.lending_state: str | None = None  # set by the gateway's lending loop; in the heartbeat
        self._log_engine()
        self._nudge = threading.Event()  # `lend_version` changed: sync at the next look

    # -- following the registry -------------------------------------------------------------------

    def wanted(self) -> tuple[VersionLike | None, VersionLike | None]:
        """(the promoted version, the candidate to hold: in canary or awaiting approval, else None)."""
        promoted = self.registry.promoted()
        cand = self.registry.in_flight()
        if cand is not None and str(cand.status) not in ("canary", "awaiting_approval"):
            cand = None
        return promoted, cand

    def lend_version(self, version_id: str | None) -> None:
        """Also hold `version_id` for lent work (module docstring), or no such version (None). Never
        waits: a sync under way (a load can take minutes) sees it at its next look."""
        changed = self._lent_version != version_id
        self._lent_version = version_id  # one reference, read once per sync: no lock needed
        if changed:
            self._nudge.set()

    def sync(self) -> SyncResult:
        """Make the engine hold and serve what the registry says (see the module's docstring)."""
        with self._lock:
            started = time.time()
            errors: list[str] = []
            loaded: list[str] = []
            retired: list[str] = []
            loads: list[LoadTimes] = []
            if not self.engine.alive:
                if self.make_engine is None:
                    result = SyncResult(None, {}, started_at=started)
                    return self._done(
                        result, [f"the engine is not running ({getattr(self.engine, 'failure', None)!r})"]
                    )
                self._restart_engine()
            try:
                promoted, cand = self.wanted()
            except Exception as e:
                result = SyncResult(self.engine.default_version, dict(self._held), started_at=started)
                return self._done(result, [f"registry: {e}"])
            if promoted is None:
                errors.append("the registry has no promoted version")
            want = [v for v in (promoted, cand) if v is not None]
            lent = self._lent_version
            if lent is not None and lent not in {v.id for v in want}:
                try:
                    extra = self.registry.get(lent)
                    if str(extra.status) in LENDABLE:
                        want.append(extra)
                    else:  # rejected or withdrawn since: its jobs end with it; nothing to hold
                        log.info("replica %s: lent version %s is %s: not held", self.replica_id, lent, extra.status)
                except Exception as e:
                    errors.append(f"lent version {lent}: {e}")
            for v in want:
                times = LoadTimes(v.id)
                try:
                    if self._ensure_loaded(v, times):
                        loaded.append(v.id)
                        loads.append(times)
                except Exception as e:
                    log.warning("replica %s: cannot serve %s: %s", self.replica_id, v.id, e)
                    errors.append(f"{v.id}: {e}")
            switched = None
            if promoted is not None and promoted.id in self._held and self.engine.default_version != promoted.id:
                self.engine.set_default(promoted.id)
                switched = time.time()
            keep = {v.id for v in want} | {self.engine.default_version}
            for name in self.engine.versions:
                if name in keep or name in self._retiring:
                    continue
                try:
                    self.engine.retire_version(name, wait=False)
                    self._retiring.add(name)
                    retired.append(name)
                except Exception as e:
                    errors.append(f"retiring {name}: {e}")
                self._held.pop(name, None)
            self._cleanup()
            result = SyncResult(self.engine.default_version, dict(self._held), loaded, retired, None, started, loads)
            result.switched_at = switched
            result = self._done(result, errors)
            if loaded or retired or switched:
                log.info("replica %s: sync %s", self.replica_id, json.dumps(result.timeline()))
            return result

    def _restart_engine(self) -> None:
        """Replace a dead engine (its process killed, its loop failed) with a fresh, empty one; the sync
        that called this then loads what the registry says, as at a start."""
        log.warning("replica %s: its engine died (%r); starting a new one", self.replica_id,
                    getattr(self.engine, "failure", None))  # fmt: skip
        try:
            self.engine.shutdown()
        except Exception as e:  # it is dead already: nothing more to free
            log.warning("replica %s: shutting the dead engine down: %r", self.replica_id, e)
        assert self.make_engine is not None
        self.engine = self.make_engine()
        self._held.clear()
        self._retiring.clear()
        self.restarts += 1
        self._log_engine()

    def _log_engine(self) -> None:
        pid = getattr(self.engine, "pid", None)  # an engine in a process of its own
        if pid is not None:
            log.info("replica %s: engine process pid %d", self.replica_id, pid)

    def _done(self, result: SyncResult, errors: list[str]) -> SyncResult:
        self.last_error = result.error = "; ".join(errors)[:2000] if errors else None
        result.ended_at = time.time()
        return result

    def _ensure_loaded(self, v: VersionLike, times: LoadTimes) -> bool:
        """True when `v` was loaded now (`times` says where the time went), False when it was held already."""
        sha = self._artifact(v).sha256
        if v.id in self._held:
            if self._held[v.id] != sha:
                raise ReplicaError(
                    f"held under artifact SHA-256 {self._held[v.id][:12]}..., the registry now records "
                    f"{sha[:12]}...; kept as it is"
                )
            return False
        t0 = time.perf_counter()
        times.fetched_bytes = self._ensure_stored(v)
        t1 = time.perf_counter()
        state = self.store.get(v.id)  # rebuilt through its chain, every tensor verified
        t2 = time.perf_counter()
        folder = self._materialize(v.id, state)
        t3 = time.perf_counter()
        self.engine.add_version(v.id, folder)
        times.fetch_s, times.verify_s, times.write_s = t1 - t0, t2 - t1, t3 - t2
        times.load_s = time.perf_counter() - t3
        self._held[v.id] = sha
        self._retiring.discard(v.id)
        log.info("replica %s: loaded %s (%s)", self.replica_id, v.id, sha[:12])
        return True

    @staticmethod
    def _artifact(v: VersionLike) -> ArtifactLike:
        a = v.artifact
        if a is None:
            raise ReplicaError(f"version {v.id!r} has no artifact in the registry")
        name = a.path.rsplit("/", 1)[-1]
        if name not in (v.id + SNAPSHOT_SUFFIX, v.id + DELTA_SUFFIX):
            raise ReplicaError(
                f"version {v.id!r}: artifact {a.path!r} is not a weight-store file "
                f"({v.id}{SNAPSHOT_SUFFIX} or {v.id}{DELTA_SUFFIX})"
            )
        return a

    def _ensure_stored(self, v: VersionLike) -> int:
        """`v`'s artifact and those of its delta chain in the local store, each checked against the registry;
        returns the bytes of those that were not there yet (downloaded or copied now)."""
        seen: list[str] = []
        fetched = 0
        while True:
            if v.id in seen:
                raise ReplicaError(f"version {seen[0]!r}: its delta chain loops at {v.id!r}")
            seen.append(v.id)
            a = self._artifact(v)
            dest = self.store.folder / a.path.rsplit("/", 1)[-1]
            with _store_lock(self.store.folder):  # replicas of one gateway share its store: one fetches
                fetched += 0 if dest.is_file() else a.bytes
                resumed = dest.with_name(dest.name + PART_SUFFIX).is_file()
                try:
                    self.fetcher.fetch(a.path, a.sha256, dest, size=a.bytes)
                except HashMismatch:
                    if not resumed:
                        raise
                    # The part an interrupted download left was not a prefix of the artifact (the fetcher
                    # deleted it): download the whole file once more, verified like any other.
                    log.warning("replica %s: the partial download of %s did not verify; fetching it again",
                                self.replica_id, v.id)  # fmt: skip
                    self.fetcher.fetch(a.path, a.sha256, dest, size=a.bytes)
            m = self.store.manifest(v.id)
            if m["kind"] == "snapshot":
                return fetched
            parent = m["parent"]["version"]
            if v.delta_base_id is not None and v.delta_base_id != parent:
                raise ReplicaError(
                    f"version {v.id!r}: its delta applies to {parent!r}, the registry says {v.delta_base_id!r}"
                )
            v = self.registry.get(parent)

    def _materialize(self, version_id: str, state: dict[str, torch.Tensor]) -> Path:
        """A checkpoint folder of `state` (HF names) in the served dtype, with the template's tokenizer."""
        folder = self.work_dir / version_id
        tmp = self.work_dir / f".{version_id}.tmp"
        for old in (folder, tmp):
            shutil.rmtree(old, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in TEMPLATE_FILES:
            if (self.template / name).is_file():
                shutil.copyfile(self.template / name, tmp / name)
        weights = {n: t.to(self.dtype).contiguous() for n, t in state.items()}
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(args_to_config(self.args, self.dtype), indent=2))
        tmp.rename(folder)
        return folder

    def _cleanup(self) -> None:
        """Remove the checkpoint folders of versions the engine no longer holds."""
        if not self.work_dir.is_dir():
            return
        loaded = set(self.engine.versions)
        self._retiring &= loaded
        for p in self.work_dir.iterdir():
            if p.name not in loaded:
                shutil.rmtree(p, ignore_errors=True)

    # -- reporting --------------------------------------------------------------------------------

    def report(self) -> tuple[dict[str, str], dict[str, float]]:
        """(holds, serves) as the heartbeat reports them (nothing while the engine is dead)."""
        with self._lock:
            if not self.engine.alive:
                return {}, {}
            holds = dict(self._held)
            default = self.engine.default_version
            serves: dict[str, float] = {}
            try:
                _, cand = self.wanted()
            except Exception:
                cand = None
            share = 0.0
            if cand is not None and str(cand.status) == "canary" and cand.id in holds and cand.id != default:
                record = cand.gate.get("canary") or {}
                share = min(1.0, max(0.0, float(record.get("share", 0.0))))
                serves[cand.id] = share
            if default is not None and default in holds:
                serves[default] = 1.0 - share
            return holds, serves

    def traffic_since_last_beat(self) -> dict[str, dict[str, float]]:
        """What this replica's engine served since the previous heartbeat, per version, with the window
        (`traffic_source`: the gateway's `serving.fleet.Fleet.traffic`; None: nothing is counted)."""
        now = time.monotonic()
        window, self._beat_at = now - self._beat_at, now
        if self.traffic_source is None:
            return {}
        total = self.traffic_source(self.engine)
        before, self._traffic_total = self._traffic_total, total
        out = {}
        for v, t in total.items():
            d = {k: x - before.get(v, {}).get(k, 0.0) for k, x in t.items()}
            if d["requests"] < 0:  # a fresh engine (the last one died): its counts start at zero
                d = dict(t)
            if d["requests"] > 0:
                out[v] = {**d, "window_s": window}
        return out

    def heartbeat(self) -> object:
        holds, serves = self.report()
        return self.registry.heartbeat(
            self.replica_id,
            gateway_id=self.gateway_id,
            host=self.host,
            holds=holds,
            serves=serves,
            error=self.last_error,
            traffic=self.traffic_since_last_beat(),
            lending=self.lending_state,
        )

    # -- the follower loop ------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Follow the registry until `stop` is set (see the module's docstring)."""
        seq = self._safely("reading the last change", self.registry.last_seq) or 0
        self.sync()
        self._safely("heartbeat", self.heartbeat)
        now = time.monotonic()
        next_beat, next_retry = now + self.heartbeat_s, now + self.retry_s
        while not stop.is_set():
            if self._nudge.is_set():
                pass  # `lend_version` asked for a sync: no wait
            elif self.notifier is not None:
                self.notifier.wait(self.poll_s)
            else:
                stop.wait(self.poll_s)
            if stop.is_set():
                return
            changes = self._safely("reading changes", functools.partial(self.registry.changes_since, seq))
            now = time.monotonic()
            synced = False
            dead = not self.engine.alive and self.make_engine is not None
            nudged = self._nudge.is_set()
            if changes or dead or nudged or (self.last_error is not None and now >= next_retry):
                self._nudge.clear()
                if changes:
                    seq = max(c.seq for c in changes)
                self.sync()
                synced, next_retry = True, now + self.retry_s
            if synced or now >= next_beat:
                self._safely("heartbeat", self.heartbeat)
                next_beat = now + self.heartbeat_s

    def _safely(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:
            log.warning("replica %s: %s failed: %s", self.replica_id, what, e)
            self.last_error = f"{what}: {e}"[:2000]
            return None


class PgNotifier:
    """LISTEN on the registry's PostgreSQL channel: `wait` returns once a change is announced."""

    CHANNEL = "flywheel_registry"

    def __init__(self, url: str):
        self.dsn = re.sub(r"^postgresql\+\w+://", "postgresql://", url)
        self._conn: Any = None

    def _connect(self) -> Any:
        import psycopg

        conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=5)
        conn.execute(f"LISTEN {self.CHANNEL}")
        return conn

    def wait(self, timeout_s: float) -> bool:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
            return any(True for _ in self._conn.notifies(timeout=timeout_s, stop_after=1))
        except Exception as e:  # the loop goes on polling; the next wait reconnects
            log.warning("registry notifications: %s", e)
            self.close()
            time.sleep(timeout_s)
            return False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
