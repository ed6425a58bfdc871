"""The admin API: read the registry and the fleet; approve, reject and roll back versions.

Every route needs an API key from the key store (`registry.keys.KeyStore`), even in local mode:
reads need `viewer` (or `admin`), actions need `admin`. A missing or unknown key is 401, a key
without the scope 403. Each action takes a reason and calls one `registry.registry.Registry`
method, which audits it; a step the lifecycle does not allow is 409 and changes nothing.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from api.deps import Caller, GatewayDep, needs
from api.errors import APIError
from registry.models import Status
from registry.registry import RegistryConflict, UnknownVersion

router = APIRouter(prefix="/admin")


class Action(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=2000)


ViewerKey = Annotated[Caller, Depends(needs("viewer", key_required=True))]
AdminKey = Annotated[Caller, Depends(needs("admin", key_required=True))]
STATUSES = tuple(s.value for s in Status)


async def _call(fn, *args):
    """A registry call on a worker thread, its domain errors as API errors."""
    try:
        return await asyncio.to_thread(fn, *args)
    except UnknownVersion as e:
        raise APIError(404, str(e), "version_id", "version_not_found") from None
    except RegistryConflict as e:
        raise APIError(409, str(e), None, "conflict") from None
    except ValueError as e:  # the lifecycle refuses the step: nothing changed
        raise APIError(409, str(e), None, "invalid_transition") from None


@router.get("/versions")
async def list_versions(gw: GatewayDep, _: ViewerKey, status: str | None = None) -> list[dict]:
    if status is not None and status not in STATUSES:  # bad input, not a lifecycle conflict
        raise APIError(400, f"unknown status {status!r}; one of: {', '.join(STATUSES)}", "status", "invalid_value")
    return [v.model_dump(mode="json") for v in await _call(gw.registry.list, status)]


@router.get("/versions/{version_id}")
async def get_version(version_id: str, gw: GatewayDep, _: ViewerKey) -> dict:
    v = await _call(gw.registry.get, version_id)
    audit = await _call(gw.registry.audit, version_id)
    return {"version": v.model_dump(mode="json"), "audit": [a.model_dump(mode="json") for a in audit]}


@router.get("/fleet")
async def fleet(gw: GatewayDep, _: ViewerKey) -> dict:
    return (await _call(gw.registry.fleet)).model_dump(mode="json")


@router.post("/versions/{version_id}/approve")
async def approve(version_id: str, body: Action, gw: GatewayDep, key: AdminKey) -> dict:
    v = await _call(gw.registry.approve, version_id, _actor(key), body.reason)
    return v.model_dump(mode="json")


@router.post("/versions/{version_id}/reject")
async def reject(version_id: str, body: Action, gw: GatewayDep, key: AdminKey) -> dict:
    v = await _call(gw.registry.reject, version_id, _actor(key), body.reason)
    return v.model_dump(mode="json")


@router.post("/versions/{version_id}/rollback")
async def rollback(version_id: str, body: Action, gw: GatewayDep, key: AdminKey) -> dict:
    """Roll back `version_id`, which must be the promoted version, to the one it superseded."""
    current = await _call(gw.registry.promoted)
    if current is None or current.id != version_id:
        promoted = None if current is None else current.id
        raise APIError(409, f"'{version_id}' is not the promoted version ({promoted}).", "version_id", "not_promoted")
    v = await _call(gw.registry.rollback, None, _actor(key), body.reason)
    return v.model_dump(mode="json")


def _actor(caller: Caller) -> str:
    key = caller.key
    assert key is not None, "the admin API takes key-store keys only"
    return f"key:{key.key_id}" + (f" ({key.label})" if key.label else "")
