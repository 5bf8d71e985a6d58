"""The BERT encoder against transformers' BertModel (random weights, every pooling mode), and the
embedding scheduler's batch choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import BertConfig as HFBertConfig
from transformers import BertModel

from shoal.engine.embedding_runner import EmbeddingRunner
from shoal.model_config import is_encoder_model
from shoal.models.bert import Pooling
from shoal.scheduler.embedding import pick_batch

POOLING_FLAGS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                 "max": "pooling_mode_max_tokens"}


def _save_random_bert(path: Path, mode: str, normalize: bool) -> BertModel:
    torch.manual_seed(0)
    config = HFBertConfig(vocab_size=300, hidden_size=48, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=96,
                          max_position_embeddings=64, architectures=["BertModel"])
    model = BertModel(config).eval()
    model.save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type":
                "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type":
                "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type":
                        "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 48, **{flag: name == mode
                                            for name, flag in POOLING_FLAGS.items()}}))
    return model


def _reference(model: BertModel, batch: list[list[int]], mode: str,
               normalize: bool) -> torch.Tensor:
    """transformers' BertModel over a padded batch, pooled as sentence-transformers does."""
    longest = max(len(ids) for ids in batch)
    ids = torch.tensor([row + [0] * (longest - len(row)) for row in batch])
    mask = torch.tensor([[1] * len(row) + [0] * (longest - len(row)) for row in batch])
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    if mode == "cls":
        pooled = hidden[:, 0]
    elif mode == "max":
        pooled = hidden.masked_fill(mask[..., None] == 0, -1e9).amax(dim=1)
    else:
        weights = mask[..., None].float()
        pooled = (hidden * weights).sum(1) / weights.sum(1)
    return F.normalize(pooled, dim=1) if normalize else pooled


@pytest.mark.parametrize(("mode", "normalize"), [("mean", True), ("cls", False), ("max", True)])
def test_the_encoder_equals_transformers_bert_for_every_pooling(
        tmp_path: Path, mode: str, normalize: bool) -> None:
    reference_model = _save_random_bert(tmp_path, mode, normalize)
    assert is_encoder_model(tmp_path)
    assert Pooling.from_pretrained(tmp_path) == Pooling(mode, normalize)
    runner = EmbeddingRunner(tmp_path, torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(1)
    batch = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (1, 7, 64, 30)]
    ours = torch.from_numpy(runner.embed(batch))
    expected = _reference(reference_model, batch, mode, normalize)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    alone = torch.from_numpy(runner.embed([batch[1]]))  # padding changes nothing
    torch.testing.assert_close(alone[0], ours[1], rtol=1e-5, atol=1e-6)


def test_a_generation_checkpoint_is_not_an_encoder(model_path: str, tmp_path: Path) -> None:
    assert not is_encoder_model(model_path)
    assert not is_encoder_model(tmp_path)  # no config.json at all


def test_a_batch_starts_with_the_oldest_input_and_adds_those_closest_in_length() -> None:
    assert pick_batch([], 100, 8) == []
    assert pick_batch([10, 50, 12, 9, 30], 40, 8) == [0, 2, 3]  # 3 x 12 padded tokens
    assert pick_batch([10, 11, 12, 9], 1000, 2) == [0, 1]       # at most max_inputs
    assert pick_batch([500, 1, 2], 100, 8) == [0]  # the oldest goes alone, however long
    lengths = [5, 60, 6, 7, 61, 4]
    chosen = pick_batch(lengths, 24, 8)
    assert chosen[0] == 0 and len(chosen) * max(lengths[i] for i in chosen) <= 24
