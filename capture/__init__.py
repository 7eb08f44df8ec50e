"""CUDA graph capture and replay: the static DecodeState, the captured decode iteration, and the
per-bucket graphs that share one memory pool."""
