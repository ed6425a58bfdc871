"""The promotion gate's error rates, by simulation: how often it lets a bad candidate through, how often it
stops a good one, and how many users the canary needs.

Every verdict below comes from the gate's own functions: the offline tests of `gating.stats`
(`paired_t_non_inferiority`, `family_regressions` with Holm) as `gating.evals.evaluate_offline`
combines them, and the online `gating.canary.decide` at its default `CanaryConfig`, called after every
batch of simulated traffic. Nothing here re-implements a test.

**Measured rates.** The demo base model (`models/demo-base`, `demo.bootstrap.SHIPPED_BASE`: the shipped
`flywheel bootstrap` recipe; made if missing) is sampled once on the gate's suite (`demo.suite.demo_suite`:
the gate split, 512 prompts of 18 families; the results of the old 8-family product's run were on its 62), `M`
samples per prompt at the gate's settings (temperature 1, 48 tokens, seeds `sample_seed(seed, prompt, g)`),
scored by `DemoVerifier`; each sample also keeps what the guardrails look at (malformed, in a loop,
length) and the demo users' expected satisfaction (`demo.users.satisfaction`). Saved in the JSON.

**Offline replicates** (`G` samples per prompt and version, default 8 as `GateConfig`). Each version's G
samples of a prompt are drawn with replacement from that prompt's M measured samples, independently per
version: the pass outcomes are Bernoulli(p_i), p_i the measured rate, and the guardrail numbers come
along. The gate's verdict is `non_inferiority and families and length and malformed and repetition`
(`offline_checks`; KL is taken as 0, as between two versions with one distribution; the spot check
measures it). Scenarios:
- equal: both versions as measured. No common random numbers (the real gate seeds both alike, which
  helps a candidate close to the incumbent): the case of a candidate with other weights and seeds.
- worse by the margin: each passing sample of the candidate turns into a failure with probability k_i,
  so its rate is p_i (1 - k_i) and the mean over prompts is exactly mean(p) - margin. Two spreads:
  "uniform" (every prompt loses the same delta, prompts below delta lose all: k_i = min(1, delta / p_i),
  delta solved so the mean drop is the margin) and "proportional" (k_i = margin / mean(p)).
Bigger G and bigger suites (each prompt repeated r times, families alike) show what power costs.

**Online replicates.** A population of users, each with a satisfaction rate p_u ~ Beta(m c, (1 - m) c)
(m: the base model's measured satisfaction, c the concentration) and a heavy-tailed activity (requests
per hour log-normal); latency log-normal, errors Bernoulli and the verifier's score (the pass-rate
guardrail) Bernoulli(measured pass rate), the same in both arms. Each request's reward is Bernoulli(p_u)
on the incumbent and Bernoulli(p_u f) on the candidate (f = 1 - effect / m: the user-averaged
satisfaction drops by exactly `effect`), and every sample is an exposure (reported shown). Users are
assigned by the gate's own sticky hash (`gating.stats.assignment_unit`, a new salt per replicate;
`assign_arm` is "unit < share").
Time is a simulated clock: every batch (one minute) adds each user's requests of that minute, then
`decide` looks; `next_step` starts a new step (stratified: counted from then on), any other final action
ends the replicate. For speed the per-user numbers live in numpy arrays (`SimOutcomes`, a
`CanaryOutcomes` whose `users` / `per_user` read them in bulk); `check_equivalence` replays a small world
through the real `CanaryOutcomes.add` with real `SampleEvent`s, and `assign_arm`, and requires the same
decision at every look. Scenarios on the default ramp (30,000 users): A/A, worse by the margin, a 5-point
drop; and the 5-point drop in one step at 5%, 20% or 50% given a day, in a population of 120,000 (so that
the users a step needs are not capped by the population).

**Spot check.** One real `evaluate_offline` of the base against itself under other sampling seeds
(`ReseededEngine`: an `EmbeddedEngine` that re-draws one version's seeds), on the real suite; its
checks are re-derived by `offline_checks` from its numbers (they must agree), and its lower bound is
placed in the simulated distribution. A dispersion check: the base model's mean pass rate over 16 real
evaluations with other seeds, against the scatter that independent Bernoulli draws predict.

Rates come with 95% Clopper-Pearson intervals. A bound is "met" when the interval lies on its right side,
"missed" when it lies wholly on the wrong side, "consistent" when it straddles the bound.

Usage: python bench/gate_sim.py [--reps 1000] [--model DIR] [--samples 64] [--seed 0] [--no-spot]
Writes bench/results/gate_sim.json and bench/results/gate_sim.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import numpy as np
from scipy import stats as sps

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from demo.bootstrap import SHIPPED_BASE  # noqa: E402
from feedback.events import CompletionEvent, RoutedExperts, SampleEvent, Signal  # noqa: E402
from gating.canary import ARMS, CanaryConfig, CanaryOutcomes, decide  # noqa: E402
from gating.evals import Guardrails, ModelScorer, evaluate_offline, has_loop, sample_seed  # noqa: E402
from gating.models import CanaryProgress  # noqa: E402
from gating.stats import (  # noqa: E402
    DEFAULT_ALPHA,
    DEFAULT_MARGIN,
    assign_arm,
    assignment_unit,
    family_regressions,
    paired_t_non_inferiority,
)
from serving.engine import Completion, EmbeddedEngine  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402

T0 = datetime(2025, 1, 1, tzinfo=UTC)
TENANT = "sim"
CANDIDATE, INCUMBENT = "candidate-v", "incumbent-v"


# ---- bounds ------------------------------------------------------------------------------------------


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact two-sided interval for a binomial rate (k successes in n)."""
    a = (1.0 - level) / 2.0
    lo = 0.0 if k == 0 else float(sps.beta.ppf(a, k, n - k + 1))
    hi = 1.0 if k == n else float(sps.beta.ppf(1.0 - a, k + 1, n - k))
    return lo, hi


