"""One rank's model: weights, KV memory and the forward pass the scheduler drives.

The scheduler owns the bookkeeping: it takes rows from `req_to_token_pool` and slots from
`token_allocator`, writes `req_to_token_pool.table`, builds a `ForwardBatch` on the runner's
device and calls `forward`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import torch
import torch.distributed as dist

from shoal.config import CpuKernels
from shoal.engine.attention import TorchNativeBackend
from shoal.engine.kv_pool import KVPool, ReqToTokenPool, TokenSlotAllocator
from shoal.engine.threads import RankThreads, forward_threads
from shoal.kernels import KernelArgs, prepare
from shoal.model_config import ModelConfig
from shoal.models import get_model_class
from shoal.models.forward_batch import ForwardBatch
from shoal.models.layers import head_shard
from shoal.models.loader import load_checkpoint
from shoal.models.parallel import ParallelGroup, pp_layer_range

# Share of memory the KV pool may take: of available host memory on CPU (the OS, the other
# ranks and the tokenizer live there too), of free device memory after the weights on CUDA.
_CPU_KV_MEMORY_FRACTION = 0.25
_CUDA_KV_MEMORY_FRACTION = 0.85
_MIN_KV_TOKENS = 16

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; known: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, model_path: str, device: torch.device, dtype: torch.dtype,
                 tp: ParallelGroup, *, pp_rank: int = 0, pp_size: int = 1,
                 max_total_tokens: int | None = None, max_running_requests: int,
                 context_length: int, world: ParallelGroup = ParallelGroup(),
                 threads: RankThreads | None = None, quantization: str = "none",
                 cpu_kernels: CpuKernels = "auto") -> None:
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.threads = threads  # None: torch's thread count is left alone
        if quantization != "none" and dtype != torch.float32:
            raise ValueError(f"--quantization {quantization} needs --dtype float32")
        self.model_config = config = ModelConfig.from_pretrained(model_path)
        start_layer, end_layer = pp_layer_range(config.num_layers, pp_rank, pp_size)
        model_class = get_model_class(config.architecture)
        with torch.device(device), _default_dtype(dtype):
            self.model = model_class(config, tp, start_layer, end_layer)
        load_checkpoint(self.model, model_path)
        kernels = prepare(self.model, KernelArgs(
            cpu_kernels, device, dtype, tp.size, quantization,
            None if threads is None else (threads.base, threads.large_forward)))

        num_layers = end_layer - start_layer
        num_kv_heads = head_shard(config.num_heads, config.num_kv_heads, tp).num_kv_heads
        bytes_per_token = KVPool.bytes_per_token(num_layers, num_kv_heads, config.head_dim, dtype)
        self.max_total_tokens = max_total_tokens or self._kv_capacity(
            bytes_per_token, max_running_requests * context_length, world)
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 1, context_length, device)
        self.token_allocator = TokenSlotAllocator(self.max_total_tokens, device)
        self.kv_pool = KVPool(num_layers, self.max_total_tokens, num_kv_heads, config.head_dim,
                              dtype, device)
        self.attn_backend = TorchNativeBackend(self.kv_pool, self.req_to_token_pool,
                                               kernels.in_place_decode)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """float32 logits at `batch.logits_at` (by default [batch, vocab], each request's last
        new token) on the last pipeline stage; (hidden, residual) for the next stage on the
        others, which also take them."""
        with forward_threads(self.threads, batch.num_tokens):
            self.attn_backend.prepare(batch)
            out = self.model(batch, self.attn_backend, hidden, residual)
        return out.float() if isinstance(out, torch.Tensor) else out

    def _kv_capacity(self, bytes_per_token: int, most_useful: int, world: ParallelGroup) -> int:
        """KV slots that fit the memory budget (capped at what the request rows can reference),
        agreed on as the minimum over all ranks (`world`, a CPU group) so every rank and stage
        allocates the same slots."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * _CUDA_KV_MEMORY_FRACTION
        else:
            budget = psutil.virtual_memory().available * _CPU_KV_MEMORY_FRACTION
        tokens = torch.tensor([min(int(budget // bytes_per_token), most_useful)])
        tokens = int(world.all_reduce(tokens, op=dist.ReduceOp.MIN).item())
        if tokens < _MIN_KV_TOKENS:
            raise RuntimeError(f"memory left for the KV cache holds only {tokens} tokens")
        return tokens


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
