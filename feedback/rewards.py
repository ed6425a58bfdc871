"""Reward shaping: one completion's feedback signals become one scalar reward, and per-user caps bound
how far any single user can move the learner. Every number below is a field of `RewardSpec`:

    signal       reward (default-v1)                      why
    accepted     +0.75                                    the strongest implicit "this was useful"
    rejected     -0.25                                    weak: users dismiss good completions too
    thumb_up     +0.5                                     explicit but rare and cheap to give
    thumb_down   -0.5                                     symmetric with thumb_up
    rating       (stars - 3) / 4 x 1.0                    1 star -0.5 .. 3 stars 0 .. 5 stars +0.5
    edited       +0.75 x kept - 0.25 x (1 - kept)         from "accepted" (kept all) to "rejected" (none)
    copied       +0.25                                    mild: copying usually follows acceptance
    regenerated  -0.25                                    "try again" is a rejection, not a verdict
    dwell        +0.05 x min(dwell_s, 30) / 30            tie-breaker only: at most 0.05
    shown        0 (exposure)                             see silence
    silence      0.0: shown, then no other reaction       "ignored" scores below anything a user liked
    total        clipped to [reward_min, reward_max] = [-1, 1]

Positive signals outweigh negative ones on purpose: rejections and regenerations also happen to correct
completions (the user wanted another phrasing). The learner subtracts a baseline: only differences matter.

Rules: (1) signals without a `user_id` are one anonymous user; (2) per user, only the latest signal
(largest `ts`, ties to the later one) of each kind counts, and of each exclusive group: {accepted,
rejected, edited} and {thumb_up, thumb_down}; (3) a user's sum is clipped to +-`per_user_cap`; (4) the
users' total is clipped to [`reward_min`, `reward_max`]; (5) a completion reported as `shown` with no
signal of its own inside the window (dwell aside) is *silence*: its reward is `silence` (plus any dwell),
so a completion users ignore still counts, and counts as ignored; (6) not shown and only dwell, or no
signal at all: no reward (None) — the completion may never have reached a user.
Silence is 0.0, not negative, on purpose: with the learner's baseline subtracted, an ignored completion
already scores below the average one as soon as users like some completions.
With `UserBudget` (at most `max_rewarded_per_user` completions per `budget_window_s`), one user moves
the learner's sum of rewards by at most `per_user_cap x max_rewarded_per_user` per window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from feedback.events import Signal

# Kinds whose signals exclude each other for one user: only the latest of the group counts.
EXCLUSIVE_GROUPS = (frozenset({"accepted", "rejected", "edited"}), frozenset({"thumb_up", "thumb_down"}))
ANONYMOUS = "<anonymous>"


class RewardSpec(BaseModel):
    """How feedback signals become one reward; see the module docstring for the reasoning."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(
        "default-v1",
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="Name and version, stamped on every SampleEvent; change it with any value.",
    )
    accepted: float = Field(0.75, ge=0.0, description="Reward of an accepted completion.")
    rejected: float = Field(-0.25, le=0.0, description="Reward of an explicitly rejected completion.")
    thumb_up: float = Field(0.5, ge=0.0, description="Reward of a thumb up.")
    thumb_down: float = Field(-0.5, le=0.0, description="Reward of a thumb down.")
    rating_scale: float = Field(1.0, ge=0.0, description="A rating of s stars (1..5) gives (s - 3) / 4 x this.")
    edited_all_kept: float = Field(0.75, description="Reward of an edited completion kept entirely (fraction 1).")
    edited_none_kept: float = Field(-0.25, description="Reward of an edit keeping none (fraction 0); linear between.")
    copied: float = Field(0.25, ge=0.0, description="Reward of a copied completion.")
    regenerated: float = Field(-0.25, le=0.0, description="Reward of a completion the user asked to regenerate.")
    dwell_weight: float = Field(0.05, ge=0.0, description="Largest dwell reward (at dwell_cap_s); below any other.")
    dwell_cap_s: float = Field(30.0, gt=0.0, description="Dwell seconds beyond this earn nothing more.")
    silence: float = Field(
        0.0, description="Reward of a completion shown to its user who reacted in no other way within the window."
    )
    reward_min: float = Field(-1.0, description="Lower clip of the final reward.")
    reward_max: float = Field(1.0, description="Upper clip of the final reward.")
    per_user_cap: float = Field(1.0, gt=0.0, description="One user's contribution to a reward is clipped to +- this.")
    max_rewarded_per_user: int = Field(200, ge=1, description="Completions one user may reward per budget window.")
    budget_window_s: float = Field(3600.0, gt=0.0, description="The UserBudget window (by completion timestamp).")

    @model_validator(mode="after")
    def _consistent(self) -> RewardSpec:
        lo, hi = self.reward_min, self.reward_max
        if not lo <= 0.0 <= hi or lo == hi:
            raise ValueError(f"reward_min <= 0 <= reward_max and reward_min < reward_max must hold, got [{lo}, {hi}]")
        if not lo <= self.silence <= hi:
            raise ValueError(f"silence ({self.silence}) must lie in [reward_min, reward_max] = [{lo}, {hi}]")
        none, full = self.edited_none_kept, self.edited_all_kept
        if not none <= full:  # keeping more of a completion cannot be worse
            raise ValueError(f"edited_none_kept ({none}) must be <= edited_all_kept ({full})")
        signals = (self.accepted, self.rejected, self.thumb_up, self.thumb_down, self.copied, self.regenerated)
        others = [abs(v) for v in signals if v != 0.0]
        if others and self.dwell_weight >= (least := min(others)):  # dwell is only a tie-breaker
            raise ValueError(f"dwell_weight ({self.dwell_weight}) must be below every other nonzero signal ({least})")
        return self