def rate(k: int, n: int, bound: float | None = None, at_most: bool = True) -> dict[str, Any]:
    """k of n with its interval and, given a bound on the rate (at most, or at least), a verdict: "met" when
    the interval lies on the bound's right side, "missed" when it lies wholly on the wrong side, else
    "consistent" (the simulation cannot tell, at this many replicates)."""
    lo, hi = clopper_pearson(k, n)
    out: dict[str, Any] = {"k": k, "n": n, "rate": k / n, "ci95": [lo, hi]}
    if bound is not None:
        met, missed = (hi <= bound, lo > bound) if at_most else (lo >= bound, hi < bound)
        out |= {"bound": bound, "at_most": at_most, "verdict": "met" if met else "missed" if missed else "consistent"}
    return out


def binomial_ceiling(n: int, p: float, tail: float = 1e-6) -> int:
    """The smallest k with P(Binomial(n, p) >= k) <= tail: a count that a rate of p reaches only by a
    one-in-a-million accident (used by the CI test so that it cannot flake)."""
    return int(sps.binom.isf(tail, n, p)) + 1


def binomial_floor(n: int, p: float, tail: float = 1e-6) -> int:
    """The largest k with P(Binomial(n, p) <= k) <= tail."""
    return int(sps.binom.ppf(tail, n, p)) - 1


# ---- measured rates ----------------------------------------------------------------------------------


def measure(model_dir: Path, samples: int, seed: int, max_tokens: int = 48, temperature: float = 1.0) -> dict:
    """Sample the model `samples` times per prompt of the demo suite, as the gate samples; per prompt, the
    samples' pass flags, malformed and loop flags, lengths and the demo users' expected satisfaction."""
    from demo.checker import check_batch
    from demo.suite import demo_suite
    from demo.tasks import task_from_prompt
    from demo.users import satisfaction

    suite, rails = demo_suite(), Guardrails()
    t0 = time.perf_counter()
    engine = EmbeddedEngine(max_batch=64, max_model_len=256, threads=2, seed=seed)
    try:
        engine.add_version("base", model_dir)
        tok = engine.tokenizer("base")
        owners = [it.prompt for it in suite.items for _ in range(samples)]
        params = [
            SamplingParams(temperature, 1.0, max_tokens, suite.stop, sample_seed(seed, it.prompt, g))
            for it in suite.items
            for g in range(samples)
        ]
        outs = engine.generate([tok.encode_prompt(p) for p in owners], params, "base")
    finally:
        engine.shutdown()
    t_sampled = time.perf_counter()
    texts = [o.text for o in outs]
    passed = suite.verifier.verify(owners, texts)
    tasks = [task_from_prompt(p) for p in owners]
    checks = check_batch([t for t in tasks if t is not None], texts)
    sat = [satisfaction(t, c, r) for t, c, r in zip(tasks, texts, checks, strict=True) if t is not None]
    assert suite.well_formed is not None
    prompts: list[dict[str, Any]] = []
    for i, it in enumerate(suite.items):
        sl = slice(i * samples, (i + 1) * samples)
        prompts.append(
            {
                "prompt": it.prompt,
                "family": it.family,
                "passed": [int(x) for x in passed[sl]],
                "malformed": [int(not o.text.strip() or not suite.well_formed(it.prompt, o.text)) for o in outs[sl]],
                "looping": [
                    int(has_loop(o.output_ids, rails.loop_max_ngram, rails.loop_min_repeats, rails.loop_min_span))
                    for o in outs[sl]
                ],
                "tokens": [len(o.output_ids) for o in outs[sl]],
                "satisfaction": float(np.mean(sat[sl])),
            }
        )
    rates = [float(np.mean(p["passed"])) for p in prompts]
    return {
        "model": _shown(model_dir),
        "suite": {"name": suite.name, "version": suite.suite_version, "n_prompts": len(suite.items)},
        "samples_per_prompt": samples,
        "sampling": {"temperature": temperature, "top_p": 1.0, "max_tokens": max_tokens, "seed": seed},
        "mean_pass_rate": float(np.mean(rates)),
        "mean_satisfaction": float(np.mean(sat)),
        "per_prompt_pass_rate": rates,
        "prompts": prompts,
        "seconds": {"sampling": t_sampled - t0, "total": time.perf_counter() - t0},
    }


