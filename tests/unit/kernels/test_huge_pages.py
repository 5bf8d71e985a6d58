"""Huge pages behind the weight arena and the KV pool: their memory is advised for them.

Whether the kernel then backs a page with a huge one depends on the host (a fragmented memory
gets 4 KiB pages, and the buffers work the same), so the tests check the advice the kernel
records for the mapping (`hg` in /proc/self/smaps' VmFlags), not the pages it found.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from shoal.engine.kv_pool import KVPool
from shoal.kernels.huge_pages import HUGE_PAGE, huge_page_arena

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _advised(buffer: torch.Tensor) -> bool:
    """Whether the mapping that holds the first whole huge page inside `buffer` is advised for
    huge pages (/proc/self/smaps: advising a range splits its mapping there)."""
    address = buffer.data_ptr() + -buffer.data_ptr() % HUGE_PAGE
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    raise AssertionError("the buffer is in no mapping of /proc/self/smaps")


# Only a kernel built without transparent huge pages (no sysfs entry; madvise refuses the
# advice, which `advise_huge_pages` logs) or another OS leaves nothing to check. Set to `never`,
# the kernel still records the advice, so the test runs there too.
needs_thp = pytest.mark.skipif(sys.platform != "linux" or not _THP.exists(),
                               reason="this kernel has no transparent huge pages")


def test_the_arena_starts_on_a_huge_page_boundary() -> None:
    arena = huge_page_arena(1000)
    assert arena.numel() == 1000 and arena.data_ptr() % HUGE_PAGE == 0


@needs_thp
def test_the_kv_pool_and_the_arena_are_advised_for_huge_pages() -> None:
    pool = KVPool(1, 16384, 3, 64, torch.float32, torch.device("cpu"))  # 12 MiB a buffer
    assert torch.count_nonzero(pool.k[0]) == 0 and torch.count_nonzero(pool.v[0]) == 0
    assert _advised(pool.k[0]) and _advised(pool.v[0])
    assert _advised(huge_page_arena(3 * HUGE_PAGE // 4))
