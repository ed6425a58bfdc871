"""The OpenAI error shape for every 4xx/5xx the gateway returns.

`{"error": {"message", "type", "param", "code"}}`. Routes raise `APIError`; FastAPI's own
validation and HTTP errors are translated here, so no other shape ever leaves the gateway.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or None


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            return error_response(
                400, f"We could not parse the JSON body of your request: {first.get('msg')}", None, "invalid_json"
            )
        param = _loc_to_param(first.get("loc", ()))
        msg = first.get("msg", "invalid value")
        if first.get("type") == "missing":
            return error_response(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
        return error_response(400, f"Invalid value for '{param}': {msg}", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(e.status_code, str(e.detail), None, code, getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(
            500, f"The server had an error while processing your request ({type(e).__name__}).", None, "internal_error"
        )
