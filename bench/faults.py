"""The fault harness: the whole loop on Kafka and PostgreSQL under simulated users, with its parts
SIGKILLed and started again on a seeded schedule; then the books.

`python -m bench.faults [--seed 0] [--minutes 12]`. The stack is `demo.stack.start(separate=True,
durable_broker=True)`: a tansu broker whose records live in an S3 bucket (`core.objstore`, so the
broker can die and come back with its topics, offsets and groups, as a Kafka broker's log on disk
would), a PostgreSQL database made for the run, two gateways (`flywheel serve`, `replicas` engines
each, lending on), and the joiner, the learner and the gate, each a process, as a process manager
would run them. This process plays the demo's users (`demo.traffic.drive_users`: completions,
`shown`, sparse implicit and explicit feedback through the SDK, the users spread over both gateways)
and approves what awaits approval, as the demo does.

**The kills** (each a SIGKILL: nothing flushed, connections dropped), one at a time, in an order and
with pauses drawn from the seed:
- `broker`: tansu, down for a few seconds, then started again on the same port and bucket;
- `learner`;
- `gate_offline`: the gate while a candidate is in offline evaluation;
- `gate_canary`: the gate while a candidate is in canary, kept down past its lease, so the canary's
  share must lapse on every gateway;
- `replica`: one engine process of gateway-1 (the gateway starts a new one);
- `gateway`: gateway-2, the whole process;
- `lent_replica`: an engine process of a replica while it is lent (its shard goes back to the queue).
Each process killed is started again with the same command (the replica by its gateway). A process
that dies unasked is a failure (and is restarted, so the run goes on).

**The books**, once the traffic has ended and the joiner has had its window:
1. *Exactly once*: every feedback event the gateways accepted (each idempotency key the SDK sent and
   did not give up on, as the event id `feedback.events.event_id_for` names) is a signal in exactly
   one sample on the samples topic (re-emitted samples, which keep their id, count once), and no
   sample holds it twice.
2. *Gated versions only*: every completion was served by the base or a version promoted by then,
   or by a version in canary then whose arm (`gating.stats.assign_arm`) the user fell in at the share
   the registry held in the seconds before; and no user was served the candidate while the gate was
   down past its lease.
3. *One hash*: the promoted version's artifact hash in the registry, the hash of the file in the
   weight store, and what every replica reports holding agree.
4. *The lapse*: both gateways counted a canary lapse while the gate was down
   (`flywheel_canary_lapses`).
Results: bench/results/faults.{json,md}; `tests/test_faults.py` runs a short variant (the broker,
the learner, the gate, a replica and a gateway, no canary) in the suite.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import signal
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import common
from bench.fault_books import exactly_once_book
from core.harness import http_ok

log = logging.getLogger(__name__)
NAME = "faults"
KILLS = ("broker", "learner", "gate_offline", "gate_canary", "replica", "gateway", "lent_replica")
TIMED = ("broker", "learner", "gate", "replica", "gateway")  # kills at a drawn time; the rest wait for a state
TARGET = {"broker": "tansu", "learner": "learner", "gate": "gate", "gate_offline": "gate", "gate_canary": "gate",
          "replica": "gateway-1 engine", "gateway": "gateway-2", "lent_replica": "lent engine"}  # fmt: skip
ENGINE_LINE = re.compile(r"replica (\S+): engine process pid (\d+)")
SLACK_S = 2.0  # clocks: a served record's time is when its response arrived; the registry's, when it changed


@dataclass
class Kill:
    kind: str
    target: str
    at: float  # wall time of the SIGKILL
    down_s: float  # how long it was left down before the restart (the replica: restarted by its gateway)
    back_at: float | None = None  # wall time it answered again (healthy, beating, or its engine reported)
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    kills: tuple[str, ...] = KILLS
    seed: int = 0
    first_after_s: float = 20.0  # the first timed kill, after the traffic starts
    gap_s: tuple[float, float] = (10.0, 25.0)  # between a recovery and the next timed kill
    down_s: tuple[float, float] = (2.0, 6.0)
    state_wait_s: float | None = None  # how long a state-triggered kill waits for its state; None: while traffic runs


class Harness:
    """Kills and restarts on `plan`, watching the registry; `books()` checks the run."""

    def __init__(self, stack: Any, plan: Plan, home: Path):
        from registry.registry import Registry

        self.stack, self.plan, self.home = stack, plan, home
        self.rng = random.Random(f"faults:{plan.seed}")
        self.registry = Registry(stack.db_url)
        self.kills: list[Kill] = []
        self.unasked: list[dict[str, Any]] = []  # processes that died without being killed
        self.down: set[str] = set()
        self.canary_log: list[tuple[float, str, float]] = []  # (wall time, version in canary, share)
        self.lapse_reads: list[dict[str, Any]] = []  # the gateways' lapse counts, read while the gate was down
        self.gate_down: list[tuple[float, float | None, float]] = []  # (killed at, back at, lease_s)
        self.skipped: list[str] = []
        self.busy: set[str] = set()  # targets with a kill in flight
        self.stop = threading.Event()  # no more kills
        self._closing = threading.Event()  # the watcher too
        self._threads: list[threading.Thread] = []
        self._kill_threads: list[threading.Thread] = []
        self._starter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="faults-starter")  # lives for the run

    # ---- running ---------------------------------------------------------------------------------

    def start(self) -> Harness:
        for target in (self._watch, self._schedule):
            t = threading.Thread(target=target, name=f"faults-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def close(self) -> None:
        self.stop.set()
        self._closing.set()
        for t in self._threads:
            t.join(timeout=120)
        self.registry.close()
        self._starter.shutdown()  # after the books: the processes it started die with its thread

    def _watch(self) -> None:
        """Every 0.5 s: the canary's version and share as the registry holds them, and any process that
        died unasked (recorded, then started again so the run goes on), until `close` (the books too)."""
        while not self._closing.wait(0.5):
            try:
                v = self.registry.in_flight()
                if v is not None and v.status == "canary":
                    share = float((v.gate.get("canary") or {}).get("share", 0.0))
                    self.canary_log.append((time.time(), v.id, share))
            except Exception as e:  # the database is not killed here; a hiccup is logged, not fatal
                log.warning("faults: reading the registry: %r", e)
            for name, child in list(self.stack.supervisor.children.items()):
                if name in self.down or child.alive() or name.endswith("-s3"):
                    continue
                self.unasked.append({"name": name, "code": child.returncode, "at": time.time(), "log": child.tail()})
                log.error("faults: %s died unasked (code %s); starting it again", name, child.returncode)
                self._start(name)

    def _start(self, name: str) -> None:
        """Start `name` again, on the one starter thread: a child's parent-death signal fires when the
        *thread* that started it ends (Linux), so a kill's short-lived thread must not start it."""

        def start() -> None:
            if name == "tansu":
                assert self.stack.broker is not None
                self.stack.broker.start()
            else:
                self.stack.start_child(name)

        self._starter.submit(start).result()

    def _schedule(self) -> None:
        """Timed kills at drawn times, state-triggered ones when their state comes; a kill's restart runs
        on a thread of its own, so kills overlap (one at a time per target)."""
        plan = self.plan
        timed = [k for k in plan.kills if k in TIMED]
        self.rng.shuffle(timed)
        waiting = [k for k in plan.kills if k not in timed]
        next_at = time.monotonic() + plan.first_after_s
        deadline = time.monotonic() + (float("inf") if plan.state_wait_s is None else plan.state_wait_s)
        while not self.stop.is_set() and (timed or waiting):
            now = time.monotonic()
            ready = [k for k in waiting if TARGET[k] not in self.busy and self._ready_for(k)]
            if ready:
                waiting.remove(ready[0])
                self._launch(ready[0])
            elif timed and now >= next_at and TARGET[timed[0]] not in self.busy:
                self._launch(timed.pop(0))
                next_at = now + self.rng.uniform(*plan.gap_s)
            elif waiting and now > deadline:
                self.skipped += waiting
                waiting = []
            self.stop.wait(0.25)
        self.skipped += waiting + timed
        for t in self._kill_threads:
            t.join()

    def _launch(self, kind: str) -> None:
        self.busy.add(TARGET[kind])
        down = self.rng.uniform(*self.plan.down_s)  # drawn here, in order: the schedule is the seed's
        t = threading.Thread(target=self._kill, args=(kind, down), name=f"faults-kill-{kind}", daemon=True)
        t.start()
        self._kill_threads.append(t)

    def _ready_for(self, kind: str) -> bool:
        if kind in ("gate", "gate_offline", "gate_canary"):
            if not self.stack.supervisor.children.get("gate"):
                return False
            if kind == "gate":
                return True
            v = self.registry.in_flight()
            want = "evaluating" if kind == "gate_offline" else "canary"
            if v is None or v.status != want or self.registry.gate_lease() is None:
                return False
            if want == "canary":
                return float((v.gate.get("canary") or {}).get("share", 0.0)) > 0
            return True
        if kind == "lent_replica":
            return any(b.lending == "lent" for b in self._replicas())
        return False

    def _replicas(self) -> list[Any]:
        f = self.registry.fleet(interval_s=1.0)
        return [b for b in f.replicas if b.replica_id in f.up]

    def _kill(self, kind: str, down: float) -> None:
        try:
            self._kill_one(kind, down)
        except Exception as e:  # a kill that could not be carried out is a failed kill, not a dead harness
            log.exception("faults: killing %s", kind)
            self.kills.append(Kill(kind, TARGET[kind], time.time(), down, detail={"error": repr(e)}))
        finally:
            self.busy.discard(TARGET[kind])

    def _kill_one(self, kind: str, down: float) -> None:
        log.warning("faults: killing %s", kind)
        if kind == "broker":
            k = Kill(kind, "tansu", time.time(), down)
            self.down.add("tansu")
            assert self.stack.broker is not None
            self.stack.broker.kill()
            time.sleep(down)
            self._start("tansu")
            self.down.discard("tansu")
            k.back_at = time.time()
        elif kind in ("learner", "gate", "gate_offline", "gate_canary", "gateway"):
            name = {"learner": "learner", "gateway": "gateway-2"}.get(kind, "gate")
            k = Kill(kind, name, time.time(), down)
            if name == "gate":
                v = self.registry.in_flight()
                lease = self.registry.gate_lease()
                lease_s = lease.lease_s if lease is not None else 0.0
                k.detail = {"version": v.id if v else None, "status": v.status.value if v else None, "lease_s": lease_s}
                if kind == "gate_canary":  # down past the lease and the gateways' cache: the share must lapse
                    k.down_s = down = lease_s + 10.0 + down
            self.down.add(name)
            # forgotten by the supervisor while down: a concurrent kill's restart, whose wait checks the
            # supervisor for dead children, must not take this one for an unasked death
            self.stack.supervisor.kill_child(name)
            time.sleep(down)
            if kind == "gate_canary":  # the gate still down, past its lease: each gateway has lapsed by now
                self.lapse_reads.append(self._lapses())
            self._start(name)
            self.down.discard(name)
            k.back_at = self._wait_back(name)
            if name == "gate":
                self.gate_down.append((k.at, k.back_at, k.detail["lease_s"]))
        else:  # an engine process: the gateway restarts it
            gateway = "gateway-1"
            lent = {b.replica_id for b in self._replicas() if b.lending == "lent"} if kind == "lent_replica" else set()
            pids = self._engine_pids()
            choices = sorted(r for r in pids if (r in lent if lent else r.startswith(gateway)))
            if not choices:
                self.skipped.append(kind)
                return
            replica = choices[0]
            pid = pids[replica]
            k = Kill(kind, f"{replica} engine (pid {pid})", time.time(), 0.0, detail={"replica": replica})
            os.kill(pid, signal.SIGKILL)
            k.back_at = within(lambda: self._engine_pids().get(replica, pid) != pid and self._serving(replica), 120)
        self.kills.append(k)
        log.warning("faults: %s back after %s s", kind, None if k.back_at is None else round(k.back_at - k.at, 1))

    def _engine_pids(self) -> dict[str, int]:
        """The latest engine pid each replica's gateway logged (`serving.replica`), over both gateways."""
        out: dict[str, int] = {}
        for name in ("gateway-1", "gateway-2"):
            path = self.home / f"{name}.log"
            if path.is_file():
                for m in ENGINE_LINE.finditer(path.read_text(errors="replace")):
                    out[m.group(1)] = int(m.group(2))
        return out

    def _serving(self, replica: str) -> bool:
        return any(b.replica_id == replica and b.serves and not b.error for b in self._replicas())

    def _wait_back(self, name: str) -> float | None:
        if name.startswith("gateway"):
            url = self.stack.urls[int(name.rsplit("-", 1)[1]) - 1]
            return within(lambda: http_ok(url + "/healthz"), 180)
        if name == "gate":
            pid = self.stack.supervisor.children["gate"].pid
            return within(lambda: any(g.pid == pid for g in self.registry.gate_leases()), 120)
        child = self.stack.supervisor.children[name]

        def alive_5s() -> bool:
            time.sleep(5.0)
            return child.alive()

        return within(alive_5s, 30)

    # ---- the books -------------------------------------------------------------------------------

    def books(
        self, traffic: Any, tenant: str, window_s: float, quiet_s: float = 15.0, timeout_s: float = 900.0
    ) -> dict[str, Any]:
        from feedback.rewards import RewardSpec

        spec = RewardSpec()  # demo.stack sets only the window: the budget is the default's
        budget = (spec.max_rewarded_per_user, spec.budget_window_s)
        once = exactly_once_book(self.stack.settings, traffic, tenant, window_s, quiet_s, timeout_s, budget)
        return {
            "exactly_once": once,
            "served": self.served_check(traffic, tenant),
            "hashes": self.hash_check(),
            "lapse": self.lapse_check(),
        }

    def served_check(self, traffic: Any, tenant: str) -> dict[str, Any]:
        from gating.stats import assign_arm

        audit = self.registry.audit()
        promoted_at: dict[str, float] = {}
        for a in audit:
            if a.to_status.value == "promoted":
                promoted_at.setdefault(a.version_id, a.at.timestamp())
        for v in self.registry.list():
            if v.parent_id is None:
                promoted_at.setdefault(v.id, 0.0)  # the base
        shares: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for t, vid, share in self.canary_log:
            shares[vid].append((t, share))
        lapsed = [(at + lease_s + 1.0 + SLACK_S, back) for at, back, lease_s in self.gate_down]
        bad: Counter[str] = Counter()
        examples: list[dict[str, Any]] = []
        by_version: Counter[str] = Counter()
        for t, user, vid, _g in traffic.served_log:
            by_version[vid] += 1
            why = None
            if vid in promoted_at and promoted_at[vid] <= t + SLACK_S:
                continue
            seen = [s for ts, s in shares.get(vid, []) if t - 3.0 - SLACK_S <= ts <= t + SLACK_S]
            if not seen:
                why = "not promoted, not in canary"
            elif assign_arm(vid, tenant, user, max(seen)) != "candidate":
                why = "outside the canary's share"
            elif any(a <= t and (b is None or t <= b) for a, b in lapsed):
                why = "served while the gate's lease had lapsed"
            if why:
                bad[why] += 1
                if len(examples) < 10:
                    examples.append({"t": t, "user": user, "version": vid, "why": why})
        return {"completions": len(traffic.served_log), "by_version": dict(by_version), "violations": dict(bad),
                "examples": examples}  # fmt: skip

    def hash_check(self) -> dict[str, Any]:
        from registry.publish import sha256_of

        f = self.registry.fleet(interval_s=1.0)
        deadline = time.monotonic() + 120
        while not f.complete and time.monotonic() < deadline:
            time.sleep(1.0)
            f = self.registry.fleet(interval_s=1.0)
        promoted = self.registry.get(f.promoted_id) if f.promoted_id else None
        if promoted is None or promoted.artifact is None:
            return {"agree": False, "why": "no promoted version with an artifact"}
        path = self.stack.settings.home / "models" / "learner" / promoted.artifact.path
        store = sha256_of(path) if path.is_file() else None
        up = [b for b in f.replicas if b.replica_id in f.up]
        reported = {b.replica_id: b.holds.get(promoted.id) for b in up}
        agree = bool(up) and store == promoted.artifact_sha256 and all(h == store for h in reported.values())
        return {"promoted": promoted.id, "registry": promoted.artifact_sha256, "weight_store": store,
                "replicas": reported, "agree": agree}  # fmt: skip

    def _lapses(self) -> dict[str, Any]:
        """Each gateway's `flywheel_canary_lapses_total` now (an error's repr where it cannot be read)."""
        counts: dict[str, Any] = {}
        for url in self.stack.urls:
            try:
                text = httpx.get(url + "/metrics", timeout=30).text
            except httpx.HTTPError as e:
                counts[url] = repr(e)
                continue
            m = re.search(r"^flywheel_canary_lapses_total\s+([0-9.e+]+)", text, re.M)
            counts[url] = float(m.group(1)) if m else 0.0
        return counts

    def lapse_check(self) -> dict[str, Any]:
        """Book 4. The counter lives in the gateway's process, so a gateway killed after the lapse starts
        it again at 0: each gateway's count is the most it showed, read while the gate was down past its
        lease (`lapse_reads`) and at the end."""
        reads = [*self.lapse_reads, self._lapses()]
        counts = {url: max((r[url] for r in reads if isinstance(r.get(url), float)), default=reads[-1][url])
                  for url in self.stack.urls}  # fmt: skip
        return {"gate_down_in_canary": sum(1 for k in self.kills if k.kind == "gate_canary"), "lapses": counts,
                "reads": reads}  # fmt: skip


