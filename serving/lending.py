"""Off-peak lending: which of a gateway's replicas serve live traffic and which are lent to offline
work (the gate's eval sampling, the learner's rollouts), decided from the live load.

Owns the policy, not the mechanics: `FleetManager` is fed load samples and answers with decisions;
whoever drives the replicas carries them out (and the simulated fleet of `bench/lending.py` drives
the same class). The rules, every number from the config file's `[lending]` section (`LendingConfig`):
- **States.** A replica is `serving`, `draining` (chosen to be lent: no new live request is routed to
  it, and it becomes `lent` once its last live request has ended) or `lent`.
- **Capacity model.** One replica serves `target_concurrency` live requests at once within the latency
  objective (Knative's target concurrency). Utilisation is the live concurrency over the serving
  replicas' capacity.
- **Lend slowly.** A replica is lent only after the load has stayed low for `lend_after_s` (minutes):
  the highest concurrency seen over that time must fit in one replica fewer, keeping `headroom` of
  their capacity free, and at least `min_serving` replicas keep serving. Then the idle clock starts
  again, so replicas are lent one at a time.
- **Reclaim fast.** Utilisation at or above `high_watermark` on average over the last
  `reclaim_after_s` seconds (or the p50 time to first token above `ttft_objective_s` there) reclaims
  one replica, then another after `reclaim_after_s` more. **Panic**: a sample with concurrency at or
  above `panic_factor` times the serving capacity reclaims every replica at once.
- **Co-serving** (`co_serve`): a serving replica also runs lent work in the slots its live requests
  leave free: it starts lent sequences up to `co_serve_fill` of `target_concurrency` in all, and cuts
  them only when live and lent together would pass the whole target (`co_serve_slots`). While one of
  its live requests has run `co_serve_yield_s`, the replica cuts its lent work and starts none: the
  tail of long generations, which lent sequences would slow further, runs alone. Whole-replica
  lending uses the night; co-serving uses the daytime slack, spread as free slots over every serving
  replica.
- A reclaimed replica serves again at once: the engine puts live requests ahead of rollout work and
  evicts running rollout sequences at its next step (`serving.engine`), and the job queue
  (`registry.jobs`) resumes what was cut short.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

State = Literal["serving", "draining", "lent"]


class LendingConfig(BaseModel):
    """The `[lending]` section of the config file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(False, description="Lend idle replicas to offline work (off: every replica serves).")
    target_concurrency: float = Field(
        32.0, gt=0, description="Live requests one replica serves at once within the latency objective."
    )
    headroom: float = Field(
        0.5, ge=0, lt=1, description="Share of the remaining replicas' capacity that must stay free after a lend."
    )
    min_serving: int = Field(1, ge=1, description="Replicas that always serve live traffic.")
    lend_after_s: float = Field(300.0, gt=0, description="Seconds the load must stay low before a replica is lent.")
    high_watermark: float = Field(
        0.8, gt=0, le=1, description="Utilisation of the serving replicas that reclaims a lent one."
    )
    reclaim_after_s: float = Field(
        5.0, gt=0, description="Seconds of high load that reclaim one replica (and between two reclaims)."
    )
    panic_factor: float = Field(
        2.0, gt=1, description="Concurrency, in multiples of the serving capacity, that reclaims every replica."
    )
    ttft_objective_s: float = Field(
        1.0, gt=0, description="p50 time to first token above this, over `reclaim_after_s`, reclaims too."
    )
    max_rollout_concurrency: int = Field(
        16, ge=1, description="Rollout sequences a lent replica runs at once (the manager caps it, not the engine)."
    )
    co_serve: bool = Field(
        False,
        description="Serving replicas run lent work too, in the slots live traffic leaves free: started up to "
        "`co_serve_fill` of `target_concurrency` in all, cut when live and lent pass the whole target.",
    )
    co_serve_fill: float = Field(
        0.75,
        gt=0,
        le=1,
        description="Share of `target_concurrency` a serving replica fills with live and co-served work; the rest "
        "is room a live request takes without cutting lent work (bench/lending.py measures 0.5, 0.75 and 1).",
    )
    co_serve_yield_s: float | None = Field(
        20.0,
        gt=0,
        description="A serving replica runs no co-served work while one of its live requests has run this long: "
        "lent sequences slow every step, and the longest generations are the ones a timeout catches "
        "(bench/lending.py; None: never yield).",
    )

    @model_validator(mode="after")
    def _windows(self) -> LendingConfig:
        if self.reclaim_after_s >= self.lend_after_s:
            raise ValueError(
                f"reclaim_after_s ({self.reclaim_after_s}) must be shorter than lend_after_s ({self.lend_after_s})"
            )
        return self


@dataclass(frozen=True)
class Decision:
    action: Literal["lend", "lent", "reclaim"]
    replica: str
    reason: str


@dataclass
class _Sample:
    t: float
    concurrency: float
    ttft_s: list[float] = field(default_factory=list)


