"""Our models against transformers in float32: prefill logits and greedy tokens, batched through
`ModelRunner` the way the scheduler drives it, plus mixed batches, pipeline stages and TP.

transformers is imported inside functions only: the TP test's spawned workers import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shoal.config import CpuKernels
from shoal.engine.model_runner import ModelRunner
from shoal.models.forward_batch import ForwardBatch
from shoal.models.parallel import ParallelGroup
from shoal.ports import free_port
from tests.support.tiny_models import randomize_weights

PROMPTS = [[1, 17, 300, 42, 9, 250, 77, 5, 123, 400, 11], [1, 88], [1, 5, 6, 7, 490, 33, 2, 61]]
TIE_GAP = 1e-3  # a greedy mismatch is tolerated only where transformers' top-2 gap is below this

_TINY_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
TINY_MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "llama3-tied": dict(model_type="llama", tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64)),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False, vocab_size=509),
    "llama-mqa": dict(model_type="llama", tie_word_embeddings=False, num_key_value_heads=1),
    # 3 GQA groups split unevenly over tp=2, as SmolLM2's 9 heads / 3 KV heads are
    "llama-3groups": dict(model_type="llama", tie_word_embeddings=False, hidden_size=96,
                          num_attention_heads=6, num_key_value_heads=3),
}


def _build_tiny_model(name: str, target: Path) -> None:
    """A random-weight transformers model (`randomize_weights`) saved as safetensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = {**_TINY_COMMON, **TINY_MODELS[name]}
    config = AutoConfig.for_model(**overrides)
    torch.manual_seed(sorted(TINY_MODELS).index(name))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model)
    model.save_pretrained(target)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    for name in TINY_MODELS:
        _build_tiny_model(name, root / name)
    return {name: root / name for name in TINY_MODELS}


def _make_runner(path: Path, tp: ParallelGroup = ParallelGroup(), pp_rank: int = 0,
                 pp_size: int = 1, cpu_kernels: CpuKernels = "auto") -> ModelRunner:
    return ModelRunner(str(path), torch.device("cpu"), torch.float32, tp, pp_rank=pp_rank,
                       pp_size=pp_size, max_total_tokens=1024, max_running_requests=8,
                       context_length=256, cpu_kernels=cpu_kernels)


def _load_hf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@dataclass
class _Request:
    req_pool_idx: int
    tokens: list[int]
    computed_len: int = 0


