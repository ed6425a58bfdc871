"""Simulated users of the demo product: latent preferences, satisfaction and feedback signals.

Called by the demo product loop, which shows a completion to a `SimulatedUser` and publishes the
returned `FeedbackSignal`s as feedback events; and by evaluation, which reports `satisfaction`
(mean over completions, in percent) as the "simulated satisfaction" metric.

A user's latent preferences (`UserPrefs`) are hidden from the learner. A user accepts a completion
with probability `satisfaction`: high when it is correct and in the house style, lower when it is
correct but verbose, very low when it is wrong. All other signals follow from that decision plus
noise. Everything is deterministic given (user_id, seed, number of earlier `react` calls).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace

from demo.checker import CheckResult
from demo.tasks import Task, is_preferred_style

SIGNAL_KINDS = (
    "thumb_up",
    "thumb_down",
    "rating",
    "accepted",
    "rejected",
    "edited",
    "copied",
    "regenerated",
    "dwell",
)
_ACCEPT_FIELDS = ("p_accept_correct_preferred", "p_accept_correct_other", "p_accept_incorrect")


@dataclass(frozen=True)
class UserPrefs:
    """Latent user behaviour. Every `p_*` field is a probability in [0, 1]."""

    p_accept_correct_preferred: float = 0.9
    """Accept a correct completion written in the house style (one `return` line)."""
    p_accept_correct_other: float = 0.3
    """Accept a correct completion in another (verbose) style."""
    p_accept_incorrect: float = 0.05
    """Accept an incorrect completion (the user did not notice the bug)."""
    p_copy: float = 0.5
    """After accepting: also copy the code."""
    p_edit_good: float = 0.1
    """After accepting a correct, house-style completion: edit it (and keep most of it)."""
    p_edit_other: float = 0.6
    """After accepting any other completion: edit it (restyle it or fix it; keep less of it)."""
    p_thumb_up: float = 0.2
    """After accepting: give a thumb up."""
    p_thumb_down: float = 0.25
    """After not accepting: give a thumb down."""
    p_rating: float = 0.1
    """Give a 1-5 star rating (4-5 after accepting, 1-2 otherwise)."""
    p_regenerate: float = 0.4
    """After not accepting: ask for another completion instead of just rejecting."""
    median_dwell_s: float = 3.0
    """Median seconds spent looking at an accepted completion (rejections take about half)."""
    noise: float = 0.03
    """Standard deviation of the per-user jitter added to the three accept probabilities."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if spec.name.startswith("p_") and not 0.0 <= value <= 1.0:
                raise ValueError(f"{spec.name} must be in [0, 1], got {value}")
        if not self.median_dwell_s > 0:
            raise ValueError(f"median_dwell_s must be > 0, got {self.median_dwell_s}")
        if not self.noise >= 0:
            raise ValueError(f"noise must be >= 0, got {self.noise}")


def satisfaction(task: Task, completion: str, check: CheckResult, prefs: UserPrefs = UserPrefs()) -> float:
    """Expected satisfaction in [0, 1]: the probability that a user with `prefs` accepts it."""
    if not check.passed:
        return prefs.p_accept_incorrect
    if is_preferred_style(completion):
        return prefs.p_accept_correct_preferred
    return prefs.p_accept_correct_other


@dataclass
class FeedbackSignal:
    """One observable user reaction.

    value: the 1-5 stars for "rating", the kept fraction in [0, 1] for "edited", seconds for
    "dwell", None for every other kind.
    """

    kind: str
    value: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in SIGNAL_KINDS:
            raise ValueError(f"unknown signal kind {self.kind!r}; expected one of {SIGNAL_KINDS}")
        valued = {"rating", "edited", "dwell"}
        if (self.kind in valued) != (self.value is not None):
            raise ValueError(f"signal {self.kind!r} has invalid value {self.value!r}")
        if self.kind == "rating" and self.value not in (1, 2, 3, 4, 5):
            raise ValueError(f"rating must be 1..5, got {self.value}")
        value = self.value
        if self.kind == "edited" and value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"edited kept_fraction must be in [0, 1], got {value}")
        if self.kind == "dwell" and value is not None and not value >= 0.0:
            raise ValueError(f"dwell must be >= 0 seconds, got {value}")


class SimulatedUser:
    """A user with (slightly jittered) latent preferences who reacts to completions."""

    def __init__(self, user_id: str, seed: int, prefs: UserPrefs = UserPrefs()):
        self.user_id = user_id
        self.seed = seed
        jitter = random.Random(f"prefs:{user_id}:{seed}")
        # This user's own preferences: the base `prefs` with jittered accept probabilities.
        self.prefs = replace(
            prefs,
            **{
                name: min(1.0, max(0.0, getattr(prefs, name) + jitter.gauss(0.0, prefs.noise)))
                for name in _ACCEPT_FIELDS
            },
        )
        self.n_reactions = 0

    def satisfaction(self, task: Task, completion: str, check: CheckResult) -> float:
        """`satisfaction` under this user's own preferences."""
        return satisfaction(task, completion, check, self.prefs)

    def react(self, task: Task, completion: str, check: CheckResult) -> list[FeedbackSignal]:
        """The signals this user emits on seeing `completion`; always ends with a "dwell"."""
        rng = random.Random(f"react:{self.user_id}:{self.seed}:{self.n_reactions}")
        self.n_reactions += 1
        prefs = self.prefs
        good = check.passed and is_preferred_style(completion)
        signals: list[FeedbackSignal] = []
        accepted = rng.random() < self.satisfaction(task, completion, check)
        if accepted:
            signals.append(FeedbackSignal("accepted"))
            if rng.random() < prefs.p_copy:
                signals.append(FeedbackSignal("copied"))
            if rng.random() < (prefs.p_edit_good if good else prefs.p_edit_other):
                kept = rng.uniform(0.85, 1.0) if good else rng.uniform(0.3, 0.8)
                signals.append(FeedbackSignal("edited", round(kept, 3)))
            if rng.random() < prefs.p_thumb_up:
                signals.append(FeedbackSignal("thumb_up"))
            if rng.random() < prefs.p_rating:
                signals.append(FeedbackSignal("rating", 5 if good else 4))
        else:
            signals.append(FeedbackSignal("regenerated" if rng.random() < prefs.p_regenerate else "rejected"))
            if rng.random() < prefs.p_thumb_down:
                signals.append(FeedbackSignal("thumb_down"))
            if rng.random() < prefs.p_rating:
                signals.append(FeedbackSignal("rating", 2 if check.passed else 1))
        median = prefs.median_dwell_s if accepted else prefs.median_dwell_s / 2
        signals.append(FeedbackSignal("dwell", round(rng.lognormvariate(0.0, 0.5) * median, 2)))
        return signals