def within(condition: Any, timeout_s: float) -> float | None:
    """The wall time `condition()` first held, within `timeout_s` (`bench.common.within`); None if never."""
    return time.time() if common.within(condition, timeout_s, interval_s=0.25) is not None else None


# ---- the run ---------------------------------------------------------------------------------------


def run(
    *,
    seed: int,
    traffic_s: float,
    plan: Plan,
    home: Path,
    replicas: int = 2,
    lending: bool = True,
    quiet_s: float = 15.0,
    books_timeout_s: float = 900.0,
    **demo: Any,
) -> dict[str, Any]:
    """One run (module docstring): the stack, the users, the kills, the books. `demo`: more
    `demo.system.DemoSystemConfig` fields (users, concurrency, diurnal_trough...); the books wait up to
    `books_timeout_s` for every accepted event to be in a sample, then `quiet_s` for repeats."""
    from demo import stack as shapes
    from demo.system import Approver, DemoSystemConfig, throttled
    from demo.traffic import drive_users
    from registry.keys import KeyStore

    cfg = DemoSystemConfig(seed=seed, traffic_s=traffic_s, shape="kafka-postgres", gateways=2, replicas=replicas,
                           lending=lending, **demo)  # fmt: skip
    home.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    stack = shapes.start(cfg, home, common.ROOT / "models" / "demo-base", separate=True, durable_broker=True)
    harness = None
    try:
        stack.wait_ready()
        stack.start_services()
        startup_s = time.monotonic() - t0
        with KeyStore(stack.db_url) as keys:
            token, _ = keys.create(["admin"], label="fault harness auto-approve")
        approver = Approver(stack.urls[0], token)
        harness = Harness(stack, plan, home).start()

        def progress(_: Any) -> None:
            try:
                approver.step()
            except httpx.HTTPError as e:  # gateway-1 is up throughout; a slow answer is retried next time
                log.warning("faults: approving: %r", e)

        traffic = asyncio.run(drive_users(cfg, stack.urls, time.monotonic() + traffic_s, throttled(progress, 2.0)))
        harness.stop.set()  # no more kills; the watcher goes on through the books
        harness._threads[1].join(timeout=300)  # the scheduler, once its kills are back
        books = harness.books(traffic, stack.settings.local_tenant, cfg.window_s, quiet_s, books_timeout_s)
        versions = [{"id": v.id, "status": v.status.value} for v in harness.registry.list()]
    finally:
        if harness is not None:
            harness.close()
        stack.supervisor.stop()
    survived = {k.kind: k.back_at is not None for k in harness.kills}
    return {
        "config": {"seed": seed, "traffic_s": traffic_s, "replicas": replicas, "lending": lending,
                   "plan": asdict(plan), "demo": demo},
        "startup_s": round(startup_s, 1),
        "traffic": {"completions": traffic.completions, "errors": traffic.errors, "failovers": traffic.failovers,
                    "feedback_events": len(traffic.feedback_keys), "given_up": len(traffic.feedback_given_up),
                    "errors_by_gateway": dict(Counter(g for _, g in traffic.error_log))},  # fmt: skip
        "kills": [asdict(k) | {"back_after_s": None if k.back_at is None else round(k.back_at - k.at, 1)}
                  for k in harness.kills],  # fmt: skip
        "survived": survived,
        "skipped": harness.skipped,
        "unasked_deaths": [{k: v for k, v in d.items() if k != "log"} for d in harness.unasked],
        "versions": versions,
        "books": books,
        "ok": all(survived.values()) and not harness.unasked and books["exactly_once"]["ok"]
        and not books["served"]["violations"] and books["hashes"]["agree"] and lapsed_everywhere(books["lapse"]),
    }  # fmt: skip


