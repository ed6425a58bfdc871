"""The offline gate: is a candidate non-inferior to the incumbent on an eval suite, without gaming it?

`evaluate_offline(engine, candidate, incumbent, suite, scorer=...)` samples both versions as loaded in
`engine`, which the caller made for the gate alone (in production a `serving.engine_process.
ProcessEngine` at low priority; never a live replica). It writes no events: it gets no bus.

- **Sampling.** G completions per prompt per version, each with its own seeded `SamplingParams`
  (`sample_seed(seed, prompt, g)`, from a hash of the three, so a prompt's samples do not depend on
  the batching, the suite's order or the other prompts). Both versions use the same seeds (common random
  numbers): an identical candidate produces identical completions and a difference of exactly 0.
  top_p is 1, so every token has a finite log-probability under both versions.
- **Rewards.** The suite's verifier scores every completion in [0, 1]; the G scores of a prompt are
  averaged first, so prompts are the unit of analysis (`gating.stats`).
- **Tests.** `gating.stats.paired_t_non_inferiority` on the per-prompt means (decides), the paired
  bootstrap (`paired_bootstrap_non_inferiority`, a cross-check number, not a check), and one harm test
  per task family on the pooled variance, corrected with Holm (`family_regressions`): no family may be
  significantly worse than -margin (an equally good candidate is flagged at most α of the time).
- **Guardrails against reward hacking** (`Guardrails`): mean output length ratio candidate /
  incumbent (tokens) within [min, max]; the share of malformed outputs (empty, or not
  `suite.well_formed`), and the share of outputs caught in a loop (`has_loop`: a token n-gram repeated
  back to back), each at most a few points above the incumbent's; and KL(candidate ‖ incumbent) per
  token, estimated on the candidate's own samples as the mean over their tokens of log π_cand - log
  π_inc: the first is recorded with each sample, the second comes from `scorer` (the candidate's
  tokens scored under the incumbent in padded batches, `serving.scoring.score_many`; `ModelScorer`),
  on the first `kl_samples_per_prompt` (2) of each prompt's G samples: a forward each, this was most
  of a cycle's time at G 8 (133 of 195 s for 504 x 8 under the demo's traffic), and 2 per prompt
  still give thousands of tokens against a bound of 0.5 nats.

The result (`OfflineResult`) has `passed` (every check passed) and `numbers`, every number behind it,
JSON-serialisable; `verdict(artifact_sha256)` is the `registry.models.OfflineVerdict` payload that
`Registry.record_gate(version, "offline", ...)` stores and `approve` checks. Called by `gating.gate`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from gating.sample_cache import SampleCache, request_key
from gating.stats import (
    DEFAULT_ALPHA,
    DEFAULT_MARGIN,
    NonInferiorityResult,
    family_regressions,
    paired_bootstrap_non_inferiority,
    paired_t_non_inferiority,
)
from product.suites import EvalSuite
from serving.checkpoint import load_checkpoint
from serving.engine import Completion
from serving.interface import Engine
from serving.model import Transformer
from serving.sampling import SamplingParams
from serving.scoring import score_many
from serving.tokenizer import Tokenizer

Scorer = Callable[[str, Sequence[Completion], int], list[list[float]]]
"""`scorer(version, completions, n_vocab)`: per completion, the log-probability under `version` of each of
its output tokens, with the completion's own sampling parameters (the first `n_vocab` logits)."""


