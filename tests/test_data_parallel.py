"""Data-parallel serving (graphexec/serve/replicas.py, routing.py): the routing policy alone,
then real servers on the CPU: two replicas answer greedy requests as one engine does, and a
replica whose process dies fails only its own requests."""
from __future__ import annotations

import os
import re
import signal
import threading

import pytest

from graphexec.block_pool import chain_hashes
from graphexec.serve.routing import Router

BLOCK = 4


def _prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 131 + i * 7) % 500 + 3 for i in range(blocks * BLOCK)]


def test_a_prompt_returns_to_the_replica_that_holds_its_prefix():
    router = Router(4, routing="prefix", block_size=BLOCK)
    history = _prompt(1, 6)
    first = router.choose(history, [0, 0, 0, 0], [True] * 4)
    assert not first.by_prefix and first.hit_blocks == 0
    # Another replica is now the least busy; the next turn still goes where its history is.
    loads = [3, 3, 3, 3]
    loads[(first.replica + 1) % 4] = 0
    turn = router.choose(history + _prompt(2, 2), loads, [True] * 4)
    assert turn.replica == first.replica and turn.by_prefix and turn.hit_blocks == 6
    # A prompt sharing only its first 2 blocks counts 2.
    other = history[:2 * BLOCK] + _prompt(9, 3)
    assert router.choose(other, [0] * 4, [True] * 4).hit_blocks == 2


def test_a_much_busier_holder_loses_to_the_least_loaded():
    router = Router(2, routing="prefix", block_size=BLOCK, slack=4)
    p = _prompt(3, 4)
    holder = router.choose(p, [0, 0], [True, True]).replica
    loads = [0, 0]
    loads[holder] = 4  # within slack: the prefix wins
    assert router.choose(p, loads, [True, True]).replica == holder
    loads[holder] = 5  # more than slack above the other
    d = router.choose(p, loads, [True, True])
    assert d.replica != holder and not d.by_prefix
    # The prefix is now cached on both: the less busy holder takes the next one.
    assert router.choose(p, loads, [True, True]) == d.__class__(d.replica, 4, True)


def test_load_routing_ignores_prefixes_and_spreads_ties():
    router = Router(3, routing="load", block_size=BLOCK)
    p = _prompt(4, 4)
    assert router.choose(p, [2, 0, 1], [True] * 3).replica == 1
    chosen = {router.choose(p, [0, 0, 0], [True] * 3).replica for _ in range(3)}
    assert chosen == {0, 1, 2}


def test_dead_replicas_are_skipped_and_forgotten():
    router = Router(2, routing="prefix", block_size=BLOCK)
    p = _prompt(5, 4)
    holder = router.choose(p, [0, 0], [True, True]).replica
    live = [True, True]
    live[holder] = False
    assert router.choose(p, [0, 0], live).replica != holder
    router.forget(holder)
    assert router.choose(p, [0, 0], [True, True]).hit_blocks in (0, 4)
    with pytest.raises(RuntimeError):
        router.choose(p, [0, 0], [False, False])
    with pytest.raises(ValueError, match="routing"):
        Router(2, routing="random")


def test_routing_keys_are_prefix_cachings_keys():
    # The router must key blocks exactly as the engines' prefix cache does, or its idea of
    # what a replica holds would be wrong.
    router = Router(1, routing="prefix", block_size=BLOCK)
    p = _prompt(6, 3)
    router.choose(p, [0], [True])
    assert list(router._held[0]) == chain_hashes(p, BLOCK, 3)


def test_llm_with_two_replicas_returns_what_one_engine_does_in_order():
    from graphexec import LLM, SamplingParams

    prompts = [_prompt(s, 1 + s % 3) for s in range(7)]
    params = [SamplingParams(max_tokens=6 + s, temperature=0, ignore_eos=True)
              for s in range(7)]
    with LLM("tiny", device="cpu") as one:
        want = [o.token_ids for o in one.generate(prompts, params)]
    with LLM("tiny", device="cpu", data_parallel_size=2) as two:
        outs = two.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        assert [len(o.token_ids) for o in outs] == [6 + s for s in range(7)]
        assert len({o.request_id for o in outs}) == 7
        with pytest.raises(ValueError, match="prompt"):
            two.generate([[1, 2], []], SamplingParams(max_tokens=2))
        assert [o.token_ids for o in two.generate(prompts[:3], params[:3])] == want[:3]
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM("tiny", device="cpu", data_parallel_size=0)


# -- real servers ----------------------------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_server import Server  # noqa: E402


def _greedy(url: str, prompts: list[list[int]]) -> list[list[int]]:
    """Sent all at once, so that the replicas share them out."""
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompts[i], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        out[i] = r.json()["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_two_replicas_answer_greedy_requests_as_one_engine_does():
    prompts = [_prompt(s, 2 + s % 3) for s in range(12)]
    one = Server("tiny", "--max-batch", "4")
    try:
        want = _greedy(one.url, prompts)
    finally:
        assert one.stop() == 0
    two = Server("tiny", "--max-batch", "4", "--data-parallel-size", "2")
    try:
        got = _greedy(two.url, prompts)
        assert got == want
        health = httpx.get(two.url + "/health", timeout=5).json()
        assert [r["status"] for r in health["replicas"]] == ["serving", "serving"]
        text = httpx.get(two.url + "/metrics", timeout=5).text
        routed = {r: sum(float(v) for v in re.findall(
            rf'graphexec_routed_requests_total{{by="\w+",replica="{r}"}} (\S+)', text))
            for r in (0, 1)}
        assert routed[0] > 0 and routed[1] > 0 and routed[0] + routed[1] == len(prompts)
    finally:
        assert two.stop() == 0, two.output()
    assert "Traceback" not in two.output(), two.output()


def _engine_pids(server_pid: int) -> list[int]:
    """The server's engine processes (its children, less multiprocessing's resource tracker)."""
    children = []
    for tid in os.listdir(f"/proc/{server_pid}/task"):
        with open(f"/proc/{server_pid}/task/{tid}/children") as f:
            children += [int(c) for c in f.read().split()]
    engines = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"resource_tracker" not in f.read():
                engines.append(pid)
    return sorted(engines)


def test_a_dead_replica_fails_its_own_requests_and_the_rest_go_on():
    srv = Server("tiny", "--max-batch", "4", "--data-parallel-size", "2")
    try:
        engines = _engine_pids(srv.proc.pid)
        assert len(engines) == 2, engines
        ends: list[str] = []
        begun = [threading.Event() for _ in range(4)]

        def stream(i: int) -> None:
            body = {"model": "tiny", "prompt": _prompt(i, 2), "max_tokens": 600,
                    "stream": True, "ignore_eos": True}
            last = []
            with httpx.stream("POST", srv.url + "/v1/completions", json=body,
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        last.append(line)
                        begun[i].set()
            ends.append("error" if any('"error"' in ln for ln in last[-2:]) else
                        "done" if last and last[-1] == "data: [DONE]" else "cut")

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for b in begun:  # every stream under way, on both replicas (load routing)
            assert b.wait(30)
        os.kill(engines[0], signal.SIGKILL)
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads)
        # The killed replica's streams end with an error event; none hangs or is cut.
        assert "cut" not in ends and "error" in ends, ends
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 200, health.text
        states = sorted(r["status"] for r in health.json()["replicas"])
        assert states == ["failed", "serving"], health.text
        # New requests go to the live replica.
        for ids in _greedy(srv.url, [_prompt(s, 2) for s in range(4)]):
            assert len(ids) == 12
    finally:
        srv.stop()