def lapsed_everywhere(lapse: dict[str, Any]) -> bool:
    """Every gateway counted a lapse if the gate was killed mid-canary (book 4); True if it was not."""
    return not lapse["gate_down_in_canary"] or all(isinstance(n, float) and n >= 1 for n in lapse["lapses"].values())


FULL_RUN: dict[str, Any] = {
    # The demo's loop made short enough that a candidate reaches offline evaluation and canary within the
    # run on 2 cores shared by 2 gateways of 2 engines, a broker, its S3 server, PostgreSQL and 3 services:
    # a wider attribution window (completions are slow here), a candidate every 2 updates of 32 samples,
    # `--quick`'s gate suite and one canary step; a compressed day (quiet nights) so replicas are lent.
    "window_s": 15.0,
    "learner_every_samples": 32,
    "updates_per_candidate": 2,
    "gate_prompts": 36,
    "gate_G": 4,
    "canary_steps": (0.5,),
    "canary_min_users": 10,
    "users": 200,
    "concurrency": 8,
    "diurnal_trough": 0.15,
}


FULL_RUN_GAP_S = (60.0, 120.0)
"""The full run's gaps between timed kills: spread over its first half or so, so that the later ones
(the broker's among them) come with minutes of records in the store, not within the first two minutes."""


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=12.0)
    ap.add_argument("--kills", default=",".join(KILLS), help=f"which, of {', '.join(KILLS)}")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=FULL_RUN["concurrency"],
        help="completions in flight at once (the load)",
    )
    ap.add_argument("--home", type=Path, default=None,
                    help="keep the run's logs and state here (default: a temporary folder, removed)")  # fmt: skip
    a = ap.parse_args()
    kills = tuple(k for k in a.kills.split(",") if k)
    unknown = set(kills) - set(KILLS) - {"gate"}
    if unknown:
        ap.error(f"unknown kills {sorted(unknown)}; choose from {KILLS}")
    st = common.stamp()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="flywheel-faults-") as tmp:
        plan = Plan(kills=kills, seed=a.seed, gap_s=FULL_RUN_GAP_S)
        result = run(seed=a.seed, traffic_s=a.minutes * 60, plan=plan, home=a.home or Path(tmp) / "home",
                     **(FULL_RUN | {"concurrency": a.concurrency}))  # fmt: skip
    result |= {"template": NAME}
    common.save(NAME, result, st, a.out)


if __name__ == "__main__":
    main()