def _shown(path: Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


# ---- offline -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    """Measured samples, [prompts, M] each: what one draw of a version's sample on a prompt can be."""

    passed: np.ndarray
    malformed: np.ndarray
    looping: np.ndarray
    tokens: np.ndarray
    families: tuple[str, ...]

    @classmethod
    def from_measured(cls, measured: dict) -> Pool:
        ps = measured["prompts"]
        arr = lambda key: np.array([p[key] for p in ps], dtype=np.float64)  # noqa: E731
        return cls(arr("passed"), arr("malformed"), arr("looping"), arr("tokens"), tuple(p["family"] for p in ps))

    @property
    def rates(self) -> np.ndarray:
        return self.passed.mean(axis=1)

    def repeated(self, r: int) -> Pool:
        """A suite r times as big with the same rates: every prompt (and its family) r times."""
        rep = lambda a: np.repeat(a, r, axis=0)  # noqa: E731
        return Pool(
            rep(self.passed),
            rep(self.malformed),
            rep(self.looping),
            rep(self.tokens),
            tuple(np.repeat(self.families, r)),
        )


def uniform_flip(p: np.ndarray, margin: float) -> np.ndarray:
    """k_i for the "uniform" spread: every prompt loses delta of pass rate (all of it if below delta), with
    delta solved (bisection) so that mean(min(p_i, delta)) = margin."""
    if p.mean() <= margin:
        raise ValueError(f"mean pass rate {p.mean():.3f} is not above the margin {margin}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.minimum(p, mid).mean() < margin else (lo, mid)
    delta = (lo + hi) / 2
    return np.where(p > 0, np.minimum(1.0, delta / np.where(p > 0, p, 1.0)), 0.0)


def proportional_flip(p: np.ndarray, margin: float) -> np.ndarray:
    """k_i for the "proportional" spread: every prompt loses the same share margin / mean(p) of its rate."""
    return np.full(p.shape, margin / p.mean())


def offline_checks(
    cand: np.ndarray,
    inc: np.ndarray,
    families: Sequence[str],
    arms: dict[str, dict[str, float]],
    rails: Guardrails,
    margin: float = DEFAULT_MARGIN,
    alpha: float = DEFAULT_ALPHA,
) -> tuple[dict[str, bool], dict[str, bool]]:
    """The checks of `evaluate_offline` but KL, from per-prompt means and the arms' guardrail numbers
    (`arms[v]`: mean_tokens, malformed, looping), by the same `gating.stats` calls it makes; and a
    diagnostic that is no check: `families_unadjusted`, every family's own test passed (no Holm)."""
    idx: dict[str, list[int]] = {}
    for k, f in enumerate(families):
        idx.setdefault(f, []).append(k)
    tests = {f: paired_t_non_inferiority(cand[ix], inc[ix], margin, alpha) for f, ix in sorted(idx.items())}
    c, i = arms["candidate"], arms["incumbent"]
    ratio = c["mean_tokens"] / i["mean_tokens"]
    checks = {
        "non_inferiority": paired_t_non_inferiority(cand, inc, margin, alpha).passed,
        "families": family_regressions(tests, alpha).all_passed,
        "length": rails.min_length_ratio <= ratio <= rails.max_length_ratio,
        "malformed": c["malformed"] - i["malformed"] <= rails.max_malformed_increase,
        "repetition": c["looping"] - i["looping"] <= rails.max_repetition_increase,
    }
    return checks, {"families_unadjusted": all(t.passed for t in tests.values())}


def simulate_offline(
    pool: Pool, flip: np.ndarray | None, G: int, reps: int, rng: np.random.Generator, keep_bounds: bool = False
) -> dict[str, Any]:
    """`reps` offline verdicts: both versions draw G of the measured samples per prompt; the candidate's
    passes turn into failures with probability flip[i] (None: it is as good). Pass counts per check."""
    rails, n, m = Guardrails(), pool.passed.shape[0], pool.passed.shape[1]
    rows = np.arange(n)[None, :, None]
    counts: Counter[str] = Counter()
    lower = []
    chunk = max(1, min(100, 2_000_000 // (n * G)))  # bounded memory: about 2M draws per array
    for start in range(0, reps, chunk):
        r = min(chunk, reps - start)
        draws = {v: rng.integers(0, m, size=(r, n, G)) for v in ARMS}
        passed = {v: pool.passed[rows, d] for v, d in draws.items()}
        if flip is not None:
            passed["candidate"] = passed["candidate"] * (rng.random((r, n, G)) >= flip[None, :, None])
        means = {v: x.mean(axis=2) for v, x in passed.items()}
        feats = {
            v: {
                "mean_tokens": pool.tokens[rows, d].mean(axis=(1, 2)),
                "malformed": pool.malformed[rows, d].mean(axis=(1, 2)),
                "looping": pool.looping[rows, d].mean(axis=(1, 2)),
            }
            for v, d in draws.items()
        }
        for j in range(r):
            arms = {v: {k: float(a[j]) for k, a in feats[v].items()} for v in ARMS}
            checks, diag = offline_checks(means["candidate"][j], means["incumbent"][j], pool.families, arms, rails)
            counts.update(k for k, ok in (checks | diag).items() if ok)
            counts["verdict"] += all(checks.values())
            counts["statistics"] += checks["non_inferiority"] and checks["families"]
            if keep_bounds:
                lower.append(paired_t_non_inferiority(means["candidate"][j], means["incumbent"][j]).lower_bound)
    keys = "verdict statistics non_inferiority families families_unadjusted length malformed repetition".split()
    out: dict[str, Any] = {"reps": reps, "G": G, "n_prompts": n, "passed": {k: counts[k] for k in keys}}
    if keep_bounds:
        out["lower_bounds"] = lower
    return out


class ReseededEngine(EmbeddedEngine):
    """An `EmbeddedEngine` that samples the version `reseeded` with other seeds (a hash of each seed it is
    asked for): that version is then the same model, sampled independently of the others."""

    def __init__(self, reseeded: str, salt: int = 1, **kw: Any):
        super().__init__(**kw)
        self.reseeded, self.salt = reseeded, salt

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams], version: str | None = None
    ) -> list[Completion]:
        if version == self.reseeded:
            plist = params if isinstance(params, list) else [params] * len(prompt_ids)
            params = [dataclasses.replace(p, seed=sample_seed(self.salt, "reseed", p.seed or 0)) for p in plist]
        return super().generate(prompt_ids, params, version)


def spot_check(model_dir: Path, G: int, seed: int) -> dict[str, Any]:
    """One real `evaluate_offline`: the base model against itself under other sampling seeds."""
    from demo.suite import demo_suite

    suite = demo_suite()
    cand, inc = "base-reseeded", "base"
    engine = ReseededEngine(cand, max_batch=64, max_model_len=256, threads=2, seed=seed)
    try:
        engine.add_version(inc, model_dir)
        engine.add_version(cand, model_dir)
        t0 = time.perf_counter()
        res = evaluate_offline(engine, cand, inc, suite, scorer=ModelScorer({inc: model_dir}), G=G, seed=seed)
        seconds = time.perf_counter() - t0
    finally:
        engine.shutdown()
    nums = res.numbers
    g = nums["guardrails"]
    arms = {
        "candidate": {
            "mean_tokens": g["length"]["candidate_mean_tokens"],
            "malformed": g["malformed"]["candidate_share"],
            "looping": g["repetition"]["candidate_share"],
        },
        "incumbent": {
            "mean_tokens": g["length"]["incumbent_mean_tokens"],
            "malformed": g["malformed"]["incumbent_share"],
            "looping": g["repetition"]["incumbent_share"],
        },
    }
    families = [it.family for it in suite.items]
    pp = nums["per_prompt"]
    rederived, _ = offline_checks(np.array(pp["candidate"]), np.array(pp["incumbent"]), families, arms, Guardrails())
    real = {k: v for k, v in nums["checks"].items() if k in rederived}
    return {
        "candidate": cand,
        "incumbent": inc,
        "G": G,
        "seed": seed,
        "passed": res.passed,
        "failed": res.failed,
        "checks": nums["checks"],
        "rederived_checks_agree": rederived == real,
        "reward": nums["reward"],
        "non_inferiority": nums["non_inferiority"],
        "families": {
            f: {k: v[k] for k in ("n_prompts", "mean_diff", "lower_bound", "p_value", "passed")}
            for f, v in nums["families"].items()
        },
        "kl_per_token": g["kl"]["per_token"],
        "per_prompt": pp,
        "seconds": seconds,
    }


def dispersion_check(model_dir: Path, rates: np.ndarray, G: int, seeds: int, seed0: int) -> dict[str, Any]:
    """Do real evaluations scatter as the simulation's independent Bernoulli draws say? The base model's
    mean pass rate in `seeds` evaluations of G samples per prompt (the gate's sampling, other seeds), against
    the binomial sd sqrt(sum_i G p_i (1 - p_i)) / (G n) from the measured rates: their variance ratio and
    the chi-square p-value of that ratio (small: the real scatter is wider than simulated)."""
    from demo.suite import demo_suite

    suite = demo_suite()
    engine = EmbeddedEngine(max_batch=64, max_model_len=256, threads=2)
    try:
        engine.add_version("base", model_dir)
        tok = engine.tokenizer("base")
        owners = [it.prompt for it in suite.items for _ in range(G)]
        ids = [tok.encode_prompt(p) for p in owners]
        means = []
        for s in range(seed0, seed0 + seeds):
            params = [
                SamplingParams(1.0, 1.0, 48, suite.stop, sample_seed(s, it.prompt, g))
                for it in suite.items
                for g in range(G)
            ]
            texts = [o.text for o in engine.generate(ids, params, "base")]
            means.append(float(np.mean(suite.verifier.verify(owners, texts))))
    finally:
        engine.shutdown()
    sd = float(np.sqrt((G * rates * (1 - rates)).sum()) / (G * rates.size))
    ratio = float(np.var(means, ddof=1) / sd**2)
    return {
        "G": G,
        "seeds": list(range(seed0, seed0 + seeds)),
        "mean_pass_rates": means,
        "sd": float(np.std(means, ddof=1)),
        "binomial_sd": sd,
        "variance_ratio": ratio,
        "p_wider": float(sps.chi2.sf(ratio * (seeds - 1), seeds - 1)),
    }


# ---- online ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """The simulated users of the online part (see the module docstring)."""

    users: int = 30_000
    concentration: float = 5.0  # Beta(m c, (1 - m) c): per-user satisfaction sd = sqrt(m (1 - m) / (c + 1))
    median_rate_h: float = 3.0  # requests per hour of the median user
    activity_sigma: float = 1.2  # log-normal sd of log(rate): heavy-tailed activity
    latency_median_ms: float = 350.0
    latency_sigma: float = 0.5
    error_rate: float = 0.01
    pass_rate: float = 0.44  # verifier score of each request, both arms (the run sets the measured rate)
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
    """One batch of requests: who made each, its reward, latency, whether it failed, its verifier score."""

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
    "error_rate": (_ERR, _N),
    "pass_rate": (_PASS_SUM, _PASS_N),
}


class _Roster(dict[str, list[float]]):
    """How many users an arm has, which is all `decide` asks of `users()`; their numbers are in arrays.
    Anything else raises, so that a `decide` that starts reading records fails here instead of silently."""

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
    batch at a time (`add_batch`), read in bulk by `users` / `per_user` (arrays stand in for lists: `decide`
    hands them to `gating.stats`, which takes any array-like)."""

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
        return (self.is_candidate[step] == (arm == "candidate")) & (self.acc[step][have] > 0)

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
    step, started, t, looks, passed = 0, 0.0, 0.0, 0, []
    candidate = pop.unit < cfg.steps[0]
    while True:
        outcomes.add_batch(step, candidate, draw_batch(pop, candidate, factor, traffic, rng))
        t += traffic.batch_s
        looks += 1
        d = decide(_progress(step, cfg.steps[step], started), outcomes, cfg, T0 + timedelta(seconds=t))
        if d.action == "wait":
            continue
        if d.action == "next_step":
            passed.append({"step": step, "users": d.numbers["users"], "elapsed_s": d.numbers["elapsed_s"]})
            step, started = step + 1, t
            candidate = pop.unit < cfg.steps[step]
            continue
        final = {k: d.numbers.get(k) for k in ("users", "elapsed_s", "reward", "srm")}
        if d.action == "awaiting_approval":
            passed.append({"step": step, "users": d.numbers["users"], "elapsed_s": d.numbers["elapsed_s"]})
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
        output_ids=[2],
        logprobs=[-0.5],
        routed_experts=RoutedExperts.from_bytes((1, 1, 1), b"\x00"),
        text="x",
        finish_reason="error" if error else "stop",
        params={},
        latency_ms={"total": latency},
        arm=arm,
    )
    shown = Signal(kind="shown", ts=ts, user_id=uid)  # an exposure: counted under denominator="exposures"
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
    """`reps` replicates of every scenario (name -> (effect, config)); replicate r shares its population and
    salt across scenarios."""
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
            sorted(Counter(f"{r.action}@{r.step}" for r in runs if r.action[:5] == "abort").items())
        ),
        "aborted": rate(sum(v for a, v in actions.items() if a.startswith("abort")), n),
        "passed": rate(actions["awaiting_approval"], n),
        "steps_passed": steps,
        "harm_at": {
            "step": dict(sorted(Counter(str(r.step) for r in harm).items())),
            "users_total": _quantiles([sum(r.final["users"].values()) for r in harm]),
            "users_candidate": _quantiles([r.final["users"]["candidate"] for r in harm]),
            "elapsed_h": _quantiles([r.final["elapsed_s"] / 3600 for r in harm]),
            "requests_per_user": _quantiles([r.final["requests_per_user"] for r in harm]),
        },
        "looks": _quantiles([r.looks for r in runs]),
        "simulated_h": _quantiles([r.total_s / 3600 for r in runs]),
    }


# ---- the benchmark -----------------------------------------------------------------------------------


def ensure_model(model_dir: Path) -> dict:
    from demo.bootstrap import REPORT, BootstrapConfig, bootstrap

    if not (model_dir / REPORT).is_file():
        print(f"bootstrapping the demo base model into {model_dir} (flywheel bootstrap's recipe) ...", flush=True)
    report = bootstrap(model_dir, BootstrapConfig())
    return {k: report[k] for k in ("steps", "stopped_early", "final_loss", "parameters")} | {
        "eval_pass_rate": report["eval"]["pass_rate"]
    }


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg": list(os.getloadavg()),
        "note": "2-core VM shared with other jobs",
    }


OFFLINE_GRID = ((8, 1), (16, 1), (32, 1), (64, 1), (128, 1), (256, 1), (8, 2), (8, 4), (8, 8), (8, 16))
"""(G, r): samples per prompt, and the suite repeated r times (512 r prompts on the default suite). (8, 1) is
the gate's default."""


def run_offline(pool: Pool, reps: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, 1])
    margin, alpha = DEFAULT_MARGIN, DEFAULT_ALPHA
    flips = {"uniform": uniform_flip(pool.rates, margin), "proportional": proportional_flip(pool.rates, margin)}
    out: dict[str, Any] = {"G_default": 8, "n_prompts_default": len(pool.families), "flip": {}, "cells": []}
    for name, flip in flips.items():
        drop = float((pool.rates * flip).mean())
        assert abs(drop - margin) < 1e-9, (name, drop)
        out["flip"][name] = {"k": flip.tolist(), "mean_drop": drop}
    t0 = time.perf_counter()
    for G, r in OFFLINE_GRID:
        p, default = pool.repeated(r), (G, r) == (8, 1)
        eq = simulate_offline(p, None, G, reps, rng, keep_bounds=default)
        cell: dict[str, Any] = {"G": G, "n_prompts": len(p.families)}
        cell["equal"] = {k: rate(v, reps) for k, v in eq["passed"].items()}
        cell["equal"]["verdict"] = rate(eq["passed"]["verdict"], reps, 0.80, at_most=False)
        if default:
            out["equal_lower_bounds"] = eq["lower_bounds"]
        for spread in ("uniform", "proportional") if default else ("uniform",):
            wr = simulate_offline(p, np.repeat(flips[spread], r), G, reps, rng)
            cell[f"worse_{spread}"] = {k: rate(v, reps, alpha) for k, v in wr["passed"].items()}
        out["cells"].append(cell)
        print(f"offline G={G} n={cell['n_prompts']}: equal {eq['passed']}", flush=True)
    out["seconds"] = time.perf_counter() - t0
    return out