class FleetManager:
    """The lending policy over named replicas (module docstring). Feed it `observe(...)` samples in time
    order; `decide(now)` returns what to do now and applies it to `states`."""

    def __init__(self, cfg: LendingConfig, replicas: list[str]):
        if len(set(replicas)) != len(replicas) or not replicas:
            raise ValueError(f"replicas must be distinct names, at least one: {replicas!r}")
        self.cfg = cfg
        self.states: dict[str, State] = dict.fromkeys(replicas, "serving")
        self._samples: deque[_Sample] = deque()
        self._live_in_flight: dict[str, int] = dict.fromkeys(replicas, 0)
        self._idle_since: float | None = None  # start of the current stretch of low load
        self._last_reclaim = float("-inf")
        self.lent_seconds = 0.0  # replica-seconds spent lent
        self.counters = {"lends": 0, "reclaims": 0, "panics": 0, "slow_first_tokens": 0, "slow_first_tokens_lent": 0}
        """`slow_first_tokens`: live times to first token over `ttft_objective_s` (latency-objective
        violations); `slow_first_tokens_lent`: those of them while a replica was away (lent or draining)."""
        self._last_t: float | None = None

    def serving(self) -> list[str]:
        return [r for r, s in self.states.items() if s == "serving"]

    def capacity(self) -> float:
        return len(self.serving()) * self.cfg.target_concurrency

    def observe(
        self, now: float, concurrency: float, live_in_flight: dict[str, int], ttft_s: list[float] | None = None
    ) -> None:
        """A load sample: the gateway's live concurrency (requests in flight), each replica's live
        requests in flight, and the times to first token of requests that started since the last one."""
        if self._last_t is not None:
            if now < self._last_t:
                raise ValueError(f"samples must come in time order: {now} after {self._last_t}")
            self.lent_seconds += (now - self._last_t) * sum(1 for s in self.states.values() if s == "lent")
        self._last_t = now
        slow = sum(x > self.cfg.ttft_objective_s for x in ttft_s or ())
        self.counters["slow_first_tokens"] += slow
        if any(s != "serving" for s in self.states.values()):
            self.counters["slow_first_tokens_lent"] += slow
        self._samples.append(_Sample(now, concurrency, list(ttft_s or [])))
        keep = max(self.cfg.lend_after_s, self.cfg.reclaim_after_s)
        while self._samples and self._samples[0].t < now - keep:
            self._samples.popleft()
        self._live_in_flight.update(live_in_flight)

    def co_serve_slots(self, replica: str, live_in_flight: int, oldest_live_s: float = 0.0) -> tuple[int, int]:
        """(start, keep): serving replica `replica`, with `live_in_flight` live requests, the oldest of
        them `oldest_live_s` seconds in, may start sequences of lent work while it runs fewer than
        `start`, and must cut them down to `keep` (`co_serve`). `start` fills the replica to
        `co_serve_fill` of `target_concurrency`; `keep` is what is left of the whole target, so a live
        request that arrives takes the room left free first and cuts lent work only beyond it. Both 0
        with `co_serve` off, for a replica that is not serving, while one of its live requests has run
        `co_serve_yield_s` (the tail runs alone), and while the last sample's utilisation of the serving
        replicas is at or above `high_watermark` (the fleet is short of room: live traffic may need every
        slot)."""
        if not self.cfg.co_serve or self.states.get(replica) != "serving":
            return 0, 0
        if self.cfg.co_serve_yield_s is not None and oldest_live_s >= self.cfg.co_serve_yield_s:
            return 0, 0
        if self._samples and self._samples[-1].concurrency >= self.cfg.high_watermark * self.capacity():
            return 0, 0
        target = self.cfg.target_concurrency
        start = max(0, int(self.cfg.co_serve_fill * target - live_in_flight))
        return start, max(start, int(target - live_in_flight))

    def _recent(self, now: float, seconds: float) -> list[_Sample]:
        return [s for s in self._samples if s.t >= now - seconds]

    def decide(self, now: float) -> list[Decision]:
        were = {r for r, s in self.states.items() if s == "draining"}  # not one chosen just now: its
        out = self._decide(now)  # in-flight count is from before live routing left it
        for r, s in self.states.items():  # a draining replica whose live requests ended is lent
            if s == "draining" and r in were and self._live_in_flight.get(r, 0) == 0:
                self.states[r] = "lent"
                out.append(Decision("lent", r, "its last live request ended"))
        return out

    def _decide(self, now: float) -> list[Decision]:
        cfg, out = self.cfg, list[Decision]()
        away = [r for r, s in self.states.items() if s != "serving"]
        if not self._samples:
            return out
        last = self._samples[-1]
        if away and last.concurrency >= cfg.panic_factor * self.capacity():
            self.counters["panics"] += 1
            for r in away:
                out.append(self._reclaim(r, now, f"panic: concurrency {last.concurrency:g} >= {cfg.panic_factor}x"))
            return out
        recent = self._recent(now, cfg.reclaim_after_s)
        if away and now - self._last_reclaim >= cfg.reclaim_after_s:
            use = statistics.fmean(s.concurrency for s in recent) / self.capacity()
            ttfts = [x for s in recent for x in s.ttft_s]
            slow = statistics.median(ttfts) if ttfts else 0.0
            if use >= cfg.high_watermark or slow > cfg.ttft_objective_s:
                why = f"utilisation {use:.2f}" if use >= cfg.high_watermark else f"p50 TTFT {slow:.3f} s"
                out.append(self._reclaim(away[-1], now, why))
                return out
        fewer = len(self.serving()) - 1
        fits = last.concurrency <= (1 - cfg.headroom) * fewer * cfg.target_concurrency
        if not fits:
            self._idle_since = None
            return out
        if self._idle_since is None:
            self._idle_since = now
        if fewer >= cfg.min_serving and now - self._idle_since >= cfg.lend_after_s:
            r = self.serving()[-1]
            self.states[r] = "draining"
            self.counters["lends"] += 1
            self._idle_since = now  # the next lend needs another stretch of low load
            out.append(Decision("lend", r, f"load fit in {fewer} replicas for {cfg.lend_after_s:g} s"))
        return out

    def _reclaim(self, replica: str, now: float, why: str) -> Decision:
        self.states[replica] = "serving"
        self.counters["reclaims"] += 1
        self._last_reclaim = now
        self._idle_since = None
        return Decision("reclaim", replica, why)
