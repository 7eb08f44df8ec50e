"""Where work that scales with one request runs: parsing a large body, tokenising a prompt,
rendering a chat template. Worker threads keep it off the event loop; on Linux they also run
at a lower CPU priority (nice is per thread there), so that on a machine with few cores a
10 MB prompt being tokenised takes its time from itself rather than from the engine process
and the streams of every other client. Measured on the 2-core CPU machine with SmolLM2
(tools/probe_server.py stall): a concurrent stream's largest gap between chunks was 26x its
gap alone with these threads at the engine's priority."""
from __future__ import annotations

import asyncio
import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

# Added to the workers' nice value: well below the engine and the event loop, above idle.
NICENESS = 10


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: full priority, still off-loop
        pass


_POOL = ThreadPoolExecutor(thread_name_prefix="graphexec-request", initializer=_lower_priority)


async def run(fn, *args):
    """fn(*args) in a low-priority worker thread, awaited."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))
