"""Wiring shared by the routes: the gateway's state, tenant resolution, model-name resolution.

`Gateway` holds the engine, the completion sink, the event bus, the completion index, the
registry, the key store and the metrics; routes get it, and the caller's tenant, as `Annotated` dependencies.
`parse_json` (and `JSONRoute`, the route class that has FastAPI parse bodies with it) is how a route
parses a JSON body.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute

from api.errors import APIError
from api.limits import TokenBuckets, retry_after
from api.metrics import Metrics
from core.security import Key
from core.settings import Settings
from feedback.bus import EventBus
from feedback.completion_index import CompletionIndex
from feedback.ingest import InFlight
from feedback.sink import CompletionSink
from registry.keys import KeyStore
from registry.models import ROLLOUT_SUFFIX
from registry.registry import Registry

if TYPE_CHECKING:
    from api.fleet import GatewayFleet

ALIAS = "flywheel"  # always names the default (promoted) version
PRODUCT_SCOPES = frozenset({"completions", "feedback:write"})  # FLYWHEEL_API_KEYS pairs and local mode


@dataclass(frozen=True)
class Caller:
    tenant: str
    scopes: frozenset[str]
    key: Key | None = None  # the key-store key it called with, if any

    def allows(self, scope: str) -> bool:
        return scope in self.scopes or "admin" in self.scopes


class Gateway:
    def __init__(
        self,
        settings: Settings,
        engine,
        sink: CompletionSink,
        bus: EventBus,
        index: CompletionIndex,
        registry: Registry,
        key_store: KeyStore,
        fleet: GatewayFleet | None = None,
    ):
        self.settings, self.engine, self.sink = settings, engine, sink
        self.bus, self.index, self.registry, self.key_store = bus, index, registry, key_store
        self.fleet = fleet
        self.metrics = Metrics()
        if fleet is not None:
            fleet.metrics = self.metrics  # it counts canary lapses
        self.background: set[asyncio.Task] = set()
        self.in_flight = InFlight()  # feedback being accepted: the bus watermark stays below it
        self.feedback_window_s: float | None = None  # the joiner's window: later feedback is refused (`serve`)
        self._keys = _parse_keys(settings.api_keys)
        self.limits: dict[str, TokenBuckets] = {}  # per-key rate limits (`api.limits`), by kind
        for kind, rate, burst in (
            ("completions", settings.limit_completions_per_s, settings.limit_completions_burst),
            ("feedback", settings.limit_feedback_events_per_s, settings.limit_feedback_burst),
        ):
            if rate is not None:
                self.limits[kind] = TokenBuckets(rate, burst if burst is not None else max(1.0, 2 * rate))

    @property
    def local_mode(self) -> bool:
        """No FLYWHEEL_API_KEYS: the product API needs no key, for local mode's one tenant."""
        return not self._keys

    def limit(self, kind: str, caller: Caller, route: str, n: int = 1) -> None:
        """Take `n` of `kind` ("completions", "feedback") from the caller's bucket, or refuse with 429
        `rate_limit_exceeded` and `Retry-After` (`api.limits`); no limit configured: nothing to do."""
        buckets = self.limits.get(kind)
        if buckets is None:
            return
        wait = buckets.take(caller.key.key_id if caller.key is not None else f"tenant:{caller.tenant}", n)
        unit = "completions" if kind == "completions" else "feedback events"
        if math.isinf(wait):  # more than a whole burst: it could never be paid, so waiting would not help
            raise APIError(
                400, f"This request asks for {n} {unit}, more than one key's burst ({buckets.burst:g}): split it.",
                None, "invalid_value",
            )  # fmt: skip
        if wait > 0:
            self.metrics.rate_limited.labels(route).inc()
            raise APIError(
                429,
                f"Rate limit reached: {buckets.rate:g} {unit} per second per key (bursts of {buckets.burst:g}); "
                f"retry in {wait:.2f} s.",
                None,
                "rate_limit_exceeded",
                headers={"Retry-After": retry_after(wait)},
            )

    def resolve_model(
        self, name: str, caller: Caller, user: str | None = None, param: str = "model", fresh: bool = False
    ) -> tuple[str, str | None]:
        """(version, arm) of a request. The alias gets the promoted (default) version, or during a canary
        the candidate for the users assigned to it (arm `candidate` / `incumbent` / `anonymous`); the
        promoted version by name, anyone; any other version only a key with the `eval` scope (arm
        `eval`, outside canary statistics), so no completions key gets around the gate; a `rollout`
        version (the learner's weights on a lent replica) nobody. `fresh`: the
        canary's share read from the registry, not the cache (resolving again after a swap retired
        the version resolved first: `api.routes.openai`)."""
        versions, default = self.engine.versions, self.engine.default_version
        if name == ALIAS and default:
            routed, arm = self.fleet.route(caller.tenant, user, fresh) if self.fleet is not None else (None, None)
            return routed or default, arm
        if name == ALIAS:  # every engine is down (killed, restarting): the alias exists, nothing serves it now
            raise APIError(
                503,
                f"No replica of this gateway is serving '{ALIAS}' right now (its engines are starting again); "
                "retry shortly.",
                param,
                "engine_unavailable",
                headers={"Retry-After": "2"},
            )
        if name.endswith(ROLLOUT_SUFFIX):  # the learner's weights on a lent replica: lent work only, never a user
            raise APIError(
                403,
                f"Version '{name}' is a rollout version, for lent work only; use '{ALIAS}'.",
                param,
                "model_not_allowed",
            )
        if name not in versions:
            known = sorted(
                v for v in versions if (v == default or caller.allows("eval")) and not v.endswith(ROLLOUT_SUFFIX)
            )
            known += [ALIAS]
            raise APIError(404, f"The model '{name}' does not exist. Available: {known}", param, "model_not_found")
        if name != default and not caller.allows("eval"):
            raise APIError(
                403,
                f"Naming version '{name}' needs a key with the 'eval' scope; use '{ALIAS}'.",
                param,
                "model_not_allowed",
            )
        return name, (None if name == default else "eval")

    def caller_for(self, request: Request, key_required: bool = False) -> Caller:
        """Who is calling: a key of the key store (`fw_...`), a `FLYWHEEL_API_KEYS` pair, or, with no
        keys configured (local mode) and `key_required` False, an anonymous caller of local mode's one
        tenant (`local_tenant`; an `X-Flywheel-Tenant` header naming another is refused: more tenants
        need keys)."""
        auth = request.headers.get("authorization", "")
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        if token.startswith("fw_"):
            key = self.key_store.verify(token)
            if key is None:
                raise APIError(401, "Incorrect or revoked API key.", None, "invalid_api_key")
            return Caller(key.tenant, frozenset(key.scopes), key)
        if key_required:
            raise APIError(401, "This API needs an API key (Authorization: Bearer fw_...).", None, "invalid_api_key")
        if not self._keys:
            local = self.settings.local_tenant
            tenant = request.headers.get("x-flywheel-tenant", local)
            if not tenant or len(tenant) > 64:
                raise APIError(400, "X-Flywheel-Tenant must be 1-64 characters", None, "invalid_tenant")
            if tenant != local:  # a header alone must not pick a tenant: isolation rests on keys
                raise APIError(
                    403,
                    f"This gateway runs without API keys (local mode), for one tenant, {local!r}; tenant "
                    f"{tenant!r} needs an API key of its own (flywheel keys create --tenant ...).",
                    None,
                    "tenant_needs_key",
                )
            return Caller(tenant, PRODUCT_SCOPES)
        for key_text, tenant in self._keys:
            if token and hmac.compare_digest(token, key_text):
                return Caller(tenant, PRODUCT_SCOPES)
        raise APIError(401, "Incorrect or missing API key.", None, "invalid_api_key")

    def spawn(self, coro) -> None:
        """Run `coro` in the background, keeping a reference until it ends (errors are logged by asyncio)."""
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)


