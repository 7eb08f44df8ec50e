"""graphexec's forward and greedy generation against HuggingFace transformers."""
import pytest
import torch

from conftest import HF_ARCHS, devices
from graphexec import LLM, SamplingParams
from graphexec.kernels import select_ops
from graphexec.model import LlamaModel, load_model, resolve_model
from graphexec.model.llama import AttentionInputs, KVCache
from graphexec.model.shard import UNSHARDED

PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [11, 12], [300, 4, 4, 8, 19, 23, 60, 61, 62, 1, 9, 100, 150]]


def _graphexec_prefill_logits(path, device, dtype, prompts, block_size=4, projections="cublas",
                              ops=None, shard=UNSHARDED):
    """Runs graphexec's varlen prefill over the paged cache; returns per-token logits. path: an
    HF dir, a GGUF file or a preset; shard: one tensor-parallel rank's part (its process in a
    torch.distributed group), the logits whole after the all-reduces."""
    ops = ops or select_ops(torch.device(device), projections=projections)
    whole, weights = load_model(resolve_model(path), torch.device(device), dtype, shard=shard)
    mc = shard.config(whole)
    model = LlamaModel(mc, weights, ops, max_positions=64, shard=shard)
    nblocks = 32
    kv = KVCache([torch.zeros(nblocks, block_size, mc.num_kv_heads, mc.head_dim, dtype=dtype,
                              device=device) for _ in range(mc.num_layers)],
                 [torch.zeros(nblocks, block_size, mc.num_kv_heads, mc.head_dim, dtype=dtype,
                              device=device) for _ in range(mc.num_layers)])
    # Blocks handed out in a scrambled order so a wrong block-table lookup shows.
    free = list(range(nblocks))[::-1]
    ids, pos, slots, cu, tables = [], [], [], [0], []
    for p in prompts:
        blocks = [free.pop() for _ in range(-(-len(p) // block_size))]
        free = free[::-1]
        ids += p
        pos += range(len(p))
        slots += [blocks[i // block_size] * block_size + i % block_size for i in range(len(p))]
        cu.append(cu[-1] + len(p))
        tables.append(blocks + [0] * (8 - len(blocks)))
    t = lambda x: torch.tensor(x, device=device)
    attn = AttentionInputs(slot_mapping=t(slots), block_tables=t(tables).int(),
                           seq_lens=t([len(p) for p in prompts]).int(), cu_seqlens_q=t(cu).int())
    hidden = model.forward(t(ids), t(pos), attn, kv)
    logits = model.compute_logits(hidden).float()
    return [logits[cu[i]:cu[i + 1]] for i in range(len(prompts))]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("arch", list(HF_ARCHS))
def test_prefill_logits_match_transformers_fp32(hf_dirs, arch, device):
    path, hf = hf_dirs[arch]
    hf = hf.to(device)
    ours = _graphexec_prefill_logits(path, device, torch.float32, PROMPTS)
    for p, mine in zip(PROMPTS, ours):
        with torch.no_grad():
            ref = hf(torch.tensor([p], device=device)).logits[0].float()
        rel = (mine - ref).norm() / ref.norm()
        assert rel < 1e-4, f"{arch}: relative error {rel:.2e}"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("arch", list(HF_ARCHS))
def test_greedy_generation_matches_transformers(hf_dirs, arch, device):
    path, hf = hf_dirs[arch]
    hf = hf.to(device)
    llm = LLM(path, device=device, dtype="float32", max_batch=4, num_kv_blocks=64,
              block_size=4)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    distinct = set()
    for p, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=device), max_new_tokens=32,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        expected = ref[0, len(p):].tolist()
        assert out.token_ids == expected, f"{arch}: {out.token_ids} != {expected}"
        assert out.finish_reason == "length"
        distinct |= set(out.token_ids)
    # A model that repeats one token would make this comparison meaningless.
    assert len(distinct) >= 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", list(HF_ARCHS))
@pytest.mark.parametrize("projections,packed", [("cublas", True), ("auto", True),
                                                ("auto", False)])
def test_prefill_logits_match_transformers_bf16(hf_dirs_moderate, arch, projections, packed):
    """packed: the three prompts in one varlen batch (22 rows); else one prompt per forward
    (2-13 rows)."""
    path, hf = hf_dirs_moderate[arch]
    hf = hf.to("cuda", torch.float32)
    with torch.no_grad():
        truth = [hf(torch.tensor([p], device="cuda")).logits[0].float() for p in PROMPTS]
    hf = hf.to(torch.bfloat16)
    if packed:
        ours = _graphexec_prefill_logits(path, "cuda", torch.bfloat16, PROMPTS,
                                         projections=projections)
    else:
        ours = [_graphexec_prefill_logits(path, "cuda", torch.bfloat16, [p],
                                          projections=projections)[0] for p in PROMPTS]
    for p, mine, exact in zip(PROMPTS, ours, truth):
        with torch.no_grad():
            ref = hf(torch.tensor([p], device="cuda")).logits[0].float()
        rel = (mine - ref).norm() / ref.norm()
        assert rel < 2e-2, f"{arch}: relative error {rel:.2e} against transformers bf16"
        # and no less accurate than transformers' own bf16 run, against fp32
        ours_err = (mine - exact).norm() / exact.norm()
        hf_err = (ref - exact).norm() / exact.norm()
        assert ours_err <= 1.25 * hf_err + 1e-3, f"{arch}: {ours_err:.2e} vs {hf_err:.2e}"
    hf.float()
