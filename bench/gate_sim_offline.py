"""The offline gate's error rates, by simulation: how often it passes a candidate worse by the margin, and
how often it passes an equally good one (its power), at the gate's G and suite size and beyond.

Every verdict comes from the gate's own functions: `paired_t_non_inferiority` and `family_regressions`
(`gating.stats`), combined as `gating.evals.evaluate_offline` combines them (`offline_checks`, checked
against a real `evaluate_offline` by the spot check below). Nothing here re-implements a test.

**Measured rates.** The demo base (`models/demo-base`, `demo.bootstrap.SHIPPED_BASE`; bootstrapped if
missing) is sampled on the gate's suite (`demo.suite.demo_suite()`: the gate split, 504 prompts: 28 in each of
the 18 families), `--samples` samples per prompt at the gate's settings (temperature 1, 48 tokens, seeds
`sample_seed(seed, prompt, g)`), scored by `DemoVerifier`; each sample also keeps what the guardrails look
at (malformed, in a loop, length) and the demo users' expected satisfaction (`demo.users.satisfaction`).

**Replicates** (`G` samples per prompt and version; 8 is `GateConfig`'s). Each version's G samples of a
prompt are drawn with replacement from that prompt's measured samples, independently per version: pass
outcomes are Bernoulli(p_i) with p_i the measured rate, and the guardrail numbers come along. The verdict
is `non_inferiority and families and length and malformed and repetition` (KL is taken as 0, as between
two versions with one distribution). Scenarios:
- equal: both versions as measured, no common random numbers (a candidate with other weights and seeds);
- worse by the margin: each passing sample of the candidate becomes a failure with probability k_i, so
  its mean over prompts is exactly mean(p) - margin: "uniform" (every prompt loses the same delta, those
  below it lose all) and "proportional" (k_i = margin / mean(p)).
Larger G and larger suites (every prompt repeated r times) show what power costs.

**Spot check.** One real `evaluate_offline` of the base against itself with other sampling seeds
(`ReseededEngine`), whose checks `offline_checks` must re-derive from its numbers; its lower bound is
placed in the simulated distribution. **Dispersion check**: the base's mean pass rate over
`--dispersion-seeds` real evaluations (G 8, other seeds) against the scatter independent Bernoulli draws
predict.

Rates come with 95% Clopper-Pearson intervals; a bound is "met" when the interval lies on its side,
"missed" when wholly on the other, "consistent" when it straddles it. The peer of every rate is its bound
(alpha for (i), 80% for (ii)) and, in the same run, the same test at larger G or suite size.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats as sps

from bench import common
from demo.bootstrap import SHIPPED_BASE
from gating.canary import ARMS
from gating.evals import Guardrails, ModelScorer, evaluate_offline, has_loop, sample_seed
from gating.stats import DEFAULT_ALPHA, DEFAULT_MARGIN, family_regressions, paired_t_non_inferiority
from serving.engine import Completion, EmbeddedEngine
from serving.sampling import SamplingParams

NAME = "gate_sim_offline"
GRID = ((8, 1), (16, 1), (32, 1), (64, 1), (128, 1), (8, 2), (8, 4))
"""(G, r): samples per prompt, and the suite repeated r times (504 r prompts). (8, 1) is the gate's default."""


def ensure_model(model_dir: Path) -> dict[str, Any]:
    """The base's bootstrap report (bootstrapping it with the shipped recipe if the folder has none)."""
    from demo.bootstrap import BootstrapConfig, bootstrap

    report = bootstrap(model_dir, BootstrapConfig())
    return {k: report[k] for k in ("steps", "final_loss", "parameters")} | {
        "eval_pass_rate": report["eval"]["pass_rate"]
    }


