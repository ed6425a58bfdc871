"""The gate's eval sampling through the lending job queue, so lent replicas share it.

`QueueEngine(engine, queue)` is the gate's engine with one change: `generate(ids, params, version)`
submits the requests as an `eval` job (`registry.jobs`: one item per request, its seed fixed), works
the job's shards on the gate's own engine (`registry.job_worker.LendingWorker`, this job only), and
waits for the shards lent replicas hold; then it returns the completions in request order, rebuilt
from the stored rollouts (`registry.job_worker.completion`). Every sample is seeded and every engine
that takes eval shards runs the batch-invariant kernels, so the result is bit-identical to the gate's
engine generating it alone; the job records the dtype and kernels the gate samples with, and a worker
whose replica serves the version otherwise gives the shard back (`registry.job_worker`). A shard whose
lent replica died comes back when its lease runs out, and
the gate does it. With nothing lent, the gate does every shard: the same samples, at the same speed.

Everything else (`tokenizer`, `model_args`, `add_version`, `shutdown`, ...) is the wrapped engine's.
Used by `gating.gate_process.run_gate` when `gate.lend_eval` is on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

from registry.job_worker import LendingWorker, completion
from registry.jobs import JobQueue
from serving.requests import Completion

log = logging.getLogger(__name__)


class QueueEngine:
    def __init__(
        self,
        engine: Any,
        queue: JobQueue,
        name: str | None = None,
        shard_size: int = 32,
        lease_s: float = 60.0,
        threads: int = 4,
        timeout_s: float = 3600.0,
    ):
        """`threads` workers on the gate's engine (0: lent replicas do every shard, the gate waits);
        `timeout_s`: a job not done by then fails the evaluation (and is cancelled)."""
        if threads < 0 or shard_size < 1 or timeout_s <= 0:
            raise ValueError(f"threads >= 0, shard_size >= 1, timeout_s > 0: got {threads}, {shard_size}, {timeout_s}")
        self.engine, self.queue = engine, queue
        self.name = name or f"gate-{os.getpid()}"
        self.shard_size, self.lease_s, self.threads, self.timeout_s = shard_size, lease_s, threads, timeout_s
        self.counters = {"jobs": 0, "shards_here": 0, "waits_s": 0.0}
        self._lock = threading.Lock()

    def __getattr__(self, attr: str) -> Any:  # everything but `generate` is the gate's engine
        return getattr(self.engine, attr)

    def generate(self, prompt_ids, params, version: str | None = None) -> list[Completion]:
        ids = list(prompt_ids)
        plist = list(params) if isinstance(params, list | tuple) else [params] * len(ids)
        if any(p.seed is None for p in plist):
            raise ValueError("eval sampling through the job queue needs a seed on every request")
        version = version or self.engine.default_version
        items = []
        for p, sp in zip(ids, plist, strict=True):
            fields = dataclasses.asdict(sp)
            seed = fields.pop("seed")
            items.append({"prompt_ids": p, "params": fields | {"stop": list(sp.stop)}, "seeds": [seed]})
        numerics = {"dtype": self.engine.weights_dtype(version), "batch_invariant": self.engine.batch_invariant}
        job = self.queue.submit("eval", version, items, 1, self.shard_size, {"gate": self.name, **numerics})
        with self._lock:
            self.counters["jobs"] += 1
        t0 = time.monotonic()
        try:
            self._work(job)
        except BaseException:
            self.queue.cancel(job)  # nobody is to work for a gate that gave up
            raise
        with self._lock:
            self.counters["waits_s"] += time.monotonic() - t0
        rows = self.queue.results(job)
        if len(rows) != len(items):
            raise RuntimeError(f"eval job {job}: {len(rows)} rollouts for {len(items)} requests")
        at = {(r.shard, r.item): r for r in rows}
        out = [
            completion(at[(i // self.shard_size, i % self.shard_size)], p, sp)
            for i, (p, sp) in enumerate(zip(ids, plist, strict=True))
        ]
        log.info("gate: %d samples of %s through job %s", len(out), version, job)
        return out

    def _work(self, job: str) -> None:
        """The job's shards on the gate's engine, `threads` at a time (so its batch stays full across
        shard ends), until the job is done; shards lent replicas hold are waited for."""
        errors: list[BaseException] = []
        deadline = time.monotonic() + self.timeout_s

        def loop(i: int) -> None:
            worker = LendingWorker(
                self.engine, self.queue, f"{self.name}-{i}", self.lease_s, 32, kinds=("eval",), job_id=job
            )
            try:
                while self.queue.job(job).status == "open" and not errors and time.monotonic() < deadline:
                    run = worker.run_shard()
                    if run is None:  # every shard left is held elsewhere: wait for it (or its lease)
                        time.sleep(0.2)
                    elif run.finished:
                        with self._lock:
                            self.counters["shards_here"] += 1
            except BaseException as e:
                errors.append(e)

        threads = [
            threading.Thread(target=loop, args=(i,), name=f"gate-shards-{i}", daemon=True) for i in range(self.threads)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        while not threads and self.queue.job(job).status == "open" and time.monotonic() < deadline:
            time.sleep(0.2)  # no worker of its own: lent replicas do it all
        if errors:
            raise errors[0]
        status = self.queue.job(job).status
        if status != "done":
            raise RuntimeError(f"eval job {job} is {status} after {self.timeout_s:.0f} s at most")
