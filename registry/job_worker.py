"""The worker that runs leased job shards (`registry.jobs`) on an engine: a lent replica's (the gateway's
lending loop, `api.lending`) or the gate's own (`gating.lent_eval`).

A job item is one prompt with everything its samples need: `{"prompt_ids": [...], "params": {...},
"seeds": [...]}` (`params`: `serving.sampling.SamplingParams` fields, without the seed; sample `k`
uses `seeds[k]`). The submitter fixes the seeds (the gate: `gating.evals.sample_seed`), so a sample is
the same whichever replica makes it, and a redone sample equals the lost one (batch-invariant kernels).

`run_shard` leases one shard (of the versions the engine holds; of one job, if the worker was made for
one), submits its missing samples as background requests (at most `max_concurrency` at once: the fleet
manager caps lent work, the engine does not), records each finished sample as a rollout (output ids,
log-probs, routed experts, text, finish reason), renews the lease as it goes, and finishes the shard.
A preempted request (a live request needed the slot, or the replica was reclaimed: `preempt`) ends the
shard's run: the lease is released, and whoever takes the shard next does only what is missing. A
version unloaded since the lease is refused the same way, counted, and so is an eval shard whose job
was sampled by the gate in another dtype or with other kernels than this engine serves the version
with (`spec["dtype"]`, `spec["batch_invariant"]`): its samples would not be bit-identical.

`max_concurrency` may be a function, read before every submission, and `keep_at_most` another: a
serving replica's co-serving worker (`serving.lending.FleetManager.co_serve_slots`) starts requests
while it runs fewer than the first, and when more run than the second allows, the newest are cut at
once (counted `cut_for_live`) and go back to the shard's to-do list; with no room at all the shard is
released ("no room") for later or elsewhere. `completion(row)` turns a stored
rollout back into the `serving.requests.Completion` it was.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from registry.jobs import JobQueue, Lease, LeaseLost
from registry.models import LendRollout
from serving.requests import Completion
from serving.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardRun:
    job_id: str
    shard: int
    recorded: int  # rollouts stored by this run (new ones)
    finished: bool  # the shard is done
    why: str  # "done", "preempted", "lease lost", "version not held", "numerics differ", "no room"


class LendingWorker:
    """Runs shards of `queue` on `engine` (anything with `submit(..., background=True)`) as `name`."""

    def __init__(
        self,
        engine,
        queue: JobQueue,
        name: str,
        lease_s: float = 60.0,
        max_concurrency: int | Callable[[], int] = 16,
        kinds=None,
        job_id: str | None = None,
        keep_at_most: Callable[[], int] | None = None,
    ):
        if (not callable(max_concurrency) and max_concurrency < 1) or lease_s <= 0:
            raise ValueError(f"max_concurrency must be >= 1 and lease_s > 0, got {max_concurrency}, {lease_s}")
        self.engine, self.queue, self.name = engine, queue, name
        self.lease_s = lease_s
        self._cap = max_concurrency if callable(max_concurrency) else (lambda: max_concurrency)
        self._keep = keep_at_most or self._cap
        self.kinds = tuple(kinds or ("eval", "rollout"))
        self.job_id = job_id  # only this job's shards (the gate working its own)
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
        if self._stop.is_set() or self._cap() < 1:
            return None
        lease = self.queue.lease(
            self.name, self.lease_s, self.kinds, versions=list(self.engine.versions), job_id=self.job_id
        )
        if lease is None:
            return None
        if lease.version_id not in self.engine.versions:  # unloaded since it was leased
            self.queue.release(lease)
            self.counters["version_not_held"] += 1
            log.warning("lending: %s lacks %s (job %s): shard released", self.name, lease.version_id, lease.job_id)
            return ShardRun(lease.job_id, lease.shard, 0, False, "version not held")
        if lease.kind == "eval" and "dtype" in lease.spec:  # bit-identical to the gate's, or not at all
            ours = {
                "dtype": self.engine.weights_dtype(lease.version_id),
                "batch_invariant": self.engine.batch_invariant,
            }
            theirs = {k: lease.spec.get(k) for k in ours}
            if ours != theirs:
                self.queue.release(lease)
                self.counters["numerics_differ"] += 1
                log.warning("lending: %s serves %s as %s, the gate samples it as %s: eval shard released",
                            self.name, lease.version_id, ours, theirs)  # fmt: skip
                return ShardRun(lease.job_id, lease.shard, 0, False, "numerics differ")
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
        renew_at, at_renew = time.time() + self.lease_s / 3, 0
        while todo or running:
            cap, keep = max(0, int(self._cap())), max(0, int(self._keep()))
            if len(running) > keep:  # co-serving: live requests need the room; the newest go back to do later
                for key in list(running)[keep:]:
                    running.pop(key).cancel()
                    todo.insert(0, key)
                    self.counters["cut_for_live"] += 1
            if not running and cap == 0:  # no room here now: the shard goes back, for later or elsewhere
                self.queue.release(lease)
                return recorded, "no room"
            while todo and len(running) < cap and not self._stop.is_set():
                i, k = todo.pop(0)
                item = lease.items[i]
                fields = dict(item.get("params", {}))
                fields["stop"] = tuple(fields.get("stop", ()))
                params = SamplingParams(**{**fields, "seed": item["seeds"][k]})
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
            if time.time() >= renew_at and recorded > at_renew:  # renewed only with progress: a wedged
                try:  # engine's lease runs out, and another worker (the gate itself) does the shard
                    lease = self.queue.renew(lease, self.lease_s)
                except LeaseLost:
                    for h in running.values():
                        h.cancel()
                    return recorded, "lease lost"
                renew_at, at_renew = time.time() + self.lease_s / 3, recorded
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
    return {
        "output_ids": list(c.output_ids),
        "logprobs": list(c.logprobs),
        "text": c.text,
        "finish_reason": c.finish_reason,
        "version": c.version,
        "experts": experts_field(c.routed_experts),
        "top_logprobs": None
        if c.top_logprobs is None
        else [{str(t): lp for t, lp in d.items()} for d in c.top_logprobs],
    }


def completion(row: LendRollout, prompt_ids: list[int], params: SamplingParams) -> Completion:
    """A stored rollout as the `Completion` its engine returned (timings aside)."""
    r = row.result
    return Completion(
        request_id=f"{row.job_id}-{row.shard}-{row.item}-{row.sample}",
        version=r["version"],
        prompt_ids=list(prompt_ids),
        output_ids=list(r["output_ids"]),
        logprobs=list(r["logprobs"]),
        routed_experts=experts_array(r["experts"]),
        text=r["text"],
        finish_reason=r["finish_reason"],
        params=params,
        top_logprobs=None
        if r["top_logprobs"] is None
        else [{int(t): lp for t, lp in d.items()} for d in r["top_logprobs"]],
    )


def experts_field(routed_experts: np.ndarray) -> dict:
    """A rollout's routed experts as JSON: their shape and base64 bytes (uint8)."""
    arr = np.ascontiguousarray(routed_experts, dtype=np.uint8)
    return {"shape": list(arr.shape), "b64": base64.b64encode(arr.tobytes()).decode()}


def experts_array(field: dict) -> np.ndarray:
    """`experts_field` back to the array."""
    return np.frombuffer(base64.b64decode(field["b64"]), dtype=np.uint8).reshape(field["shape"]).copy()
