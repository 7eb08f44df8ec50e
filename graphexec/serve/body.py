"""Request bodies parsed and validated off the event loop.

FastAPI parses a body model's JSON and validates it on the event loop, where a body of
megabytes holds every other client (streams, /health) for the whole parse. Here the route reads
the raw bytes (limits.py has already bounded them), and a large body is parsed in a worker
thread; the interpreter's switch interval then hands the loop the GIL every few milliseconds.
"""
from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from . import offload
from .errors import APIError

# Below this a thread's hand-off costs more than the parse it would move.
OFF_LOOP_BYTES = 64 * 1024

Model = TypeVar("Model", bound=BaseModel)


def parse(model: type[Model], raw: bytes) -> Model:
    """The body as `model`, or a RequestValidationError located in the body, as FastAPI's own
    parse reports it (errors.validation_error names the field). The standard library's parser,
    as FastAPI's: it keeps a lone surrogate as text for the field's own check to name, where
    pydantic's parser would refuse the whole body."""
    try:
        obj = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise _not_json(str(e)) from None
    except RecursionError:  # [[[[...: the parser recurses once a level
        raise _not_json("arrays or objects nested too deeply") from None
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])}
                                      for err in e.errors(include_url=False)]) from None


def _not_json(why: str) -> RequestValidationError:
    return RequestValidationError([{"type": "json_invalid", "loc": ("body",),
                                    "msg": "JSON decode error", "ctx": {"error": why}}])


def json_body(model: type[Model]):
    """A route parameter's default: the request's body as `model`, parsed off the loop when
    large."""

    async def read(request: Request) -> Model:
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone, or cut off by limits.py (which has answered 413)
            raise APIError("the client closed the connection before its body was read",
                           status=499, code="client_closed") from None
        if len(raw) < OFF_LOOP_BYTES:
            return parse(model, raw)
        return await offload.run(parse, model, raw)

    return Depends(read)
