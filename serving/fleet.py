"""The replicas of one gateway behind one engine-shaped front: requests go to a replica holding their version.

`Fleet(engines)` offers what the gateway's routes use of an engine (`versions`, `default_version`,
`tokenizer`, `context_length`, `alive`, `submit`, `generate`, `shutdown`) over several engines, each
driven by its own `serving.replica.Replica`. `engines` is a list, or a callable returning the
engines of the moment (a replica replaces an engine that died). A request goes to the engine with the
fewest live requests in flight (ties round robin) that holds its version and takes it (a replica still
loading a new version, or retiring an old one, refuses it and the next is tried): with round robin
alone, a replica whose requests ran longer queued new ones while another had free slots. Called by
`api.main` when the gateway runs replicas.

Lending (`serving.lending`): `lend(engine)` takes an engine out of live routing (its requests in
flight finish; `live_in_flight` counts them, from submit to the engine's last event, read or not),
`reclaim(engine)` puts it back; `oldest_live_s(engine)` is how long its oldest live request in flight
has run (co-serving yields to the tail: `FleetManager.co_serve_slots`). A version that only lent
engines hold is still served by them, counted in `live_on_lent`: live traffic always wins.

`traffic(engine)`: what each engine served, per version, since it joined: requests, errors, tokens
and the sum of end-to-end seconds (counted when a request's stream ends). Each replica reports the
change since its last heartbeat, so the fleet page shows requests/s and latency per version from
the heartbeats of every gateway (`registry.fleet_state`).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from serving.interface import Engine
from serving.requests import Completion, EngineError, GenerateMixin, RequestHandle
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer


class Fleet(GenerateMixin):
    def __init__(self, engines: list[Engine] | Callable[[], list[Engine]]):
        self._engines = engines if callable(engines) else (lambda: list(engines))
        if not self.engines:
            raise ValueError("a fleet needs at least one engine")
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._traffic: dict[int, dict[str, list[float]]] = {}  # id(engine) -> version -> [n, errors, tokens, s]
        self._away: set[int] = set()  # id(engine) of lent engines: no new live requests
        # id(engine) -> {request: monotonic submit time}: live requests submitted and not ended
        self._in_flight: dict[int, dict[int, float]] = {}
        self._seq = itertools.count()
        self._ttfts: deque[float] = deque(maxlen=10_000)  # times to first token since `take_ttfts`
        self.live_on_lent = 0

    def traffic(self, engine: Engine) -> dict[str, dict[str, float]]:
        """Cumulative counts of what `engine` served, per version (module docstring)."""
        with self._lock:
            got = {v: list(c) for v, c in self._traffic.get(id(engine), {}).items()}
        return {v: {"requests": n, "errors": e, "tokens": t, "seconds": s} for v, (n, e, t, s) in got.items()}

    def lend(self, engine: Engine) -> None:
        with self._lock:
            self._away.add(id(engine))

    def reclaim(self, engine: Engine) -> None:
        with self._lock:
            self._away.discard(id(engine))

    def serves_live(self, engine: Engine) -> bool:
        """`engine` takes new live requests (it is not lent)."""
        with self._lock:
            return id(engine) not in self._away

    def live_in_flight(self, engine: Engine) -> int:
        with self._lock:
            return len(self._in_flight.get(id(engine), ()))

    def oldest_live_s(self, engine: Engine, now: float | None = None) -> float:
        """Seconds since the oldest live request in flight on `engine` was submitted (0.0: none, or the
        engine is dead: requests it will never end are forgotten)."""
        with self._lock:
            if not engine.alive:
                self._in_flight.pop(id(engine), None)
            starts = self._in_flight.get(id(engine))
            first = min(starts.values()) if starts else None
        if first is None:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - first)

    def take_ttfts(self) -> list[float]:
        """Times to first token of the live requests that ended since the last call."""
        with self._lock:
            got = list(self._ttfts)
            self._ttfts.clear()
        return got

    def _ended(self, engine: Engine, seq: int) -> None:
        with self._lock:
            self._in_flight.get(id(engine), {}).pop(seq, None)

    def _count(self, engine: Engine, version: str, c: Completion | None) -> None:
        with self._lock:
            if c is not None:
                self._ttfts.append(c.first_token_s)
            rec = self._traffic.setdefault(id(engine), {}).setdefault(version, [0, 0, 0, 0.0])
            rec[0] += 1
            if c is None:
                rec[1] += 1
            else:
                rec[2] += len(c.output_ids)
                rec[3] += c.total_s

    @property
    def engines(self) -> list[Engine]:
        return self._engines()

    @property
    def versions(self) -> list[str]:
        """Versions some replica holds."""
        return sorted({v for e in self.engines for v in e.versions})

    @property
    def default_version(self) -> str | None:
        """The default most live replicas serve (they agree once synced: the promoted version)."""
        defaults = [e.default_version for e in self.engines if e.alive and e.default_version]
        return max(set(defaults), key=defaults.count) if defaults else None

    @property
    def alive(self) -> bool:
        return any(e.alive for e in self.engines)

    def _holding(self, version: str | None) -> list[Engine]:
        name = version or self.default_version
        engines = self.engines
        with self._lock:
            start = next(self._turn) % len(engines)
            order = engines[start:] + engines[:start]
            # the fewest live requests in flight first (a stable sort: ties stay in round-robin order)
            order.sort(key=lambda e: len(self._in_flight.get(id(e), ())))
        held = [e for e in order if e.alive and name in e.versions]
        serving = [e for e in held if id(e) not in self._away]
        return serving or held  # only lent engines hold it: served there rather than refused (counted)

    def tokenizer(self, version: str | None = None) -> Tokenizer:
        return self._first(version).tokenizer(version)

    def context_length(self, version: str | None = None) -> int:
        return self._first(version).context_length(version)

    def _first(self, version: str | None) -> Engine:
        held = self._holding(version)
        if not held:
            raise KeyError(f"model version {version or self.default_version!r} is not loaded on any replica")
        return held[0]

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        version: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
    ) -> RequestHandle:
        held = self._holding(version)
        count_lent = bool(held) and all(id(e) in self._away for e in held)
        if not held:
            if not self.alive:
                raise EngineError("no replica is running")
            raise KeyError(f"model version {version or self.default_version!r} is not loaded on any replica")
        refused: Exception | None = None
        name = str(version or self.default_version)
        for engine in held:
            try:
                handle = engine.submit(prompt_ids, params, version, request_id=request_id, stream=stream)
            except (KeyError, EngineError) as e:  # retiring there, or that replica just died: try the next
                refused = e
                continue
            seq = next(self._seq)
            with self._lock:
                self._in_flight.setdefault(id(engine), {})[seq] = time.monotonic()
            handle.when_ended(functools.partial(self._ended, engine, seq))  # read or not: a dropped stream too
            if count_lent:
                with self._lock:
                    self.live_on_lent += 1
            return _Counted(handle, functools.partial(self._count, engine, name))
        assert refused is not None
        raise refused

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()


class _Counted(RequestHandle):
    """A replica's request handle that reports how the request ended (its completion, or None for an
    error or an abandoned stream) once, to the fleet's traffic counts."""

    def __init__(self, inner: RequestHandle, done: Callable[[Completion | None], None]):
        self.inner, self._done, self._reported = inner, done, False
        self.request_id, self.stream, self.cancelled = inner.request_id, inner.stream, False

    def cancel(self) -> None:
        self.cancelled = True
        self.inner.cancel()

    def when_ended(self, fn: Callable[[], object]) -> None:
        self.inner.when_ended(fn)

    def _report(self, c: Completion | None) -> None:
        if not self._reported:
            self._reported = True
            self._done(c)

    def __iter__(self):
        try:
            for ev in self.inner:
                if ev.completion is not None:
                    self._report(ev.completion)
                yield ev
        finally:
            self._report(None)

    async def __aiter__(self):
        try:
            async for ev in self.inner:
                if ev.completion is not None:
                    self._report(ev.completion)
                yield ev
        finally:
            self._report(None)
