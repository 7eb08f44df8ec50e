"""Stop strings over streamed text: find the first one, and never stream any part of it.

Text arrives in deltas. Characters at the end of the text that could be the start of a stop
string are held back from the stream until the next delta shows whether they are (the request
ends there, the text cut before the stop string) or not (they are released).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopStringMatcher:
    stops: tuple[str, ...]
    include_stop: bool = False  # keep the matched stop string in the text
    held: str = ""  # the text's tail that may begin a stop string; not streamed yet
    _longest: int = field(init=False)

    def __post_init__(self) -> None:
        self._longest = max(map(len, self.stops))

    def feed(self, delta: str, check: bool = True) -> tuple[str, bool]:
        """Returns the text that may be streamed now, and whether a stop string matched (the
        text then ends where the stream must end). check=False (min_tokens not reached yet)
        looks for no match but still holds back a possible start."""
        if not delta:
            return "", False
        buf = self.held + delta
        if check:
            cut = self._first_match(buf)
            if cut is not None:
                self.held = ""
                return buf[:cut], True
        keep = self._possible_start(buf)
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """The held tail, released when the request ends without a match."""
        out, self.held = self.held, ""
        return out

    def _first_match(self, buf: str) -> int | None:
        """Where the text ends for the match that completes first (ties: the longer one). Only
        matches ending in the new delta count: the held part alone was checked before, or was
        produced before min_tokens."""
        best = None
        for stop in self.stops:
            i = buf.find(stop, max(0, len(self.held) - len(stop) + 1))
            if i < 0:
                continue
            key = (i + len(stop), i)
            if best is None or key < best[0]:
                best = (key, i + len(stop) if self.include_stop else i)
        return None if best is None else best[1]

    def _possible_start(self, buf: str) -> int:
        """Length of the longest tail of buf that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(stop.startswith(tail) for stop in self.stops):
                return k
        return 0
