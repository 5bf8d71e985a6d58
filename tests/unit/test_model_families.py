"""Each model family of `shoal.models.families` against transformers in float32, in process
through `ModelRunner` (the server-level acceptance is tests/integration/test_model_families.py):
prefill logits, a prompt prefilled in chunks (an extend after a prefix attends within each
layer's window), pipeline stages, and the loading rules (sharded index, bf16 / fp16 weights).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shoal.config import CpuKernels
from shoal.models import DecoderForCausalLM
from shoal.models.loader import INDEX_FILE, checkpoint_files
from tests.support import tiny_models
from tests.unit.test_model_parity import _Driver, _load_hf, _make_runner

# longer than the sliding window, of several lengths (one batch of fresh prompts per length)
PROMPTS = [[1, *range(300, 300 + n)] for n in (30, 19, 19, 4)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, model_path: str) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {family: tiny_models.build(family, root / family, Path(model_path))
            for family in tiny_models.FAMILIES}


@torch.no_grad()
def _hf_last_logits(path: Path, prompts: list[list[int]]) -> torch.Tensor:
    hf = _load_hf(path)
    return torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
@pytest.mark.parametrize("family", sorted(tiny_models.FAMILIES))
def test_prefill_logits_match_transformers(checkpoints: dict[str, Path], family: str,
                                           cpu_kernels: CpuKernels) -> None:
    runner = _make_runner(checkpoints[family], cpu_kernels=cpu_kernels)
    assert isinstance(runner.model, DecoderForCausalLM)
    _, logits = _Driver(runner).prefill(PROMPTS)
    torch.testing.assert_close(logits, _hf_last_logits(checkpoints[family], PROMPTS),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_a_prompt_in_chunks_beside_decodes_matches_transformers(
        checkpoints: dict[str, Path], family: str) -> None:
    """The long prompt's last chunk extends a 20-token prefix (its window layers mask it to the
    window), beside two decode rows whose context is past the window too."""
    path = checkpoints[family]
    driver = _Driver(_make_runner(path), seed=4)
    long, a, b = (driver.add(p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[2][:-1]))
    driver.step([(long, 20), (a, len(a.tokens)), (b, len(b.tokens))])
    a.tokens.append(5)
    b.tokens.append(PROMPTS[2][-1])
    logits = driver.step([(a, 1), (long, len(long.tokens) - 20), (b, 1)])
    expected = _hf_last_logits(path, [a.tokens, long.tokens, b.tokens])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_pipeline_stages_match_single_stage(checkpoints: dict[str, Path]) -> None:
    """Gemma 3 over two stages: the second stage's only layer is global layer 1, a full one
    with the global rope, while its local layer index is 0."""
    path = checkpoints["gemma3"]
    single = _Driver(_make_runner(path)).prefill(PROMPTS)[1]
    stages = [_make_runner(path, pp_rank=rank, pp_size=2) for rank in range(2)]
    assert stages[1].model.layers[0].self_attn.how.sliding_window is None
    staged = _Driver(*stages).prefill(PROMPTS)[1]
    torch.testing.assert_close(staged, single, atol=1e-5, rtol=1e-5)


def test_a_sharded_checkpoint_is_read_through_its_index(checkpoints: dict[str, Path],
                                                        tmp_path: Path) -> None:
    """Only the shards the index names are read: a stray file beside them is not; a shard the
    index names but the folder lacks is a clear error."""
    folder = tmp_path / "qwen3"
    shutil.copytree(checkpoints["qwen3"], folder)
    index = json.loads((folder / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (folder / "consolidated.safetensors").write_bytes(b"not a checkpoint")
    assert checkpoint_files(folder) == [folder / name for name in shards]
    (folder / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        checkpoint_files(folder)


@pytest.mark.parametrize("family", ["qwen3", "phi3"])
def test_half_precision_checkpoints_are_served_in_float32(checkpoints: dict[str, Path],
                                                          family: str) -> None:
    """qwen3 is saved in bf16, phi3 in fp16: the runner's weights are their float32 values."""
    runner = _make_runner(checkpoints[family])
    hf = _load_hf(checkpoints[family])
    ours = runner.model.embed_tokens.weight
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, hf.model.embed_tokens.weight, atol=0, rtol=0)
