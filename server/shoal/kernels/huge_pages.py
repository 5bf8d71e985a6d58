"""Transparent huge pages for the large CPU buffers a decode step streams or gathers from.

With 4 KiB pages a step that reads all of a model's weights, or each request's K/V rows scattered
over the pool, misses the TLB on most pages it touches; the kernel backs a region with 2 MiB pages
where it is asked to (`madvise(MADV_HUGEPAGE)`, which hosts whose transparent huge pages are in
`madvise` mode require). Both the weights streamed from one arena and decode attention over
K/V laid out as serving lays them run measurably faster so (docs/perf-log.md).
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def advise_huge_pages(buffer: torch.Tensor) -> None:
    """Ask for huge pages behind the whole 2 MiB pages inside a contiguous CPU tensor's memory
    (those not yet touched get them when first touched). Linux only; logged where refused."""
    start = buffer.data_ptr() + -buffer.data_ptr() % HUGE_PAGE
    end = (buffer.data_ptr() + buffer.numel() * buffer.element_size()) // HUGE_PAGE * HUGE_PAGE
    if sys.platform != "linux" or end <= start:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) != 0:
        logger.info("no transparent huge pages for a %d MiB buffer (madvise: errno %d)",
                    (end - start) >> 20, ctypes.get_errno())


def huge_page_arena(numel: int) -> torch.Tensor:
    """An untouched float32 buffer of `numel` elements starting on a 2 MiB boundary, its pages
    asked to be huge (`advise_huge_pages`)."""
    buffer = torch.empty(numel + HUGE_PAGE // 4, dtype=torch.float32)
    start = -buffer.data_ptr() % HUGE_PAGE // 4
    arena = buffer[start:start + numel]
    advise_huge_pages(arena)
    return arena
