"""The server's error handlers on an app of their own: a bug in a handler still answers JSON."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("httpx")
fastapi = pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from graphexec.serve import errors  # noqa: E402


def _app() -> fastapi.FastAPI:
    app = fastapi.FastAPI()
    errors.install(app)

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("a bug")

    @app.post("/only-post")
    async def only_post() -> dict:
        return {}

    return app


def test_unexpected_exception_is_a_json_500_logged_with_its_traceback(caplog):
    client = TestClient(_app(), raise_server_exceptions=False)
    with caplog.at_level(logging.ERROR, logger="graphexec.serve"):
        r = client.get("/boom")
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error", err
    assert "a bug" not in err["message"]  # internals stay in the log
    logged = [rec for rec in caplog.records if rec.exc_info]
    assert logged and "RuntimeError" in caplog.text and "/boom" in caplog.text
