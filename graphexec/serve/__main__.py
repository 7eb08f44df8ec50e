"""python -m graphexec.serve --model smollm2-135m (also the `graphexec-serve` script)."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import signal
import sys

import uvicorn

from ..config import EngineConfig
from ..data_parallel import build_replica, replica_options
from ..spec import SpeculativeConfig
from .config import ServeConfig
from .engine_loop import Phase
from .routing import ROUTINGS
from .timeouts import ReadTimeouts, protocol_class
from .tool_parsers import PARSERS

log = logging.getLogger("graphexec.serve")

# flag -> EngineConfig field, for the engine options passed through as they are
_ENGINE_FLAGS = {"device": "device", "dtype": "dtype", "max_batch": "max_batch",
                 "max_model_len": "max_model_len", "num_kv_blocks": "num_kv_blocks",
                 "kv_cache_memory": "kv_cache_memory", "block_size": "block_size",
                 "seed": "seed", "max_num_batched_tokens": "max_num_batched_tokens",
                 "manifest": "manifest", "projections": "projections",
                 "quantization": "quantization", "kv_cache_dtype": "kv_cache_dtype",
                 "tensor_parallel_size": "tensor_parallel_size", "nnodes": "nnodes",
                 "node_rank": "node_rank", "dist_init_addr": "dist_init_addr"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="graphexec-serve",
                                 description="OpenAI-compatible server over a graphexec Engine")
    ap.add_argument("--model", required=True,
                    help="a model directory, a GGUF file, or a name (smollm2-135m, tiny, ...)")
    ap.add_argument("--served-model-name", default=None,
                    help="the name requests use in `model` (default: --model)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("GRAPHEXEC_API_KEY"),
                    help="require `Authorization: Bearer <key>` on /v1 routes "
                         "(default: $GRAPHEXEC_API_KEY, else none)")
    ap.add_argument("--max-queue", type=int, default=256,
                    help="waiting requests beyond which new ones are refused with 503")
    ap.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                    help="request bodies above this are refused with 413 before they are "
                         "read (default 8 MiB: a 128K-token prompt is about 0.5 MB as text "
                         "and 1 MB as token ids, and \\u escapes can make text 6x longer)")
    ap.add_argument("--timeout-headers", type=float, default=ReadTimeouts.headers,
                    help="seconds a client may take to send a request's headers before it "
                         "gets a 408 and its connection is closed")
    ap.add_argument("--timeout-body", type=float, default=ReadTimeouts.body,
                    help="seconds a client may take to send a request's body, once its "
                         "headers are in, before it gets a 408")
    ap.add_argument("--timeout-keep-alive", type=float, default=5.0,
                    help="seconds an idle kept-alive connection stays open between requests")
    ap.add_argument("--device", default=None, help="cuda, cuda:1, cpu (default: cuda if any)")
    ap.add_argument("--dtype", default=None, help="bfloat16, float16, float32")
    ap.add_argument("--max-batch", type=int, default=None, help="rows decoded together")
    ap.add_argument("--max-model-len", type=int, default=None, help="context limit, tokens")
    ap.add_argument("--num-kv-blocks", type=int, default=None)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size, bytes")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None,
                    help="seeds the draws of requests that give no seed")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per step, decode rows plus prompt chunks")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="reuse the KV of prompt prefixes seen before")
    ap.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="GPUs (CPU processes) the model is split over, one worker each")
    ap.add_argument("--nnodes", type=int, default=None,
                    help="hosts the tensor-parallel ranks are split over (default 1)")
    ap.add_argument("--node-rank", type=int, default=None,
                    help="this host's place among them: 0 serves HTTP and runs the engine, "
                         "the others run workers only")
    ap.add_argument("--dist-init-addr", default=None,
                    help="host:port of node 0, where the ranks meet (port + 1 is also used)")
    ap.add_argument("--data-parallel-size", type=int, default=1,
                    help="engine replicas behind this server, each a whole model on "
                         "--tensor-parallel-size GPUs of its own (replica r from GPU r*tp on)")
    ap.add_argument("--data-parallel-routing", choices=ROUTINGS, default=None,
                    help="how a request picks its replica: prefix (where its prompt's "
                         "leading KV blocks are cached; the default with prefix caching) or "
                         "load (the least busy; the default without)")
    ap.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                    help="the model's tool-call format, read out of its output into "
                         "tool_calls when a request has tools and tool_choice \"auto\"")
    ap.add_argument("--manifest", default=None, help="graph manifest from tools/capture.py")
    ap.add_argument("--projections", default=None, help="auto or cublas")
    ap.add_argument("--quantization", default=None,
                    help="weights quantized at load: none, fp8, int4, int4_asym (a quantized "
                         "checkpoint loads as stored without it)")
    ap.add_argument("--kv-cache-dtype", default=None, help="KV cache: auto or fp8")
    ap.add_argument("--speculative-draft", default=None,
                    help="speculative decoding: self:N, a preset or a draft model directory")
    ap.add_argument("--num-speculative-tokens", type=int, default=4,
                    help="tokens drafted per step (with --speculative-draft)")
    ap.add_argument("--sync", action="store_true",
                    help="sync scheduling (read each step before the next): for debugging")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="eager steps on CUDA")
    ap.add_argument("--shutdown-timeout", type=float, default=30.0,
                    help="seconds open requests may take to finish on SIGTERM before they "
                         "are aborted")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


def engine_options(args: argparse.Namespace, ap_error) -> dict:
    accepted = {f.name for f in dataclasses.fields(EngineConfig)}
    opts = {}
    for flag, name in _ENGINE_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if name not in accepted:
            ap_error(f"--{flag.replace('_', '-')}: this engine has no {name} option")
        opts[name] = value
    opts["async_scheduling"] = not args.sync
    if args.no_cuda_graphs:
        opts["cuda_graphs"] = False
    if args.enable_prefix_caching:
        opts["enable_prefix_caching"] = True
    # Options are checked here, before the port opens, rather than in the engine process.
    try:
        if args.speculative_draft is not None:
            opts["speculative"] = SpeculativeConfig(args.speculative_draft,
                                                    args.num_speculative_tokens)
        EngineConfig(model=args.model, **opts)
    except (ValueError, TypeError) as e:
        ap_error(str(e))
    return opts


class _Server(uvicorn.Server):
    """Uvicorn's server, telling the app the moment a shutdown signal arrives: from then on
    /health answers 503 and new requests are refused while the open ones finish."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    def ap_error(msg: str):
        print(f"graphexec-serve: error: {msg}", file=sys.stderr)
        sys.exit(2)

    opts = engine_options(args, ap_error)
    if opts.get("node_rank", 0) > 0:  # a worker node: no server, no engine; its ranks only
        from ..parallel.nodes import run_node

        logging.basicConfig(level=args.log_level.upper())
        sys.exit(run_node(EngineConfig(model=args.model, **opts)))
    try:
        timeouts = ReadTimeouts(headers=args.timeout_headers, body=args.timeout_body)
    except ValueError as e:
        ap_error(str(e))
    if not args.timeout_keep_alive > 0:
        ap_error(f"--timeout-keep-alive must be positive, got {args.timeout_keep_alive}")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        per_replica = replica_options(args.model, opts, args.data_parallel_size)
    except ValueError as e:
        ap_error(str(e))
    routing = args.data_parallel_routing or (
        "prefix" if opts.get("enable_prefix_caching") else "load")
    config = ServeConfig(model=args.model, served_model_name=args.served_model_name or args.model,
                         engine_options=opts, api_key=args.api_key, max_queue=args.max_queue,
                         max_request_bytes=args.max_request_bytes, routing=routing,
                         tool_call_parser=args.tool_call_parser)
    from ..engine import Engine
    from .app import build_app

    server: _Server | None = None

    def on_fatal() -> None:  # runs on the event loop; uvicorn polls should_exit
        if server is not None:
            server.should_exit = True

    factories = ([functools.partial(Engine, args.model, **opts)] if len(per_replica) == 1 else
                 [functools.partial(build_replica, args.model, o) for o in per_replica])
    app = build_app(config, factories,
                    on_fatal=on_fatal, log_level=args.log_level)
    state = app.state.server

    def on_exit() -> None:  # in the signal handler: only flag setting and a reentrant put
        # One deadline, from the first signal: uvicorn counts its own cap from then too, so a
        # drain re-sent later would abort streams after uvicorn had already cut them.
        if state.draining:
            log.info("shutdown already under way; the signal changes nothing")
            return
        state.draining = True
        state.loop.drain(args.shutdown_timeout)

    # Uvicorn waits for open requests a little past our own abort at shutdown_timeout, so
    # that the streams aborted then still end with an error event and [DONE], not a cut.
    uv = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                        access_log=False, timeout_graceful_shutdown=args.shutdown_timeout + 5,
                        http=protocol_class(timeouts),
                        timeout_keep_alive=args.timeout_keep_alive)
    server = _Server(uv, on_exit)
    # Uvicorn re-raises the shutdown signal once it has finished, to whatever handler was
    # there before it: a no-op here, so a graceful shutdown ends with exit status 0 (1 if the
    # engine failed) rather than death by SIGTERM.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    # Past here a SIGTERM changes nothing, but Python resets a handler written in Python to the
    # default (death by SIGTERM) while it finalises: an ignored signal stays ignored.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if state.loop.phase is Phase.FAILED:
        print(f"graphexec-serve: the engine failed: {state.loop.error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
