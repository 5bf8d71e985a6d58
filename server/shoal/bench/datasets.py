"""Benchmark prompts as text, sized in the server's tokens.

Prompts are sent as text (not token ids, which `transformers serve` does not accept), built from
random whole-word vocabulary tokens such as " river": each word is one token and starts with a
space, so a prompt of n words re-encodes to n tokens (checked, and trimmed until it does), and a
shared prefix followed by a suffix encodes to the sum of both.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from transformers import AutoTokenizer, PreTrainedTokenizerBase

_WORD_MARKERS = ("Ġ", "▁")  # byte-level BPE and sentencepiece spellings of a leading space
_MIN_WORDS = 100
_FIT_ROUNDS = 8


@dataclass(frozen=True)
class Prompt:
    text: str
    num_tokens: int   # by the benchmark's tokenizer; the server's `usage` is what gets reported
    output_len: int


@lru_cache(maxsize=4)
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


class PromptMaker:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, rng: random.Random) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.words = _word_tokens(tokenizer)
        if len(self.words) < _MIN_WORDS:
            raise ValueError(f"the tokenizer has only {len(self.words)} whole-word tokens; "
                             f"cannot build prompts from it")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, num_tokens: int) -> str:
        """Random words that encode to `num_tokens` tokens (fewer only if trimming overshoots)."""
        ids = [self.rng.choice(self.words) for _ in range(num_tokens)]
        text = self.tokenizer.decode(ids)
        for _ in range(_FIT_ROUNDS):
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == num_tokens:
                break
            if len(encoded) > num_tokens:
                text = self.tokenizer.decode(encoded[:num_tokens])
            else:
                extra = [self.rng.choice(self.words) for _ in range(num_tokens - len(encoded))]
                text += self.tokenizer.decode(extra)
        return text


def _word_tokens(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    special = set(tokenizer.all_special_ids)
    words = []
    for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(
            list(range(len(tokenizer))))):
        if not token or token[0] not in _WORD_MARKERS:
            continue
        word = token[1:]
        if (len(word) >= 2 and word.isascii() and word.isalpha() and word.islower()
                and token_id not in special):
            words.append(token_id)
    return words


def random_prompts(maker: PromptMaker, num_prompts: int, input_len: int,
                   output_len: int) -> list[Prompt]:
    prompts = []
    for _ in range(num_prompts):
        text = maker.text(input_len)
        prompts.append(Prompt(text, maker.count(text), output_len))
    return prompts


REPEAT_INSTRUCTION = "Repeat the following text exactly, word for word.\n\nText:"
REPEAT_CUE = "\n\nRepeated text:"


def repeat_prompts(maker: PromptMaker, num_prompts: int, input_len: int,
                   output_len: int) -> list[Prompt]:
    """Prompts asking to repeat a text of `input_len` random words (an editing-style workload
    whose output copies its input: what prompt-lookup speculation speeds up); the instruction
    and cue add a few tokens."""
    prompts = []
    for _ in range(num_prompts):
        text = REPEAT_INSTRUCTION + maker.text(input_len) + REPEAT_CUE
        prompts.append(Prompt(text, maker.count(text), output_len))
    return prompts


def shared_prefix_prompts(maker: PromptMaker, num_prompts: int, prefix_len: int,
                          suffix_len: int, output_len: int) -> list[Prompt]:
    """One common prefix of `prefix_len` tokens, then a unique suffix of `suffix_len` tokens."""
    prefix = maker.text(prefix_len)
    prompts = []
    for _ in range(num_prompts):
        text = prefix + maker.text(suffix_len)
        prompts.append(Prompt(text, maker.count(text), output_len))
    return prompts
