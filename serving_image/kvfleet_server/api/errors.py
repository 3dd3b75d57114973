"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``.

Mapping: invalid parameters, malformed JSON, a non-object body and a wrong content type are 400
(FastAPI's 422 is turned into 400, as OpenAI and vLLM answer); an unknown model 404; a missing or
wrong API key 401; a full waiting queue 429 with ``Retry-After``; draining, loading or a dead engine
503. Anything else is a server bug: 500, logged with its traceback, never caused by a client error.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import EngineDeadError, InvalidRequestError, UnsupportedFeatureError

logger = logging.getLogger("kvfleet.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}
# ``code`` is always a string (OpenAI's machine-readable codes); a more specific one is passed where known
_CODES = {
    400: "invalid_value",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
}
UNSUPPORTED_CODE = "unsupported_parameter"


class APIError(Exception):
    """An error the HTTP layer answers in OpenAI's shape.

    Args:
        status: HTTP status code.
        message: human-readable message naming the field and the limit.
        param: the offending request field, if any.
        code: machine-readable code (e.g. ``"model_not_found"``); defaults to the status's code in ``_CODES``.
        headers: extra response headers (``Retry-After`` for 429/503).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def _encodable(text: str | None) -> str | None:
    """Lone UTF-16 surrogates (legal in JSON escapes, echoed from a request) as ``\\udXXX`` text: UTF-8 safe."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object; ``code`` defaults to the status's string code."""
    code = code if code is not None else _CODES.get(status, "invalid_value" if status < 500 else "internal_error")
    return {"error": {"message": _encodable(message), "type": _TYPES.get(status, "invalid_request_error"),
                      "param": _encodable(param), "code": _encodable(str(code))}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _loc_to_param(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or None


def validation_message(request: Request, exc: RequestValidationError) -> tuple[str, str | None]:
    """Turn pydantic's error list into one message; explains JSON and content-type problems plainly."""
    errors = exc.errors()
    ctype = request.headers.get("content-type", "")
    if request.method in ("POST", "PUT", "PATCH") and ctype and "json" not in ctype.split(";")[0].lower():
        return f"Content-Type must be application/json, got {ctype!r}", None
    for err in errors:
        if err.get("type") == "json_invalid":
            return f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
    for err in errors:
        if tuple(err.get("loc", ())) == ("body",):
            if err.get("type") == "missing":
                return "request body is required (a JSON object)", None
            return "request body must be a JSON object", None
    msgs = []
    for err in errors[:5]:
        param = _loc_to_param(tuple(err.get("loc", ())))
        msgs.append(f"{param}: {err.get('msg')}" if param else str(err.get("msg")))
    first = _loc_to_param(tuple(errors[0].get("loc", ()))) if errors else None
    return "; ".join(msgs) or "invalid request", first


def install_error_handlers(app: FastAPI) -> None:
    """Register the exception handlers that give every error OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(request, exc)
        return error_response(400, message, param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError):
        return error_response(400, exc.message, exc.param)

    @app.exception_handler(UnsupportedFeatureError)
    async def _unsupported(request: Request, exc: UnsupportedFeatureError):
        return error_response(400, exc.message, exc.param, UNSUPPORTED_CODE)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(503, f"engine is not running: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}")