def signal_reward(spec: RewardSpec, signal: Signal) -> float:
    """The reward of one signal on its own (before any cap or clip)."""
    if signal.kind == "shown":
        return 0.0
    if signal.kind not in ("rating", "edited", "dwell"):
        return float(getattr(spec, signal.kind))
    v = signal.value
    assert v is not None, "validated by FeedbackEvent"
    if signal.kind == "rating":
        return (v - 3.0) / 4.0 * spec.rating_scale
    if signal.kind == "edited":
        return spec.edited_all_kept * v + spec.edited_none_kept * (1.0 - v)
    return spec.dwell_weight * min(max(v, 0.0), spec.dwell_cap_s) / spec.dwell_cap_s


def user_key(signal: Signal) -> str:
    return signal.user_id if signal.user_id is not None else ANONYMOUS


def counted_signals(signals: Sequence[Signal]) -> list[Signal]:
    """The signals that count (rules 1-2), in input order."""
    latest: dict[tuple[str, frozenset[str] | str], int] = {}
    for i, s in enumerate(signals):
        key = (user_key(s), next((g for g in EXCLUSIVE_GROUPS if s.kind in g), s.kind))
        if key not in latest or s.ts >= signals[latest[key]].ts:
            latest[key] = i
    keep = set(latest.values())
    return [s for i, s in enumerate(signals) if i in keep]


def reward(spec: RewardSpec, signals: Sequence[Signal]) -> float | None:
    """One completion's reward from all its signals (rules 1-6); None when no signal counts."""
    counted = counted_signals(signals)
    silent = all(s.kind in ("dwell", "shown") for s in counted)
    if silent and not any(s.kind == "shown" for s in counted):
        return None
    per_user: dict[str, float] = {}
    for s in counted:
        per_user[user_key(s)] = per_user.get(user_key(s), 0.0) + signal_reward(spec, s)
    total = sum(max(-spec.per_user_cap, min(spec.per_user_cap, r)) for r in per_user.values())
    if silent:
        total += spec.silence
    return max(spec.reward_min, min(spec.reward_max, total))


class UserBudget:
    """How many completions each user has rewarded in a sliding window, by completion timestamp.

    `admit(user, completion_id, ts)` is True when the completion already counts for the user in the
    window, or the user rewarded fewer than `max_per_window` in (ts - window_s, ts]. Memory is bounded
    by users x max_per_window; `prune(now)` forgets users idle for a whole window.
    """

    def __init__(self, max_per_window: int, window_s: float):
        if max_per_window < 1:
            raise ValueError(f"max_per_window must be >= 1, got {max_per_window}")
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.max_per_window, self.window_s = max_per_window, window_s
        self._used: dict[str, deque[tuple[float, str]]] = {}

    @classmethod
    def from_spec(cls, spec: RewardSpec) -> UserBudget:
        return cls(spec.max_rewarded_per_user, spec.budget_window_s)

    def admit(self, user: str, completion_id: str, ts: float) -> bool:
        q = self._used.setdefault(user, deque())
        while q and q[0][0] <= ts - self.window_s:
            q.popleft()
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
