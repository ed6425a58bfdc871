"""The gateway's side of lending: `LendingLoop` feeds `serving.lending.FleetManager` from the fleet's
live load and carries out its decisions (lend, lent, reclaim), with one `registry.job_worker.LendingWorker`
per lent replica running shards of the job queue (`registry.jobs`) as background requests, and with
`co_serve` one per serving replica too, capped by the slots its live requests leave free
(`FleetManager.co_serve_slots`, read before every submission).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

from registry.job_worker import LendingWorker
from registry.jobs import JobQueue
from serving.lending import Decision, FleetManager, LendingConfig

log = logging.getLogger(__name__)
LOAD_WAIT_S = 300.0  # a lent replica that has not loaded a job's version by then passes it over


class LendingLoop:
    """The gateway's lending: every `interval_s` it feeds the fleet manager (`serving.lending`) the
    fleet's live load, then carries out its decisions. `lend`: the engine leaves live routing
    (`Fleet.lend`) and drains; `lent`: a worker thread runs shards on it until it is reclaimed;
    `reclaim`: the worker's background requests are preempted at the engine's next step and the
    engine serves live traffic again. `engines()` names the replicas' engines of the moment."""

    def __init__(self, fleet, engines, cfg: LendingConfig, queue: JobQueue, interval_s: float = 1.0, prepare=None):
        """`prepare(name, version | None, state)`: replica `name` is in lending `state`, and should also
        hold `version` for lent work, or nothing extra (`serving.replica.Replica.lend_version`; the state
        goes in its heartbeat); None: lent work runs only on what the replicas hold anyway."""
        self.fleet, self.engines, self.cfg, self.queue = fleet, engines, cfg, queue
        for name, engine in engines().items():  # vLLM: live requests need slots lent work cannot fill
            batch = getattr(engine, "max_batch", None)
            if not getattr(engine, "preempts_for_live", True) and batch is not None:
                if cfg.max_rollout_concurrency >= batch:
                    raise ValueError(
                        f"lending.max_rollout_concurrency={cfg.max_rollout_concurrency} must be below replica "
                        f"{name}'s max_batch={batch}: its engine (vLLM) does not preempt lent work for live requests"
                    )
                if cfg.co_serve and cfg.target_concurrency >= batch:
                    raise ValueError(
                        f"lending.co_serve needs lending.target_concurrency={cfg.target_concurrency:g} below "
                        f"replica {name}'s max_batch={batch}: its engine (vLLM) does not preempt co-served work "
                        "for live requests"
                    )
        self.prepare = prepare
        self._prepared: dict[str, tuple[str | None, str]] = {}
        self._asked: dict[tuple[str, str], float] = {}  # (replica, version) -> when it was asked to hold it
        self.interval_s = interval_s
        self.manager = FleetManager(cfg, sorted(engines()))
        self.decisions: list[tuple[float, Decision]] = []
        self._workers: dict[str, tuple[LendingWorker, threading.Event, threading.Thread]] = {}
        self._co_workers: dict[str, tuple[LendingWorker, threading.Event, threading.Thread]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self._past: Counter[str] = Counter()  # counters of workers already stopped
        self._lock = threading.Lock()  # `_workers` and `_past`: the loop changes them, `/metrics` reads

    def start(self) -> LendingLoop:
        self._thread = threading.Thread(target=self._run, name="lending", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.step(time.monotonic() - self._t0)
            except Exception:  # the loop goes on; every replica keeps serving whatever happens here
                log.exception("lending: a step failed")

    def step(self, now: float) -> list[Decision]:
        engines = self.engines()
        in_flight = {name: self.fleet.live_in_flight(e) for name, e in engines.items()}
        self.manager.observe(now, sum(in_flight.values()), in_flight, self.fleet.take_ttfts())
        decided = self.manager.decide(now)
        for d in decided:
            self.decisions.append((now, d))
            log.info("lending: %s %s (%s)", d.action, d.replica, d.reason)
        # Reclaims first, live traffic waits: every reclaimed replica is back in live routing and its lent
        # work preempted (ending at its engine's next step) before any worker is waited for, so a panic
        # over many replicas costs one engine step, not one per replica.
        reclaimed = [d.replica for d in decided if d.action == "reclaim"]
        if gone := [r for r in reclaimed if r not in engines]:
            log.error("lending: reclaimed replicas %s have no engine now", gone)
            reclaimed = [r for r in reclaimed if r in engines]
        for name in reclaimed:
            try:
                self.fleet.reclaim(engines[name])
            except Exception:  # one replica's failure never strands the others' decisions
                log.exception("lending: reclaim %s failed", name)
        stopping = [got for name in reclaimed if (got := self._preempt_worker(name, self._workers)) is not None]
        for got in stopping:
            self._join_worker(got)
        for d in decided:
            try:
                engine = engines[d.replica]
                if d.action == "lend":  # its co-served work ends before it drains
                    self._stop_worker(d.replica, self._co_workers)
                    self.fleet.lend(engine)
                elif d.action == "lent":
                    self._start_worker(d.replica, engine)
            except Exception:  # one replica's failure never strands the others' decisions
                log.exception("lending: %s %s failed", d.action, d.replica)
        if self.cfg.co_serve:
            for name, state in self.manager.states.items():
                if state == "serving" and name not in self._co_workers and name in engines:
                    self._start_worker(name, engines[name], co_serve=True)
        if self.prepare is not None:
            try:
                self._prepare(engines, now)
            except Exception:
                log.exception("lending: preparing lent replicas failed")
        return decided

    def _prepare(self, engines: dict, now: float) -> None:
        """Each lent replica (with `co_serve`, each serving one too) holds the version of one open job it
        lacks: the one it was given while that job is open, else the oldest; a version it has not loaded
        within `LOAD_WAIT_S` (one it may not hold: rejected, superseded) is passed over for `LOAD_WAIT_S`.
        The others hold nothing extra."""
        working = {r for r, s in self.manager.states.items() if s == "lent" or (s == "serving" and self.cfg.co_serve)}
        open_versions = self.queue.open_versions() if working else []
        for name, state in self.manager.states.items():
            had = (self._prepared.get(name) or (None, None))[0]
            want = None
            if name in working:
                held = set(engines[name].versions)
                if had is not None and had in held:
                    self._asked.pop((name, had), None)  # loaded
                skip = {v for (n, v), t in self._asked.items() if n == name and now - t > LOAD_WAIT_S}
                if had in open_versions and had not in skip:
                    want = had
                else:
                    want = next((v for v in open_versions if v not in held and v not in skip), None)
                for key in [k for k, t in self._asked.items() if now - t > 2 * LOAD_WAIT_S]:
                    del self._asked[key]  # passed over long enough: may be tried again
            if self._prepared.get(name, "?") != (want, state):
                assert self.prepare is not None
                self.prepare(name, want, state)  # recorded only once done: a failure is tried again
                self._prepared[name] = (want, state)
                if want is not None:
                    self._asked.setdefault((name, want), now)
                log.info("lending: %s is %s and holds %s for lent work", name, state, want)

    def _start_worker(self, name: str, engine, co_serve: bool = False) -> None:
        # Eval shards only where samples are bit-identical to the gate's engine (the batch-invariant kernels).
        kinds = ("eval", "rollout") if getattr(engine, "batch_invariant", False) else ("rollout",)
        if co_serve:  # what live traffic leaves free on this serving replica, now

            def slots() -> tuple[int, int]:
                live, oldest = self.fleet.live_in_flight(engine), self.fleet.oldest_live_s(engine)
                return self.manager.co_serve_slots(name, live, oldest)

            def start() -> int:
                return slots()[0]

            def keep() -> int:
                return slots()[1]

            worker = LendingWorker(engine, self.queue, name, max_concurrency=start, keep_at_most=keep, kinds=kinds)
        else:
            cap = self.cfg.max_rollout_concurrency
            worker = LendingWorker(engine, self.queue, name, max_concurrency=cap, kinds=kinds)
        stop = threading.Event()

        def work() -> None:
            while not stop.is_set():
                try:
                    run = worker.run_shard()
                    if run is None or run.why != "done":
                        stop.wait(1.0)  # nothing it can do now (no work, or a version it lacks): look again later
                except Exception:
                    log.exception("lending: worker %s failed a shard", name)
                    stop.wait(1.0)

        t = threading.Thread(target=work, name=f"{'co' if co_serve else 'lent'}-{name}", daemon=True)
        with self._lock:
            (self._co_workers if co_serve else self._workers)[name] = (worker, stop, t)
        t.start()

    def _stop_worker(self, name: str, workers: dict) -> None:
        if (got := self._preempt_worker(name, workers)) is not None:
            self._join_worker(got)

    def _preempt_worker(self, name: str, workers: dict) -> tuple | None:
        """Take replica `name`'s worker out of `workers` and preempt its lent work (it ends at the
        engine's next step); the worker, to `_join_worker`, or None if it had none."""
        with self._lock:
            got = workers.pop(name, None)
        if got is not None:
            _, stop, _ = got
            stop.set()
            got[0].preempt()
        return got

    def _join_worker(self, got: tuple) -> None:
        worker, _, t = got
        t.join(30)
        with self._lock:
            self._past.update(worker.counters)

    def counters(self) -> dict[str, float]:
        """The manager's lends, reclaims and panics, replica-seconds lent, and the workers' counts."""
        with self._lock:
            work = Counter(self._past)
            for w, _, _ in [*self._workers.values(), *self._co_workers.values()]:
                work.update(dict(w.counters))
        out = {**self.manager.counters, "lent_seconds": self.manager.lent_seconds, **work}
        return out | {"live_on_lent": self.fleet.live_on_lent}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for workers in (self._workers, self._co_workers):
            for name in list(workers):
                self._stop_worker(name, workers)
