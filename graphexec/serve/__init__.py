"""An OpenAI-compatible HTTP server over the Engine: `python -m graphexec.serve --model ...`.

A process of its own owns the Engine and steps it (engine_core.py); in the HTTP process, the
asyncio event loop only parses, validates and streams (app.py and the route modules). They meet
at two pipes (engine_loop.py): commands go down one, each iteration's outputs come up the
other, and the event loop reads that pipe itself and puts each event into its HTTP request's
Sink. Each side has a core and a Python lock of its own.
"""
