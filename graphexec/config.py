"""EngineConfig: every option of LLM and Engine, validated in one place."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .plan import default_buckets, token_buckets

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
           "fp32": torch.float32, "float": torch.float32}

# kv_cache_dtype -> the cache's dtype (None: the activation dtype)
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class EngineConfig:
    model: str
    dtype: torch.dtype | str | None = None  # default: bf16 on CUDA, fp32 on CPU
    device: str | torch.device | None = None  # default: cuda when available
    max_batch: int = 64
    max_model_len: int | None = None  # default: the model's, capped at 4096
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes; alternative to num_kv_blocks
    block_size: int = 16
    seed: int = 0
    # Tokens one step runs at most: a decode token per row plus prompt chunks (the vLLM name),
    # larger than max_batch. A longer prompt is prefilled over several steps while the batch
    # decodes on. The default is docs/benchmarks.md's pick.
    max_num_batched_tokens: int = 1024
    # Full prompt blocks are kept under a hash of their token chain and reused by any later
    # request whose prompt starts the same way (docs/architecture.md, "Prefix caching").
    enable_prefix_caching: bool = False
    buckets: list[int] | None = None
    async_scheduling: bool | None = None  # default: on
    cuda_graphs: bool | None = None  # default: on with CUDA
    capture_logprobs: bool = True  # False: steps that need logprobs run eagerly (less memory)
    use_triton: bool | None = None  # default: Triton kernels on CUDA when triton imports
    # Who runs the projections on CUDA: "cublas", or "auto": Triton for one-row batches (RMSNorm
    # and silu * mul fused in front), at 33-64 rows Triton for o, gate_up and down (residual add
    # and silu * mul in their epilogues), cuBLAS elsewhere: the set that measured fastest.
    projections: str = "auto"
    # Kernels whose per-row results do not depend on the batch size (CUDA + Triton): a draft
    # that computes what the target computes is then accepted every time, in bf16 too.
    batch_invariant: bool = False
    speculative: object | None = None  # a SpeculativeConfig
    # Weights quantized online at load (the vLLM name): None / "none", "fp8" (e4m3, a scale per
    # output channel), "int4" (groups of 128 along K, symmetric) or "int4_asym" (zero points).
    # A quantized checkpoint loads as stored whatever this says (graphexec/model/quantize.py).
    quantization: str | None = None
    # The paged KV cache's element type: "auto" (the activation dtype) or "fp8" (e4m3,
    # saturating at 448: half of bf16's bytes, so twice the blocks in the same memory; a
    # checkpoint's k_scale / v_scale are folded into its projections, model/kv_scales.py).
    kv_cache_dtype: str = "auto"
    # Ranks the model is split over (the vLLM name): one process each, rank 0 this one; on
    # CUDA one device each, from `device` on (docs/architecture.md, "Tensor parallelism").
    tensor_parallel_size: int = 1
    # Tensor parallelism over several hosts (SGLang's flags): the ranks are split evenly over
    # nnodes hosts; this one is node_rank. Node 0 hosts the rendezvous at dist_init_addr
    # ("host:port"; the launch channel takes port + 1) and runs the host loop; the others run
    # workers only (graphexec/parallel/nodes.py).
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    manifest: str | None = None  # from tools/capture.py: buckets (and their memory) to use
    graph_memory_mib: float | None = None  # with a manifest: keep the buckets that fit
    # The prefill token counts a step is padded to (the captured prefill graphs' sizes), from
    # max_num_batched_tokens; the scheduler, the runner and the capture all read this list.
    token_buckets: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        dev = self.device if self.device is not None else (
            "cuda" if torch.cuda.is_available() else "cpu")
        try:
            self.device = torch.device(dev)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={dev!r} is not a valid torch device") from e
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={dev!r}: CUDA is not available on this machine")
        self._check_tensor_parallel_size()
        if self.dtype is None:
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        elif isinstance(self.dtype, str):
            if self.dtype not in _DTYPES:
                raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(_DTYPES)}")
            self.dtype = _DTYPES[self.dtype]
        elif self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype={self.dtype!r} must be bfloat16, float16 or float32")
        for name in ("max_batch", "block_size", "max_num_batched_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.max_batch > 4096:
            raise ValueError(f"max_batch={self.max_batch} is larger than 4096")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory, not both "
                             f"(got {self.num_kv_blocks!r} and {self.kv_cache_memory!r})")
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.buckets is None:
            self.buckets = default_buckets(self.max_batch)
        else:
            bad = [b for b in self.buckets if not isinstance(b, int) or b < 1]
            if bad:
                raise ValueError(f"buckets must be positive integers, got {self.buckets!r}")
            self.buckets = sorted(set(b for b in self.buckets if b <= self.max_batch)
                                  | {self.max_batch})
        if self.speculative is not None:
            from .spec import SpeculativeConfig

            if not isinstance(self.speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig, got "
                                 f"{type(self.speculative).__name__}")
        elif self.max_num_batched_tokens <= self.max_batch:
            # A step's decode rows and prompt chunks share the budget (capture/mixed.py): with a
            # full batch, prompts would get none of it and wait for rows to finish.
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be "
                             f"larger than max_batch={self.max_batch}: each step gives a token "
                             "to every decoding row before prompt chunks get any")
        self.token_buckets = token_buckets(self.max_num_batched_tokens)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got "
                             f"{self.enable_prefix_caching!r}")
        if self.async_scheduling is None:
            self.async_scheduling = True
        cuda = self.device.type == "cuda"
        if self.cuda_graphs is None:
            self.cuda_graphs = cuda
        elif self.cuda_graphs and not cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got device={self.device}")
        if self.use_triton and not cuda:
            raise ValueError(f"use_triton=True needs a CUDA device, got device={self.device}")
        from .kernels import PROJECTIONS

        if self.projections not in PROJECTIONS:
            raise ValueError(f"projections={self.projections!r} is not one of {PROJECTIONS}")
        from .model.quantize import check_quantization

        self.quantization = check_quantization(self.quantization)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of "
                             f"{sorted(KV_CACHE_DTYPES)}")
        if self.batch_invariant:
            if self.quantization is not None:
                raise ValueError("batch_invariant=True runs dense weights only, got "
                                 f"quantization={self.quantization!r}")
            if not cuda or self.use_triton is False:
                raise ValueError("batch_invariant=True needs the Triton kernels on a CUDA "
                                 f"device, got device={self.device}, use_triton={self.use_triton}")
            if self.dtype == torch.float32:  # its projections are bf16/fp16 kernels
                raise ValueError("batch_invariant=True needs dtype bfloat16 or float16, got "
                                 "dtype=float32")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's torch dtype."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    def _check_tensor_parallel_size(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        from .parallel.nodes import NodeLayout

        layout = NodeLayout.of(self)  # ValueError for nnodes, node_rank or dist_init_addr
        if self.device.type == "cuda":
            first, count = self.device.index or 0, torch.cuda.device_count()
            if first + layout.per_node > count:
                raise ValueError(f"tensor_parallel_size={tp} needs {layout.per_node} CUDA "
                                 f"devices from {self.device} on, this machine has {count}")
        if tp > 1:
            from .parallel import symmetric

            symmetric.check(tp)  # a bad GRAPHEXEC_ALL_REDUCE fails here, before any worker
