"""Tensor parallelism over two "nodes" on the CPU (graphexec/parallel/nodes.py): node 0 is this
test's engine with its own worker, node 1 a `python -m graphexec.serve --node-rank 1` process
with two workers, all meeting at 127.0.0.1 over gloo. Size 1 is the oracle: the same weights
split four ways over two nodes must give the same greedy tokens."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from graphexec import LLM, SamplingParams
from graphexec.config import EngineConfig

transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def four_way_model(tmp_path_factory) -> str:
    """A random Llama whose heads and KV heads split four ways."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, max_position_embeddings=256)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama4")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _two_free_ports() -> int:
    """A port p with p + 1 free too (the rendezvous and the launch channel)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 1 >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [100, 3, 44, 17, 90, 12, 8]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = dict(device="cpu", max_batch=4, num_kv_blocks=32, block_size=8, max_model_len=128)


def test_two_nodes_of_two_ranks_decode_as_one_rank_does(four_way_model):
    with LLM(four_way_model, **ENGINE) as one:
        want = [o.token_ids for o in one.generate(PROMPTS, PARAMS)]
    port = _two_free_ports()
    nodes = dict(tensor_parallel_size=4, nnodes=2, dist_init_addr=f"127.0.0.1:{port}")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "graphexec.serve", "--model", four_way_model, "--device",
         "cpu", "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
         "--dist-init-addr", f"127.0.0.1:{port}", "--max-batch", "4", "--num-kv-blocks", "32",
         "--block-size", "8", "--max-model-len", "128"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with LLM(four_way_model, **ENGINE, **nodes) as four:
            got = [o.token_ids for o in four.generate(PROMPTS, PARAMS)]
        assert got == want
        out, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, out
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()


def test_a_lost_node_is_a_tensor_parallel_error_naming_its_rank(four_way_model):
    from graphexec import Engine, TensorParallelError

    port = _two_free_ports()
    node1 = subprocess.Popen(
        [sys.executable, "-m", "graphexec.serve", "--model", four_way_model, "--device",
         "cpu", "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
         "--dist-init-addr", f"127.0.0.1:{port}", "--max-batch", "4", "--num-kv-blocks", "32",
         "--block-size", "8", "--max-model-len", "128"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)  # its own process group: the whole node dies at once
    try:
        with Engine(four_way_model, tensor_parallel_size=4, nnodes=2,
                    dist_init_addr=f"127.0.0.1:{port}", **ENGINE) as engine:
            engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True))
            engine.step()
            os.killpg(node1.pid, signal.SIGKILL)  # the node and both its ranks
            with pytest.raises(TensorParallelError, match=r"rank [23]"):
                for _ in range(2000):
                    engine.step()
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
        node1.wait()


@pytest.mark.parametrize("kw,field", [
    (dict(tensor_parallel_size=4, nnodes=2), "dist_init_addr"),
    (dict(tensor_parallel_size=4, nnodes=2, dist_init_addr="nohost"), "dist_init_addr"),
    (dict(tensor_parallel_size=3, nnodes=2, dist_init_addr="h:5000"), "multiple of nnodes"),
    (dict(tensor_parallel_size=4, nnodes=2, node_rank=2, dist_init_addr="h:5000"),
     "node_rank"),
    (dict(nnodes=0), "nnodes"),
])
def test_bad_node_options_are_named(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(model="tiny", device="cpu", **kw)
