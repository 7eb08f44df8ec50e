"""Errors in the OpenAI wire format: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("graphexec.serve")


class APIError(Exception):
    """Raised anywhere below a route; the handler below turns it into the wire format."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(message, status=400, param=param, code=code)


def unavailable(message: str, code: str) -> APIError:
    # Retry-After: both states (a full queue, an engine still loading) are expected to pass.
    return APIError(message, status=503, type="service_unavailable", code=code,
                    headers={"Retry-After": "1"})


def _param_of(loc: tuple) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content". A union's member names
    (pydantic puts them in the path, e.g. "list[int]") are left out: the client never wrote them."""
    parts = [p for p in loc[1:] if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
    if not parts or not isinstance(parts[0], str):
        return None  # the body as a whole (not JSON, not an object)
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def _shown(value, limit: int = 40) -> str:
    """The value as the client wrote it (JSON), cut short: it can be megabytes."""
    if isinstance(value, str) and len(value) > limit:
        value = value[:limit]
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return invalid(f"the request body is not valid JSON: {detail}".rstrip(": "), None,
                       code="invalid_json")
    param = _param_of(tuple(first.get("loc", ())))
    msg = first.get("msg", "invalid request")
    if param and "input" in first and first.get("type") != "missing":
        msg += f", got {_shown(first['input'])}"
    where = f"{param}: " if param else "request body: "
    return invalid(where + msg, param)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # 404 / 405 from routing, in the same body shape as everything else
        # (their headers kept: a 405 carries Allow)
        return APIError(str(exc.detail), status=exc.status_code, code=str(exc.status_code),
                        headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault: the client still gets JSON it can parse, and the
        # traceback goes to our log (Starlette then re-raises it to uvicorn, which logs too).
        log.error("unexpected error in %s %s", request.method, request.url.path,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return APIError("the server failed on this request; see its log", status=500,
                        type="server_error", code="internal_error").response()
