"""The gateway's replicas: engines that follow the registry, and the canary split of its traffic.

`GatewayFleet.start(settings, registry, make_engine)` publishes the base model if nothing is
promoted yet (`registry.publish.publish_base`), makes `FLYWHEEL_REPLICAS` engines, each driven by a
`serving.replica.Replica` that fetches versions from the weight store shared with the learner,
checks them against the registry's hashes, swaps them in and heartbeats; it waits for their first
sync, then runs their follower loops on threads; a replica whose engine dies (its process killed)
starts a fresh one with `make_engine` and loads what the registry says. On PostgreSQL each replica LISTENs for the
registry's NOTIFY (`serving.replica.PgNotifier`), so a change reaches it at once rather than at its
next poll (at most a second on SQLite). `engine` is the `serving.fleet.Fleet` the routes
submit to. `route(tenant, user)` says which version and arm a request for the `flywheel` alias gets:
during a canary, users land in it by `gating.stats.assign_arm` (sticky, salted by the candidate's
id); completions without a user are their own stratum and get the promoted version.

A canary is routed only while a gate holds a live lease (`registry.gate_lease`): with no gate beating
(killed, hung, stopped), its share *lapses* to 0 here, so nobody is routed to a candidate that no gate
watches. The registry is not written (the candidate stays in `canary` at its share); a fresh beat
resumes the routing at the stored share. The lease is read with the canary, so a lapse takes effect
within the lease plus `CANARY_TTL_S`. Each lapse is logged at WARNING when it starts and when it ends,
and counted (`lapses`; `flywheel_canary_lapses` and the `flywheel_canary_lapsed` gauge in `/metrics`).
Called by `api.main`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from api.lending import LendingLoop
from api.metrics import Metrics
from core.settings import Settings
from gating.stats import assign_arm
from registry.jobs import JobQueue
from registry.models import utcnow
from registry.publish import STORE, publish_base
from registry.registry import Registry
from serving.fetch import Fetcher
from serving.fleet import Fleet
from serving.interface import Engine
from serving.lending import LendingConfig
from serving.replica import PgNotifier, Replica
from serving.weight_store import WeightStore

log = logging.getLogger(__name__)
CANARY_TTL_S = 1.0  # how long the canary's share is cached between registry reads


@dataclass(frozen=True)
class Canary:
    version: str
    share: float


def gateway_id_of(settings: Settings) -> str:
    """This gateway's id: `gateway.id` (FLYWHEEL_GATEWAY_ID), else `<host>-<pid>`."""
    return settings.gateway_id or f"{socket.gethostname()}-{os.getpid()}"


def wait_for_promoted(registry: Registry, where: str, timeout_s: float = 600.0) -> None:
    """Until the registry has a promoted version (a gateway whose weights come from `where`, not its
    own folder, never publishes the base: a second copy in its own folder would race the first)."""
    deadline, said = time.monotonic() + timeout_s, False
    while registry.promoted() is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no promoted version after {timeout_s:.0f} s: the base is published at {where}")
        if not said:
            log.info("gateway: waiting for the base to be published at %s", where)
            said = True
        time.sleep(0.5)


