"""`make gpu-check`: what only a GPU machine can show, in one run of a few minutes.

1. CUDA greedy parity: `shoal serve --device cuda --dtype float32` against transformers on the
   same GPU, 8 prompts x 32 tokens (a difference only where the reference's top-2 logprob gap
   is below 1e-3).
2. Decode throughput (bfloat16, the GPU default) at batch 1, 32 and 128: `shoal bench forward`.
3. With 2+ GPUs: `--tp 2` greedy output equals `--tp 1`.
Prints one JSON summary; exits 1 when a parity check fails.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from shoal import model_store

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village,", "1, 2, 3, 4, 5,",
           "The three primary colors are", "Q: What is photosynthesis?\nA:",
           "import numpy as np\nx = np.", "My favourite season is"]
NEW_TOKENS = 32
TIE_GAP = 1e-3


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m shoal.gpu_check", description=__doc__)
    parser.add_argument("--batch-sizes", default="1,32,128")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--device", default="cuda", help="cpu only to dry-run this script")
    opts = parser.parse_args()
    model_path = str(model_store.prepare())
    report: dict[str, object] = {"device": _device_name(opts.device)}
    ids = _encode(model_path)
    tp1 = _serve_and_generate(model_path, ids, opts.device)
    report["parity_tp1"] = _parity(model_path, ids, tp1, opts.device)
    report["decode_tokens_per_s"] = {
        b: _bench_forward(opts.device, int(b), opts.input_len)
        for b in opts.batch_sizes.split(",")}
    if opts.device == "cuda" and torch.cuda.device_count() >= 2:
        tp2 = _serve_and_generate(model_path, ids, opts.device, "--tp", "2")
        report["parity_tp2_vs_tp1"] = _compare(model_path, ids, tp1, tp2, opts.device)
    print(json.dumps(report, indent=2))
    checks = [v for k, v in report.items() if k.startswith("parity")]
    sys.exit(0 if all(c["ok"] for c in checks) else 1)  # type: ignore[index]


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def _encode(model_path: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return [tokenizer.encode(p) for p in PROMPTS]


def _serve_and_generate(model_path: str, ids: list[list[int]], device: str,
                        *flags: str) -> list[list[int]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "shoal", "serve", "--port", str(port),
                             "--device", device, "--dtype", "float32", "--model-path",
                             model_path, "--max-total-tokens", "16384", *flags])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"shoal serve exited with {proc.returncode}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        with httpx.Client(base_url=base, timeout=300) as client:
            return [client.post("/generate", json={"input_ids": p, "sampling_params": {
                "max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}
            ).json()["output_ids"] for p in ids]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)


@torch.inference_mode()
def _reference(model_path: str, device: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, at each step, the top-2 logprob gap."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
    sequence = list(prompt)
    tokens, gaps = [], []
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([sequence], device=device)).logits[0, -1]
        top = torch.log_softmax(logits.float(), -1).topk(2).values
        tokens.append(int(logits.argmax()))
        gaps.append(float(top[0] - top[1]))
        sequence.append(tokens[-1])
    return tokens, gaps


def _parity(model_path: str, ids: list[list[int]], got: list[list[int]],
            device: str) -> dict[str, object]:
    references = [_reference(model_path, device, p) for p in ids]
    return _judge([r[0] for r in references], [r[1] for r in references], got)


def _compare(model_path: str, ids: list[list[int]], expected: list[list[int]],
             got: list[list[int]], device: str) -> dict[str, object]:
    gaps = [_reference(model_path, device, p)[1] for p in ids]
    return _judge(expected, gaps, got)


def _judge(expected: list[list[int]], gaps: list[list[float]],
           got: list[list[int]]) -> dict[str, object]:
    exact, ties, failures = 0, 0, []
    for i, (want, gap, have) in enumerate(zip(expected, gaps, got)):
        first = next((j for j in range(len(want)) if j >= len(have) or want[j] != have[j]), None)
        if first is None:
            exact += 1
        elif gap[first] < TIE_GAP:
            ties += 1
        else:
            failures.append({"prompt": i, "position": first, "gap": gap[first]})
    return {"ok": not failures, "exact": exact, "near_tie": ties, "failures": failures}


def _bench_forward(device: str, batch_size: int, input_len: int) -> float:
    dtype = "bfloat16" if device == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "forward.json"
        subprocess.run([sys.executable, "-m", "shoal", "bench", "forward", "--device", device,
                        "--dtype", dtype, "--batch-size", str(batch_size), "--input-len",
                        str(input_len), "--output-file", str(result)], check=True)
        return float(json.loads(result.read_text())["result"]["decode_tokens_per_s"])


if __name__ == "__main__":
    main()