DETECTION_USERS = 120_000
"""Population of the fixed-share detection runs: big enough that the users a step needs are not capped by it."""


def run_online(measured: dict, reps: int, seed: int) -> dict[str, Any]:
    traffic = Traffic(pass_rate=measured["mean_pass_rate"])
    big = dataclasses.replace(traffic, users=DETECTION_USERS)
    mean_sat, default, margin = measured["mean_satisfaction"], CanaryConfig(), DEFAULT_MARGIN
    small = [(1.0, CanaryConfig(margin=0.15, min_users_per_arm=10, min_step_s=300)), (0.5, CanaryConfig())]
    equivalence = [
        {"factor": f, **check_equivalence(mean_sat, f, seed + i, cfg.model_copy(update={"max_step_s": 3600.0}))}
        for i, (f, cfg) in enumerate(small)
    ]
    assert all(e["agree"] for e in equivalence), equivalence
    ramp = {"aa": (0.0, default), "worse_by_margin": (margin, default), "drop_5pt": (0.05, default)}
    detect = {  # users needed at one share, the step given a day
        f"drop_5pt_at_{share:.0%}": (0.05, default.model_copy(update={"steps": (share,), "max_step_s": 86400.0}))
        for share in (0.05, 0.20, 0.50)
    }
    t0 = time.perf_counter()

    def tick(r: int) -> None:
        if (r + 1) % 100 == 0:
            print(f"online: {r + 1}/{reps} replicates, {time.perf_counter() - t0:.0f}s", flush=True)

    sc: dict[str, Any] = {}
    for group, tr in ((ramp, traffic), (detect, big)):
        runs = simulate_online(group, tr, mean_sat, reps, seed, tick)
        sc |= {name: {"effect": e, "users": tr.users, **summarize(runs[name])} for name, (e, _) in group.items()}
    sc["worse_by_margin"]["passed"] = rate(sc["worse_by_margin"]["passed"]["k"], reps, DEFAULT_ALPHA)
    aa = sc["aa"]
    aa["aborted"] = rate(aa["aborted"]["k"], reps, DEFAULT_ALPHA)
    alarms = aa["actions"].get("abort_invalid", 0) + aa["actions"].get("abort_harm", 0)
    aa["false_alarms"] = rate(alarms, reps, DEFAULT_ALPHA)  # SRM and harm: what the statistics decide
    return {
        "config": default.model_dump(mode="json"),
        "traffic": dataclasses.asdict(traffic),
        "mean_satisfaction": mean_sat,
        "equivalence": equivalence,
        "scenarios": sc,
        "seconds": time.perf_counter() - t0,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    out: dict[str, Any] = {"started_at": datetime.now(UTC).isoformat(timespec="seconds"), "reps": args.reps}
    out["seed"], model_dir = args.seed, Path(args.model)
    out["base_model"] = ensure_model(model_dir)
    out["measured"] = measured = measure(model_dir, args.samples, seed=args.seed + 1000)
    print(f"measured: pass rate {measured['mean_pass_rate']:.3f} in {measured['seconds']['total']:.0f}s", flush=True)
    out["offline"] = run_offline(Pool.from_measured(measured), args.reps, args.seed)
    if not args.no_spot:
        spot = spot_check(model_dir, G=8, seed=args.seed)
        bounds = np.asarray(out["offline"]["equal_lower_bounds"])
        spot["lower_bound_quantile_in_simulation"] = float(np.mean(bounds <= spot["non_inferiority"]["lower_bound"]))
        out["spot_check"] = spot
        assert spot["rederived_checks_agree"], "offline_checks no longer combines the checks as evaluate_offline"
        print(f"spot check: passed={spot['passed']} failed={spot['failed']} ({spot['seconds']:.0f}s)", flush=True)
        rates = np.asarray(measured["per_prompt_pass_rate"])
        out["dispersion_check"] = dispersion_check(model_dir, rates, G=8, seeds=16, seed0=args.seed + 2000)
    out["offline"]["equal_lower_bounds"] = _quantiles(out["offline"]["equal_lower_bounds"])
    out["online"] = run_online(measured, args.reps, args.seed)
    out["seconds"], out["machine"] = time.perf_counter() - t_start, machine()
    return out


def _pct(r: dict[str, Any]) -> str:
    return f"{100 * r['rate']:.1f}% [{100 * r['ci95'][0]:.1f}, {100 * r['ci95'][1]:.1f}]"


def _q(q: dict[str, float] | None, key: str = "median", fmt: str = ",.0f") -> str:
    return "-" if q is None else format(q[key], fmt)


def write_md(res: dict[str, Any], path: Path) -> None:
    """The four claims, then the tables behind them (the findings are written by hand below them)."""
    off, on, m, mach = res["offline"], res["online"], res["measured"], res["machine"]
    cell = off["cells"][0]
    sc = on["scenarios"]
    a = DEFAULT_ALPHA
    row = lambda what, r, bound: f"| {what} | {_pct(r)} | {bound} | {r['verdict']} |"  # noqa: E731
    d5, h5 = sc["drop_5pt"], sc["drop_5pt"]["harm_at"]
    lines = [
        "# The gate's error rates, by simulation",
        "",
        f"Run {res['started_at']} on {mach['platform']}, {mach['cpus']} CPUs ({mach['note']}; load average "
        f"{mach['load_avg'][0]:.1f} at the end); {res['reps']} replicates per scenario, seed {res['seed']}; "
        f"{res['seconds'] / 60:.1f} min in all (offline {off['seconds']:.0f} s, online {on['seconds']:.0f} s). "
        "Rates: estimate [95% Clopper-Pearson]. Reproduce: `python bench/gate_sim.py` (design: its docstring).",
        "",
        f"Measured: `{m['model']}` on `{m['suite']['version']}` ({m['suite']['n_prompts']} prompts), "
        f"{m['samples_per_prompt']} samples per prompt: mean pass rate {m['mean_pass_rate']:.3f}, demo users' "
        f"satisfaction {m['mean_satisfaction']:.3f}.",
        "",
        "| claim | measured | bound | verdict |",
        "|---|---|---|---|",
        row(
            "(i) offline, worse by the margin (uniform spread): verdict passes",
            cell["worse_uniform"]["verdict"],
            f"<= {a}",
        ),
        row("... its non-inferiority test alone", cell["worse_uniform"]["non_inferiority"], f"<= {a}"),
        row(
            "(i) offline, worse by the margin (proportional): verdict passes",
            cell["worse_proportional"]["verdict"],
            f"<= {a}",
        ),
        row("... its non-inferiority test alone", cell["worse_proportional"]["non_inferiority"], f"<= {a}"),
        row("(i) online, worse by the margin: reaches awaiting_approval", sc["worse_by_margin"]["passed"], f"<= {a}"),
        row(
            f"(ii) offline, equally good (G 8, {cell['n_prompts']} prompts): verdict passes",
            cell["equal"]["verdict"],
            ">= 0.8",
        ),
        row(
            f"(iii) online A/A: aborted (any reason), a look every {on['traffic']['batch_s']:.0f} s",
            sc["aa"]["aborted"],
            f"<= {a}",
        ),
        row("... of which SRM and harm (abort_invalid, abort_harm)", sc["aa"]["false_alarms"], f"<= {a}"),
        "",
        f"(iv) A 5-point satisfaction drop, default ramp: {d5['actions']}; at abort_harm the step had "
        f"{_q(h5['users_total'])} users (median; p90 {_q(h5['users_total'], 'p90')}), "
        f"{_q(h5['users_candidate'])} of them on the candidate, after {_q(h5['elapsed_h'], fmt='.2f')} h.",
        "",
    ]
    lines += [
        "## Offline: how often each check passes",
        "",
        "Independent draws from the measured samples (no common random numbers). `families (no Holm)`: every "
        "family's own test passes, a diagnostic, not a check.",
        "",
        "| G | prompts | equal: verdict | non-inferiority | families | families (no Holm) | worse (uniform): verdict "
        "| non-inferiority |",
        "|---|---|---|---|---|---|---|---|",
    ]
    p = lambda r: f"{100 * r['rate']:.1f}%"  # noqa: E731
    for c in off["cells"]:
        e, w = c["equal"], c["worse_uniform"]
        lines.append(
            f"| {c['G']} | {c['n_prompts']} | {p(e['verdict'])} | {p(e['non_inferiority'])} | {p(e['families'])} | "
            f"{p(e['families_unadjusted'])} | {p(w['verdict'])} | {p(w['non_inferiority'])} |"
        )
    if "spot_check" in res:
        s = res["spot_check"]
        ni = s["non_inferiority"]
        lines += [
            "",
            f"Spot check (real `evaluate_offline`, base vs base with other seeds, G {s['G']}): passed {s['passed']}, "
            f"failed {s['failed']}; pass rate {s['reward']['candidate']:.3f} vs {s['reward']['incumbent']:.3f}, lower "
            f"bound {ni['lower_bound']:+.4f} (quantile {s['lower_bound_quantile_in_simulation']:.2f} of the simulated "
            f"ones), KL {s['kl_per_token']:.2g}/token; its checks re-derived by the simulation's code agree: "
            f"{s['rederived_checks_agree']}.",
        ]
    if "dispersion_check" in res:
        dc = res["dispersion_check"]
        lines += [
            "",
            f"Dispersion check: the base model's mean pass rate in {len(dc['seeds'])} real evaluations (G {dc['G']}, "
            f"other seeds) has sd {dc['sd']:.4f}; independent Bernoulli draws from the measured rates give "
            f"{dc['binomial_sd']:.4f} (variance ratio {dc['variance_ratio']:.2f}, p = {dc['p_wider']:.2f} for wider).",
        ]
    lines += [
        "",
        "## Online: outcomes per scenario",
        "",
        f"Traffic: {on['traffic']}. Container check against the real `CanaryOutcomes.add`: "
        f"{[e['agree'] for e in on['equivalence']]}.",
        "",
        "| scenario | population | effect | outcomes | aborts at step | abort_harm by | users at harm: median (p90) "
        "| candidate users | requests per user | hours |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in sc.items():
        h = s["harm_at"]
        lines.append(
            f"| {name} | {s['users']:,} | {s['effect']} | {s['actions']} | {s['aborts_at_step']} | "
            f"{s['abort_harm_by']} | {_q(h['users_total'])} ({_q(h['users_total'], 'p90')}) | "
            f"{_q(h['users_candidate'])} | {_q(h['requests_per_user'], fmt='.1f')} | {_q(h['elapsed_h'], fmt='.2f')} |"
        )
    aa = sc["aa"]["steps_passed"]
    lines += [
        "",
        "A/A, users in the step when it passed (median, p90): "
        + "; ".join(f"step {k}: {_q(v['users_total'])} ({_q(v['users_total'], 'p90')})" for k, v in aa.items()),
        "",
    ]
    path.write_text("\n".join(lines + findings(res)) + "\n")


def findings(res: dict[str, Any]) -> list[str]:
    """What the numbers say, and what to change (written for this run's numbers, which it quotes)."""
    off, sc, m = res["offline"], res["online"]["scenarios"], res["measured"]
    cells = {(c["G"], c["n_prompts"]): c for c in off["cells"]}
    n0 = off["n_prompts_default"]
    c8, c64, big = cells[(8, n0)], cells[(64, n0)], cells[(8, 8 * n0)]
    r = np.asarray(m["per_prompt_pass_rate"])
    fam_sizes = Counter(q["family"] for q in m["prompts"]).values()
    nf, fam_range = len(fam_sizes), f"{min(fam_sizes)}-{max(fam_sizes)}"
    pc = lambda x: f"{100 * x['rate']:.1f}%"  # noqa: E731
    wm, aa, d5 = sc["worse_by_margin"], sc["aa"], sc["drop_5pt"]
    act, harm_by, at = aa["actions"], aa["abort_harm_by"], aa["aborts_at_step"]
    srm = [at.get(f"abort_invalid@{k}", 0) for k in range(3)]
    n = res["reps"]
    ni = [c["worse_uniform"]["non_inferiority"] for c in off["cells"]]
    ni_missed = [
        f"G {c['G']} x {c['n_prompts']}" for c, x in zip(off["cells"], ni, strict=True) if x["verdict"] == "missed"
    ]
    size_note = (
        f"above alpha at {', '.join(ni_missed)}"
        if ni_missed
        else f"at alpha, as designed (no interval lies above it, across the table's G and suite sizes: "
        f"{min(x['rate'] for x in ni):.1%} to {max(x['rate'] for x in ni):.1%})"
    )
    spot = res.get("spot_check")
    spot_line = (
        f" The spot check agrees: the base against itself with other seeds {'passed' if spot['passed'] else 'failed'}"
        f" ({', '.join(spot['failed']) or 'nothing'}), lower bound {spot['non_inferiority']['lower_bound']:+.3f}, "
        f"quantile {spot['lower_bound_quantile_in_simulation']:.2f} of the simulated ones."
        if spot
        else ""
    )
    rpu = " to ".join(
        _q(sc[f"drop_5pt_at_{share}"]["harm_at"]["requests_per_user"], fmt=".1f") for share in ("50%", "5%")
    )
    detect = "; ".join(
        f"{share}: {_q(sc[f'drop_5pt_at_{share}']['harm_at']['users_total'])} users "
        f"({_q(sc[f'drop_5pt_at_{share}']['harm_at']['users_candidate'])} on the candidate)"
        for share in ("5%", "20%", "50%")
    )
    return [
        "## Findings",
        "",
        "(The prose of these findings was written for the run on the old 8-family product's 62-prompt suite, "
        "`demo-tasks@1`, before the families check became the harm test `family_regressions` and the gate suite "
        "the 512-prompt gate split; the numbers it quotes are this run's.)",
        "",
        f"**(i) {c8['worse_uniform']['verdict']['verdict']} offline, {wm['passed']['verdict']} online.** Offline the "
        f"verdict passed {pc(c8['worse_uniform']['verdict'])} (uniform) and {pc(c8['worse_proportional']['verdict'])} "
        f"(proportional) of the candidates worse by the margin. Its non-inferiority test alone passed "
        f"{pc(c8['worse_uniform']['non_inferiority'])} and {pc(c8['worse_proportional']['non_inferiority'])}: "
        f"{size_note}. The verdict is far "
        "below alpha only because the families check almost never passes (ii). Online none reached "
        f"awaiting_approval: {wm['aborts_at_step']} (action@step).",
        "",
        f"**(ii) {c8['equal']['verdict']['verdict']}, by design, for two reasons.** (1) The families check: "
        f"`family_non_inferiority` asked each of the {nf} families ({fam_range} prompts) to show non-inferiority at "
        f"the same 3-point margin, Holm-adjusted, and the verdict needed all {nf}. An equally good candidate passes "
        f"one family's test well under half the time, so all {nf} ~never: "
        f"{pc(c8['equal']['families'])} at the default size, {pc(cells[(256, n0)]['equal']['families'])} even at "
        f"G 256 and {pc(cells[(8, 16 * n0)]['equal']['families'])} at {16 * n0} prompts, with or without Holm "
        '(column `families (no Holm)`). Holm is not needed for this decision anyway: "pass iff every family '
        'passes" is an intersection-union test, of size at most alpha without any correction (Berger 1982). '
        "(2) The overall test is underpowered at the default size: the base model's per-prompt pass rates all lie "
        f"in [{r.min():.2f}, {r.max():.2f}], so every sample carries near-maximal Bernoulli variance, and with G 8 x "
        f"{n0} prompts an equally good candidate with other weights and seeds clears the lower bound "
        f"{pc(c8['equal']['non_inferiority'])} of the time; {pc(c64['equal']['non_inferiority'])} at G 64, "
        f"{pc(big['equal']['non_inferiority'])} at {8 * n0} prompts x 8." + spot_line,
        "",
        "Fix (gating/evals.py, gating/gate.py): make the families check a harm check, failing a family only when "
        "it is shown worse than the margin (one-sided upper bound mean + t se < -margin; Holm across families keeps "
        "false failures at alpha), and leave the alpha-level decision to the overall test, whose size (i) is then "
        "unchanged; and raise `GateConfig.G` from 8 to 64 (or the suite to ~500 prompts) for >= 80% power against an "
        "independent equally good candidate. Common random numbers (both versions share seeds) help a candidate "
        "whose samples track the incumbent's, a small update; not one with other weights.",
        "",
        f"**(iii) {aa['aborted']['verdict']}:** {pc(aa['aborted'])} of A/A canaries aborted: {act}; "
        f"SRM and harm alone {pc(aa['false_alarms'])}. No test is broken; alpha is not split:",
        f"- Harm ({act.get('abort_harm', 0)}: {harm_by}). Each step runs three one-sided guardrails (latency, error "
        "rate, pass rate) and the satisfaction harm test, each on an always-valid interval at the full alpha (one "
        "side of a two-sided interval: ~alpha/2), restarted at every step (stratified): 12 tests per canary and no "
        "split. Each stays within its own bound (at most "
        f"{max(harm_by.values(), default=0)} false alarms in {n} canaries x 3 steps, against alpha/2 = 2.5% per "
        f"step), but together they abort {pc(rate(act.get('abort_harm', 0), n))}; they fire early in a step "
        f"(median {_q(aa['harm_at']['elapsed_h'], fmt='.2f')} h in), where the boundary is tightest.",
        f"- SRM ({act.get('abort_invalid', 0)}; {srm[0]}, {srm[1]}, {srm[2]} at steps 0, 1, 2). `srm_check` is a "
        "fixed-sample chi-square, re-tested at every look (every minute here; every poll in the gate) at p < 0.001; "
        "repeated over a step's looks it fires far more often than 0.1%.",
        f"- Inconclusive ({act.get('abort_inconclusive', 0)}, at step 0) is traffic: at 5% an A/A step passes after "
        f"{_q(aa['steps_passed']['0']['users_total'])} users (median; p90 "
        f"{_q(aa['steps_passed']['0']['users_total'], 'p90')}), more than a small product sees in 6 h.",
        "",
        "Fix (gating/canary.py, gating/stats.py): budget the false aborts. Run the guardrails at a level that "
        "splits one alpha over all of them and all steps (e.g. `guardrail(..., alpha=2 a / (n_guardrails x "
        "n_steps))` for a one-sided share a); make SRM sequential: an always-valid test of the candidate's share of "
        'users (the normal-mixture boundary of `normal_mixture_radius` on the 0/1 "user is in the candidate '
        'arm", whose variance share (1 - share) is known; or the multinomial mixture test of Lindon & Malek '
        "2022) at a small level per step, instead of a chi-square p-value at every look.",
        "",
        f"**(iv)** With the default ramp a 5-point satisfaction drop is stopped at step 0 (5%): abort_harm "
        f"{pc(rate(d5['actions'].get('abort_harm', 0), n))} of the time, after {_q(d5['harm_at']['users_total'])} "
        f"users in the step (median; p90 {_q(d5['harm_at']['users_total'], 'p90')}; "
        f"{_q(d5['harm_at']['users_candidate'])} on the candidate), {_q(d5['harm_at']['elapsed_h'], fmt='.2f')} h; "
        "the rest end inconclusive or invalid, unpromoted. How many users depends on how many requests each "
        f"brings: in a population of {sc['drop_5pt_at_5%']['users']:,} ({rpu} requests per user at detection, "
        f"against {_q(d5['harm_at']['requests_per_user'], fmt='.1f')} above) a step at {detect} (medians).",
        "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1000)
    ap.add_argument("--model", default=str(SHIPPED_BASE), help="Default: the shipped demo base (models/demo-base).")
    ap.add_argument("--samples", type=int, default=64, help="Measured samples per prompt.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-spot", action="store_true", help="Skip the real evaluate_offline spot check.")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    res = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gate_sim.json").write_text(json.dumps(res, indent=1) + "\n")
    write_md(res, out / "gate_sim.md")
    print((out / "gate_sim.md").read_text())


if __name__ == "__main__":
    main()
