"""How many CPU threads a rank's torch runs on (docs/operations.md, "Multi-rank servers")."""

from __future__ import annotations

from dataclasses import dataclass


def torch_threads_per_rank(num_cores: int, ranks_on_this_host: int) -> int:
    """Cores per local rank, leaving one core to the api and detokenizer: OpenMP threads that
    outnumber the free cores stall at every barrier."""
    return max(1, (num_cores - 1) // ranks_on_this_host)


def large_product_threads_per_rank(num_cores: int, ranks_on_this_host: int) -> int:
    """Cores per local rank, none left over: for the prefill's large products only (each is one
    barrier long; see `shoal.models.linear_kernels`)."""
    return max(1, num_cores // ranks_on_this_host)


@dataclass(frozen=True)
class RankThreads:
    base: int            # torch threads of the rank's forward
    large_products: int  # threads of one linear over LARGE_PRODUCT_ROWS rows or more

    @classmethod
    def for_host(cls, num_cores: int, ranks_on_this_host: int) -> RankThreads:
        return cls(torch_threads_per_rank(num_cores, ranks_on_this_host),
                   large_product_threads_per_rank(num_cores, ranks_on_this_host))
