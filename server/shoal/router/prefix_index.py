"""cache_aware's picture of each worker's prefix cache: an approximate prefix tree over the
prompt *text* (no tokenizer needed), as SGLang's router keeps, stored as chained block hashes
(llm-d's prefix scorer does the same): hash i names the text's first (i + 1) blocks, so a
worker's set of hashes is a radix tree at block granularity, and the prompts a worker saw last
are the ones it keeps (LRU, at most `max_chars` characters' worth).
"""

from __future__ import annotations

from collections import OrderedDict

BLOCK_CHARS = 64


def block_hashes(text: str, block_chars: int = BLOCK_CHARS) -> list[int]:
    """Hash i covers text[:(i + 1) * block_chars]; a trailing partial block has none."""
    hashes, chained = [], 0
    for start in range(0, len(text) - block_chars + 1, block_chars):
        chained = hash((chained, text[start:start + block_chars]))
        hashes.append(chained)
    return hashes


class PrefixIndex:
    def __init__(self, max_chars: int, block_chars: int = BLOCK_CHARS) -> None:
        self.block_chars = block_chars
        self.max_blocks = max(1, max_chars // block_chars)
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def insert(self, worker: str, hashes: list[int]) -> None:
        """The worker was sent a prompt with these blocks: they are its most recent."""
        blocks = self._blocks.setdefault(worker, OrderedDict())
        for h in hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)

    def match(self, hashes: list[int], workers: list[str]) -> tuple[str | None, int]:
        """The worker (of `workers`, the first on a tie) holding the longest run of the
        prompt's leading blocks, and how many; (None, 0) when none holds the first."""
        best, best_len = None, 0
        for worker in workers:
            blocks = self._blocks.get(worker)
            if not blocks:
                continue
            matched = 0
            while matched < len(hashes) and hashes[matched] in blocks:
                matched += 1
            if matched > best_len:
                best, best_len = worker, matched
        return best, best_len

    def size(self, worker: str) -> int:
        """Characters remembered for the worker."""
        return len(self._blocks.get(worker, ())) * self.block_chars

    def forget(self, worker: str) -> None:
        self._blocks.pop(worker, None)
