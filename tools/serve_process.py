"""A `python -m graphexec.serve` subprocess for the HTTP benchmark (tools/bench_http.py): the
command line that gives it the in-process engine's options, and its start, health wait and
SIGTERM."""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serve import engine_options  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Engine options with a graphexec.serve flag of the same name (--max-batch for max_batch...).
SERVER_FLAGS = ("device", "dtype", "max_batch", "max_model_len", "num_kv_blocks",
                "kv_cache_memory", "block_size", "seed", "max_num_batched_tokens", "manifest",
                "projections", "tensor_parallel_size")

def server_argv(model: str, options: dict, port: int, max_queue: int) -> list[str]:
    """The `python -m graphexec.serve` command for an Engine(model, **options). ValueError for
    an option the server has no flag for: the two runs would not have the same engine."""
    argv = [sys.executable, "-m", "graphexec.serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), "--max-queue", str(max_queue), "--log-level", "warning"]
    for key, value in options.items():
        argv += _flags(key, value)
    return argv


def _flags(key: str, value: object) -> list[str]:
    if value is None:
        return []
    if key in SERVER_FLAGS:
        return [f"--{key.replace('_', '-')}", str(value)]
    if key == "async_scheduling":
        return [] if value else ["--sync"]
    if key == "cuda_graphs":  # on by default wherever it can be
        return [] if value else ["--no-cuda-graphs"]
    if key == "enable_prefix_caching":
        return ["--enable-prefix-caching"] if value else []
    if key == "speculative":
        return ["--speculative-draft", value.draft, "--num-speculative-tokens",
                str(value.num_tokens)]
    raise ValueError(f"engine option {key}={value!r} has no graphexec.serve flag, so --http "
                     f"auto cannot give the server the same engine; start one yourself and "
                     f"use --http URL")


def server_options(args: argparse.Namespace, mode: str, engine: dict | None) -> dict:
    """The in-process engine's options, with what it derived (batch, KV blocks, context) fixed,
    so that the server's engine is the same one even where sizes come from free memory."""
    opts = engine_options(args, mode)
    if engine is not None:
        opts.pop("kv_cache_memory", None)  # num_kv_blocks says it exactly
        opts.update(max_batch=engine["max_batch"], num_kv_blocks=engine["kv_blocks"],
                    max_model_len=engine["max_model_len"])
    return opts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A graphexec.serve subprocess: started, waited for until /health says 200, SIGTERMed."""

    def __init__(self, argv: list[str], port: int, log_path: str):
        self.argv, self.log_path = argv, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.exit_code: int | None = None
        env = dict(os.environ)
        # this checkout's graphexec, not whatever an installed copy points at
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        self._log = open(log_path, "w")
        try:
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         cwd=ROOT, env=env)
        except OSError:
            self._log.close()
            raise

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with status {self.proc.returncode} before "
                                 f"it was healthy:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"the server did not answer /health within {timeout:g} s "
                         f"(--server-timeout):\n{self.log_tail()}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.exit_code = self.proc.returncode
        return self.exit_code

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-chars:]

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
