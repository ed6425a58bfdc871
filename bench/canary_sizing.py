"""The canary sized to its traffic: the smallest margin with 80% power at the demo's users per step.

One canary step is simulated, vectorised over replicates, looking every `look_s` as the demo's gate does
(`poll_s` 1 s), with `gating.canary.decide`'s rules on its own numbers: the satisfaction confidence
sequence at ρ = `gating.sequential.step_rho(expected users)`, the always-valid SRM e-value, the one-sided
TTFT and TPOT guardrails at `harm_alpha`, min users, min step time, the max step time and one extension
for a candidate ahead when time runs out. `check_decide` replays one replicate through the real
`decide` on real `CanaryOutcomes` records at every look and requires the same action.

**Traffic, measured.** The demo's users (`demo.traffic._users`): N users, activity Pareto(1.5), each
completion drawn in proportion to it. Completions per second: the lowest of the report's runs
(docs/demo/report.json: 14,064 completions in 600 s of traffic, seed 0; the others 24-39 /s) and
32.5 /s in a quick run's sample topic. The gate counts a completion from `route_lag_s` (3 s) after the
step starts, one attribution window (4 s) after it is served: `lag_s` 7. Per-request reward: user
effect N(0, 0.10²) plus noise N(0, 0.47²), the between- and within-user parts measured on a quick
run's 7,741 joined samples (per-user sd 0.21 at 11 completions per user: the σ ≈ 0.2 that
docs/gate.md sizes production's margin with). TTFT and TPOT per request: log-normal, log-mean
3.07 / 2.91 (21.8 / 19.0 ms medians), log-sd 0.58 / 0.41, from the same samples
(`latency_ms.first_token`; (total - first_token) / (tokens - 1)), the same on both arms (an A/A:
both arms run the same engines).

Run: `python -m bench.canary_sizing [--reps N] [--seed S]`; tests/gating/test_canary_sizing.py runs
the same functions at fewer replicates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from gating.canary import CanaryConfig, CanaryOutcomes, decide
from gating.sequential import log_srm_evalue, step_rho
from registry.models import CanaryProgress

NAME = "canary_sizing"
T0 = datetime(2025, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class DemoTraffic:
    users: int = 500
    activity_shape: float = 1.5
    rate_s: float = 23.4
    lag_s: float = 7.0
    look_s: float = 1.0
    between_sd: float = 0.10
    within_sd: float = 0.47
    reward_mean: float = 0.1
    ttft_log: tuple[float, float] = (3.07, 0.58)
    tpot_log: tuple[float, float] = (2.91, 0.41)


FULL = DemoTraffic()
QUICK = DemoTraffic(users=150)


def expected_users(tr: DemoTraffic, duration_s: float, seed: int = 0, draws: int = 200) -> float:
    """Distinct users (both arms) with a counted completion in a step of `duration_s`, on average."""
    rng = np.random.default_rng(seed)
    w = rng.pareto(tr.activity_shape, (draws, tr.users)) + 1.0
    lam = tr.rate_s * max(0.0, duration_s - tr.lag_s) * w / w.sum(axis=1, keepdims=True)
    return float((1.0 - np.exp(-lam)).sum(axis=1).mean())


def _radius(w: np.ndarray, t: np.ndarray, rho: float, alpha: float) -> np.ndarray:
    """`gating.stats.confidence_sequence`'s radius, vectorised: sqrt(W 2 (1 + ρ/t) log(sqrt(1 + t/ρ)/α))."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt(w * 2.0 * (1.0 + rho / t) * np.log(np.sqrt(1.0 + t / rho) / alpha))


