"""Shared by the kernel tests (tests/test_kernels_*.py): where they run, poisoned outputs,
tolerances, random inputs, paged caches and sampling inputs.

The kernel tests are marked `gpu` and run on CUDA (`make test-gpu`). The same tests run on the
CPU through Triton's interpreter (test_kernels_graphs.py re-runs them with TRITON_INTERPRET=1 and
GRAPHEXEC_KERNEL_DEVICE=cpu), where they use CPU tensors and small shapes.

Every output a wrapper allocates is poisoned (NaN / a sentinel) before the kernel runs, and cache
slots the kernels must not read hold NaN, so an unwritten element or a stray read shows up.
"""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from graphexec.kernels import attention as attn_ref  # noqa: F401  (re-exported to the tests)
from graphexec.kernels import rmsnorm as norm_ref  # noqa: F401
from graphexec.kernels import rope as rope_ref  # noqa: F401
from graphexec.kernels import sampling as samp_ref  # noqa: F401

CPU_MODE = os.environ.get("GRAPHEXEC_KERNEL_DEVICE", "") == "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


HAS_TRITON = _has_triton()
RUNNABLE = HAS_TRITON and ((CPU_MODE and INTERPRET) or (not CPU_MODE and torch.cuda.is_available()))
DEV = torch.device("cpu" if CPU_MODE else "cuda")

kernel_test = pytest.mark.skipif(
    not RUNNABLE, reason="needs CUDA and Triton, or GRAPHEXEC_KERNEL_DEVICE=cpu + TRITON_INTERPRET=1")


# `make test-gpu-sweep` sets this: every shape of every sweep. `make test-gpu` takes the first two
# of each list, so the whole GPU suite fits one device call.
SWEEP = os.environ.get("GRAPHEXEC_GPU_SWEEP", "0") == "1"


def big(gpu_value, cpu_value):
    """Shapes: full size on the GPU, small under the interpreter."""
    if CPU_MODE:
        return cpu_value
    if SWEEP or not isinstance(gpu_value, list):
        return gpu_value
    return gpu_value[:2]


# ----------------------------------------------------------------------------------------------
# fixtures and helpers


def _poisoned_empty(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        t.fill_(float("nan"))
    elif dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-123456789 if dtype in (torch.int32, torch.int64) else 7)
    return t


def poisoned_triton_modules(monkeypatch) -> SimpleNamespace:
    """The Triton modules, with every output allocation poisoned (the `K` fixture)."""
    from graphexec.kernels import (attention_decode_triton, attention_prefill_triton,
                                   attention_tiles_triton, linear_fused_triton,
                                   linear_invariant_triton, linear_triton, norm_rope_triton,
                                   sampling_triton, triton_ops)
    for mod in (attention_tiles_triton, linear_triton, norm_rope_triton, sampling_triton):
        monkeypatch.setattr(mod, "_new", _poisoned_empty)
    return SimpleNamespace(at=attention_decode_triton, ap=attention_prefill_triton,
                           nr=norm_rope_triton, st=sampling_triton,
                           lt=linear_triton, li=linear_invariant_triton, lf=linear_fused_triton,
                           ops=triton_ops.TRITON_OPS)


def _tol(dtype, kind="elementwise"):
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5) if kind == "elementwise" else dict(atol=2e-4, rtol=2e-4)
    if dtype == torch.float16:
        return dict(atol=2e-3, rtol=2e-3) if kind == "elementwise" else dict(atol=3e-3, rtol=5e-3)
    # bf16: 2 ulp (the interpreter truncates fp32 -> bf16 where the GPU rounds)
    return dict(atol=2e-2, rtol=2e-2) if kind == "elementwise" else dict(atol=2e-2, rtol=2e-2)


def _check(out, ref, dtype, kind="elementwise"):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert not torch.isnan(out).any(), "NaN in output: an element left unwritten or a bad read"
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype, kind))


