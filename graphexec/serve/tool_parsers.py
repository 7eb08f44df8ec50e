"""Tool calls read out of a model's free text (tool_choice "auto"), one class per format.

hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text
(Hermes, Qwen2.5+). llama3_json: the whole output is `{"name": ..., "parameters": {...}}`,
optionally after `<|python_tag|>`, several separated by `;` (Llama 3.1+). Either key,
"arguments" or "parameters", is taken in both.

Each parser is incremental: fed the text as it is generated, it says what is decided (events)
and holds back what may still become a call. A call is decided once its object has opened with
a string "name" and the arguments' "{": its name goes out then, and its arguments as the model
writes them, so that they can stream. The arguments are the model's own text, not checked
further (as OpenAI's are not: a client validates them). An object whose keys come in another
order is held whole and taken if it is JSON with a string name and object arguments. Anything
that cannot be a call is content, character for character: an output without calls comes out
as it went in. Whitespace between calls and around them is dropped.

`parse(name, text)` is the same parser fed everything at once, so a stream and a whole answer
always agree, however the text was cut into deltas.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # calls are numbered from 0 in the order they start
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # appended to the call's arguments


Event = Content | CallStart | CallArguments


@dataclass
class ParsedCall:
    name: str
    arguments: str


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall]


def collect(events: list[Event]) -> Parsed:
    content: list[str] = []
    calls: list[ParsedCall] = []
    for ev in events:
        if isinstance(ev, Content):
            content.append(ev.text)
        elif isinstance(ev, CallStart):
            calls.append(ParsedCall(ev.name, ""))
        else:
            calls[ev.index].arguments += ev.text
    return Parsed("".join(content), calls)


# Outside strings a JSON value holds only these; anything else (the "<" of a closing tag) ends
# a value the model left unfinished.
_JSON_CHARS = frozenset(' \t\r\n{}[],:"-+.0123456789eEtruefalsn')
_SPACE = " \t\r\n"


@dataclass
class _Brackets:
    """Finds where a JSON value that opens with { ends, resumably: nesting depth and whether
    inside a string are all it takes."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str, start: int) -> tuple[int, bool]:
        """(how far it got, whether the value ended there: closed, or cut by a stray
        character at that index)."""
        for i in range(start, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
            elif c not in _JSON_CHARS:
                return i, True
        return len(text), False


_ARGUMENT_KEYS = ("arguments", "parameters")


def _header(text: str, i: int) -> tuple[str, int] | bool | None:
    """At an object's "{": (name, index of the arguments' "{") once `{"name": "...",
    "arguments": ` has come whole; None while it still may; False if it cannot."""
    steps = ("{", '"name"', ":", "name", ",", "key", ":", "args")
    name = ""
    for step in steps:
        while i < len(text) and text[i] in _SPACE:
            i += 1
        if i == len(text):
            return None
        if step == "args":
            return (name, i) if text[i] == "{" else False
        if step in ("name", "key") or step.startswith('"'):
            value, i = _string(text, i)
            if value is None or value is False:
                return value
            if step == "name":
                name = value
            elif (step == "key" and value not in _ARGUMENT_KEYS) or (
                    step == '"name"' and value != "name"):
                return False
        elif text[i] != step:
            return False
        else:
            i += 1
    raise AssertionError("unreachable")


def _string(text: str, i: int) -> tuple[str | bool | None, int]:
    """The JSON string at text[i] and the index past it; None if it is not closed yet, False
    if there is none."""
    if text[i] != '"':
        return False, i
    j = i + 1
    while True:
        j = text.find('"', j)
        if j < 0:
            return None, i
        backslashes = len(text[i + 1:j]) - len(text[i + 1:j].rstrip("\\"))
        if backslashes % 2 == 0:
            break
        j += 1
    try:
        return json.loads(text[i:j + 1]), j + 1
    except ValueError:
        return False, i


def _whole_call(obj: str) -> tuple[str, str] | None:
    """A complete object held because its keys came in another order: (name, arguments)."""
    try:
        value = json.loads(obj)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = next((value[k] for k in _ARGUMENT_KEYS if k in value), None)
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


class _Phase(Enum):
    TEXT = "text"  # content, watching for a call
    OPEN = "open"  # past a call's opening (hermes' tag), before its "{"
    HEADER = "header"  # inside a call's object, before its arguments
    ARGUMENTS = "arguments"  # the arguments, going out as they come
    TAIL = "tail"  # the rest of the call's object
    HOLD = "hold"  # an object whose keys came in another order, held until it closes
    AFTER = "after"  # past a call's object: a closing tag or a separator
    CONTENT = "content"  # all that is left is content


@dataclass
class ToolCallParser:
    """The machinery both formats share: a buffer of the text so far, how far it is decided,
    and the call being read. A format says where calls begin and what lies between them."""

    buf: str = ""
    pos: int = 0  # buf[:pos] is decided
    phase: _Phase = _Phase.TEXT
    calls: int = 0
    fallback: int = 0  # where content resumes if what began at `pos` is no call
    obj: int = 0  # the current call object's "{"
    brackets: _Brackets = field(default_factory=_Brackets)
    events: list[Event] = field(default_factory=list)

    name = ""  # the --tool-call-parser value

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self._advance()
        return self._take()

    def finish(self) -> list[Event]:
        """The output is complete: what is still held is settled."""
        self._advance()
        rest = self.buf[self.pos:]
        if self.phase in (_Phase.OPEN, _Phase.HEADER, _Phase.HOLD):
            self._content(self.buf[self.fallback:])  # a call never completed: text
        elif self.phase in (_Phase.TEXT, _Phase.CONTENT) and (rest.strip() or not self.calls):
            self._content(rest)
        self.pos = len(self.buf)
        return self._take()

    def _take(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def _content(self, text: str) -> None:
        if text:
            self.events.append(Content(text))

    def _emit_until(self, end: int) -> None:
        """Content up to `end`, but for trailing whitespace: held until it is known whether a
        call follows it (then dropped) or more text (then sent)."""
        chunk = self.buf[self.pos:end]
        kept = chunk.rstrip(_SPACE)
        self._content(kept)
        self.pos += len(kept)

    def _advance(self) -> None:
        while self._step():
            pass

    def _step(self) -> bool:
        """Decides what it can from `pos`; False when it must wait for more text."""
        phase = self.phase
        if phase is _Phase.HEADER:
            head = _header(self.buf, self.obj)
            if head is None:
                return False
            if head is False:
                self.phase, self.pos, self.brackets = _Phase.HOLD, self.obj, _Brackets()
                return True
            name, args = head
            self.events.append(CallStart(self.calls, name))
            self.calls += 1
            self.phase, self.pos, self.brackets = _Phase.ARGUMENTS, args, _Brackets()
            return True
        if phase is _Phase.ARGUMENTS:
            end, done = self.brackets.scan(self.buf, self.pos)
            if end > self.pos:
                self.events.append(CallArguments(self.calls - 1, self.buf[self.pos:end]))
            self.pos = end
            if done:
                self.phase, self.brackets = _Phase.TAIL, _Brackets(depth=1)
            return done
        if phase is _Phase.TAIL:
            self.pos, done = self.brackets.scan(self.buf, self.pos)
            if done:
                self.phase = _Phase.AFTER
            return done
        if phase is _Phase.HOLD:
            end, done = self.brackets.scan(self.buf, self.pos)
            self.pos = end
            if not done:
                return False
            call = _whole_call(self.buf[self.obj:end])
            if call is None:
                self._not_a_call()
                return True
            self.events += [CallStart(self.calls, call[0]), CallArguments(self.calls, call[1])]
            self.calls += 1
            self.phase = _Phase.AFTER
            return True
        if phase is _Phase.CONTENT:
            self._emit_until(len(self.buf))
            return False
        return self._format_step()

    def _object_at(self, i: int) -> bool:
        """A call's object opens at `i`: its header is read next."""
        self.obj, self.phase = i, _Phase.HEADER
        return True

    def _format_step(self) -> bool:
        raise NotImplementedError

    def _not_a_call(self) -> None:
        raise NotImplementedError


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in _SPACE:
        i += 1
    return i


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class HermesParser(ToolCallParser):
    name = "hermes"
    OPEN_TAG = "<tool_call>"
    CLOSE_TAG = "</tool_call>"

    def _format_step(self) -> bool:
        if self.phase is _Phase.TEXT:
            at = self.buf.find(self.OPEN_TAG, self.pos)
            if at < 0:
                self._emit_until(len(self.buf) - _held_prefix(self.buf, self.OPEN_TAG))
                return False
            self._emit_until(at)
            self.fallback, self.pos, self.phase = self.pos, at + len(self.OPEN_TAG), _Phase.OPEN
            return True
        if self.phase is _Phase.OPEN:
            i = _skip_space(self.buf, self.pos)
            if i == len(self.buf):
                return False
            if self.buf[i] != "{":
                self._not_a_call()
                return True
            return self._object_at(i)
        # AFTER: the rest of the block is dropped up to its closing tag, or up to the next
        # opening one where the model left this block unclosed
        close = self.buf.find(self.CLOSE_TAG, self.pos)
        again = self.buf.find(self.OPEN_TAG, self.pos)
        ends = [e for e in (close, again) if e >= 0]
        if not ends:
            return False
        end = min(ends)
        self.pos = end + len(self.CLOSE_TAG) if end == close else end
        self.phase = _Phase.TEXT
        # whitespace after a call is held like any trailing whitespace
        return True

    def _not_a_call(self) -> None:
        # The opening tag (and the whitespace before it) is text; reading goes on past it.
        opened = self.buf.find(self.OPEN_TAG, self.fallback) + len(self.OPEN_TAG)
        self._content(self.buf[self.fallback:opened])
        self.pos, self.phase = opened, _Phase.TEXT


@dataclass
class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def _format_step(self) -> bool:
        if self.phase is _Phase.TEXT:  # the start of the output
            i = _skip_space(self.buf, self.pos)
            rest = self.buf[i:]
            if len(rest) < len(self.TAG) and self.TAG.startswith(rest):
                return False  # empty, or maybe the tag
            if rest.startswith(self.TAG):
                i = _skip_space(self.buf, i + len(self.TAG))
                if i == len(self.buf):
                    return False
            if self.buf[i] != "{":
                self._not_a_call()
                return True
            self.fallback = self.pos
            return self._object_at(i)
        # AFTER: `;` and another call, or the end; anything else is content
        i = _skip_space(self.buf, self.pos)
        if i == len(self.buf):
            return False
        if self.buf[i] != ";":
            self.pos, self.phase = i, _Phase.CONTENT
            return True
        j = _skip_space(self.buf, i + 1)
        if j == len(self.buf):
            return False
        if self.buf[j] != "{":
            self.pos, self.phase = i, _Phase.CONTENT
            return True
        self.fallback = i
        return self._object_at(j)

    def _not_a_call(self) -> None:
        self.pos, self.phase = self.fallback, _Phase.CONTENT


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def parse(parser: str, text: str) -> Parsed:
    """A whole output, read by the named parser."""
    p = PARSERS[parser]()
    return collect(p.feed(text) + p.finish())
