"""A request's output text: detokenized incrementally, stop strings held back and cut."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling_params import SamplingParams
from .detokenizer import Decoder, IncrementalDetokenizer
from .stop_strings import StopStringMatcher


@dataclass(slots=True)
class RequestText:
    detok: IncrementalDetokenizer
    stops: StopStringMatcher | None
    # Released text, append-only: the cumulative text is their concatenation. Outputs keep the
    # list and a count rather than a joined copy, so a step costs O(new text).
    pieces: list[str] = field(default_factory=list)
    consumed: int = 0  # output tokens fed to the detokenizer
    taken: int = 0  # pieces already handed out as new_text
    done: bool = False

    @classmethod
    def create(cls, tokenizer: Decoder, params: SamplingParams) -> "RequestText":
        stops = (StopStringMatcher(tuple(params.stop), params.include_stop_str_in_output)
                 if params.stop else None)
        return cls(IncrementalDetokenizer(tokenizer, params.skip_special_tokens), stops)

    @property
    def has_stops(self) -> bool:
        return self.stops is not None

    def feed(self, output: list[int], check_stops: bool = True) -> bool:
        """Detokenizes the tokens of `output` not seen yet; True when a stop string matched
        (the text is then final)."""
        if self.done or self.consumed == len(output):
            return False
        delta = self.detok.add(output[self.consumed:])
        self.consumed = len(output)
        matched = False
        if self.stops is not None:
            delta, matched = self.stops.feed(delta, check_stops)
        self._release(delta)
        self.done = matched
        return matched

    def finish(self) -> None:
        """The request ended (not on a stop string): releases what was held back. A stop string
        completed only by the final bytes still ends the text there."""
        if self.done:
            return
        delta = self.detok.flush()
        if self.stops is not None:
            delta, matched = self.stops.feed(delta)
            if not matched:
                delta += self.stops.flush()
        self._release(delta)
        self.done = True

    def advance(self, output: list[int], finished: bool) -> str:
        """Brings the text up to `output` (and to its end once finished); returns the text
        released since the previous call."""
        self.feed(output)
        if finished:
            self.finish()
        return self.take_new()

    def take_new(self) -> str:
        new = "".join(self.pieces[self.taken:])
        self.taken = len(self.pieces)
        return new

    def _release(self, delta: str) -> None:
        if delta:
            self.pieces.append(delta)
