"""The FastAPI application: lifespan (the engine loop's start and stop), the checks made before
a body is read (limits.py: API key, size, JSON), and the routes that are not generation
(/health, /metrics, /v1/models)."""
from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from . import chat_completions, completions, errors
from .config import ServeConfig
from .engine_loop import EngineLoop
from .limits import RequestLimits
from .metrics import ServerMetrics
from .replicas import Replicas
from .render import created
from .routing import Router
from .state import ServerState


def build_app(config: ServeConfig, engine_factory: Callable[[], object] | list,
              on_fatal: Callable[[], None] | None = None, log_level: str = "INFO") -> FastAPI:
    """engine_factory builds the Engine; it runs in the engine process (so it must pickle),
    started once the server is listening, so /health answers 503 while weights load and
    graphs are captured. A list of them: one engine process each, data-parallel replicas
    behind this front end (replicas.py). on_fatal: called (from the event reader thread) if
    the engine (every replica) fails to start or dies."""
    factories = engine_factory if isinstance(engine_factory, list) else [engine_factory]
    if len(factories) == 1:
        loop = EngineLoop(factories[0], on_fatal=on_fatal, log_level=log_level)
    else:
        loop = Replicas(factories, Router(len(factories), routing=config.routing),
                        on_fatal=on_fatal, log_level=log_level)
    metrics = ServerMetrics(lambda: loop.snapshot, loop.num_waiting)
    if isinstance(loop, Replicas):
        metrics.registry.register(loop)
    loop.observer = metrics.observe
    state = ServerState(config, loop, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start(asyncio.get_running_loop())
        # What was imported or built so far (torch among it: some 200,000 objects) lives as
        # long as the process: out of the collector's sight, a full collection under load
        # scans only what serving made, a few ms where it took about 150 ms (a pause of
        # every stream) and a sixth of the HTTP process's CPU time.
        gc.collect()
        gc.freeze()
        yield
        # Uvicorn has stopped accepting and waited for open requests (up to its graceful
        # timeout) before it gets here; what is still running is aborted by the loop's stop.
        state.draining = True
        await asyncio.to_thread(loop.stop)

    app = FastAPI(title="graphexec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    errors.install(app)
    app.add_middleware(RequestLimits, max_bytes=config.max_request_bytes,
                       api_key=config.api_key)
    v1 = APIRouter()
    v1.include_router(completions.router)
    v1.include_router(chat_completions.router)

    @v1.get("/v1/models")
    async def list_models() -> dict:
        card = {"id": config.served_model_name, "object": "model", "created": _STARTED,
                "owned_by": "graphexec", "root": config.model}
        if loop.info is not None:
            card["max_model_len"] = loop.info.max_model_len
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        # Replicas: 200 while any serves, and the body says which are down.
        replicas = {"replicas": loop.health()} if isinstance(loop, Replicas) else {}
        if state.ready:
            return JSONResponse(replicas) if replicas else Response(status_code=200)
        return JSONResponse({"status": "draining" if state.draining else loop.phase.value,
                             **replicas}, status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


_STARTED = created()
