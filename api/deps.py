"""Wiring shared by the routes: the gateway's state, tenant resolution, model-name resolution.

`Gateway` holds the engine, the completion sink, the event bus, the completion index, the
registry, the key store and the metrics; routes get it, and the caller's tenant, as `Annotated` dependencies.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Annotated

from fastapi import Depends, Request

from api.errors import APIError
from api.metrics import Metrics
from core.security import KeyStore
from core.settings import Settings
from feedback.bus import EventBus
from feedback.completion_index import CompletionIndex
from feedback.sink import CompletionSink
from gating.registry import Registry

ALIAS = "flywheel"  # always names the default (promoted) version


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
    ):
        self.settings, self.engine, self.sink = settings, engine, sink
        self.bus, self.index, self.registry, self.key_store = bus, index, registry, key_store
        self.metrics = Metrics()
        self.background: set[asyncio.Task] = set()
        self._keys = _parse_keys(settings.api_keys)

    def resolve_model(self, name: str, param: str = "model") -> str:
        versions = self.engine.versions
        if name == ALIAS and self.engine.default_version:
            return self.engine.default_version
        if name in versions:
            return name
        raise APIError(
            404, f"The model '{name}' does not exist. Available: {sorted(versions) + [ALIAS]}", param, "model_not_found"
        )

    def tenant_for(self, request: Request) -> str:
        if not self._keys:
            tenant = request.headers.get("x-flywheel-tenant", "default")
            if not tenant or len(tenant) > 64:
                raise APIError(400, "X-Flywheel-Tenant must be 1-64 characters", None, "invalid_tenant")
            return tenant
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth.lower().startswith("bearer ") else ""
        for key, tenant in self._keys:
            if token and hmac.compare_digest(token, key):
                return tenant
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


async def get_tenant(request: Request, gw: GatewayDep) -> str:
    return gw.tenant_for(request)


TenantDep = Annotated[str, Depends(get_tenant)]