class Guardrails(BaseModel):
    """Thresholds of the reward-hacking checks (each fails the verdict on its own)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_length_ratio: float = Field(0.5, gt=0, description="Lowest mean output length, candidate / incumbent.")
    max_length_ratio: float = Field(2.0, gt=0, description="Highest mean output length, candidate / incumbent.")
    max_malformed_increase: float = Field(
        0.10, ge=0, le=1, description="Share of empty or unparsable outputs, at most this far above the incumbent's."
    )
    max_repetition_increase: float = Field(
        0.10, ge=0, le=1, description="Share of outputs in a loop, at most this far above the incumbent's."
    )
    max_kl: float = Field(0.5, ge=0, description="KL(candidate ‖ incumbent) per token (nats), at most.")
    kl_samples_per_prompt: int = Field(
        2,
        ge=1,
        description="The KL estimate scores the first this many of each prompt's G candidate samples under the "
        "incumbent (a full forward each: most of a cycle's time at G 8); all of them when G is smaller.",
    )
    loop_max_ngram: int = Field(8, ge=1, description="Longest n-gram a loop may repeat.")
    loop_min_repeats: int = Field(3, ge=2, description="Back-to-back repeats that make a loop.")
    loop_min_span: int = Field(12, ge=2, description="Tokens a loop must cover at least.")


@dataclass
class OfflineResult:
    """The offline verdict of `candidate` against `incumbent` on the suite `suite_version`."""

    passed: bool
    candidate: str
    incumbent: str
    suite_version: str
    failed: list[str]
    """Names of the failed checks: non_inferiority, families, length, malformed, repetition, kl."""
    numbers: dict[str, Any] = field(default_factory=dict)

    def verdict(self, artifact_sha256: str, incumbent_id: str | None = None) -> dict[str, Any]:
        """The `OfflineVerdict` payload (`incumbent_id`: the incumbent's registry id, default its engine name)."""
        return {
            "passed": self.passed,
            "incumbent_id": incumbent_id or self.incumbent,
            "artifact_sha256": artifact_sha256,
            "suite_version": self.suite_version,
            "numbers": self.numbers,
        }

    def summary(self) -> str:
        ni = self.numbers["non_inferiority"]
        what = "passed" if self.passed else f"failed ({', '.join(self.failed)})"
        flagged = [
            f"{f} {r['mean_diff'] * 100:+.1f} pts (p {r['p_regression']:.2g})"
            for f, r in self.numbers["families"].items()
            if not r["passed"]
        ]
        if flagged:
            what += "; families worse than -margin: " + ", ".join(flagged)
        a = self.numbers.get("anchor")
        if a:
            what += f"; vs anchor {a['id']} ({a['pass_rate']:.3f}) lower bound {a['lower_bound']:+.3f}"
        return (
            f"offline {what}: pass rate {self.numbers['reward']['candidate']:.3f} vs "
            f"{self.numbers['reward']['incumbent']:.3f}, lower bound {ni['lower_bound']:+.3f} "
            f"(margin {ni['margin']}), {ni['n_prompts']} prompts x {self.numbers['sampling']['G']} on "
            f"{self.suite_version}" + (" (in-distribution)" if self.numbers["in_distribution"] else "")
        )


class ModelScorer:
    """A `Scorer` over models held in this process: `sources[version]` is a checkpoint folder (loaded
    on first use) or a `Transformer`. Full forwards over padded batches of completions
    (`serving.scoring.score_many`, each row equal to its own `score`) on the caller's thread;
    `batch_invariant` as the engine that sampled (float32 models: bit-identical log-probs)."""

    def __init__(self, sources: Mapping[str, str | Path | Transformer], batch_invariant: bool = True):
        self._sources = dict(sources)
        self._models: dict[str, Transformer] = {}
        self.batch_invariant = batch_invariant

    def model(self, version: str) -> Transformer:
        if version not in self._models:
            if version not in self._sources:
                raise KeyError(f"the scorer holds no version {version!r}; it has {sorted(self._sources)}")
            src = self._sources[version]
            self._models[version] = src.eval() if isinstance(src, Transformer) else load_checkpoint(src)
        return self._models[version]

    def __call__(self, version: str, completions: Sequence[Completion], n_vocab: int) -> list[list[float]]:
        requests = [(list(c.prompt_ids), list(c.output_ids), c.params) for c in completions]
        scored = score_many(self.model(version), requests, n_vocab=n_vocab, batch_invariant=self.batch_invariant)
        return [lp.tolist() for lp in scored]


def sample_seed(seed: int, prompt: str, g: int) -> int:
    """The seed of sample `g` of `prompt`: 63 bits of SHA-256 of the JSON [seed, prompt, g]."""
    digest = hashlib.sha256(json.dumps([seed, prompt, g]).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def has_loop(ids: Sequence[int], max_ngram: int = 8, min_repeats: int = 3, min_span: int = 12) -> bool:
    """Some n-gram (n <= max_ngram) repeats back to back at least `min_repeats` times, covering at least
    `min_span` tokens: a run where ids[j] == ids[j + n] for `span - n` positions in a row."""
    for n in range(1, max_ngram + 1):
        need = max(n * min_repeats, min_span) - n
        run = 0
        for j in range(len(ids) - n):
            run = run + 1 if ids[j] == ids[j + n] else 0
            if run >= need:
                return True
    return False


def _test(r: NonInferiorityResult) -> dict[str, Any]:
    return {k: (float(v) if isinstance(v, float) else v) for k, v in dataclasses.asdict(r).items()}


def _share(flags: Sequence[bool]) -> float:
    return float(sum(flags)) / max(1, len(flags))


EXAMPLES = 6  # sampled outputs kept with the verdict, side by side, for the dashboard
EXAMPLE_CHARS = 400


def _examples(items, G, outs, scores, cand, inc, candidate: str, incumbent: str) -> list[dict[str, Any]]:
    """The prompts where the versions differ most (per-prompt mean), with each version's first sample."""
    order = sorted(range(len(items)), key=lambda i: (-abs(float(cand[i] - inc[i])), i))[:EXAMPLES]
    return [
        {
            "prompt": items[i].prompt[:EXAMPLE_CHARS],
            "family": items[i].family,
            "candidate": {
                "text": outs[candidate][i * G].text[:EXAMPLE_CHARS],
                "score": float(scores[candidate][i * G]),
                "mean": float(cand[i]),
            },
            "incumbent": {
                "text": outs[incumbent][i * G].text[:EXAMPLE_CHARS],
                "score": float(scores[incumbent][i * G]),
                "mean": float(inc[i]),
            },
        }
        for i in order
    ]


def _scores(suite: EvalSuite, prompts: list[str], outs: list[Completion], version: str) -> np.ndarray:
    raw = suite.verifier.verify(prompts, [o.text for o in outs])
    scores = np.asarray([float(s) for s in raw], dtype=np.float64)
    if scores.shape != (len(outs),):
        raise ValueError(f"the verifier returned {scores.size} scores for {len(outs)} completions of {version!r}")
    bad = np.flatnonzero(~np.isfinite(scores) | (scores < 0.0) | (scores > 1.0))
    if bad.size:
        raise ValueError(f"the verifier scored a completion of {version!r} {scores[bad[0]]!r}; scores are in [0, 1]")
    return scores


def suite_requests(
    tok: Tokenizer, suite: EvalSuite, G: int, seed: int, max_tokens: int, temperature: float
) -> tuple[list[str], list[list[int]], list[SamplingParams]]:
    """The gate's requests for one version on `suite`: each prompt G times (its owner prompt, its ids,
    its own seeded sampling parameters, top_p 1)."""
    owners = [it.prompt for it in suite.items for _ in range(G)]
    ids = [tok.encode_prompt(p) for p in owners]
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=1.0,
            max_tokens=max_tokens,
            stop=suite.stop,
            seed=sample_seed(seed, it.prompt, g),
        )
        for it in suite.items
        for g in range(G)
    ]
    return owners, ids, params


