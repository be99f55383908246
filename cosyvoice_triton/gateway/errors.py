"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, for every refusal the gateway
answers (its own limits, bad input, Triton's refusals) and for FastAPI's and Starlette's own (404, 405, ...)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

log = logging.getLogger(__name__)

#: OpenAI's error ``type`` of each status the gateway answers with.
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
         413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error",
         429: "rate_limit_error", 500: "server_error", 502: "server_error", 503: "server_error",
         504: "server_error"}


class GatewayError(Exception):
    """A refusal with its HTTP status; ``code`` a short machine-readable reason, ``param`` the field at fault."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = int(status), message, code, param
        self.headers = headers or {}


def check_text(value: str | None, name: str) -> str | None:
    """``value`` if it is text UTF-8 can carry; 400 naming ``name`` when it holds a lone surrogate (JSON's
    ``"\\ud800"``, which no UTF-8 encoder takes: the client's input, not the backend's fault)."""
    if value is not None:
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise GatewayError(400, f"{name}: not valid text (a lone surrogate at character {exc.start})",
                               param=name, code="invalid_value") from None
    return value


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error" if status >= 500
                                                             else "invalid_request_error"),
                      "param": param, "code": code}}


def error_bytes(status: int, message: str, **kw) -> bytes:
    return json.dumps(error_body(status, message, **kw)).encode()


class ErrorResponse(JSONResponse):
    """A refusal's JSON in ASCII: a message that names the client's input (an unknown field, a bad value) may hold a
    lone surrogate of the client's JSON, which no UTF-8 encoder takes (Starlette's own JSON would fail with a 500);
    escaped, it reads back as what the client sent."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(exc: GatewayError) -> JSONResponse:
    return ErrorResponse(error_body(exc.status, exc.message, code=exc.code, param=exc.param),
                         status_code=exc.status, headers=exc.headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(GatewayError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(GatewayError(400, f"{param or 'request'}: {first.get('msg', 'invalid')}",
                                           param=param, code="invalid_value"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return error_response(GatewayError(500, "internal error of the gateway", code="internal_error"))
