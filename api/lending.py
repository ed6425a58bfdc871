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
Called by the gateway's lending loop and by tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from registry.jobs import JobQueue, Lease, LeaseLost
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
        """The replica is reclaimed: end the run under way at the engine's next step."""
        self._stop.set()
        self.engine.preempt_background()

    def run_shard(self) -> ShardRun | None:
        """Lease a shard and work on it until it is done or preempted; None if no shard is free."""
        self._stop.clear()
        lease = self.queue.lease(self.name, self.lease_s, self.kinds)
        if lease is None:
            return None
        if lease.version_id not in self.engine.versions:
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
        todo = list(lease.todo)
        running: dict[tuple[int, int], Any] = {}
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
    return {
        "output_ids": list(c.output_ids),
        "logprobs": list(c.logprobs),
        "text": c.text,
        "finish_reason": c.finish_reason,
        "version": c.version,
    }
