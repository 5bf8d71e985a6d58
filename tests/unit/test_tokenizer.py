"""`max_chars_per_token`: the bound that lets the api refuse a text too long for the context
before tokenizing it holds for BPE, shrinks by a composing normalizer, and is absent where a
token may stand for a whole word."""

from __future__ import annotations

from tokenizers import Tokenizer, models, normalizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from shoal import model_store
from shoal.tokenizer import load_tokenizer, max_chars_per_token

VOCAB = {"a": 0, "b": 1, "ab": 2, "abab": 3, "<unk>": 4}
MERGES = [("a", "b"), ("ab", "ab")]


def _bpe(normalizer: normalizers.Normalizer | None = None, fuse_unk: bool = False
         ) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE(VOCAB, MERGES, unk_token="<unk>", fuse_unk=fuse_unk))
    if normalizer is not None:
        backend.normalizer = normalizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_the_default_models_bound_holds_on_text(tokenizer: PreTrainedTokenizerBase) -> None:
    most = max_chars_per_token(tokenizer)
    assert most == 81
    text = "The quick brown fox jumps over the lazy dog. " * 200 + "-" * 5000 + " " * 5000
    assert len(tokenizer.encode(text)) * most >= len(text)


def test_a_composing_normalizer_allows_three_characters_per_entry_character() -> None:
    assert max_chars_per_token(_bpe()) == len("<unk>")
    assert max_chars_per_token(_bpe(normalizers.NFC())) == 3 * len("<unk>")
    nested = normalizers.Sequence([normalizers.Lowercase(), normalizers.NFKC()])
    assert max_chars_per_token(_bpe(nested)) == 3 * len("<unk>")


def test_no_bound_where_a_token_may_stand_for_a_whole_word() -> None:
    assert max_chars_per_token(_bpe(fuse_unk=True)) is None
    wordpiece = load_tokenizer(str(model_store.prepare("all-MiniLM-L6-v2")))
    assert max_chars_per_token(wordpiece) is None