def measure(model_dir: Path, samples: int, seed: int, max_tokens: int = 48, temperature: float = 1.0) -> dict:
    """Sample the model `samples` times per prompt of the gate's suite, as the gate samples; per prompt,
    the samples' pass, malformed and loop flags, lengths and the demo users' expected satisfaction."""
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
    known = [t for t in tasks if t is not None]
    assert len(known) == len(tasks), "every suite prompt parses back into its task"
    checks = check_batch(known, texts)
    sat = [satisfaction(t, c, r) for t, c, r in zip(known, texts, checks, strict=True)]
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
        "model": common.shown(model_dir),
        "suite": {"name": suite.name, "version": suite.suite_version, "n_prompts": len(suite.items)},
        "samples_per_prompt": samples,
        "sampling": {"temperature": temperature, "top_p": 1.0, "max_tokens": max_tokens, "seed": seed},
        "mean_pass_rate": float(np.mean(rates)),
        "mean_satisfaction": float(np.mean(sat)),
        "pass_rate_range": [min(rates), max(rates)],
        "per_prompt_pass_rate": rates,
        "prompts": prompts,
        "seconds": {"sampling": t_sampled - t0, "total": time.perf_counter() - t0},
    }


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

        def arr(key: str) -> np.ndarray:
            return np.array([p[key] for p in ps], dtype=np.float64)

        return cls(arr("passed"), arr("malformed"), arr("looping"), arr("tokens"), tuple(p["family"] for p in ps))

    @property
    def rates(self) -> np.ndarray:
        return np.asarray(self.passed.mean(axis=1))

    def repeated(self, r: int) -> Pool:
        """A suite r times as big with the same rates: every prompt (and its family) r times."""

        def rep(a: np.ndarray) -> np.ndarray:
            return np.repeat(a, r, axis=0)

        fams = tuple(str(f) for f in np.repeat(np.array(self.families), r))
        return Pool(rep(self.passed), rep(self.malformed), rep(self.looping), rep(self.tokens), fams)


def uniform_flip(p: np.ndarray, margin: float) -> np.ndarray:
    """k_i of the "uniform" spread: every prompt loses delta of pass rate (all of it if below delta),
    delta solved by bisection so that mean(min(p_i, delta)) = margin."""
    if p.mean() <= margin:
        raise ValueError(f"mean pass rate {p.mean():.3f} is not above the margin {margin}")
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.minimum(p, mid).mean() < margin else (lo, mid)
    delta = (lo + hi) / 2
    return np.where(p > 0, np.minimum(1.0, delta / np.where(p > 0, p, 1.0)), 0.0)


def proportional_flip(p: np.ndarray, margin: float) -> np.ndarray:
    """k_i of the "proportional" spread: every prompt loses the same share margin / mean(p) of its rate."""
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
    (`arms[v]`: mean_tokens, malformed, looping), by the same `gating.stats` calls; and a diagnostic that
    is no check: `families_unadjusted`, no family's own test flags harm (no Holm)."""
    c, i = arms["candidate"], arms["incumbent"]
    ratio = c["mean_tokens"] / i["mean_tokens"]
    fam = family_regressions(cand - inc, families, margin, alpha)
    checks = {
        "non_inferiority": paired_t_non_inferiority(cand, inc, margin, alpha).passed,
        "families": fam.all_passed,
        "length": rails.min_length_ratio <= ratio <= rails.max_length_ratio,
        "malformed": c["malformed"] - i["malformed"] <= rails.max_malformed_increase,
        "repetition": c["looping"] - i["looping"] <= rails.max_repetition_increase,
    }
    return checks, {"families_unadjusted": all(p >= alpha for p in fam.p_values.values())}


def simulate_offline(
    pool: Pool, flip: np.ndarray | None, G: int, reps: int, rng: np.random.Generator, keep_bounds: bool = False
) -> dict[str, Any]:
    """`reps` offline verdicts: both versions draw G of the measured samples per prompt; the candidate's
    passes become failures with probability flip[i] (None: it is as good). Pass counts per check."""
    rails, n, m = Guardrails(), pool.passed.shape[0], pool.passed.shape[1]
    rows = np.arange(n)[None, :, None]
    counts: Counter[str] = Counter()
    lower: list[float] = []
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
    """An `EmbeddedEngine` that samples the version `reseeded` with other seeds (a hash of each seed it
    is asked for): that version is then the same model, sampled independently of the others."""

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
    """One real `evaluate_offline`: the base against itself under other sampling seeds."""
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
        arm: {
            "mean_tokens": g["length"][f"{arm}_mean_tokens"],
            "malformed": g["malformed"][f"{arm}_share"],
            "looping": g["repetition"][f"{arm}_share"],
        }
        for arm in ARMS
    }
    families = [it.family for it in suite.items]
    pp = nums["per_prompt"]
    rederived, _ = offline_checks(np.array(pp["candidate"]), np.array(pp["incumbent"]), families, arms, Guardrails())
    real = {k: v for k, v in nums["checks"].items() if k in rederived}
    return {
        "G": G,
        "seed": seed,
        "passed": res.passed,
        "failed": res.failed,
        "checks": nums["checks"],
        "rederived_checks_agree": rederived == real,
        "reward": nums["reward"],
        "non_inferiority": nums["non_inferiority"],
        "kl_per_token": g["kl"]["per_token"],
        "seconds": seconds,
    }


