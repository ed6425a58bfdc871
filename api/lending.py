"""The worker that runs leased job shards (`registry.jobs`) on a lent replica's engine.

A job item is one prompt with everything its samples need: `{"prompt_ids": [...], "params": {...},
"seeds": [...]}` (`params`: `serving.sampling.SamplingParams` fields, without the seed; sample `k`
uses `seeds[k]`). The submitter fixes the seeds (the gate: `gating.evals.sample_seed`), so a sample is
the same whichever replica makes it, and a redone sample equals the lost one (batch-invariant kernels).

`run_shard` leases one shard, submits its missing samples as background requests (at most
`max_concurrency` at once: the fleet manager caps lent work, the engine does not), records each
finished sample as a rollout (output ids, log-probs, text, finish reason), renews the lease as it
goes, and finishes the shard. A preempted request (a live request needed the slot, or the replica was
reclaimed: `preempt`) ends the shard's run: the lease is released, and whoever takes the shard next
does only what is missing. A version the engine does not hold is refused the same way, counted.
`LendingLoop` is the gateway's side: it feeds `serving.lending.FleetManager` from the fleet's live
load and carries out its decisions (lend, lent, reclaim), one worker per lent replica.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from registry.jobs import JobQueue, Lease, LeaseLost
from serving.lending import Decision, FleetManager, LendingConfig
from serving.requests import Completion
from serving.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardRun:
    job_id: str
    shard: int
    recorded: int  # rollouts stored by this run (new ones)
    finished: bool  # the shard is done
    why: str  # "done", "preempted", "lease lost", "version not held"


class LendingWorker:
    """Runs shards of `queue` on `engine` (anything with `submit(..., background=True)`) as `name`."""

    def __init__(
        self, engine, queue: JobQueue, name: str, lease_s: float = 60.0, max_concurrency: int = 16, kinds=None
    ):
        if max_concurrency < 1 or lease_s <= 0:
            raise ValueError(f"max_concurrency must be >= 1 and lease_s > 0, got {max_concurrency}, {lease_s}")
        self.engine, self.queue, self.name = engine, queue, name
        self.lease_s, self.max_concurrency = lease_s, max_concurrency
        self.kinds = tuple(kinds or ("eval", "rollout"))
        self.counters: Counter[str] = Counter()
        self._stop = threading.Event()

    def preempt(self) -> None:
        """The replica is reclaimed: end the run under way at the engine's next step. A preempted worker
        stays stopped (`run_shard` returns None): the next lent period gets a new one."""
        self._stop.set()
        self.engine.preempt_background()

    def run_shard(self) -> ShardRun | None:
        """Lease a shard and work on it until it is done or preempted; None if no shard is free (or the
        worker was preempted)."""
        if self._stop.is_set():
            return None
        lease = self.queue.lease(self.name, self.lease_s, self.kinds, versions=list(self.engine.versions))
        if lease is None:
            return None
        if lease.version_id not in self.engine.versions:  # unloaded since it was leased
            self.queue.release(lease)
            self.counters["version_not_held"] += 1
            log.warning("lending: %s lacks %s (job %s): shard released", self.name, lease.version_id, lease.job_id)
            return ShardRun(lease.job_id, lease.shard, 0, False, "version not held")
        recorded, why = self._work(lease)
        self.counters["rollouts"] += recorded
        if why != "done":
            self.counters[why.replace(" ", "_")] += 1
            return ShardRun(lease.job_id, lease.shard, recorded, False, why)
        try:
            finished = self.queue.finish(lease)
        except LeaseLost:
            return ShardRun(lease.job_id, lease.shard, recorded, False, "lease lost")
        self.counters["shards_done"] += finished
        return ShardRun(lease.job_id, lease.shard, recorded, finished, "done")

    def _work(self, lease: Lease) -> tuple[int, str]:
        running: dict[tuple[int, int], Any] = {}
        try:
            return self._work_on(lease, running)
        except BaseException:  # whatever failed, the shard goes back and nothing keeps generating for it
            for h in running.values():
                h.cancel()
            self.queue.release(lease)
            raise

    def _work_on(self, lease: Lease, running: dict[tuple[int, int], Any]) -> tuple[int, str]:
        todo = list(lease.todo)
        recorded = 0
        renew_at = time.time() + self.lease_s / 3
        while todo or running:
            while todo and len(running) < self.max_concurrency and not self._stop.is_set():
                i, k = todo.pop(0)
                item = lease.items[i]
                params = SamplingParams(**{**item.get("params", {}), "seed": item["seeds"][k]})
                running[(i, k)] = self.engine.submit(
                    item["prompt_ids"], params, lease.version_id, stream=False, background=True
                )
            done, preempted = [], False
            for key, handle in list(running.items()):
                c = _result(handle)
                if c is None:
                    continue
                del running[key]
                if c.finish_reason == "preempted":
                    preempted = True
                else:
                    done.append((key[0], key[1], _rollout(c)))
            if done:
                recorded += self.queue.record(lease, done)
            if preempted or self._stop.is_set():
                for h in running.values():
                    h.cancel()
                self.queue.release(lease)
                return recorded, "preempted"
            if time.time() >= renew_at:
                try:
                    lease = self.queue.renew(lease, self.lease_s)
                except LeaseLost:
                    for h in running.values():
                        h.cancel()
                    return recorded, "lease lost"
                renew_at = time.time() + self.lease_s / 3
            if running and not done:
                time.sleep(0.005)
        return recorded, "done"


def _result(handle) -> Completion | None:
    """The handle's completion if it has ended (non-blocking; a handle submitted with stream=False)."""
    ev = handle.poll()
    if ev is None:
        return None
    if ev.error is not None:
        raise ev.error
    return ev.completion


