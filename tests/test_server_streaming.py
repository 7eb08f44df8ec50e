"""The HTTP process's streaming path without a server: deltas merged for a stream that fell
behind, completions chunks written without json.dumps, and the events pipe's framing."""
from __future__ import annotations

import asyncio
import json
import os
import random
import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from graphexec.outputs import TokenLogprob  # noqa: E402
from graphexec.serve.completions import _chunks, _Render  # noqa: E402
from graphexec.serve.events import Delta  # noqa: E402
from graphexec.serve.frames import FrameReader, write_frame  # noqa: E402
from graphexec.serve.generation import Generation, Job, sse  # noqa: E402
from graphexec.serve.render import ChunkFrame, TokenText  # noqa: E402

HEAD = {"id": "cmpl-\u00e9x", "object": "text_completion", "created": 1700000000,
        "model": 'a "model"'}
# token texts a tokenizer gives, some needing JSON escapes or outside ASCII
WORDS = [" the", "\n", ' "q"', "\\", " caf\u00e9", "\U0001f600", "\t", "", " end"]


def _body(return_token_ids: bool = True) -> SimpleNamespace:
    return SimpleNamespace(return_token_ids=return_token_ids, echo=False, prompt_logprobs=None,
                           prompt=[1, 2], n=1, logprobs=None)


def _generation(num_choices: int) -> Generation:
    jobs = [Job([1, 2], None) for _ in range(num_choices)]
    return Generation(SimpleNamespace(), "cmpl-test", jobs, None)


def _script(num_choices: int, tokens: int) -> list[Delta]:
    """One delta per token per choice, the choices' steps interleaved as the engine sends
    them; each token has its text, its id and its logprob."""
    out = []
    for k in range(tokens):
        for i in range(num_choices):
            tid = 100 * i + k
            out.append(Delta(i, [tid], WORDS[(k + i) % len(WORDS)],
                             [TokenLogprob(tid, -k / 8)], "length" if k == tokens - 1 else None,
                             k + 1))
    return out


async def _read_slowly(gen: Generation, script: list[Delta], feed_every: int) -> list[Delta]:
    """The reader falls behind: `feed_every` deltas reach the sink between its reads."""
    got = []
    pos = 0

    def feed() -> None:
        nonlocal pos
        for d in script[pos:pos + feed_every]:
            gen.sink.put(d)
        pos += feed_every

    feed()
    async for d in gen.deltas():
        got.append(d)
        feed()
        await asyncio.sleep(0)
    return got


@pytest.mark.parametrize("choices", [1, 3])
@pytest.mark.parametrize("feed_every", [1, 7, 64])
def test_a_stream_that_fell_behind_gets_every_token_in_order(choices, feed_every):
    tokens = 40
    script = _script(choices, tokens)
    got = asyncio.run(_read_slowly(_generation(choices), script, feed_every))
    for i in range(choices):
        mine = [d for d in got if d.index == i]
        want = [d for d in script if d.index == i]
        assert "".join(d.text for d in mine) == "".join(d.text for d in want)
        assert [t for d in mine for t in d.token_ids] == [t for d in want for t in d.token_ids]
        # per-token logprobs stay complete, one per token, in order
        assert [lp.token_id for d in mine for lp in d.logprobs] == [
            t for d in want for t in d.token_ids]
        assert [d.num_tokens for d in mine][-1] == tokens
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + ["length"]
    if choices == 1 and feed_every > 1:  # what piled up went out merged
        assert len(got) < len(script)
    if feed_every == 1:
        assert len(got) == len(script)


def test_slow_completions_chunks_carry_every_token_in_order():
    script = _script(1, 60)
    gen = _generation(1)
    out = _Render(None, TokenText(None), _body(), [[1, 2]], None)

    async def run() -> list[str]:
        for d in script[:25]:  # the client fell 25 tokens behind before its first read
            gen.sink.put(d)
        events = []
        async for event in _chunks(gen, ChunkFrame(HEAD), out, [0]):
            events.append(event)
            for d in script[25 + 10 * (len(events) - 1):25 + 10 * len(events)]:
                gen.sink.put(d)
        return events

    events = asyncio.run(run())
    assert len(events) < len(script)
    chunks = [json.loads(e.removeprefix("data: ")) for e in events]
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(d.text for d in script)
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == list(range(60))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all({k: c[k] for k in HEAD} == HEAD for c in chunks)


@pytest.mark.parametrize("return_token_ids", [True, False])
def test_completions_chunks_are_the_bytes_json_dumps_gives(return_token_ids):
    rng = random.Random(5)
    pieces = WORDS + ["\ud800", "\x00", "\x7f", "\u2028", "<>&'"]
    frame = ChunkFrame(HEAD)
    out = _Render(None, TokenText(None), _body(return_token_ids), [[1]] * 4, None)
    for _ in range(500):
        index = rng.randrange(4)
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(4)))
        ids = [rng.randrange(1 << 17) for _ in range(rng.randrange(4))]
        finish = rng.choice([None, None, "stop", "length"])
        first = index not in out.started
        fast = frame.event(out.part_json(index, text, ids, None, finish, None))
        if first:  # the reference writes that choice's first chunk too
            out.started.discard(index)
        slow = sse({**HEAD, "choices": [out.part(index, text, ids, None, finish, None)]})
        assert fast == slow


def test_frames_survive_any_split_of_the_pipe():
    messages = [("events", [(f"r{i}", Delta(0, [i], "x" * (i % 7), None, None, i))] * (i % 40),
                 None) for i in range(60)]
    messages.append(("ready", "y" * 300_000, None))  # larger than a pipe's buffer
    r, w = os.pipe()

    def write_all() -> None:
        for m in messages:
            write_frame(w, m)
        os.close(w)

    writer = threading.Thread(target=write_all)
    writer.start()
    reader, got, rng = FrameReader(), [], random.Random(1)
    while data := os.read(r, rng.randrange(1, 9000)):
        got += reader.feed(data)
    writer.join()
    os.close(r)
    assert got == messages
