"""What is refused before a request's body is read: a missing API key (401), a body over
--max-request-bytes (413) and a POST body that is not JSON (415).

A pure ASGI middleware rather than a route dependency: FastAPI reads and parses the whole body
before dependencies run, so an unauthenticated or oversized body would cost its full read and
parse first. A chunked body, whose size is not known up front, is counted as it streams and cut
off with 413 the moment it passes the limit.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass

from .errors import APIError

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                           and media.endswith("+json"))


def bearer_ok(authorization: str, expected: bytes) -> bool:
    """The scheme is case-insensitive (RFC 7235); the key is not."""
    scheme, _, token = authorization.strip().partition(" ")
    ok = hmac.compare_digest(token.strip().encode(), expected)  # constant time: a secret
    return ok and scheme.lower() == "bearer"


def unauthorized() -> APIError:
    return APIError("a valid API key is required (Authorization: Bearer <key>)", status=401,
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def too_large(limit: int, size: int | None) -> APIError:
    got = f"{size} bytes" if size is not None else "more than that"
    return APIError(f"the request body is {got}; this server accepts at most {limit} bytes "
                    f"(--max-request-bytes)", status=413, code="request_too_large")


def not_json(content_type: str) -> APIError:
    return APIError(f"Content-Type: expected application/json, got {content_type!r}",
                    status=415, param="Content-Type", code="unsupported_media_type")


async def send_error(send, err: APIError, close: bool) -> None:
    """The error as a whole response. close: the body was left unread, so the connection
    cannot carry another request; tell the client (uvicorn then closes it)."""
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@dataclass
class RequestLimits:
    """ASGI middleware. api_key guards the paths under /v1; max_bytes bounds every body."""

    app: object
    max_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    api_key: str | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        length = headers.get("content-length")
        has_body = bool(length and length.strip() != "0") or "transfer-encoding" in headers
        err = self._refusal(scope, headers)
        if err is not None:
            return await send_error(send, err, close=has_body)
        body = _Counted(receive, send, self.max_bytes)
        await self.app(scope, body.receive, body.send)

    def _refusal(self, scope, headers: dict[str, str]) -> APIError | None:
        path = scope.get("path", "")
        v1 = path == "/v1" or path.startswith("/v1/")  # the API's routes; not /health
        if self.api_key is not None and v1:
            if not bearer_ok(headers.get("authorization", ""), self.api_key.encode()):
                return unauthorized()
        length = headers.get("content-length", "").strip()
        if length.isdigit() and int(length) > self.max_bytes:
            return too_large(self.max_bytes, int(length))
        content_type = headers.get("content-type")
        # Without this, FastAPI hands such a body on as bytes: "Input should be a valid dict".
        if v1 and scope.get("method") == "POST" and content_type is not None \
                and not _is_json(content_type):
            return not_json(content_type)
        return None


class _Counted:
    """Counts the body as the app reads it; past the limit, answers 413 itself and shows the
    app a disconnect, so that the app stops reading and its own answer is dropped."""

    def __init__(self, receive, send, limit: int):
        self._receive, self._send, self._limit = receive, send, limit
        self.seen = 0
        self.started = False  # a response has begun: too late for a 413
        self.cut = False  # the 413 was sent: the app's own answer goes nowhere

    async def receive(self):
        message = await self._receive()
        if message["type"] != "http.request":
            return message
        self.seen += len(message.get("body", b""))
        if self.seen <= self._limit:
            return message
        if not self.started:
            await send_error(self._send, too_large(self._limit, None), close=True)
            self.started = self.cut = True
        return {"type": "http.disconnect"}

    async def send(self, message) -> None:
        if self.cut:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)
