"""The online canary's error rates, by simulation: how often an A/A canary aborts, how often a candidate
worse by the margin reaches approval, and how many users a 5-point drop takes to stop.

Every decision is `gating.canary.decide` at its default `CanaryConfig`, called after every batch of
simulated traffic (one minute); nothing here re-implements a test.

**Users.** A population, each user with a satisfaction rate p_u ~ Beta(m c, (1 - m) c) (m: the demo
base's measured satisfaction on the gate split, c the concentration) and a heavy-tailed activity
(requests per hour log-normal); latency log-normal, errors Bernoulli and the verifier's score (the
pass-rate guardrail) Bernoulli(the base's measured pass rate), the same in both arms. A request's reward
is Bernoulli(p_u) on the incumbent and Bernoulli(p_u f) on the candidate (f = 1 - effect / m: the
user-averaged satisfaction drops by exactly `effect`), and every sample is an exposure. Users are assigned
by the gate's own sticky hash (`gating.stats.assignment_unit`, a new salt per replicate).

**Clock.** Every batch adds each user's requests of that minute, then `decide` looks; `next_step` starts a
new step (counted from then on), any other final action ends the replicate. The per-user numbers live in
numpy arrays (`SimOutcomes`, a `CanaryOutcomes` read in bulk); `check_equivalence` replays small worlds
through the real `CanaryOutcomes.add` with real `SampleEvent`s and `assign_arm`, and requires the same
decision and numbers at every look.

**Scenarios**, on the default ramp (30,000 users): A/A, worse by the margin, a 5-point drop; and the
5-point drop in a single step at 5%, 20% or 50% given a day, in 120,000 users. The base's pass rate and
satisfaction are measured here (`--samples` per gate-split prompt, as `bench.gate_sim_offline` samples).
The peer of every rate is its bound (alpha) in the same run; of the users a drop needs, the other shares.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import numpy as np

from bench import common
from bench.gate_sim_offline import ensure_model, measure
from demo.bootstrap import SHIPPED_BASE
from feedback.events import CompletionEvent, RoutedExperts, SampleEvent, Signal
from gating.canary import CanaryConfig, CanaryOutcomes, decide
from gating.stats import DEFAULT_ALPHA, DEFAULT_MARGIN, assign_arm, assignment_unit
from registry.models import CanaryProgress

NAME = "gate_sim_canary"
T0 = datetime(2025, 1, 1, tzinfo=UTC)
TENANT = "sim"
CANDIDATE, INCUMBENT = "candidate-v", "incumbent-v"
DETECTION_USERS = 120_000
"""Population of the single-step detection runs: large enough not to cap the users a step needs."""


@dataclass(frozen=True)
class Traffic:
    """The simulated users (module docstring)."""

    users: int = 30_000
    concentration: float = 5.0  # Beta(m c, (1 - m) c): per-user satisfaction sd = sqrt(m (1 - m) / (c + 1))
    median_rate_h: float = 3.0  # requests per hour of the median user
    activity_sigma: float = 1.2  # log-normal sd of log(rate): heavy-tailed activity
    latency_median_ms: float = 350.0
    latency_sigma: float = 0.5
    error_rate: float = 0.01
    pass_rate: float = 0.44  # verifier score of each request, both arms (a run sets the measured rate)
    batch_s: float = 60.0  # the gate looks after every batch


@dataclass
class Population:
    p: np.ndarray  # satisfaction rate per user
    rate_s: np.ndarray  # requests per second per user
    unit: np.ndarray  # assignment_unit(salt, TENANT, id)
    ids: list[str]
    salt: str


def population(traffic: Traffic, mean_sat: float, rng: np.random.Generator, salt: str) -> Population:
    n, c = traffic.users, traffic.concentration
    ids = [f"user-{i}" for i in range(n)]
    return Population(
        rng.beta(mean_sat * c, (1.0 - mean_sat) * c, n),
        traffic.median_rate_h / 3600.0 * np.exp(traffic.activity_sigma * rng.standard_normal(n)),
        np.array([assignment_unit(salt, TENANT, u) for u in ids]),
        ids,
        salt,
    )


@dataclass
class Requests:
    """One batch: who made each request, its reward, latency, whether it failed, its verifier score."""

    owner: np.ndarray
    reward: np.ndarray
    latency_ms: np.ndarray
    error: np.ndarray
    passed: np.ndarray


def draw_batch(
    pop: Population, candidate: np.ndarray, factor: float, traffic: Traffic, rng: np.random.Generator
) -> Requests:
    k = rng.poisson(pop.rate_s * traffic.batch_s)
    owner = np.repeat(np.arange(k.size), k)
    p = pop.p[owner] * np.where(candidate[owner], factor, 1.0)
    return Requests(
        owner,
        (rng.random(owner.size) < p).astype(np.float64),
        rng.lognormal(math.log(traffic.latency_median_ms), traffic.latency_sigma, owner.size),
        rng.random(owner.size) < traffic.error_rate,
        (rng.random(owner.size) < traffic.pass_rate).astype(np.float64),
    )


_N, _SUM, _SQ, _LAT_N, _LAT_SUM, _ERR, _PASS_N, _PASS_SUM = range(8)  # gating.canary's per-user record
_METRICS = {
    "reward": (_SUM, _N),
    "latency_ms": (_LAT_SUM, _LAT_N),
    "ttft_ms": (_LAT_SUM, _LAT_N),  # the simulated latency stands for the time to first token
    "tpot_ms": (_LAT_SUM, _LAT_N),  # and for the time per output token (_sample_event sends both)
    "error_rate": (_ERR, _N),
    "pass_rate": (_PASS_SUM, _PASS_N),
}


class _Roster(dict[str, list[float]]):
    """How many users an arm has, all `decide` asks of `users()`; their numbers are in arrays. Anything
    else raises, so a `decide` that starts reading records fails here instead of silently."""

    def __init__(self, n: int):
        super().__init__()
        self._n = n

    def __len__(self) -> int:
        return self._n

    def _refuse(self, *a: Any, **kw: Any) -> Any:
        raise TypeError("SimOutcomes keeps per-user records in arrays; use per_user (or CanaryOutcomes)")

    __iter__ = __getitem__ = keys = values = items = get = _refuse


class SimOutcomes(CanaryOutcomes):
    """`CanaryOutcomes` for the simulation: step -> [8, users] array of the same per-user record, filled a
    batch at a time (`add_batch`), read in bulk by `users` / `per_user`."""

    def __init__(self, n_users: int):
        super().__init__()
        self.n_users = n_users
        self.acc: dict[int, np.ndarray] = {}
        self.is_candidate: dict[int, np.ndarray] = {}

    def add_batch(self, step: int, candidate: np.ndarray, req: Requests) -> None:
        if step not in self.acc:
            self.acc[step], self.is_candidate[step] = np.zeros((8, self.n_users)), candidate
        a, n = self.acc[step], self.n_users
        count = np.bincount(req.owner, minlength=n)
        rew = np.bincount(req.owner, weights=req.reward, minlength=n)
        a[_N] += count
        a[_SUM] += rew
        a[_SQ] += rew  # rewards are 0 or 1
        a[_LAT_N] += count
        a[_LAT_SUM] += np.bincount(req.owner, weights=req.latency_ms, minlength=n)
        a[_ERR] += np.bincount(req.owner, weights=req.error.astype(np.float64), minlength=n)
        a[_PASS_N] += count
        a[_PASS_SUM] += np.bincount(req.owner, weights=req.passed, minlength=n)

    def _mask(self, step: int, arm: str, have: int) -> np.ndarray:
        return np.asarray((self.is_candidate[step] == (arm == "candidate")) & (self.acc[step][have] > 0))

    def users(self, step: int, arm: str) -> dict[str, list[float]]:
        return _Roster(int(self._mask(step, arm, _N).sum()) if step in self.acc else 0)

    def per_user(self, step: int, arm: str, metric: str) -> list[float]:
        a = self.acc[step]
        num, den = _METRICS[metric]
        m = self._mask(step, arm, den)
        return cast(list[float], a[num][m] / a[den][m])


@dataclass
class CanaryRun:
    action: str
    reason: str
    step: int
    total_s: float
    looks: int
    passed_steps: list[dict[str, Any]]
    final: dict[str, Any]


def _progress(step: int, share: float, started_s: float) -> CanaryProgress:
    return CanaryProgress(step=step, share=share, started_at=T0 + timedelta(seconds=started_s))


def run_canary(
    pop: Population, factor: float, cfg: CanaryConfig, traffic: Traffic, rng: np.random.Generator
) -> CanaryRun:
    """One canary through `decide`, looking after every batch, until it ends."""
    outcomes = SimOutcomes(len(pop.ids))
    step, started, t, looks = 0, 0.0, 0.0, 0
    passed: list[dict[str, Any]] = []
    candidate = pop.unit < cfg.steps[0]
    while True:
        outcomes.add_batch(step, candidate, draw_batch(pop, candidate, factor, traffic, rng))
        t += traffic.batch_s
        looks += 1
        d = decide(_progress(step, cfg.steps[step], started), outcomes, cfg, T0 + timedelta(seconds=t))
        if d.action == "wait":
            continue
        if d.action in ("next_step", "awaiting_approval"):
            passed.append({"step": step, "users": d.numbers["users"], "elapsed_s": d.numbers["elapsed_s"]})
        if d.action == "next_step":
            step, started = step + 1, t
            candidate = pop.unit < cfg.steps[step]
            continue
        final = {k: d.numbers.get(k) for k in ("users", "elapsed_s", "reward", "srm")}
        reqs = outcomes.acc[step][_N]
        final["requests_per_user"] = float(reqs[reqs > 0].mean())
        return CanaryRun(d.action, d.reason, step, t, looks, passed, final)


def _sample_event(uid: str, arm: str, reward: float, latency: float, error: bool, ts: float, n: int) -> SampleEvent:
    c = CompletionEvent(
        completion_id=f"{uid}-{n}",
        tenant=TENANT,
        ts=ts,
        user_id=uid,
        model_version=CANDIDATE if arm == "candidate" else INCUMBENT,
        endpoint="completions",
        prompt_ids=[1],
        output_ids=[2, 3],
        logprobs=[-0.5, -0.5],
        routed_experts=RoutedExperts.from_bytes((2, 1, 1), b"\x00\x00"),
        text="x",
        finish_reason="error" if error else "stop",
        params={},
        latency_ms={"first_token": latency, "total": 2 * latency},  # TTFT and TPOT both `latency`
        arm=arm,
    )
    # an exposure: counted under denominator="exposures"
    shown = Signal(kind="shown", ts=ts, user_id=uid, event_id=f"shown-{uid}-{n}")
    return SampleEvent(tenant=TENANT, ts=ts, completion=c, reward=reward, signals=[shown], reward_spec="sim")


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return bool(a == b)


def check_equivalence(
    mean_sat: float, factor: float, seed: int, cfg: CanaryConfig | None = None, traffic: Traffic | None = None
) -> dict[str, Any]:
    """A small world run twice side by side: `SimOutcomes` and the real `CanaryOutcomes.add` of real
    `SampleEvent`s, arms from `assign_arm`. Same action and numbers at every look, or `agree` is False."""
    cfg = cfg or CanaryConfig(min_users_per_arm=10, min_step_s=300, max_step_s=3600)
    traffic = traffic or Traffic(users=1500, median_rate_h=6.0)
    rng = np.random.default_rng(seed)
    pop = population(traffic, mean_sat, rng, salt=f"equivalence-{seed}")
    fast, real = SimOutcomes(len(pop.ids)), CanaryOutcomes()
    step, started, t, looks, n_events = 0, 0.0, 0.0, 0, 0
    while True:
        share = cfg.steps[step]
        candidate = pop.unit < share
        req = draw_batch(pop, candidate, factor, traffic, rng)
        fast.add_batch(step, candidate, req)
        for j, u in enumerate(req.owner.tolist()):
            arm = assign_arm(pop.salt, TENANT, pop.ids[u], share)
            if (arm == "candidate") != bool(candidate[u]):
                return {"agree": False, "why": f"assign_arm disagrees for {pop.ids[u]} at share {share}"}
            ev = _sample_event(
                pop.ids[u], arm, float(req.reward[j]), float(req.latency_ms[j]), bool(req.error[j]), t, n_events
            )
            n_events += 1
            if not real.add(step, ev, CANDIDATE, INCUMBENT, passed=float(req.passed[j])):
                return {"agree": False, "why": "CanaryOutcomes.add refused a simulated sample"}
        t += traffic.batch_s
        looks += 1
        now, prog = T0 + timedelta(seconds=t), _progress(step, share, started)
        d_fast, d_real = decide(prog, fast, cfg, now), decide(prog, real, cfg, now)
        if d_fast.action != d_real.action or not _close(d_fast.numbers, d_real.numbers):
            return {"agree": False, "why": f"look {looks}: {d_fast.numbers} != {d_real.numbers}"}
        if d_real.action == "next_step":
            step, started = step + 1, t
        elif d_real.action != "wait":
            return {"agree": True, "looks": looks, "events": n_events, "action": d_real.action}


def simulate_online(
    scenarios: dict[str, tuple[float, CanaryConfig]],
    traffic: Traffic,
    mean_sat: float,
    reps: int,
    seed: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, list[CanaryRun]]:
    """`reps` replicates of every scenario (name -> (effect, config)); replicate r shares its population
    and salt across scenarios."""
    runs: dict[str, list[CanaryRun]] = {name: [] for name in scenarios}
    for r in range(reps):
        pop = population(traffic, mean_sat, np.random.default_rng([seed, r]), salt=f"sim-{seed}-{r}")
        for s, (name, (effect, cfg)) in enumerate(scenarios.items()):
            rng = np.random.default_rng([seed, r, s + 1])
            runs[name].append(run_canary(pop, 1.0 - effect / mean_sat, cfg, traffic, rng))
        if progress:
            progress(r)
    return runs


def _quantiles(x: Sequence[float]) -> dict[str, float] | None:
    if not x:
        return None
    q = np.quantile(np.asarray(x, dtype=np.float64), [0.1, 0.5, 0.9])
    return {"p10": float(q[0]), "median": float(q[1]), "p90": float(q[2]), "n": len(x)}


def summarize(runs: list[CanaryRun]) -> dict[str, Any]:
    n = len(runs)
    actions = Counter(r.action for r in runs)
    harm_kinds = Counter(
        ("satisfaction" if "satisfaction" in r.reason else r.reason.split(": ", 1)[-1].split(" ")[0])
        for r in runs
        if r.action == "abort_harm"
    )
    steps = {}
    for k in range(3):
        at = [p for r in runs for p in r.passed_steps if p["step"] == k]
        steps[str(k)] = {
            "passed": len(at),
            "users_total": _quantiles([sum(p["users"].values()) for p in at]),
            "users_candidate": _quantiles([p["users"]["candidate"] for p in at]),
            "elapsed_h": _quantiles([p["elapsed_s"] / 3600 for p in at]),
        }
    harm = [r for r in runs if r.action == "abort_harm"]
    return {
        "reps": n,
        "actions": dict(sorted(actions.items())),
        "abort_harm_by": dict(sorted(harm_kinds.items())),
        "aborts_at_step": dict(
            sorted(Counter(f"{r.action}@{r.step}" for r in runs if r.action.startswith("abort")).items())
        ),
        "aborted": common.rate(sum(v for a, v in actions.items() if a.startswith("abort")), n),
        "passed": common.rate(actions["awaiting_approval"], n),
        "steps_passed": steps,
        "harm_at": {
            "users_total": _quantiles([sum(r.final["users"].values()) for r in harm]),
            "users_candidate": _quantiles([r.final["users"]["candidate"] for r in harm]),
            "elapsed_h": _quantiles([r.final["elapsed_s"] / 3600 for r in harm]),
            "requests_per_user": _quantiles([r.final["requests_per_user"] for r in harm]),
        },
        "simulated_h": _quantiles([r.total_s / 3600 for r in runs]),
    }


def scenarios(which: Sequence[str]) -> list[tuple[dict[str, tuple[float, CanaryConfig]], bool]]:
    """The scenario groups to run, each with whether it runs in the detection population."""
    default = CanaryConfig()
    ramp = {"aa": (0.0, default), "worse_by_margin": (DEFAULT_MARGIN, default), "drop_5pt": (0.05, default)}
    detect = {
        f"drop_5pt_at_{share:.0%}": (0.05, default.model_copy(update={"steps": (share,), "max_step_s": 86400.0}))
        for share in (0.05, 0.20, 0.50)
    }
    groups = [
        ({k: v for k, v in ramp.items() if k in which}, False),
        ({k: v for k, v in detect.items() if k in which}, True),
    ]
    return [(g, big) for g, big in groups if g]


ALL = ("aa", "worse_by_margin", "drop_5pt", "drop_5pt_at_5%", "drop_5pt_at_20%", "drop_5pt_at_50%")


def run_online(pass_rate: float, mean_sat: float, reps: int, seed: int, which: Sequence[str]) -> dict[str, Any]:
    traffic = Traffic(pass_rate=pass_rate)
    big = dataclasses.replace(traffic, users=DETECTION_USERS)
    small = [(1.0, CanaryConfig(margin=0.15, min_users_per_arm=10, min_step_s=300)), (0.5, CanaryConfig())]
    equivalence = [
        {"factor": f, **check_equivalence(mean_sat, f, seed + i, cfg.model_copy(update={"max_step_s": 3600.0}))}
        for i, (f, cfg) in enumerate(small)
    ]
    assert all(e["agree"] for e in equivalence), equivalence
    t0 = time.perf_counter()

    def tick(r: int) -> None:
        if (r + 1) % 50 == 0:
            print(f"online: {r + 1}/{reps} replicates, {time.perf_counter() - t0:.0f} s", flush=True)

    sc: dict[str, Any] = {}
    for group, in_big in scenarios(which):
        tr = big if in_big else traffic
        runs = simulate_online(group, tr, mean_sat, reps, seed, tick)
        sc |= {name: {"effect": e, "users": tr.users, **summarize(runs[name])} for name, (e, _) in group.items()}
    if "worse_by_margin" in sc:
        sc["worse_by_margin"]["passed"] = common.rate(sc["worse_by_margin"]["passed"]["k"], reps, DEFAULT_ALPHA)
    if "aa" in sc:
        aa = sc["aa"]
        aa["aborted"] = common.rate(aa["aborted"]["k"], reps, DEFAULT_ALPHA)
        alarms = aa["actions"].get("abort_invalid", 0) + aa["actions"].get("abort_harm", 0)
        aa["false_alarms"] = common.rate(alarms, reps, DEFAULT_ALPHA)
    return {
        "config": CanaryConfig().model_dump(mode="json"),
        "harm_alpha": CanaryConfig().harm_alpha,
        "traffic": dataclasses.asdict(traffic),
        "detection_users": DETECTION_USERS,
        "equivalence": equivalence,
        "scenarios": sc,
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--reps", type=int, default=1000, help="replicates per scenario")
    ap.add_argument("--scenarios", nargs="+", default=list(ALL), choices=ALL)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the base (default: models/demo-base)")
    ap.add_argument("--samples", type=int, default=8, help="samples per gate-split prompt to measure the base")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    st = common.stamp()
    ensure_model(a.model)
    m = measure(a.model, a.samples, seed=a.seed + 1000)
    measured = {k: m[k] for k in ("model", "suite", "samples_per_prompt", "mean_pass_rate", "mean_satisfaction")}
    print(f"measured: pass rate {m['mean_pass_rate']:.3f}, satisfaction {m['mean_satisfaction']:.3f}", flush=True)
    res = {"reps": a.reps, "seed": a.seed, "measured": measured}
    res["online"] = run_online(m["mean_pass_rate"], m["mean_satisfaction"], a.reps, a.seed, a.scenarios)
    common.save(NAME, res, st, a.out)


if __name__ == "__main__":
    main()