def _parse_keys(entries: list[str]) -> list[tuple[str, str]]:
    """`tenant:key` pairs (a bare key belongs to tenant `default`)."""
    out = []
    for e in entries:
        tenant, sep, key = e.partition(":")
        out.append((key, tenant) if sep else (e, "default"))
    return out


# Both dependencies are async on purpose: they only read memory, and FastAPI would run a sync
# dependency on its thread pool (a thread hop per request).
async def get_gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


def needs(scope: str, key_required: bool = False):
    """A dependency: the caller, who must hold `scope` (403 otherwise)."""

    async def caller(request: Request, gw: GatewayDep) -> Caller:
        who = gw.caller_for(request, key_required)  # a key-store key costs a small file read
        if not who.allows(scope):
            raise APIError(403, f"This key lacks the '{scope}' scope.", None, "insufficient_scope")
        return who

    return caller


CompletionsCaller = Annotated[Caller, Depends(needs("completions"))]
FeedbackCaller = Annotated[Caller, Depends(needs("feedback:write"))]


async def metrics_reader(request: Request, gw: GatewayDep) -> None:
    """`/metrics` is operator-level: outside local mode (FLYWHEEL_API_KEYS set) it needs a key-store key
    with the `viewer` scope (or `admin`), as a Prometheus scraper's bearer token; in local mode it is
    open, like the rest of the product API. It carries no tenant's or user's identity either way."""
    if gw.local_mode:
        return
    who = gw.caller_for(request, key_required=True)
    if not who.allows("viewer"):
        raise APIError(403, "Reading /metrics needs a key with the 'viewer' scope.", None, "insufficient_scope")


MetricsReader = Depends(metrics_reader)


OFF_LOOP_BYTES = 64 << 10  # a body larger than this is parsed on a worker thread, off the event loop


async def off_the_loop_if_large(raw: bytes, parse: Callable[..., Any], *args: Any) -> Any:
    """`parse(raw, *args)`: inline for a small body, on a worker thread for one over `OFF_LOOP_BYTES`
    (parsing the largest body the limit admits takes tens of milliseconds: the loop serves meanwhile)."""
    if len(raw) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse, raw, *args)
    return parse(raw, *args)


def parse_json(raw: bytes) -> Any:
    """`json.loads` with the garbage collector paused: the objects of one document hold no cycles,
    and a body of many small containers (`[[],[],...]`) would otherwise set off collections that scan
    the whole heap, holding the event loop several times longer than the parsing itself."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return json.loads(raw)
    finally:
        if paused:
            gc.enable()


class _JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = await off_the_loop_if_large(await self.body(), parse_json)
        return self._json


class JSONRoute(APIRoute):
    """An `APIRoute` whose JSON body FastAPI parses with `parse_json` (off the loop when large)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(_JSONRequest(request.scope, request.receive))

        return handle
