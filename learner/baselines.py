"""Which reward baseline each online sample's advantage A = r - b is measured against, and how often.

- **The key** (`baseline_key`) is chosen by the product: the completion's `context` (the request's
  `metadata.context`, recorded on its `CompletionEvent`), scoped by tenant as "<tenant>:<context>"
  (a context has no ':', so the key names one pair). The demo's users send the task family. A
  completion served without a context has no key.
- **One running baseline per key, a global fallback** (`learner.objective.RunningBaseline`): a
  key's advantage is measured against its own EMA once it has `min_count` rewards; before that, and
  for samples without a key, against the global EMA over every reward. Every reward updates the
  global EMA and its key's, after the batch's advantages are computed from the baseline as it was
  before the batch (a sample never baselines itself, a batch's samples share one baseline state).
- **N = `TrainerConfig.baseline_min_count` = 20.** With the default decay 0.95 an EMA averages about
  the last 1 / (1 - 0.95) = 20 rewards, and a key's first rewards are averaged plainly (the
  bias-corrected start: step 1/c while that exceeds 1 - decay), so at 20 rewards a key's baseline
  is the mean of 20 of its rewards: as noisy as the global one, without its bias (the gap between
  the key's mean reward and everyone's). Switching sooner trades that bias for the noise of a mean
  of a few rewards; later keeps a known bias for nothing.
- **Per-batch statistics.** The advantages are not re-centred or scaled per batch: per key, after
  warm-up, r - b has mean about 0 because b tracks that key's mean reward (tests/learner/
  test_baselines.py measures it); `adv_mean` / `adv_std` of each update report the batch's values.
  `usage` counts, per update, the samples baselined by their key's EMA (`baseline_keyed`) and by the
  fallback (`baseline_fallback`, of which `baseline_unkeyed` had no key), and the keys tracked.
"""

from __future__ import annotations

from feedback.events import SampleEvent
from learner.objective import RunningBaseline


def baseline_key(ev: SampleEvent) -> str | None:
    """The baseline key of a sample: "<tenant>:<context>" of its completion, or None without a context."""
    c = ev.completion
    return None if c.context is None else f"{c.tenant}:{c.context}"


def usage(baseline: RunningBaseline, keys: list[str | None]) -> dict[str, float]:
    """How the samples with baseline keys `keys` are baselined by `baseline` as it is now."""
    keyed = sum(baseline.keyed(k) for k in keys)
    unkeyed = sum(k is None for k in keys)
    return {
        "baseline_keyed": float(keyed),
        "baseline_fallback": float(len(keys) - keyed),
        "baseline_unkeyed": float(unkeyed),
        "baseline_keys": float(len(baseline.counts)),
    }
