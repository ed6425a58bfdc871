"""Lending on this machine: two real replicas, real traffic, a real job queue.

`python -m bench.lending_real [--seconds-per-phase 30]`. Two embedded engines serve the shipped demo
base behind one `serving.fleet.Fleet`, driven by the gateway's lending loop (`api.lending.LendingLoop`,
stepped once a second here so each decision can be timed) with a rollout job of `--items` x 4 samples
in a SQLite job queue. Live traffic is closed-loop clients of completions (up to 32 tokens) through the
fleet, in phases: quiet (1 client), spike (`--spike` clients), quiet, spike, quiet. The same traffic
runs twice: lending off, then on.

Figures (lending on; latency also off):
- **reclaim**: from the start of the loop step that decides a reclaim to the first token of a live
  request sent straight to the reclaimed replica the moment it is back in live routing (as a user
  arriving then would be; p50 and p99 over the run's reclaims), and that request's wait in the engine
  before a step took it (`queued_s`: the lent work's preemption), against the engine's step time;
- failed live requests; live p50 and p99 latency, on and off;
- replica-seconds lent and the rollouts recorded, and at the end (the quiet tail finishes the job):
  rollouts counted once each, none lost (the job's rollouts equal what it wanted);
- use: replica-seconds lent over the replica-seconds the policy could have lent.

On 2 shared cores lent work slows live work (the engines share the cores), so the fleet-scale
floors are judged by `bench/lending.py`, not here.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench import common

NAME = "lending_real"
PROMPTS = ["# add 3 to x\ndef f(x):\n", "# count 'a' in s\ndef f(s):\n", "# reverse s\ndef f(s):\n", "def"]


class Traffic:
    """Closed-loop live clients through the fleet; how many run is set per phase."""

    def __init__(self, fleet, tok, clients: int):
        self.fleet, self.tok = fleet, tok
        self.active = 0
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        from serving.sampling import SamplingParams

        k = 0
        while not self.stop.is_set():
            if i >= self.active:
                time.sleep(0.05)
                continue
            k += 1
            ids = self.tok.encode_prompt(PROMPTS[(i + k) % len(PROMPTS)])
            t = time.monotonic()
            try:
                c = self.fleet.submit(
                    ids, SamplingParams(max_tokens=32, temperature=1.0, seed=i * 100_000 + k)
                ).result()
                if c.finish_reason not in ("stop", "length"):
                    self.failures.append(c.finish_reason)
                else:
                    self.latencies.append(time.monotonic() - t)
            except Exception as e:  # a failed live request is a figure, not a crash
                self.failures.append(f"{type(e).__name__}: {e}")

    def start(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def probe_first_token(engine, tok) -> tuple[float, float]:
    """A live request sent now straight to `engine`: when (`time.monotonic()`) its first token came, and
    how long it waited in the engine before a step took it (`queued_s`)."""
    from serving.sampling import SamplingParams

    h = engine.submit(tok.encode_prompt("def"), SamplingParams(max_tokens=2, temperature=1.0, seed=1), stream=True)
    got, queued = None, 0.0
    for ev in h:
        if got is None and (ev.token_ids or ev.completion is not None):
            got = time.monotonic()
        if ev.completion is not None:
            queued = ev.completion.queued_s
    return (got if got is not None else time.monotonic()), queued


class ReclaimProbe:
    """Waits for a lent replica to come back into live routing, then at once sends it a live request
    (`probe_first_token`), as a user arriving right then would: the reclaim as live traffic sees it."""

    def __init__(self, fleet, engine, tok):
        self.fleet, self.engine, self.tok = fleet, engine, tok
        self.back: float | None = None
        self.first: float | None = None
        self.queued_s = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.fleet.serves_live(self.engine):
                self.back = time.monotonic()
                self.first, self.queued_s = probe_first_token(self.engine, self.tok)
                return
            time.sleep(0.0005)

    def result(self) -> tuple[float | None, float | None, float]:
        self._t.join(60)
        return self.back, self.first, self.queued_s

    def cancel(self) -> None:
        self._stop.set()
        self._t.join(60)


def run(lending: bool, a: Any, model: Path, work: Path) -> dict[str, Any]:
    from api.lending import LendingLoop
    from registry.jobs import JobQueue
    from serving.engine import EmbeddedEngine
    from serving.fleet import Fleet
    from serving.lending import LendingConfig
    from serving.sampling import SamplingParams

    engines = {f"r{i}": EmbeddedEngine(max_batch=16, max_model_len=256, seed=i) for i in range(2)}
    for e in engines.values():
        e.add_version("base", model, default=True)
    fleet = Fleet(list(engines.values()))
    tok = engines["r0"].tokenizer()
    for e in engines.values():  # warm, so neither run pays the first requests' costs
        e.generate([tok.encode_prompt(p) for p in PROMPTS] * 4, [SamplingParams(max_tokens=16, seed=0)] * 16)
    q = JobQueue(f"sqlite:///{work / ('on' if lending else 'off')}.db")
    items = [
        {
            "prompt_ids": tok.encode_prompt(PROMPTS[i % len(PROMPTS)]),
            "params": {"temperature": 1.0, "max_tokens": 32},
            "seeds": [1000 * i + g for g in range(4)],
        }
        for i in range(a.items)
    ]
    job = q.submit("rollout", "base", items, samples_per_item=4, shard_size=4) if lending else None
    cfg = LendingConfig(
        enabled=True,
        target_concurrency=a.target,
        lend_after_s=a.lend_after_s,
        reclaim_after_s=1.0,
        max_rollout_concurrency=8,
    )
    loop = LendingLoop(fleet, lambda: engines, cfg, q) if lending else None
    traffic = Traffic(fleet, tok, a.spike).start()
    phases = [("quiet", 1), ("spike", a.spike), ("quiet", 1), ("spike", a.spike), ("quiet", 1)]
    reclaims: list[dict[str, Any]] = []
    timeline: list[dict[str, Any]] = []
    t0 = time.monotonic()
    try:
        for name, clients in phases:
            traffic.active = clients
            end = time.monotonic() + a.seconds_per_phase
            while time.monotonic() < end:
                now = time.monotonic() - t0
                if loop is not None:
                    away = [r for r, st in loop.manager.states.items() if st != "serving"]
                    probes = {r: ReclaimProbe(fleet, engines[r], tok) for r in away}
                    before = time.monotonic()  # the decision is taken inside the step: timed from its start
                    decided = loop.step(now)
                    for d in decided:
                        if d.action == "reclaim" and d.replica in probes:
                            back, first, queued = probes.pop(d.replica).result()
                            reclaims.append({"t": now, "replica": d.replica, "why": d.reason,
                                             "routed_again_s": None if back is None else back - before,
                                             "first_token_s": None if first is None else first - before,
                                             "engine_wait_s": queued})  # fmt: skip
                    for probe in probes.values():
                        probe.cancel()
                    states = dict(loop.manager.states)
                else:
                    states = dict.fromkeys(engines, "serving")
                timeline.append({"t": round(now, 1), "phase": name, "clients": clients, "states": states})
                time.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - now)))
        traffic.close()
        if loop is not None and job is not None:  # the quiet tail: let the job finish where it is lent
            deadline = time.monotonic() + a.finish_s
            while q.job(job).status != "done" and time.monotonic() < deadline:
                loop.step(time.monotonic() - t0)
                time.sleep(1.0)
    finally:
        traffic.close()
        counters = loop.counters() if loop is not None else {}
        if loop is not None:
            loop.close()
        for e in engines.values():
            e.shutdown()
    lat = traffic.latencies
    out: dict[str, Any] = {
        "lending": lending,
        "live_requests": len(lat) + len(traffic.failures),
        "failed_live": len(traffic.failures),
        "failures": traffic.failures[:10],
        "p50_latency_s": common.pct(lat, 50),
        "p99_latency_s": common.pct(lat, 99),
        "timeline": timeline,
    }
    if lending and job is not None:
        progress = q.progress(job)
        rows = q.results(job)
        keys = {(r.shard, r.item, r.sample) for r in rows}
        lendable = sum(1 for x in timeline if x["clients"] == 1) * 1.0  # quiet seconds: one replica could go
        out |= {
            "counters": counters,
            "reclaims": reclaims,
            "reclaim_first_token_p50_s": _pct(reclaims, "first_token_s", 50),
            "reclaim_first_token_p99_s": _pct(reclaims, "first_token_s", 99),
            "reclaim_engine_wait_p50_s": _pct(reclaims, "engine_wait_s", 50),
            "reclaim_engine_wait_p99_s": _pct(reclaims, "engine_wait_s", 99),
            "job": progress | {"status": q.job(job).status},
            "rollouts_counted_twice": len(rows) - len(keys),
            "rollouts_lost": progress["wanted"] - len(keys) if q.job(job).status == "done" else None,
            "lent_replica_s": counters.get("lent_seconds", 0.0),
            "lendable_replica_s": lendable,
        }
    q.close()
    return out


def _pct(rows: list[dict[str, Any]], key: str, q: float) -> float | None:
    xs = [r[key] for r in rows if r.get(key) is not None]
    return common.pct(xs, q) if xs else None


def step_time_s(model: Path, batch: int) -> float:
    """The engine's decode step at `batch` live sequences, timed here (the reclaim's yardstick)."""
    from serving.engine import EmbeddedEngine
    from serving.sampling import SamplingParams

    e = EmbeddedEngine(max_batch=16, max_model_len=256)
    try:
        e.add_version("base", model, default=True)
        ids = [e.tokenizer().encode_prompt("def")] * batch
        params = SamplingParams(max_tokens=33, ignore_eos=True, temperature=1.0, seed=0)
        e.generate(ids, [params] * batch)  # warm
        t = time.monotonic()
        e.generate(ids, [params] * batch)
        return (time.monotonic() - t) / 33
    finally:
        e.shutdown()


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--seconds-per-phase", type=float, default=30.0)
    ap.add_argument("--spike", type=int, default=12, help="live clients in a spike")
    ap.add_argument("--target", type=float, default=4.0, help="the policy's target concurrency per replica")
    ap.add_argument("--lend-after-s", type=float, default=10.0)
    ap.add_argument("--items", type=int, default=64, help="rollout job items (4 samples each)")
    ap.add_argument("--finish-s", type=float, default=120.0, help="quiet tail allowed for the job to finish")
    a = ap.parse_args()
    st = common.stamp()
    model = common.ROOT / "models" / "demo-base"
    with tempfile.TemporaryDirectory(prefix="flywheel-lend-") as tmp:
        off = run(False, a, model, Path(tmp))
        on = run(True, a, model, Path(tmp))
    steps = {b: step_time_s(model, b) for b in (1, a.spike)}
    result = {
        "template": NAME,
        "params": vars(a) | {"out": str(a.out)},
        "off": off,
        "on": on,
        "step_s": steps,
        "p99_on_over_off": (on["p99_latency_s"] or 0) / (off["p99_latency_s"] or 1),
    }
    common.save(NAME, result, st, a.out)
    print({k: on.get(k) for k in ("failed_live", "reclaim_first_token_p50_s", "reclaim_first_token_p99_s", "job")})
    print({"step_s": steps, "p99_on_over_off": result["p99_on_over_off"]}, statistics.fmean(steps.values()))


if __name__ == "__main__":
    main()
