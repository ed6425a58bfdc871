"""`GET /v1/weights/{path}`: the weight store over HTTP, for replicas on other machines.

A gateway on the machine that holds the learner's models folder serves the artifacts of registered
versions to gateways elsewhere (`FLYWHEEL_WEIGHTS_URL=http://that-gateway:8000/v1/weights`,
`FLYWHEEL_WEIGHTS_TOKEN=<a key with the weights:read scope>`; `serving.fetch.Fetcher` is the client).
- Only a path that is a registered version's file is served (a registry lookup, never a walk of the
  folder), so nothing else in the models folder can be read through it.
- `Range: bytes=N-` resumes an interrupted download (206 with `Content-Range`); 416 past the end.
- A key with `weights:read` (or `admin`) is required, even in local mode: weights are the product.
- The client checks the bytes against the hash the registry recorded, so this route sends none.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from api.deps import Caller, GatewayDep, needs
from api.errors import APIError

router = APIRouter(prefix="/v1/weights")
CHUNK = 1 << 20
WeightsKey = Annotated[Caller, Depends(needs("weights:read", key_required=True))]


def _registered(gw, path: str) -> bool:
    return any(f.path == path for v in gw.registry.list() for f in v.files)


def _start(header: str | None, size: int) -> int:
    """The first byte asked for by `Range: bytes=N-` (0 without one); other range forms are 416."""
    if not header:
        return 0
    unit, _, spec = header.partition("=")
    first, dash, last = spec.strip().partition("-")
    if unit.strip() != "bytes" or not dash or last or not first.isdigit():
        raise APIError(416, f"Range {header!r}: only 'bytes=N-' is supported", "range", "range_not_satisfiable")
    start = int(first)
    if start >= size and size > 0:
        raise APIError(416, f"Range {header!r}: the file has {size} bytes", "range", "range_not_satisfiable")
    return start


def _chunks(file: Path, start: int):
    with open(file, "rb") as f:
        f.seek(start)
        while chunk := f.read(CHUNK):
            yield chunk


@router.get("/{path:path}")
async def weights(path: str, request: Request, gw: GatewayDep, _: WeightsKey):
    if gw.registry is None or not await asyncio.to_thread(_registered, gw, path):
        raise APIError(404, f"{path!r} is not a file of a registered version", "path", "not_found")
    root = gw.settings.learner_models_dir.resolve()
    file = (root / path).resolve()
    if root not in file.parents or not file.is_file():
        raise APIError(404, f"{path!r} is registered but not in this gateway's models folder", "path", "not_found")
    size = os.path.getsize(file)
    start = _start(request.headers.get("range"), size)
    headers = {"Accept-Ranges": "bytes", "Content-Length": str(size - start)}
    if request.headers.get("range"):
        headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
    return StreamingResponse(
        _chunks(file, start), status_code=206 if "Content-Range" in headers else 200, headers=headers
    )
