"""Per-key rate limits: token buckets for completions (requests per second) and feedback (events per
second), set by the config file's `[limits]` (`core.settings`).

Each caller has one bucket per kind, keyed by its API key's id (a key of the key store), else by its
tenant (a `FLYWHEEL_API_KEYS` pair, or local mode's `X-Flywheel-Tenant`). A bucket holds up to `burst`
tokens and refills at `rate` per second; a request takes 1 token (a feedback batch, one per event). A
request the bucket cannot pay for gets 429 `rate_limit_exceeded` with `Retry-After` (whole seconds,
at least 1): when the bucket will hold enough again; one that asks for more than a whole burst could
never be paid, and gets 400 `invalid_value` saying so. Nothing of a refused request is done or kept.

The buckets live in each gateway's memory: behind a load balancer that spreads one key over N gateways,
the key's limit is up to N times the configured one (docs/api.md). At most `max_keys` buckets are kept
per kind; past that the longest-unused one is dropped (a full bucket: dropping it forgives nothing).
`/metrics` counts refusals per route (`flywheel_rate_limited_total{route}`), never per key or tenant.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable


class TokenBuckets:
    """Buckets of `burst` tokens refilled at `rate` per second, one per key (module docstring)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 100_000, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"a rate limit must be positive, got {rate!r}")
        if not burst >= 1:
            raise ValueError(f"a burst must hold at least one request, got {burst!r}")
        self.rate, self.burst, self.max_keys, self.clock = float(rate), float(burst), max_keys, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str, n: float = 1.0) -> float:
        """Take `n` tokens from `key`'s bucket: 0.0 when taken, else the seconds until the bucket holds
        `n` (nothing taken). More than `burst` can never be paid: `math.inf`."""
        if n > self.burst:
            return math.inf
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            wait = 0.0
            if tokens >= n:
                tokens -= n
            else:
                wait = (n - tokens) / self.rate
            self._buckets[key] = (tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return wait


def retry_after(wait_s: float) -> str:
    """`Retry-After` for a wait: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s)))
