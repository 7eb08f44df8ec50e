"""Ticket counters: zeroed int32 slots for kernels whose last program to finish a share of the
work completes it (the split merge of flash-decoding, kernels/attention_decode_triton.py; the
split-K sums of the quantized projections, kernels/quant_tiles_triton.py). A program
publishes its partial, takes a ticket with an acquire-release atomic add, and the one that
draws the last ticket reads every partial and resets its counter to 0 for the next launch."""
from __future__ import annotations

import torch

# Process-wide state, not settings: captured graphs hold these buffers' addresses for as long as
# the process lives, whichever op set or engine captured them, so no object owns them.
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def ticket_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n counters, zero between launches (each launch's last programs reset theirs).
    One buffer per device, kept for the process, so captured graphs keep pointing at live,
    zeroed memory. Launches sharing it must not run concurrently: the engine issues everything
    on one stream at a time (graph warm-up on a side stream is joined before capture), and a
    programmatic dependent waits for the launch before it to end before touching memory."""
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else 0)
    key = (device.type, index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _OUTGROWN.append(buf)  # graphs captured earlier still point at it: keep it alive
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf
