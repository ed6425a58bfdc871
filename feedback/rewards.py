"""Reward shaping: from the feedback signals of one completion to one scalar reward, and the
per-user caps that bound how much any single user can move the learner.

Owns `RewardSpec` (a frozen, validated config whose `name` is stamped on every `SampleEvent`),
the pure functions `signal_reward`, `counted_signals` and `reward`, and `UserBudget` (a windowed
per-user limit on how many completions one user may reward). Called by `feedback.joiner`.

Why these numbers (the `default-v1` table; every value is one field of `RewardSpec`):

    signal       reward                                   why
    accepted     +0.75                                    the strongest implicit "this was useful"
    rejected     -0.25                                    weak: users dismiss good completions too
    thumb_up     +0.5                                     explicit but rare and cheap to give
    thumb_down   -0.5                                     symmetric with thumb_up
    rating       (stars - 3) / 4 x 1.0                    1 star -0.5 .. 3 stars 0 .. 5 stars +0.5
    edited       +0.75 x kept - 0.25 x (1 - kept)         accepted, then changed: interpolates from
                                                          "accepted" (kept all) to "rejected" (kept none)
    copied       +0.25                                    mild: copying usually follows acceptance
    regenerated  -0.25                                    "try again" is a rejection, not a verdict
    dwell        +0.05 x min(dwell_s, 30) / 30            tie-breaker only: at most 0.05
    total        clipped to [reward_min, reward_max] = [-1, 1]

Positive signals outweigh negative ones on purpose: an accept is a deliberate act, while rejections
and regenerations also happen to correct completions (the user wanted another phrasing), so they
carry less information. The learner subtracts a running baseline, so only differences matter.

Rules, in order (`counted_signals` applies 1-2, `reward` applies 3-5):

1. Signals without a `user_id` count as one anonymous user (the joiner first fills in the
   completion's own user, who is almost always the one reacting to it).
2. Once per user and kind, latest wins: a user who clicks thumb_up ten times counts once. Mutually
   exclusive kinds form one group, also latest wins: {accepted, rejected, edited} (an edit
   follows an accept and supersedes it, an "undo" reject supersedes an accept) and
   {thumb_up, thumb_down} (a changed vote). "Latest" is the largest `ts`; ties go to the signal
   that came later in the input (arrival order).
3. A user's counted signals are summed and the sum is clipped to +-`per_user_cap`.
4. The users' contributions are summed and the total clipped to [`reward_min`, `reward_max`].
5. A completion whose only signals are dwell gets no reward (None): dwell is a tie-breaker, not
   evidence; so does a completion with no signal at all.

How the caps bound one user's influence (poisoning defence): by rule 2 a user has at most one
signal per group or kind, so repeating a signal gains nothing; by rule 3 that user moves any
completion's reward by at most `per_user_cap`; and `UserBudget` lets a user reward at most
`max_rewarded_per_user` completions per `budget_window_s` (the joiner drops, and counts, the
signals of a user over budget). So within one window a single user shifts the learner's sum of
rewards by at most `per_user_cap x max_rewarded_per_user` (default 1.0 x 200 per hour), however
much feedback they send. `per_user_cap` defaults to the full reward range because a completion is
normally seen by exactly one user; lower it where many users rate the same completion.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from feedback.events import Signal

# Kinds whose signals exclude each other for one user: only the latest of the group counts.
EXCLUSIVE_GROUPS: tuple[frozenset[str], ...] = (
    frozenset({"accepted", "rejected", "edited"}),
    frozenset({"thumb_up", "thumb_down"}),
)
ANONYMOUS = "<anonymous>"
_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _group_of(kind: str) -> str:
    for group in EXCLUSIVE_GROUPS:
        if kind in group:
            return "|".join(sorted(group))
    return kind


class RewardSpec(BaseModel):
    """How feedback signals become one reward; see the module docstring for the reasoning."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = "default-v1"
    """Name and version of this spec, stamped on every SampleEvent; change it with any value."""
    accepted: float = Field(0.75, ge=0.0)
    """Reward of an accepted completion."""
    rejected: float = Field(-0.25, le=0.0)
    """Reward of an explicitly rejected completion."""
    thumb_up: float = Field(0.5, ge=0.0)
    """Reward of a thumb up."""
    thumb_down: float = Field(-0.5, le=0.0)
    """Reward of a thumb down."""
    rating_scale: float = Field(1.0, ge=0.0)
    """A rating of s stars (1..5) gives (s - 3) / 4 x rating_scale."""
    edited_all_kept: float = 0.75
    """Reward of an edited completion whose text was kept entirely (kept fraction 1)."""
    edited_none_kept: float = -0.25
    """Reward of an edited completion of which nothing was kept (kept fraction 0); linear between."""
    copied: float = Field(0.25, ge=0.0)
    """Reward of a copied completion."""
    regenerated: float = Field(-0.25, le=0.0)
    """Reward of a completion the user asked to regenerate."""
    dwell_weight: float = Field(0.05, ge=0.0)
    """Largest dwell reward, reached at dwell_cap_s; must stay below every other nonzero signal."""
    dwell_cap_s: float = Field(30.0, gt=0.0)
    """Dwell seconds beyond this earn nothing more."""
    reward_min: float = -1.0
    """Lower clip of the final reward."""
    reward_max: float = 1.0
    """Upper clip of the final reward."""
    per_user_cap: float = Field(1.0, gt=0.0)
    """One user's total contribution to one completion's reward is clipped to +- this."""
    max_rewarded_per_user: int = Field(200, ge=1)
    """How many completions one user may reward per budget_window_s; signals beyond are dropped."""
    budget_window_s: float = Field(3600.0, gt=0.0)
    """Length of the UserBudget window in seconds (by completion timestamp)."""

    @field_validator("name")
    @classmethod
    def _name_ok(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError(f"name must be 1-64 characters of [A-Za-z0-9._-], got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "RewardSpec":
        if not self.reward_min < self.reward_max:
            raise ValueError(f"reward_min ({self.reward_min}) must be < reward_max ({self.reward_max})")
        if not self.reward_min <= 0.0 <= self.reward_max:
            raise ValueError(f"reward_min <= 0 <= reward_max must hold, "
                             f"got [{self.reward_min}, {self.reward_max}]")
        if not self.edited_none_kept <= self.edited_all_kept:
            raise ValueError(f"edited_none_kept ({self.edited_none_kept}) must be <= edited_all_kept "
                             f"({self.edited_all_kept}): keeping more of a completion cannot be worse")
        others = [abs(v) for v in (self.accepted, self.rejected, self.thumb_up, self.thumb_down, self.copied,
                                   self.regenerated) if v != 0.0]
        if others and self.dwell_weight >= min(others):
            raise ValueError(f"dwell_weight ({self.dwell_weight}) must be below every other nonzero signal "
                             f"(smallest {min(others)}): dwell is only a tie-breaker")
        return self


def signal_reward(spec: RewardSpec, signal: Signal) -> float:
    """The reward of one signal on its own (before any cap or clip)."""
    kind, v = signal.kind, signal.value
    if kind == "rating":
        assert v is not None, "validated by FeedbackEvent"
        return (v - 3.0) / 4.0 * spec.rating_scale
    if kind == "edited":
        assert v is not None, "validated by FeedbackEvent"
        return spec.edited_all_kept * v + spec.edited_none_kept * (1.0 - v)
    if kind == "dwell":
        assert v is not None, "validated by FeedbackEvent"
        return spec.dwell_weight * min(max(v, 0.0), spec.dwell_cap_s) / spec.dwell_cap_s
    return float(getattr(spec, kind))


def user_key(signal: Signal) -> str:
    return signal.user_id if signal.user_id is not None else ANONYMOUS


def counted_signals(signals: Sequence[Signal]) -> list[Signal]:
    """The signals that count (rules 1-2): the latest per user and kind/exclusive group.

    Returned in input order, so the result is deterministic for a given input.
    """
    latest: dict[tuple[str, str], int] = {}
    for i, s in enumerate(signals):
        key = (user_key(s), _group_of(s.kind))
        j = latest.get(key)
        if j is None or s.ts >= signals[j].ts:
            latest[key] = i
    keep = set(latest.values())
    return [s for i, s in enumerate(signals) if i in keep]


def reward(spec: RewardSpec, signals: Sequence[Signal]) -> float | None:
    """One completion's reward from all its signals (rules 1-5); None when no signal counts."""
    counted = counted_signals(signals)
    if all(s.kind == "dwell" for s in counted):
        return None
    per_user: dict[str, float] = {}
    for s in counted:
        per_user[user_key(s)] = per_user.get(user_key(s), 0.0) + signal_reward(spec, s)
    total = sum(max(-spec.per_user_cap, min(spec.per_user_cap, r)) for r in per_user.values())
    return max(spec.reward_min, min(spec.reward_max, total))


class UserBudget:
    """How many completions each user has rewarded in the sliding window `window_s`.

    Deterministic and free of I/O: time is an argument (the joiner passes completion timestamps),
    never read from a clock. `admit(user, completion_id, ts)` is True when the user's signals on
    that completion may count: the completion is already counted for the user in the window, or
    the user has rewarded fewer than `max_per_window` completions in (ts - window_s, ts]. Memory is
    bounded by users x max_per_window; `prune(now)` forgets users idle for a whole window.
    """

    def __init__(self, max_per_window: int, window_s: float):
        if max_per_window < 1:
            raise ValueError(f"max_per_window must be >= 1, got {max_per_window}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.max_per_window, self.window_s = max_per_window, window_s
        self._used: dict[str, deque[tuple[float, str]]] = {}

    @classmethod
    def from_spec(cls, spec: RewardSpec) -> "UserBudget":
        return cls(spec.max_rewarded_per_user, spec.budget_window_s)

    def _in_window(self, user: str, ts: float) -> deque[tuple[float, str]]:
        q = self._used.setdefault(user, deque())
        while q and q[0][0] <= ts - self.window_s:
            q.popleft()
        return q

    def admit(self, user: str, completion_id: str, ts: float) -> bool:
        q = self._in_window(user, ts)
        if any(cid == completion_id for _, cid in q):
            return True
        if sum(1 for t, _ in q if t <= ts) >= self.max_per_window:
            return False
        q.append((ts, completion_id))
        if len(q) > 1 and q[-2][0] > ts:  # out-of-order timestamp: keep the queue sorted by time
            self._used[user] = deque(sorted(q))
        return True

    def used(self, user: str, ts: float) -> int:
        """Completions `user` has rewarded in (ts - window_s, ts]."""
        return sum(1 for t, _ in self._used.get(user, ()) if ts - self.window_s < t <= ts)

    def prune(self, now: float) -> None:
        for user in [u for u, q in self._used.items() if not q or q[-1][0] <= now - self.window_s]:
            del self._used[user]
