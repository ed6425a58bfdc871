"""The OpenAI error shape for every 4xx/5xx the gateway returns.

`{"error": {"message", "type", "param", "code"}}`. Routes raise `APIError`; FastAPI's own
validation and HTTP errors are translated here, so no other shape ever leaves the gateway. A
message never repeats more than `ECHO_CHARS` characters of what the caller sent. `BodyLimit` is
the ASGI middleware that refuses a request body over the size limit (413) before anything parses it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.schemas import UNSUPPORTED

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


ECHO_CHARS = 100


def _short(text: str) -> str:
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + f"... ({len(text)} characters)"


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    etype = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": etype, "param": param, "code": code}}


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _loc_to_param(loc) -> str | None:
    parts = [_short(str(p)) for p in loc if p not in ("body",)]
    return ".".join(parts) or None


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errs = e.errors()
        # A refused OpenAI field is the answer whatever else is wrong with the body (`api.schemas.Refused`).
        refusals = [x for x in errs if x.get("type") in UNSUPPORTED]
        first = (refusals or errs or [{"loc": (), "msg": "invalid request", "type": ""}])[0]
        if first.get("type") == "json_invalid":
            return error_response(
                400,
                f"We could not parse the JSON body of your request: {_short(str(first.get('msg')))}",
                None,
                "invalid_json",
            )
        param = _loc_to_param(first.get("loc", ()))
        if first.get("type") in UNSUPPORTED:  # the server's own message (it repeats nothing the caller sent)
            return error_response(400, str(first.get("msg")), param, first["type"])
        msg = _short(str(first.get("msg", "invalid value")))
        if first.get("type") == "missing":
            return error_response(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
        what = f"value for '{param}'" if param else "request body"
        return error_response(400, f"Invalid {what}: {msg}", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code)
        return error_response(e.status_code, str(e.detail), None, code, getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(
            500, f"The server had an error while processing your request ({type(e).__name__}).", None, "internal_error"
        )


class _TooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: a request whose body is over `limit` bytes gets 413 `request_too_large`.

    A declared Content-Length over the limit is refused before the app runs; a body sent without
    one (chunked) is counted as the app receives it, and refused as soon as the count passes the
    limit: the 413 is sent, the app's read fails, and whatever the app sends after is dropped.
    """

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(send, f"{declared} bytes")
            return
        seen, started, refused = 0, False, False

        async def counted_receive() -> dict:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    if not started:
                        await self._refuse(send, f"more than {self.limit} bytes")
                    refused = True
                    raise _TooLarge
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception:
            if not refused:
                raise

    async def _refuse(self, send: Any, size: str) -> None:
        body = json.dumps(
            error_body(
                413,
                f"The request body ({size}) is larger than this gateway's limit of {self.limit} bytes.",
                None,
                "request_too_large",
            )
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