class GatewayFleet:
    def __init__(self, registry: Registry, replicas: list[Replica], stop: threading.Event):
        self.registry, self.replicas, self._stop = registry, replicas, stop
        self.engine = Fleet(lambda: [r.engine for r in replicas])  # a replica may replace an engine that died
        self._threads: list[threading.Thread] = []
        self._canary: tuple[float, Canary | None] = (0.0, None)
        self.metrics: Metrics | None = None  # the gateway's, for the lapse counter (`api.deps.Gateway`)
        self.lapses = 0  # canary lapses started: a candidate in canary with no live gate lease
        self._lapse: tuple[str, float] | None = None  # (version, monotonic start) of the current lapse
        self._lapse_lock = threading.Lock()
        self.lending: LendingLoop | None = None  # lending idle replicas (`[lending]` enabled)

    @classmethod
    def start(
        cls,
        settings: Settings,
        registry: Registry,
        make_engine: Callable[[], Engine],
        lending: LendingConfig | None = None,
    ) -> GatewayFleet:
        """`lending` enabled: a `api.lending.LendingLoop` lends idle replicas to the registry's job queue."""
        models_dir = settings.learner_models_dir  # shared with `flywheel learner`
        weights = settings.weights_url
        if weights is not None and Path(weights) != models_dir:  # the versions live where the learner is:
            wait_for_promoted(registry, weights)  # it (or the gateway beside it) publishes the base there
        else:
            publish_base(registry, models_dir, settings.served_model_dir)
        gateway_id = gateway_id_of(settings)
        store = WeightStore(models_dir / STORE)
        fetcher = Fetcher(settings.weights_url or models_dir, token=settings.weights_token)
        on_postgres = settings.db_url.startswith("postgresql")
        replicas = [
            Replica(
                f"{gateway_id}-r{i}",
                gateway_id,
                make_engine(),
                store,
                registry,
                fetcher,
                settings.served_model_dir,
                heartbeat_s=settings.heartbeat_s,
                notifier=PgNotifier(settings.db_url) if on_postgres else None,
                make_engine=make_engine,
            )  # fmt: skip
            for i in range(settings.replicas)
        ]
        fleet = cls(registry, replicas, threading.Event())
        for r in replicas:
            r.traffic_source = fleet.engine.traffic  # heartbeats say what each replica served
            result = r.sync()
            if result.default is None:
                fleet.close()
                raise RuntimeError(f"replica {r.replica_id} could not load the promoted version: {result.error}")
            r.heartbeat()
        for r in replicas:
            t = threading.Thread(target=r.run, args=(fleet._stop,), name=f"replica-{r.replica_id}", daemon=True)
            t.start()
            fleet._threads.append(t)
        if lending is not None and lending.enabled:
            queue = JobQueue(settings.db_url)
            engines = lambda: {r.replica_id: r.engine for r in replicas}  # noqa: E731
            by_id = {r.replica_id: r for r in replicas}

            def prepare(name: str, version: str | None, state: str) -> None:
                by_id[name].lending_state = state
                by_id[name].lend_version(version)

            fleet.lending = LendingLoop(fleet.engine, engines, lending, queue, prepare=prepare).start()
            log.info("lending: on, over %d replicas (%s)", len(replicas), lending)
        return fleet

    def canary(self, fresh: bool = False) -> Canary | None:
        """The version in canary and its share, None when there is none or it lapsed (no live gate
        lease). Cached for `CANARY_TTL_S`; `fresh`: read now."""
        at, cached = self._canary
        if not fresh and time.monotonic() - at < CANARY_TTL_S:
            return cached
        v = self.registry.in_flight()
        share = float((v.gate.get("canary") or {}).get("share", 0.0)) if v is not None else 0.0
        now = Canary(v.id, share) if v is not None and v.status == "canary" and share > 0 else None
        if now is not None and self.registry.gate_lease() is None:
            self._lapsed(now)
            now = None
        elif self._lapse is not None:
            self._lapse_over(now)
        self._canary = (time.monotonic(), now)
        return now

    def _lapsed(self, c: Canary) -> None:
        if self._lapse is not None and self._lapse[0] != c.version:
            self._lapse_over(None)
        with self._lapse_lock:
            if self._lapse is not None and self._lapse[0] == c.version:
                return
            self._lapse = (c.version, time.monotonic())
            self.lapses += 1
        last = next(iter(self.registry.gate_leases()), None)
        seen = "no gate ever beat" if last is None else (
            f"the last beat, of gate {last.gate_id} ({last.host} pid {last.pid}), is {last.age_s(utcnow()):.1f} s "
            f"old (lease {last.lease_s:g} s)"
        )  # fmt: skip
        log.warning(
            "canary lapsed: %s stays in canary at %.0f%% but is routed to nobody: no live gate lease (%s)",
            c.version,
            100 * c.share,
            seen,
        )
        if self.metrics is not None:
            self.metrics.canary_lapses.inc()
            self.metrics.canary_lapsed.set(1)

    def _lapse_over(self, now: Canary | None) -> None:
        with self._lapse_lock:
            if self._lapse is None:
                return
            (version, since), self._lapse = self._lapse, None
        took = time.monotonic() - since
        if now is not None and now.version == version:
            log.warning("canary lapse over: a gate beats again; %s routed at %.0f%% after %.1f s", version,
                        100 * now.share, took)  # fmt: skip
        else:
            log.warning("canary lapse over: %s is no longer in canary (after %.1f s)", version, took)
        if self.metrics is not None:
            self.metrics.canary_lapsed.set(0)

    def route(self, tenant: str, user: str | None, fresh: bool = False) -> tuple[str | None, str | None]:
        """(version, arm) for a request of the alias: (None, None) outside a canary (the default)."""
        c = self.canary(fresh)
        if c is None or c.version not in self.engine.versions:
            return None, None
        arm = assign_arm(c.version, tenant, user, c.share)
        return (c.version if arm == "candidate" else self.engine.default_version), arm

    def close(self) -> None:
        if self.lending is not None:
            self.lending.close()
            self.lending.queue.close()
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        for r in self.replicas:
            if isinstance(r.notifier, PgNotifier):
                r.notifier.close()
        self.engine.shutdown()