class _Driver:
    """Plays the scheduler: takes req_to_token entries, hands out KV slots in shuffled order, writes
    req_to_token and builds each ForwardBatch. Several runners are the stages of a pipeline."""

    def __init__(self, *stages: ModelRunner, seed: int = 0) -> None:
        self.stages = stages
        allocator = stages[0].token_allocator
        slots = allocator.alloc(allocator.num_free)
        assert slots is not None
        order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(seed))
        self._free_slots = slots[order]

    def add(self, prompt: list[int]) -> _Request:
        indices = {stage.req_to_token_pool.alloc() for stage in self.stages}
        assert len(indices) == 1
        req_pool_idx = indices.pop()
        assert req_pool_idx is not None
        return _Request(req_pool_idx, list(prompt))

    def step(self, work: list[tuple[_Request, int]]) -> torch.Tensor:
        """Forward the next `n` tokens of each request; logits at each one's last token."""
        ids, positions, locs = [], [], []
        for req, n in work:
            slots, self._free_slots = self._free_slots[:n], self._free_slots[n:]
            end = req.computed_len + n
            for stage in self.stages:
                stage.req_to_token_pool.table[req.req_pool_idx, req.computed_len:end] = slots
            ids += req.tokens[req.computed_len:end]
            positions += range(req.computed_len, end)
            locs.append(slots)
            req.computed_len = end
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(positions),
            out_cache_loc=torch.cat(locs),
            req_pool_indices=torch.tensor([r.req_pool_idx for r, _ in work]),
            seq_lens=torch.tensor([r.computed_len for r, _ in work]),
            extend_lens=[n for _, n in work])
        hidden: torch.Tensor | None = None
        residual: torch.Tensor | None = None
        for stage in self.stages[:-1]:
            out = stage.forward(batch, hidden, residual)
            assert isinstance(out, tuple)
            hidden, residual = out
        logits = self.stages[-1].forward(batch, hidden, residual)
        assert isinstance(logits, torch.Tensor)
        return logits

    def prefill(self, prompts: list[list[int]]) -> tuple[list[_Request], torch.Tensor]:
        requests = [self.add(prompt) for prompt in prompts]
        return requests, self.step([(req, len(req.tokens)) for req in requests])

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy, all requests in one batch; each continues until `max_new_tokens`."""
        requests, logits = self.prefill(prompts)
        for step in range(max_new_tokens):
            for req, token in zip(requests, logits.argmax(-1).tolist()):
                req.tokens.append(token)
            if step + 1 < max_new_tokens:
                logits = self.step([(req, 1) for req in requests])
        return [req.tokens[len(prompt):] for req, prompt in zip(requests, prompts)]


def _until_eos(tokens: list[int], eos_token_ids: tuple[int, ...]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return tokens[:i + 1]
    return tokens


def _assert_greedy_parity(hf: Any, prompt: list[int], ours: list[int],
                          eos_token_ids: tuple[int, ...]) -> None:
    """Token-for-token equal to transformers' greedy output, except that the sequences may part
    at a step where transformers' best two logits are within TIE_GAP (checked, not assumed)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=len(ours), do_sample=False,
                      output_logits=True, return_dict_in_generate=True)
    theirs = out.sequences[0, len(prompt):].tolist()
    ours = _until_eos(ours, eos_token_ids)
    for step, (mine, reference) in enumerate(zip(ours, theirs)):
        if mine != reference:
            top2 = out.logits[step][0].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE_GAP, (f"token {step} differs ({mine} vs {reference}) with a "
                                   f"top-2 gap of {gap:.2e}: ours {ours} theirs {theirs}")
            return
    assert ours == theirs


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_prefill_logits_match_transformers(tiny_model_dirs: dict[str, Path], name: str) -> None:
    hf = _load_hf(tiny_model_dirs[name])
    _, logits = _Driver(_make_runner(tiny_model_dirs[name])).prefill(PROMPTS)
    with torch.no_grad():
        expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cpu_kernels", ["auto", "torch"])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_matches_transformers(tiny_model_dirs: dict[str, Path], name: str,
                                     cpu_kernels: CpuKernels) -> None:
    runner = _make_runner(tiny_model_dirs[name], cpu_kernels=cpu_kernels)
    generated = _Driver(runner, seed=1).generate(PROMPTS, max_new_tokens=32)
    hf = _load_hf(tiny_model_dirs[name])
    for prompt, ours in zip(PROMPTS, generated):
        _assert_greedy_parity(hf, prompt, ours, runner.model_config.eos_token_ids)


def test_mixed_batch_matches_separate_forwards(tiny_model_dirs: dict[str, Path]) -> None:
    """One request's second prefill chunk alongside two decodes equals each run on its own."""
    path = tiny_model_dirs["llama"]
    results = []
    for batched in (True, False):
        driver = _Driver(_make_runner(path), seed=2)
        a, c, b = (driver.add(p) for p in (PROMPTS[0], PROMPTS[2], [1, *range(100, 112)]))
        driver.step([(a, len(a.tokens)), (c, len(c.tokens)), (b, 6)])
        a.tokens.append(7)
        c.tokens.append(8)
        work = [(a, 1), (b, len(b.tokens) - 6), (c, 1)]
        results.append(driver.step(work) if batched
                       else torch.cat([driver.step([item]) for item in work]))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


def test_pipeline_stages_match_single_stage(tiny_model_dirs: dict[str, Path]) -> None:
    """Tied embeddings across stages: the last stage loads its LM head from embed_tokens."""
    path = tiny_model_dirs["llama3-tied"]
    single = _Driver(_make_runner(path)).prefill(PROMPTS)[1]
    stages = [_make_runner(path, pp_rank=rank, pp_size=2) for rank in range(2)]
    assert [len(stage.model.layers) for stage in stages] == [1, 1]
    staged = _Driver(*stages).prefill(PROMPTS)[1]
    torch.testing.assert_close(staged, single, atol=1e-5, rtol=1e-5)


