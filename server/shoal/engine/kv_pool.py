"""Paged KV memory: request → token table, token slot allocator, per-layer K/V buffers.

Slot 0 of every buffer is a padding sink that is never handed out; padded reads point at it.
"""

from __future__ import annotations

import torch

from shoal.kernels.huge_pages import advise_huge_pages


class ReqToTokenPool:
    """`table[req_pool_idx, pos]` is the KV slot holding the token at `pos` of the request that
    holds row `req_pool_idx` of the table."""

    def __init__(self, num_rows: int, max_context_len: int, device: torch.device) -> None:
        self.table = torch.zeros((num_rows, max_context_len), dtype=torch.int64, device=device)
        self._free = list(range(num_rows))
        self.num_rows = num_rows

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        """A free req_pool_idx, or None when every row is taken."""
        return self._free.pop() if self._free else None

    def free(self, req_pool_idx: int) -> None:
        self._free.append(req_pool_idx)


class TokenSlotAllocator:
    """Free list of KV slots 1..size (slot 0 is the padding sink)."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.size = size
        self.device = device
        self._free = torch.arange(1, size + 1, dtype=torch.int64, device=device)

    @property
    def num_free(self) -> int:
        return int(self._free.shape[0])

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` slots, or None (and nothing taken) when fewer than `n` are free."""
        if n > self.num_free:
            return None
        slots, self._free = self._free[:n], self._free[n:]
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free = torch.cat((self._free, slots.to(self.device)))

    def reset(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)


class KVPool:
    """Per-layer K and V buffers of shape [num_slots + 1, num_kv_heads, head_dim]; on the CPU in
    transparent huge pages (decode attention reads each request's rows where they lie, scattered
    over the buffer: `shoal.kernels.huge_pages`)."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_slots + 1, num_kv_heads, head_dim)
        self.k = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device) for _ in range(num_layers)]
        self.num_slots = num_slots

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        element_size = torch.tensor([], dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * element_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed buffer; on the CPU its pages are asked to be huge before zeroing touches them."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    if device.type == "cpu":
        advise_huge_pages(buffer)
    return buffer.zero_()
