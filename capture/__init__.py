"""CUDA graph capture and replay: the static DecodeState, the captured decode iteration and mixed
step, the per-bucket graphs that share one memory pool, and the pinned rings a step's inputs
(staging.py) and results (results.py) pass through. The plan types they run come from
graphexec/plan.py."""