def _scripted_logits(runner: ModelRunner) -> torch.Tensor:
    """Prefill, then three decode steps fed fixed tokens (argmax could split on near-ties)."""
    driver = _Driver(runner, seed=3)
    requests, logits = driver.prefill(PROMPTS)
    steps = [logits]
    for token in (3, 50, 400):
        for req in requests:
            req.tokens.append(token)
        steps.append(driver.step([(req, 1) for req in requests]))
    return torch.stack(steps)


def _tp_worker(rank: int, port: int, model_dirs: dict[str, Path], out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        for name, path in model_dirs.items():
            logits = _scripted_logits(_make_runner(path, ParallelGroup(rank, 2)))
            torch.save(logits, out_dir / f"{name}-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_matches_single_rank(tiny_model_dirs: dict[str, Path],
                                             tmp_path: Path) -> None:
    """tp=2 over gloo: KV heads split evenly (2 heads), unevenly (3 heads) and replicated
    (llama-mqa: 1 head)."""
    model_dirs = {name: tiny_model_dirs[name]
                  for name in ("llama", "qwen2", "llama-mqa", "llama-3groups")}
    mp.spawn(_tp_worker, args=(free_port(), model_dirs, tmp_path), nprocs=2)
    for name, path in model_dirs.items():
        expected = _scripted_logits(_make_runner(path))
        for rank in range(2):
            got = torch.load(tmp_path / f"{name}-{rank}.pt")
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_fused_decode_matches_the_layers_op_by_op(tiny_model_dirs: dict[str, Path],
                                                  name: str) -> None:
    """Decode steps run each layer as one kernel call (`shoal.kernels.fused_decode`, from the
    layers Llama declares: `shoal.kernels.interface`) on this CPU
    float32 runner, reading the layers' panels (packed for it; the LM head's only where one of
    its own kernels reads them); five rows of different context lengths give the logits the
    layers give op by op, and the same K/V."""
    runner = _make_runner(tiny_model_dirs[name])
    fused = runner.model.fused_decode
    assert fused is not None
    for layer in runner.model.layers:
        assert layer.mlp.down_proj.linear_kernel.stored.panels is not None
    assert runner.model.lm_head is not None
    head = runner.model.lm_head.linear_kernel
    assert head is not None and (head.stored.panels is not None) == any(k.name.endswith("panels")
                                                   for k in head.kernels)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [1, *range(40, 60)], [1, 9]]
    driver = _Driver(runner, seed=3)
    requests, logits = driver.prefill(prompts)
    for req, token in zip(requests, logits.argmax(-1).tolist()):
        req.tokens.append(token)
    computed = [req.computed_len for req in requests]
    rows = torch.tensor([req.req_pool_idx for req in requests])
    outputs = []
    for mode in (fused, None):
        runner.model.fused_decode = mode
        for req, length in zip(requests, computed):
            req.computed_len = length
        logits = driver.step([(req, 1) for req in requests])
        slots = runner.req_to_token_pool.table[rows, torch.tensor(computed)]
        outputs.append((logits, [(k[slots], v[slots])
                                 for k, v in zip(runner.kv_pool.k, runner.kv_pool.v)]))
    (fused_logits, fused_kv), (op_logits, op_kv) = outputs
    torch.testing.assert_close(fused_logits, op_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_kv, op_kv, atol=1e-5, rtol=1e-5)


def test_torch_kernels_leave_every_part_to_torch(tiny_model_dirs: dict[str, Path]) -> None:
    """`--cpu-kernels torch`: F.linear on the weights as loaded, torch's norms and rotary, decode
    op by op over SDPA, the full LM head; `auto` takes each kernel on this host."""
    plain, kernels = (_make_runner(tiny_model_dirs["qwen2"], cpu_kernels=mode)
                      for mode in ("torch", "auto"))
    for runner, on in ((plain, False), (kernels, True)):
        model = runner.model
        assert (model.fused_decode is not None) == on
        assert (model.greedy_head is not None) == on
        assert runner.attn_backend.in_place_decode == on
        spec = model.kernel_spec()
        assert all((linear.linear_kernel is not None) == on for linear in spec.linears)
        assert all(ops.cpu_kernels == on for ops in spec.layer_ops)