def _arm_stats(total: np.ndarray, cnt: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per replicate: users, mean and variance (ddof 1) of the users' means over `mask`."""
    with np.errstate(divide="ignore", invalid="ignore"):
        m = np.where(mask, total / np.where(cnt > 0, cnt, 1), 0.0)
        n = mask.sum(axis=1)
        mean = m.sum(axis=1) / np.maximum(n, 1)
        var = ((m - mean[:, None]) ** 2 * mask).sum(axis=1) / np.maximum(n - 1, 1)
    return n, mean, var


def _difference(
    tot: np.ndarray, cnt: np.ndarray, cand: np.ndarray, rho: float, alpha: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(n_candidate, n_incumbent, estimate, radius) of candidate - incumbent per replicate."""
    have = cnt > 0
    nc, mc, vc = _arm_stats(tot, cnt, have & cand)
    ni, mi, vi = _arm_stats(tot, cnt, have & ~cand)
    w = vc / np.maximum(nc, 1) + vi / np.maximum(ni, 1)
    rad = np.where(w > 0, _radius(w, (nc + ni).astype(np.float64), rho, alpha), 0.0)
    return nc, ni, mc - mi, rad


@dataclass(frozen=True)
class Step:
    """One step's settings: the demo's `CanaryConfig` fields that matter here."""

    share: float
    margin: float
    max_step_s: float
    min_step_s: float = 8.0
    min_users: int = 20
    min_users_for_harm: int = 10
    alpha: float = 0.05
    harm_alpha: float = 0.05 / 8
    srm_alpha: float = 0.001
    srm_concentration: float = 100.0
    extensions: int = 1


QUICK_STEP = Step(0.5, 0.0, 120.0, min_users=10, min_users_for_harm=5, harm_alpha=0.05 / 4)
"""`DemoSystemConfig.quick()`'s one step (4 guardrails x 1 step share alpha)."""


def simulate_step(
    tr: DemoTraffic, st: Step, effect: float, reps: int, seed: int, latency: bool = False, trace: bool = False
) -> dict[str, Any]:
    """One step, `reps` replicates; `effect`: satisfaction(candidate) - satisfaction(incumbent).
    Returns outcome counts, when they happened, and (`trace`) replicate 0's per-user records per look."""
    rng = np.random.default_rng(seed)
    rho = step_rho(expected_users(tr, st.max_step_s, seed=seed + 1), st.alpha)
    w = rng.pareto(tr.activity_shape, (reps, tr.users)) + 1.0
    lam = tr.rate_s * tr.look_s * w / w.sum(axis=1, keepdims=True)
    bias = rng.normal(0.0, tr.between_sd, (reps, tr.users))
    cand = rng.random((reps, tr.users)) < st.share
    shift = tr.reward_mean + bias + np.where(cand, effect, 0.0)
    cnt, tot = np.zeros((reps, tr.users)), np.zeros((reps, tr.users))
    lat = {m: (np.zeros((reps, tr.users)), np.zeros((reps, tr.users))) for m in ("ttft_ms", "tpot_ms")}
    outcome = np.full(reps, "", dtype=object)
    at = np.full(reps, np.nan)
    first_pass = np.full(reps, np.nan)
    limit = np.full(reps, st.max_step_s)
    extended = np.zeros(reps, dtype=np.int64)
    traced: list[dict[str, Any]] = []
    looks = int(round(st.max_step_s * (1 + st.extensions) / tr.look_s))
    for i in range(1, looks + 1):
        t = i * tr.look_s
        if t > tr.lag_s:  # the completions served lag_s before this look are counted now
            k = rng.poisson(lam)
            cnt += k
            tot += k * shift + tr.within_sd * np.sqrt(k) * rng.standard_normal(k.shape)
            if latency:
                idx = np.repeat(np.arange(k.size), k.ravel().astype(np.int64))
                for m, (mu, sd) in (("ttft_ms", tr.ttft_log), ("tpot_ms", tr.tpot_log)):
                    lat[m][0].ravel()[:] += np.bincount(idx, rng.lognormal(mu, sd, idx.size), minlength=k.size)
                    lat[m][1].ravel()[:] += np.bincount(idx, minlength=k.size)
        live = outcome == ""
        if trace and live[0]:
            traced.append(_trace(t, cnt[0], tot[0], cand[0], {m: (a[0], b[0]) for m, (a, b) in lat.items()}))
        nc, ni, est, rad = _difference(tot, cnt, cand, rho, st.alpha)
        srm_bad = log_srm_evalue(np.stack([nc, ni], -1), [st.share, 1 - st.share], st.srm_concentration) >= math.log(
            1 / st.srm_alpha
        )
        judged = np.minimum(nc, ni) >= st.min_users_for_harm
        harm = judged & (est + rad < -st.margin)
        if latency:
            for a, b in lat.values():
                lnc, lni, lest, lrad = _difference(a, b, cand, rho, st.harm_alpha)
                harm |= judged & (np.minimum(lnc, lni) >= 2) & (lest - lrad > 0)
        ok = (t >= st.min_step_s) & (np.minimum(nc, ni) >= st.min_users) & (np.minimum(nc, ni) >= 2)
        passed = ok & (est - rad > -st.margin)
        for name, hit in (("abort_invalid", srm_bad & ((nc + ni) > 0)), ("abort_harm", harm), ("passed", passed)):
            new = live & hit
            outcome[new], at[new] = name, t
            live &= ~new
        first_pass[np.isnan(first_pass) & passed & (t <= st.max_step_s)] = t
        ran_out = live & (t >= limit)
        ahead = ran_out & (est > 0) & (extended < st.extensions)
        limit[ahead] += st.max_step_s
        extended += ahead
        done = ran_out & ~ahead
        outcome[done], at[done] = "abort_inconclusive", t
        if not (outcome == "").any():
            break
    counts = {k: int((outcome == k).sum()) for k in ("passed", "abort_harm", "abort_invalid", "abort_inconclusive")}
    in_time = int(((outcome == "passed") & (at <= st.max_step_s)).sum())
    return {
        "reps": reps,
        "effect": effect,
        "rho": rho,
        "expected_users": expected_users(tr, st.max_step_s, seed=seed + 1),
        "outcomes": counts,
        "passed_in_time": in_time,
        "extended": int((extended > 0).sum()),
        "median_s": {k: float(np.median(at[outcome == k])) if (outcome == k).any() else None for k in counts},
        "trace": traced,
        "first": (str(outcome[0]), float(at[0])),
    }


def _trace(t: float, cnt: np.ndarray, tot: np.ndarray, cand: np.ndarray, lat: dict[str, Any]) -> dict[str, Any]:
    users: dict[str, dict[str, list[float]]] = {"candidate": {}, "incumbent": {}}
    for u in np.flatnonzero(cnt > 0):
        n = float(cnt[u])
        rec = [n, float(tot[u]), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        for m in ("ttft_ms", "tpot_ms"):
            s, c = lat[m]
            rec += [float(c[u]), float(s[u])]
        users["candidate" if cand[u] else "incumbent"][f"u{u}"] = rec
    return {"t": t, "users": users}


def check_decide(tr: DemoTraffic, st: Step, effect: float, seed: int, latency: bool = False) -> dict[str, Any]:
    """Replicate 0 through the real `decide` at every look: `agree` iff it ends as the simulation's does,
    at the same look (`passed` is `awaiting_approval`: the config has one step)."""
    sim = simulate_step(tr, st, effect, 2, seed, latency=latency, trace=True)
    cfg = config(st, latency)
    extensions, got = 0, None
    for look in sim["trace"]:
        progress = CanaryProgress(step=0, share=st.share, started_at=T0, counts={})
        progress = progress.model_copy(update={"rho": sim["rho"], "active_s": look["t"], "extensions": extensions})
        d = decide(progress, CanaryOutcomes(steps={0: look["users"]}), cfg, T0 + timedelta(seconds=look["t"]))
        if d.action == "extend":
            extensions += 1
        elif d.action != "wait":
            got = ("passed" if d.action == "awaiting_approval" else d.action, look["t"])
            break
    want = sim["first"]
    return {"decide": got, "simulation": want, "agree": got == want, "looks": len(sim["trace"])}


def config(st: Step, latency: bool = True) -> CanaryConfig:
    """The `CanaryConfig` of `st` (the last step of its ramp)."""
    return CanaryConfig(
        steps=(st.share,),
        margin=st.margin,
        max_step_s=st.max_step_s,
        min_step_s=st.min_step_s,
        min_users_per_arm=st.min_users,
        min_users_for_harm=st.min_users_for_harm,
        alpha=st.alpha,
        guardrail_alpha=st.harm_alpha,
        srm_threshold=st.srm_alpha,
        guardrails=("ttft_ms", "tpot_ms") if latency else (),
        extend_inconclusive=st.extensions,
    )


def power(tr: DemoTraffic, st: Step, reps: int, seed: int) -> dict[str, Any]:
    """At `st.margin`: the equal candidate, the one worse by twice the margin, and the A/A latency."""
    eq = simulate_step(tr, st, 0.0, reps, seed)
    worse = simulate_step(tr, st, -2 * st.margin, reps, seed + 1)
    aa = simulate_step(tr, st, 0.0, reps, seed + 2, latency=True)
    return {
        "margin": st.margin,
        "share": st.share,
        "rho": eq["rho"],
        "expected_users": eq["expected_users"],
        "equal_passed_in_time": eq["passed_in_time"] / reps,
        "equal": eq["outcomes"],
        "worse_aborted_harm": worse["outcomes"]["abort_harm"] / reps,
        "worse": worse["outcomes"],
        "aa_false_aborts": (aa["outcomes"]["abort_harm"] + aa["outcomes"]["abort_invalid"]) / reps,
        "aa": aa["outcomes"],
        "reps": reps,
    }


def smallest_margin(tr: DemoTraffic, st: Step, reps: int, seed: int, grid: list[float]) -> dict[str, Any]:
    """The first margin of `grid` at which both powers reach 80%, with every row tried."""
    rows = []
    for m in grid:
        s = replace(st, margin=m)
        eq = simulate_step(tr, s, 0.0, reps, seed)
        worse = simulate_step(tr, s, -2 * m, reps, seed + 1)
        row = {"margin": m, "equal_passed_in_time": eq["passed_in_time"] / reps, "rho": eq["rho"]}
        row["expected_users"] = eq["expected_users"]
        row["worse_aborted_harm"] = worse["outcomes"]["abort_harm"] / reps
        rows.append(row)
        if row["equal_passed_in_time"] >= 0.8 and row["worse_aborted_harm"] >= 0.8:
            return {"margin": m, "rows": rows}
    return {"margin": None, "rows": rows}


def main() -> None:
    from bench import common

    ap = common.parser(__doc__)
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    st0 = common.stamp()
    grid = [round(0.01 * i, 2) for i in range(8, 31)]
    runs = {
        "full step 0 (20%)": (FULL, Step(0.2, 0.0, 120.0)),
        "full step 1 (50%)": (FULL, Step(0.5, 0.0, 120.0)),
        "quick step 0 (50%)": (QUICK, QUICK_STEP),
    }
    res: dict[str, Any] = {"reps": a.reps, "seed": a.seed, "traffic": {"full": asdict(FULL), "quick": asdict(QUICK)}}
    res["search"] = {k: smallest_margin(tr, st, a.reps, a.seed, grid) for k, (tr, st) in runs.items()}
    chosen = {k: replace(st, margin=res["search"][k]["margin"] or 0.3) for k, (_, st) in runs.items()}
    chosen = {k: replace(st, margin=max(s.margin for s in chosen.values())) if k.startswith("full") else st
              for k, st in chosen.items()}  # fmt: skip
    res["at_margin"] = {k: power(runs[k][0], st, a.reps, a.seed + 100) for k, st in chosen.items()}
    common.save(NAME, res, st0, a.out)


if __name__ == "__main__":
    main()
