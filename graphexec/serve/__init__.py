"""An OpenAI-compatible HTTP server over the Engine: `python -m graphexec.serve --model ...`.

One thread owns the Engine and steps it (engine_loop.py); the asyncio event loop only parses,
validates and streams (app.py and the route modules). They meet at two queues: a thread-safe
inbox the handlers put commands into, and one asyncio.Queue per HTTP request that the engine
thread fills through `call_soon_threadsafe`.
"""
