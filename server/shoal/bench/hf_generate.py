"""transformers `generate` at batch 1: the single-stream baseline of `make bench`.

`python -m shoal.bench.hf_generate --input-len 64 --output-len 128 --num-threads 1` greedily
generates exactly `--output-len` tokens (`min_new_tokens`) after a prompt built like the random
dataset's, and reports tokens/s = output_len / generate time (prefill included, as a serving
request's output throughput at concurrency 1 includes it) and the decode-only rate.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from shoal import model_store
from shoal.bench.datasets import PromptMaker, load_tokenizer


def _timed_generate(model: torch.nn.Module, input_ids: torch.Tensor, num_tokens: int) -> float:
    start = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                         pad_token_id=model.generation_config.eos_token_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - input_ids.shape[1] == num_tokens
    return elapsed


def run(model_path: str, input_len: int, output_len: int, num_threads: int, repeats: int,
        seed: int) -> dict[str, float | int | str]:
    torch.set_num_threads(num_threads)
    tokenizer = load_tokenizer(model_path)
    text = PromptMaker(tokenizer, random.Random(seed)).text(input_len)
    input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        _timed_generate(model, input_ids, 4)  # warmup
        first = statistics.median(_timed_generate(model, input_ids, 1) for _ in range(repeats))
        total = statistics.median(_timed_generate(model, input_ids, output_len)
                                  for _ in range(repeats))
    return {"model_path": model_path, "input_len": int(input_ids.shape[1]),
            "output_len": output_len, "num_threads": num_threads, "repeats": repeats,
            "generate_s": total, "first_token_s": first,
            "tokens_per_s": output_len / total,
            "decode_tokens_per_s": (output_len - 1) / max(total - first, 1e-9)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shoal.bench.hf_generate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-file", default=None)
    ns = parser.parse_args(argv)
    result = run(ns.model_path or str(model_store.prepare()), ns.input_len, ns.output_len,
                 ns.num_threads, ns.repeats, ns.seed)
    print(f"transformers generate, batch 1, {result['num_threads']} threads: "
          f"{result['tokens_per_s']:.2f} tokens/s ({result['output_len']} tokens after "
          f"{result['input_len']} prompt tokens in {result['generate_s']:.2f} s; decode only "
          f"{result['decode_tokens_per_s']:.2f} tokens/s)")
    if ns.output_file:
        Path(ns.output_file).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