def warm_samples(
    engine: Engine,
    version: str,
    artifact_sha256: str,
    suite: EvalSuite,
    cache: SampleCache,
    *,
    G: int,
    seed: int,
    max_tokens: int,
    temperature: float,
) -> bool:
    """Sample `version` (loaded in `engine`) on `suite` into `cache` unless it holds them already, with
    exactly the requests `evaluate_offline` makes; True if it sampled."""
    _, ids, params = suite_requests(engine.tokenizer(version), suite, G, seed, max_tokens, temperature)
    key = request_key(artifact_sha256, ids, params)
    if cache.has(key):
        return False
    cache.put(key, engine.generate(ids, params, version))
    return True


def evaluate_offline(
    engine: Engine,
    candidate: str,
    incumbent: str,
    suite: EvalSuite,
    *,
    scorer: Scorer,
    G: int = 8,
    margin: float = DEFAULT_MARGIN,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
    max_tokens: int = 48,
    temperature: float = 1.0,
    guardrails: Guardrails | None = None,
    n_resamples: int = 2000,
    anchor: str | None = None,
    cache: SampleCache | None = None,
    artifacts: Mapping[str, str] | None = None,
) -> OfflineResult:
    """Candidate vs incumbent (two versions loaded in `engine`) on `suite`; see the module docstring.

    `scorer` scores the candidate's samples under the incumbent (KL); `seed` fixes every sample and the
    bootstrap. `anchor` (a third loaded version, the best promoted so far): the candidate must also be
    non-inferior to it, with the same margin (check "anchor"). `cache` with `artifacts` (version name ->
    artifact sha256): a version's completions are read from the cache when it holds them and stored
    when sampled (`gating.sample_cache`); `numbers["sampling"]["from_cache"]` names the versions read.
    ValueError for a bad argument, versions with different tokenizers, or a bad verifier."""
    if not isinstance(G, int) or G < 1:
        raise ValueError(f"G must be an integer >= 1, got {G!r}")
    if not 0.0 < temperature <= 2.0:
        raise ValueError(f"temperature must be in (0, 2] (the gate samples), got {temperature!r}")
    if candidate == incumbent:
        raise ValueError(f"candidate and incumbent are both {candidate!r}")
    if anchor in (candidate, incumbent):
        raise ValueError(f"the anchor {anchor!r} is the candidate or the incumbent; pass anchor=None then")
    rails = guardrails or Guardrails()
    t0 = time.perf_counter()
    tok = engine.tokenizer(incumbent)
    if engine.tokenizer(candidate).token_bytes != tok.token_bytes:
        raise ValueError(f"{candidate!r} and {incumbent!r} have different tokenizers; the gate compares like with like")
    n_vocab = min(engine.model_args(incumbent).vocab_size, tok.vocab_size)
    items = suite.items
    owners, ids, params = suite_requests(tok, suite, G, seed, max_tokens, temperature)
    from_cache: list[str] = []

    def sample(v: str) -> list[Completion]:
        sha = (artifacts or {}).get(v)
        if cache is None or sha is None:
            return engine.generate(ids, params, v)
        key = request_key(sha, ids, params)
        got = cache.get(key, ids, params, v)
        if got is not None:
            from_cache.append(v)
            return got
        fresh = engine.generate(ids, params, v)
        cache.put(key, fresh)
        return fresh

    outs = {v: sample(v) for v in (candidate, incumbent) + ((anchor,) if anchor else ())}
    t_sampled = time.perf_counter()
    scores = {v: _scores(suite, owners, outs[v], v) for v in outs}
    t_verified = time.perf_counter()
    means = {v: s.reshape(len(items), G).mean(axis=1) for v, s in scores.items()}
    cand, inc = means[candidate], means[incumbent]
    anchored = None if anchor is None else paired_t_non_inferiority(cand, means[anchor], margin, alpha)

    overall = paired_t_non_inferiority(cand, inc, margin, alpha)
    boot = paired_bootstrap_non_inferiority(cand, inc, margin, alpha, n_resamples=n_resamples, seed=seed)
    fam_names = [it.family for it in items]
    fam_checks = family_regressions(cand - inc, fam_names, margin, alpha)
    families = {}
    for f in sorted(set(fam_names)):
        ix = [i for i, name in enumerate(fam_names) if name == f]
        lo, hi = fam_checks.bounds(f)
        families[f] = {
            "n_prompts": len(ix),
            "candidate": float(cand[ix].mean()),
            "incumbent": float(inc[ix].mean()),
            "mean_diff": fam_checks.mean_diff[f],
            "se_pooled": fam_checks.se[f],
            "lower_bound": lo,
            "upper_bound": hi,
            "p_regression": fam_checks.p_values[f],
            "passed": fam_checks.passed[f],
        }

    def malformed(o: Completion, prompt: str) -> bool:
        return not o.text.strip() or (suite.well_formed is not None and not suite.well_formed(prompt, o.text))

    def loops(o: Completion) -> bool:
        return has_loop(o.output_ids, rails.loop_max_ngram, rails.loop_min_repeats, rails.loop_min_span)

    arms = {
        v: {
            "mean_tokens": float(np.mean([len(o.output_ids) for o in outs[v]])),
            "empty": _share([not o.text.strip() for o in outs[v]]),
            "malformed": _share([malformed(o, p) for o, p in zip(outs[v], owners, strict=True)]),
            "looping": _share([loops(o) for o in outs[v]]),
        }
        for v in (candidate, incumbent)
    }
    c_arm, i_arm = arms[candidate], arms[incumbent]
    ratio = c_arm["mean_tokens"] / i_arm["mean_tokens"]  # every completion holds >= 1 token
    t_kl = time.perf_counter()
    k = min(rails.kl_samples_per_prompt, G)
    scored = [outs[candidate][i * G + g] for i in range(len(items)) for g in range(k)]
    inc_lp = scorer(incumbent, scored, n_vocab)
    t_kl = time.perf_counter() - t_kl
    per_token, per_seq = [], []
    for o, lp_i in zip(scored, inc_lp, strict=True):
        if len(lp_i) != len(o.logprobs):
            raise ValueError(f"the scorer returned {len(lp_i)} log-probs for {len(o.logprobs)} tokens")
        d = np.asarray(o.logprobs, dtype=np.float64) - np.asarray(lp_i, dtype=np.float64)
        per_token.append(d)
        per_seq.append(float(d.mean()))
    diffs = np.concatenate(per_token)
    kl = float(diffs.mean())
    if not math.isfinite(kl):
        raise ValueError(
            f"KL({candidate} ‖ {incumbent}) is not finite: a sampled token is impossible under the incumbent"
        )

    checks = {
        "non_inferiority": overall.passed,
        "families": fam_checks.all_passed,
        "length": rails.min_length_ratio <= ratio <= rails.max_length_ratio,
        "malformed": c_arm["malformed"] - i_arm["malformed"] <= rails.max_malformed_increase,
        "repetition": c_arm["looping"] - i_arm["looping"] <= rails.max_repetition_increase,
        "kl": kl <= rails.max_kl,
    }
    if anchored is not None:
        checks["anchor"] = anchored.passed
    failed = [name for name, ok in checks.items() if not ok]
    numbers: dict[str, Any] = {
        "in_distribution": suite.in_distribution,
        "candidate": candidate,
        "incumbent": incumbent,
        "suite": {
            "name": suite.name,
            "version": suite.version,
            "sha256": suite.sha256,
            "n_prompts": len(items),
            "families": suite.family_sizes,
        },
        "sampling": {
            "G": G,
            "temperature": temperature,
            "top_p": 1.0,
            "max_tokens": max_tokens,
            "seed": seed,
            "from_cache": sorted(from_cache),
        },
        "reward": {"candidate": float(scores[candidate].mean()), "incumbent": float(scores[incumbent].mean())},
        "non_inferiority": _test(overall),
        "anchor": None
        if anchored is None or anchor is None
        else {"id": anchor, "pass_rate": float(scores[anchor].mean()), **_test(anchored)},
        "bootstrap": {**_test(boot), "n_resamples": n_resamples},
        "families": families,
        "examples": _examples(items, G, outs, scores, cand, inc, candidate, incumbent),
        "guardrails": {
            "length": {
                "candidate_mean_tokens": c_arm["mean_tokens"],
                "incumbent_mean_tokens": i_arm["mean_tokens"],
                "ratio": ratio,
                "bounds": [rails.min_length_ratio, rails.max_length_ratio],
            },
            "malformed": {
                "candidate_share": c_arm["malformed"],
                "incumbent_share": i_arm["malformed"],
                "candidate_empty_share": c_arm["empty"],
                "incumbent_empty_share": i_arm["empty"],
                "max_increase": rails.max_malformed_increase,
                "checked_with": "well_formed" if suite.well_formed is not None else "non-empty",
            },
            "repetition": {
                "candidate_share": c_arm["looping"],
                "incumbent_share": i_arm["looping"],
                "max_increase": rails.max_repetition_increase,
                "loop": {
                    "max_ngram": rails.loop_max_ngram,
                    "min_repeats": rails.loop_min_repeats,
                    "min_span": rails.loop_min_span,
                },
            },
            "kl": {
                "per_token": kl,
                "per_sequence_mean": float(np.mean(per_seq)),
                "n_tokens": int(diffs.size),
                "samples_per_prompt": k,
                "max": rails.max_kl,
                "estimator": "mean over the candidate's sampled tokens of logp_candidate - logp_incumbent",
            },
        },
        "checks": checks,
        "failed": failed,
        "per_prompt": {"candidate": cand.tolist(), "incumbent": inc.tolist()},
        "timing_s": {
            "sampling": t_sampled - t0,
            "verifying": t_verified - t_sampled,
            "kl_scoring": t_kl,
            "total": time.perf_counter() - t0,
        },
    }
    return OfflineResult(not failed, candidate, incumbent, suite.suite_version, failed, numbers)