def _gen(seed):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _randn(shape, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(device=DEV, dtype=dtype)


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


# ----------------------------------------------------------------------------------------------
# Paged KV cache helpers


def _paged_cache(seq_lens, hk, d, block_size, dtype, seed, extra_cols=1):
    """Returns (clean_k, clean_v, poisoned_k, poisoned_v, block_tables). Each sequence gets
    distinct random blocks; slots past its length and the blocks that table columns beyond the
    sequence point to hold NaN in the poisoned caches and zeros in the clean ones."""
    n_blocks_seq = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    used = sum(n_blocks_seq)
    spare = 3
    nb = used + spare
    g = _gen(seed)
    perm = torch.randperm(used, generator=g)
    m = max(n_blocks_seq) + extra_cols
    tables = torch.empty(len(seq_lens), m, dtype=torch.int32)
    k_clean = torch.zeros(nb, block_size, hk, d)
    v_clean = torch.zeros(nb, block_size, hk, d)
    k_bad = torch.full((nb, block_size, hk, d), float("nan"))
    v_bad = torch.full((nb, block_size, hk, d), float("nan"))
    at = 0
    for i, s in enumerate(seq_lens):
        blocks = perm[at:at + n_blocks_seq[i]]
        at += n_blocks_seq[i]
        tables[i, :len(blocks)] = blocks.int()
        tables[i, len(blocks):] = torch.randint(used, nb, (m - len(blocks),), generator=g).int()
        for j, blk in enumerate(blocks.tolist()):
            n = min(block_size, s - j * block_size)
            if n <= 0:
                continue
            kk = torch.randn(n, hk, d, generator=g)
            vv = torch.randn(n, hk, d, generator=g)
            k_clean[blk, :n] = kk
            v_clean[blk, :n] = vv
            k_bad[blk, :n] = kk
            v_bad[blk, :n] = vv
    cast = dict(device=DEV, dtype=dtype)
    return (k_clean.to(**cast), v_clean.to(**cast), k_bad.to(**cast), v_bad.to(**cast),
            tables.to(DEV))


def _lengths(b, max_len, block_size, seed):
    """b lengths in [1, max_len]: 1, max_len, block boundaries +-1, random."""
    g = _gen(seed)
    special = [1, max_len, block_size, block_size + 1, 2 * block_size - 1, max_len - 1]
    out = []
    for i in range(b):
        if i < len(special):
            v = special[i]
        else:
            v = int(torch.randint(1, max_len + 1, (1,), generator=g))
        out.append(min(max(v, 1), max_len))
    return out


# ----------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------
# sampling

# One row per mode: (temperature, top_k, top_p, logit scale)
SAMPLE_MODES = [
    (0.0, 0, 1.0, 3.0),     # greedy
    (1.0, 0, 1.0, 3.0),     # plain sampling
    (0.7, 0, 1.0, 1.0),
    (1.0, 1, 1.0, 3.0),     # top-1
    (0.8, 5, 1.0, 3.0),     # small top-k
    (1.0, 50, 0.9, 3.0),    # top-k and top-p
    (1.3, 0, 0.8, 3.0),     # top-p on a peaked row
    (1.0, 0, 0.9, 0.2),     # top-p on a flat row
    (1.0, 0, 0.0, 1.0),     # top-p 0: the max only
    (1.0, -1, 0.5, 2.0),    # negative top-k: off
    (0.5, 10**9, 0.95, 2.0),  # top-k beyond V: off
    (1.0, 700, 1.0, 0.5),   # large top-k
    (2.0, 3000, 0.97, 1.0),  # top-k beyond the selection table
    (0.9, 40, 0.3, 0.05),   # almost tied logits
]


def _sample_inputs(b, v, seed, modes=SAMPLE_MODES, neg_inf=True):
    g = _gen(seed)
    logits = torch.randn(b, v, generator=g)
    temps, ks, ps = [], [], []
    for i in range(b):
        t, k, p, scale = modes[i % len(modes)]
        logits[i] *= scale
        temps.append(t)
        ks.append(min(k, 2**62))
        ps.append(p)
    if neg_inf and v > 8:  # stop tokens masked by mask_stop_tokens
        logits[1::3, 3] = float("-inf")
        logits[2::5, :5] = float("-inf")
    seeds = torch.randint(-2**63, 2**63 - 1, (b,), generator=g, dtype=torch.int64)
    steps = torch.randint(0, 2**40, (b,), generator=g, dtype=torch.int64)
    cast = dict(device=DEV)
    return (logits.to(**cast), torch.tensor(temps, **cast), torch.tensor(ks, **cast),
            torch.tensor(ps, **cast), seeds.to(**cast), steps.to(**cast))


def _chi2_critical(df: int, alpha: float = 1e-3) -> float:
    try:
        from scipy.stats import chi2
        return float(chi2.ppf(1 - alpha, df))
    except Exception:  # Wilson-Hilferty, z(0.999) = 3.0902
        z = 3.0902
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
