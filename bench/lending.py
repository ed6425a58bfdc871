"""Lending at fleet scale: the lending policy (`serving.lending.FleetManager`, the class the gateway
runs) driving simulated replicas through a simulated day, lending on against lending off on the same
traffic.

The simulation (request level, exact event times):
- **Replicas** batch continuously: every running sequence gains one token per engine step, and a step
  with b sequences takes `step_s(b) = a + c·b`. The default a and c are this machine's engine
  process, fitted to `bench/results/serving.json` (batches 1 and 64) and scaled by `--step-scale`
  (default 30: a large model on a GPU replica, slower per step than the demo's tiny one on a CPU, with
  `--target` 8 live requests per replica: about 8 s per request); the result records both. A replica
  runs at most `max_batch` sequences; live requests beyond that wait, first come first served.
- **Traffic**: a diurnal rate (trough `--trough` of the peak, peak in the afternoon) with
  Gamma-distributed inter-arrival times (shape 0.5: burstier than Poisson); each live request
  generates a Gamma-distributed number of tokens (mean 48). The peak is sized to `--peak-load` of the
  fleet's capacity at the policy's target concurrency.
- **Routing**: round robin over serving replicas; a lent or draining replica takes no live request.
- **Lent work**: a lent replica runs rollouts (128 tokens each) up to `max_rollout_concurrency` at
  once, from an endless queue. On a reclaim its rollouts are preempted at the next step boundary (the
  reclaim time is that step's remainder) and go back to the queue to be redone: counted once when they
  finish, never when they are cut.
- **Co-serving** (`co_serve`, the third run): a serving replica also runs rollouts in the slots its
  live requests leave free, as `FleetManager.co_serve_slots` says: started up to `co_serve_fill` of
  the target concurrency in all, and when live and lent pass the whole target, the newest rollouts are
  cut and queued again, as the gateway's co-serving worker does (`registry.job_worker`). While one of
  its live requests has run `co_serve_yield_s`, the replica cuts all of its rollouts and starts none.
- **The policy** sees the live concurrency, each replica's live requests in flight and the times to
  first token every second, as in the gateway.

Figures: the share of idle replica-time put to use (rollout replica-seconds, each replica counting
min(1, rollouts running / target) of itself, over the fleet's idle capacity, Σ (N − live concurrency /
target), in the same unit: a replica's worth is target-concurrency sequences; "useful" counts only the
share of rollouts that finished, not of those cut and redone), live p50/p99 latency on vs off, reclaim time p50
and p99 (the engine's part: from the decision to the end of the step under way, the last step a
rollout takes; the gateway adds its 1 s look and a thread hop), failed live requests (none may wait over
`--timeout-s`), and rollouts lost or counted twice.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from serving.lending import FleetManager, LendingConfig

NAME = "lending"
DAY_S = 24 * 3600.0
ROLLOUT_TOKENS = 128


@dataclass
class Seq:
    sid: int  # this run of it (a preempted rollout is run again under a new one)
    live: bool
    tokens: int
    arrived: float
    rollout: int = -1  # the rollout it computes (counted once, when a run of it ends)
    v_end: float = 0.0  # the replica's token clock at which it ends
    first_token: float | None = None
    credit: float = 0.0  # replica-seconds of its replica's rollout use that are its share


@dataclass
class Replica:
    name: str
    max_batch: int
    a: float
    c: float
    v: float = 0.0  # token clock: tokens each running sequence has gained
    t: float = 0.0  # when `v` was last brought up to date
    running: dict[int, Seq] = field(default_factory=dict)
    heap: list[tuple[float, int]] = field(default_factory=list)
    waiting: list[Seq] = field(default_factory=list)
    busy_rollout_s: float = 0.0  # seconds with any rollout running
    target: float = 8.0
    slot_rollout_s: float = 0.0  # ∫ min(1, rollouts running / target) dt: the replica's share they use

    def step_s(self) -> float:
        return self.a + self.c * max(1, len(self.running))

    def advance(self, now: float) -> None:
        if self.running:
            dt = now - self.t
            rollouts = [s for s in self.running.values() if not s.live]
            if rollouts:
                self.busy_rollout_s += dt
                share = dt * min(1.0, len(rollouts) / self.target)
                self.slot_rollout_s += share
                for s in rollouts:
                    s.credit += share / len(rollouts)
            self.v += dt / self.step_s()
        self.t = now

    def next_end(self) -> float:
        while self.heap and self.heap[0][1] not in self.running:
            heapq.heappop(self.heap)
        if not self.heap:
            return math.inf
        return self.t + (self.heap[0][0] - self.v) * self.step_s()

    def start(self, s: Seq, now: float) -> None:
        s.v_end = self.v + s.tokens
        if s.live:
            s.first_token = now + self.step_s()  # the prefill step
        self.running[s.sid] = s
        heapq.heappush(self.heap, (s.v_end, s.sid))

    def live_count(self) -> int:
        return sum(1 for s in self.running.values() if s.live) + len(self.waiting)

    def oldest_live_s(self, now: float) -> float:
        arrived = [s.arrived for s in self.running.values() if s.live] + [s.arrived for s in self.waiting]
        return now - min(arrived) if arrived else 0.0

    def rollouts(self) -> list[Seq]:
        return [s for s in self.running.values() if not s.live]


def simulate(cfg: LendingConfig, lending: bool, p: dict[str, Any], seed: int) -> dict[str, Any]:
    day_s = p.get("day_s", DAY_S)
    rng = np.random.default_rng(seed)  # the traffic: the same, lending on or off
    rng_reclaim = np.random.default_rng(seed + 1)
    n = p["replicas"]
    reps = [Replica(f"r{i:02d}", p["max_batch"], p["a"], p["c"], target=cfg.target_concurrency) for i in range(n)]
    by_name = {r.name: r for r in reps}
    manager = FleetManager(cfg, [r.name for r in reps]) if lending else None
    state = dict.fromkeys(by_name, "serving")
    target = cfg.target_concurrency
    mean_latency = p["tokens_mean"] * (p["a"] + p["c"] * target)
    peak_rate = p["peak_load"] * n * target / mean_latency  # Little's law at the target concurrency

    def rate(t: float) -> float:
        phase = 0.5 * (1 - math.cos(2 * math.pi * ((t / day_s) - 0.125)))  # low at 03:00, high at 15:00
        return peak_rate * (p["trough"] + (1 - p["trough"]) * phase)

    shape = 0.5
    ids = itertools.count()
    issued: list[int] = [0]  # rollouts handed out
    turn = itertools.count()
    lat: list[float] = []
    ttfts_tick: list[float] = []
    failed = 0
    rollouts_done: set[int] = set()
    rollouts_twice = 0
    rollout_queue: list[int] = []  # ids cut short, redone first
    cut_for_live = [0]  # co-served rollouts cut because a live request needed the room
    useful, wasted = [0.0], [0.0]  # replica-seconds of rollouts that finished / that were cut
    reclaim_times: list[float] = []
    idle_capacity = 0.0
    next_arrival = rng.gamma(shape, 1 / (shape * rate(0.0)))
    next_tick = 1.0
    t = 0.0
    live_now = 0
    sample_s = p.get("sample_s", 300.0)
    timeline: dict[str, list[float]] = {"hour": [], "live": [], "lent": [], "used": []}  # every `sample_s`

    def fill_rollouts(r: Replica, now: float) -> None:
        while (
            sum(1 for s in r.running.values() if not s.live) < cfg.max_rollout_concurrency
            and len(r.running) < r.max_batch
        ):
            if rollout_queue:
                rollout = rollout_queue.pop(0)
            else:
                rollout, issued[0] = issued[0], issued[0] + 1
            r.start(Seq(next(ids), False, ROLLOUT_TOKENS, now, rollout), now)

    def co_serve(r: Replica, now: float) -> None:
        """A serving replica's rollouts to its co-serving slots: cut the newest beyond them, start more
        up to them (a no-op with `co_serve` off or lending off)."""
        if manager is None or state[r.name] != "serving":
            return
        start, keep = manager.co_serve_slots(r.name, r.live_count(), r.oldest_live_s(now))
        ours = sorted(r.rollouts(), key=lambda s: s.sid)
        for s in ours[keep:]:  # the newest first
            del r.running[s.sid]
            rollout_queue.insert(0, s.rollout)
            cut_for_live[0] += 1
            wasted[0] += s.credit
        ours = ours[:keep]
        while len(ours) < start and len(r.running) < r.max_batch:
            if rollout_queue:
                rollout = rollout_queue.pop(0)
            else:
                rollout, issued[0] = issued[0], issued[0] + 1
            s = Seq(next(ids), False, ROLLOUT_TOKENS, now, rollout)
            r.start(s, now)
            ours.append(s)

    def admit(r: Replica, now: float) -> None:
        while r.waiting and len(r.running) < r.max_batch:
            r.start(r.waiting.pop(0), now)

    arrivals = 0
    nxt = [r.next_end() for r in reps]  # each replica's next completion, kept up to date as it changes
    index = {r.name: i for i, r in enumerate(reps)}

    def touch(r: Replica) -> None:
        nxt[index[r.name]] = r.next_end()

    while t < day_s:
        i_end = min(range(n), key=nxt.__getitem__)
        t_end, r_end = nxt[i_end], reps[i_end]
        t_next = min(next_arrival, next_tick, t_end)
        if t_next > day_s:
            break
        idle_capacity += (t_next - t) * max(0.0, n - live_now / target)
        t = t_next
        if t == t_end:
            r = r_end
            r.advance(t)
            _, sid = heapq.heappop(r.heap)
            s = r.running.pop(sid)
            if s.live:
                live_now -= 1
                total = t - s.arrived
                if total > p["timeout_s"]:
                    failed += 1
                lat.append(total)
                ttfts_tick.append((s.first_token or t) - s.arrived)
            else:
                rollouts_twice += s.rollout in rollouts_done
                rollouts_done.add(s.rollout)
                useful[0] += s.credit
            admit(r, t)
            if state[r.name] == "lent":
                fill_rollouts(r, t)
            else:
                co_serve(r, t)
            touch(r)
        elif t == next_arrival:
            serving = [r for r in reps if state[r.name] == "serving"] or reps  # live traffic always wins
            r = serving[next(turn) % len(serving)]
            r.advance(t)
            s = Seq(next(ids), True, max(1, int(rng.gamma(2.0, p["tokens_mean"] / 2.0))), t)
            live_now += 1
            arrivals += 1
            r.waiting.append(s)  # counted live while its co-serving room is made
            co_serve(r, t)
            r.waiting.pop()
            if len(r.running) < r.max_batch:
                r.start(s, t)
            else:
                r.waiting.append(s)
            touch(r)
            next_arrival = t + rng.gamma(shape, 1 / (shape * rate(t)))
        else:
            next_tick += 1.0
            if t >= len(timeline["hour"]) * sample_s:
                timeline["hour"].append(round(t / 3600, 4))
                timeline["live"].append(live_now)
                timeline["lent"].append(sum(st != "serving" for st in state.values()))
                timeline["used"].append(round(sum(min(1.0, len(r.rollouts()) / target) for r in reps), 3))
            if manager is None:
                continue
            in_flight = {r.name: r.live_count() for r in reps}
            manager.observe(t, live_now, in_flight, ttfts_tick)
            ttfts_tick = []
            for d in manager.decide(t):
                r = by_name[d.replica]
                r.advance(t)
                state[d.replica] = manager.states[d.replica]
                if d.action == "lent":
                    fill_rollouts(r, t)
                elif d.action == "reclaim":
                    cut = [s for s in r.running.values() if not s.live]
                    if cut:  # preempted at the next step boundary: the step under way ends first
                        reclaim_times.append(r.step_s() * float(rng_reclaim.uniform()))
                    else:
                        reclaim_times.append(0.0)
                    for s in cut:
                        wasted[0] += s.credit
                        del r.running[s.sid]
                        rollout_queue.append(s.rollout)  # redone from the start, counted when it finishes
                    admit(r, t)
                touch(r)
            for r in reps:  # co-serving follows the load every second
                if state[r.name] == "serving":
                    r.advance(t)
                    co_serve(r, t)
                    touch(r)
    idle_capacity += (day_s - t) * max(0.0, n - live_now / target)
    for r in reps:
        r.advance(day_s)
    lent_s = manager.lent_seconds if manager else 0.0
    busy = sum(r.busy_rollout_s for r in reps)
    used = sum(r.slot_rollout_s for r in reps)
    running = {s.rollout for r in reps for s in r.running.values() if not s.live}
    lost = set(range(issued[0])) - rollouts_done - set(rollout_queue) - running
    lat_a = np.array(lat)
    return {
        "lending": lending,
        "arrivals": arrivals,
        "live_requests": len(lat),
        "failed_live": failed,
        "p50_latency_s": float(np.percentile(lat_a, 50)),
        "p99_latency_s": float(np.percentile(lat_a, 99)),
        "max_latency_s": float(lat_a.max()),
        "idle_capacity_replica_s": idle_capacity,
        "lent_replica_s": lent_s,
        "co_serve": cfg.co_serve,
        "rollout_busy_replica_s": busy,
        "rollout_used_replica_s": used,
        "idle_use": used / idle_capacity if idle_capacity else None,
        "rollout_useful_replica_s": useful[0],
        "rollout_wasted_replica_s": wasted[0],
        "useful_idle_use": useful[0] / idle_capacity if idle_capacity else None,
        "rollouts_cut_for_live": cut_for_live[0],
        "rollouts_done": len(rollouts_done),
        "rollouts_counted_twice": rollouts_twice,
        "rollouts_lost": len(lost),
        "rollouts_in_flight_at_end": len(running) + len(rollout_queue),
        "reclaims": len(reclaim_times),
        "reclaim_p50_s": float(np.percentile(reclaim_times, 50)) if reclaim_times else None,
        "reclaim_p99_s": float(np.percentile(reclaim_times, 99)) if reclaim_times else None,
        "step_s_at_target": p["a"] + p["c"] * target,
        "counters": dict(manager.counters) if manager else {},
        "peak_rate_per_s": peak_rate,
        "timeline": timeline,
    }


def plot(result: dict[str, Any], path: Any) -> None:
    """Live requests in flight and replicas lent (or draining) over the simulated day, lending on; with
    a co-serving run, the replicas' worth of rollouts it ran (Σ min(1, rollouts / target))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["on"]["timeline"]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.plot(tl["hour"], tl["live"], color="#4063d8", lw=1.2, label="live requests in flight")
    ax.set_xlabel("hour of the simulated day")
    ax.set_ylabel("live requests in flight")
    ax2 = ax.twinx()
    ax2.step(tl["hour"], tl["lent"], where="post", color="#cb3c33", lw=1.2, label="replicas lent or draining")
    if "co_serve" in result:
        co = result["co_serve"]["timeline"]
        ax2.plot(co["hour"], co["used"], color="#389826", lw=1.0, label="replicas' worth of rollouts, co-serving")
    ax2.set_ylabel("replicas lent or draining")
    ax2.set_ylim(0, result["params"]["replicas"])
    lines = ax.get_lines() + ax2.get_lines()
    ax.legend(lines, [str(x.get_label()) for x in lines], loc="upper left", fontsize=8)
    ax.set_title(f"{result['params']['replicas']} replicas through a simulated day (bench/lending.py)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def engine_step_fit() -> tuple[float, float, str]:
    """(a, c) of step_s(b) = a + c·b from the engine process's rows of bench/results/serving.json."""
    from bench import common

    rows = {r["batch"]: r for r in common.load_result("serving")["rows"] if r["backend"] == "embedded (process)"}
    s1, s64 = 1 / rows[1]["tokens_per_s"], 64 / rows[64]["tokens_per_s"]
    c = (s64 - s1) / 63
    return s1 - c, c, "bench/results/serving.json: embedded (process), batches 1 and 64"


def main() -> None:
    from bench import common

    ap = common.parser(__doc__)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-scale", type=float, default=30.0, help="GPU replica step over this machine's")
    ap.add_argument("--target", type=float, default=8.0, help="the policy's target concurrency per replica")
    ap.add_argument("--peak-load", type=float, default=0.7, help="peak traffic over capacity at target concurrency")
    ap.add_argument("--trough", type=float, default=0.15, help="the night's rate over the peak's")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--headroom", type=float, default=None, help="the policy's headroom (default: [lending]'s)")
    ap.add_argument("--co-serve-fill", type=float, default=None, help="co_serve_fill (default: [lending]'s)")
    ap.add_argument(
        "--co-serve-yield-s", type=float, default=None, help="co_serve_yield_s (default: [lending]'s; 0: never)"
    )
    ap.add_argument("--name", default=NAME, help="result name (bench/results/<name>.json)")
    a = ap.parse_args()
    st = common.stamp()
    a0, c0, source = engine_step_fit()
    p = {
        "replicas": a.replicas,
        "max_batch": 64,
        "a": a0 * a.step_scale,
        "c": c0 * a.step_scale,
        "tokens_mean": 48,
        "peak_load": a.peak_load,
        "trough": a.trough,
        "timeout_s": a.timeout_s,
    }
    cfg = LendingConfig(enabled=True, target_concurrency=a.target, max_rollout_concurrency=32)
    if a.headroom is not None:
        cfg = cfg.model_copy(update={"headroom": a.headroom})
    if a.co_serve_fill is not None:
        cfg = cfg.model_copy(update={"co_serve_fill": a.co_serve_fill})
    if a.co_serve_yield_s is not None:
        cfg = cfg.model_copy(update={"co_serve_yield_s": a.co_serve_yield_s or None})
    off = simulate(cfg, False, p, a.seed)
    on = simulate(cfg, True, p, a.seed)
    co = simulate(cfg.model_copy(update={"co_serve": True}), True, p, a.seed)
    result = {
        "template": NAME,
        "params": p,
        "step_fit": {"a": a0, "c": c0, "source": source, "scale": a.step_scale},
        "policy": cfg.model_dump(),
        "seed": a.seed,
        "off": off,
        "on": on,
        "co_serve": co,
        "p99_on_over_off": on["p99_latency_s"] / off["p99_latency_s"],
        "p99_co_serve_over_off": co["p99_latency_s"] / off["p99_latency_s"],
    }
    common.save(a.name, result, st, a.out)
    plot(result, Path(a.out) / f"{a.name}.png")


if __name__ == "__main__":
    main()