def dispersion_check(model_dir: Path, rates: np.ndarray, G: int, seeds: int, seed0: int) -> dict[str, Any]:
    """Do real evaluations scatter as independent Bernoulli draws say? The base's mean pass rate in `seeds`
    evaluations of G samples per prompt against the binomial sd sqrt(sum_i G p_i (1 - p_i)) / (G n): their
    variance ratio and its chi-square p-value (small: the real scatter is wider than simulated)."""
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
        "seeds": seeds,
        "mean_pass_rates": means,
        "sd": float(np.std(means, ddof=1)),
        "binomial_sd": sd,
        "variance_ratio": ratio,
        "p_wider": float(sps.chi2.sf(ratio * (seeds - 1), seeds - 1)),
    }


def _quantiles(x: Sequence[float]) -> dict[str, float]:
    q = np.quantile(np.asarray(x, dtype=np.float64), [0.1, 0.5, 0.9])
    return {"p10": float(q[0]), "median": float(q[1]), "p90": float(q[2]), "n": len(x)}


def run_grid(pool: Pool, reps: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng([seed, 1])
    margin, alpha = DEFAULT_MARGIN, DEFAULT_ALPHA
    flips = {"uniform": uniform_flip(pool.rates, margin), "proportional": proportional_flip(pool.rates, margin)}
    for name, flip in flips.items():
        drop = float((pool.rates * flip).mean())
        assert abs(drop - margin) < 1e-9, (name, drop)
    cells: list[dict[str, Any]] = []
    out: dict[str, Any] = {"margin": margin, "alpha": alpha, "n_prompts_default": len(pool.families)}
    t0 = time.perf_counter()
    for G, r in GRID:
        p, default = pool.repeated(r), (G, r) == (8, 1)
        eq = simulate_offline(p, None, G, reps, rng, keep_bounds=default)
        cell: dict[str, Any] = {"G": G, "n_prompts": len(p.families), "default": default}
        cell["equal"] = {k: common.rate(v, reps) for k, v in eq["passed"].items()}
        cell["equal"]["verdict"] = common.rate(eq["passed"]["verdict"], reps, 0.80, at_most=False)
        if default:
            out["equal_lower_bounds"] = eq["lower_bounds"]
        for spread in ("uniform", "proportional") if default else ("uniform",):
            wr = simulate_offline(p, np.repeat(flips[spread], r), G, reps, rng)
            cell[f"worse_{spread}"] = {k: common.rate(v, reps, alpha) for k, v in wr["passed"].items()}
        cells.append(cell)
        print(
            f"offline G={G} n={cell['n_prompts']}: equal {eq['passed']} ({time.perf_counter() - t0:.0f} s)", flush=True
        )
    out["cells"] = cells
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--reps", type=int, default=1000, help="replicates per scenario and cell")
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the base (default: models/demo-base)")
    ap.add_argument("--samples", type=int, default=64, help="measured samples per suite prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dispersion-seeds", type=int, default=16, help="real evaluations in the dispersion check")
    ap.add_argument("--no-spot", action="store_true", help="skip the spot and dispersion checks")
    a = ap.parse_args()
    st = common.stamp()
    res: dict[str, Any] = {"reps": a.reps, "seed": a.seed, "base_model": ensure_model(a.model)}
    res["measured"] = measured = measure(a.model, a.samples, seed=a.seed + 1000)
    print(f"measured: pass rate {measured['mean_pass_rate']:.3f} in {measured['seconds']['total']:.0f} s", flush=True)
    res["grid"] = run_grid(Pool.from_measured(measured), a.reps, a.seed)
    bounds = res["grid"].pop("equal_lower_bounds")
    res["grid"]["equal_lower_bounds"] = _quantiles(bounds)
    if not a.no_spot:
        spot = spot_check(a.model, G=8, seed=a.seed)
        spot["lower_bound_quantile_in_simulation"] = float(
            np.mean(np.asarray(bounds) <= spot["non_inferiority"]["lower_bound"])
        )
        assert spot["rederived_checks_agree"], "offline_checks no longer combines the checks as evaluate_offline"
        res["spot_check"] = spot
        print(f"spot check: passed={spot['passed']} failed={spot['failed']} ({spot['seconds']:.0f} s)", flush=True)
        rates = np.asarray(measured["per_prompt_pass_rate"])
        res["dispersion_check"] = dispersion_check(a.model, rates, 8, a.dispersion_seeds, a.seed + 2000)
    del measured["prompts"]
    common.save(NAME, res, st, a.out)


if __name__ == "__main__":
    main()