def _rollout(c: Completion) -> dict[str, Any]:
    """What a rollout stores: enough to train on it (the log-probs and routed experts it was made with)."""
    arr = np.ascontiguousarray(c.routed_experts, dtype=np.uint8)
    return {
        "output_ids": list(c.output_ids),
        "logprobs": list(c.logprobs),
        "text": c.text,
        "finish_reason": c.finish_reason,
        "version": c.version,
        "experts": {"shape": list(arr.shape), "b64": base64.b64encode(arr.tobytes()).decode()},
    }


class LendingLoop:
    """The gateway's lending: every `interval_s` it feeds the fleet manager (`serving.lending`) the
    fleet's live load, then carries out its decisions. `lend`: the engine leaves live routing
    (`Fleet.lend`) and drains; `lent`: a worker thread runs shards on it until it is reclaimed;
    `reclaim`: the worker's background requests are preempted at the engine's next step and the
    engine serves live traffic again. `engines()` names the replicas' engines of the moment."""

    def __init__(self, fleet, engines, cfg: LendingConfig, queue: JobQueue, interval_s: float = 1.0, prepare=None):
        """`prepare(name, version | None)`: have replica `name` also hold `version` for lent work, or
        nothing extra (`serving.replica.Replica.lend_version`); None: lent work runs only on what the
        replicas hold anyway."""
        self.fleet, self.engines, self.cfg, self.queue = fleet, engines, cfg, queue
        self.prepare = prepare
        self._prepared: dict[str, str | None] = {}
        self.interval_s = interval_s
        self.manager = FleetManager(cfg, sorted(engines()))
        self.decisions: list[tuple[float, Decision]] = []
        self._workers: dict[str, tuple[LendingWorker, threading.Event, threading.Thread]] = {}
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
        for d in sorted(decided, key=lambda d: d.action != "reclaim"):  # reclaims first: live traffic waits
            self.decisions.append((now, d))
            log.info("lending: %s %s (%s)", d.action, d.replica, d.reason)
            try:
                engine = engines[d.replica]
                if d.action == "reclaim":
                    self.fleet.reclaim(engine)  # live routing first, then stop the lent work
                if d.action == "lend":
                    self.fleet.lend(engine)
                elif d.action == "lent":
                    self._start_worker(d.replica, engine)
                else:
                    self._stop_worker(d.replica)
            except Exception:  # one replica's failure never strands the others' decisions
                log.exception("lending: %s %s failed", d.action, d.replica)
        if self.prepare is not None:
            self._prepare(engines)
        return decided

    def _prepare(self, engines: dict) -> None:
        """Each lent replica holds the version of the oldest open job it lacks (if any); the others
        nothing extra."""
        open_versions = self.queue.open_versions() if any(s == "lent" for s in self.manager.states.values()) else []
        for name, state in self.manager.states.items():
            held = set(engines[name].versions) if state == "lent" else set()
            want = next((v for v in open_versions if v not in held), None) if state == "lent" else None
            if want is None and state == "lent" and self._prepared.get(name) in open_versions:
                want = self._prepared.get(name)  # keep what it loaded while that job is open
            if self._prepared.get(name) != want:
                self._prepared[name] = want
                assert self.prepare is not None
                self.prepare(name, want)
                log.info("lending: %s holds %s for lent work", name, want)

    def _start_worker(self, name: str, engine) -> None:
        worker = LendingWorker(engine, self.queue, name, max_concurrency=self.cfg.max_rollout_concurrency)
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

        t = threading.Thread(target=work, name=f"lent-{name}", daemon=True)
        with self._lock:
            self._workers[name] = (worker, stop, t)
        t.start()

    def _stop_worker(self, name: str) -> None:
        with self._lock:
            got = self._workers.pop(name, None)
        if got is None:
            return
        worker, stop, t = got
        stop.set()
        worker.preempt()
        t.join(30)
        with self._lock:
            self._past.update(worker.counters)

    def counters(self) -> dict[str, float]:
        """The manager's lends, reclaims and panics, replica-seconds lent, and the workers' counts."""
        with self._lock:
            work = Counter(self._past)
            for w, _, _ in self._workers.values():
                work.update(dict(w.counters))
        out = {**self.manager.counters, "lent_seconds": self.manager.lent_seconds, **work}
        return out | {"live_on_lent": self.fleet.live_on_lent}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for name in list(self._workers):
            self._stop_worker(name)
