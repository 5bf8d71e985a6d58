"""`shoal bench embeddings`: texts per second of an embedding server, one text per request at
each concurrency, against transformers encoding the same texts in batches of 32 in this process
(BertModel, mean pooling, L2 normalisation; torch's default threads), measured in the same run.

Without `--base-url` it starts `shoal serve --model-path all-MiniLM-L6-v2` itself and stops it
before the reference runs, so the two never share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from shoal import model_store

MODEL = "all-MiniLM-L6-v2"
REFERENCE_BATCH = 32


def add_embeddings_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", help="a running embedding server (default: start one)")
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--min-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", default="1,32",
                        help="comma-separated in-flight requests (one text each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="write the results as JSON here")


def bench_texts(num_texts: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """Texts of lengths spread uniformly over [min_tokens, max_tokens] word pieces (with the
    model's two special tokens on top), words drawn from the model's vocabulary."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_store.prepare(MODEL))
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and w.isascii() and len(w) > 2]
    rng = random.Random(seed)
    texts = []
    for _ in range(num_texts):
        target = rng.randint(min_tokens, max_tokens)
        ids = tokenizer(" ".join(rng.choices(words, k=target)),
                        add_special_tokens=False)["input_ids"][:target]
        texts.append(tokenizer.decode(ids))
    return texts


async def _serve_texts(base_url: str, texts: list[str], concurrency: int) -> float:
    """Texts per second, one text per `/v1/embeddings` request, `concurrency` in flight."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        async def one(text: str) -> None:
            async with limit:
                response = await client.post("/v1/embeddings", json={"input": text})
                response.raise_for_status()

        await asyncio.gather(*(one(text) for text in texts[:concurrency]))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(one(text) for text in texts))
        return len(texts) / (time.perf_counter() - start)


def reference_texts_per_second(texts: list[str]) -> float:
    """transformers' BertModel in batches of REFERENCE_BATCH, tokenizing included."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    path = model_store.prepare(MODEL)
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()

    def encode(batch: list[str]) -> torch.Tensor:
        inputs = tokenizer(batch, padding=True, truncation=True, max_length=512,
                           return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**inputs).last_hidden_state
        mask = inputs["attention_mask"][..., None].float()
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)

    encode(texts[:REFERENCE_BATCH])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(texts), REFERENCE_BATCH):
        encode(texts[i:i + REFERENCE_BATCH])
    return len(texts) / (time.perf_counter() - start)


def run(ns: argparse.Namespace) -> dict[str, object]:
    from shoal.bench.servers import shoal_server

    texts = bench_texts(ns.num_texts, ns.min_tokens, ns.max_tokens, ns.seed)
    levels = [int(c) for c in ns.concurrency.split(",")]
    shoal: dict[int, float] = {}
    if ns.base_url:
        shoal = {c: asyncio.run(_serve_texts(ns.base_url, texts, c)) for c in levels}
    else:
        with tempfile.TemporaryDirectory(prefix="shoal-bench-embeddings-") as log_dir:
            server = shoal_server(Path(log_dir), "shoal embeddings", "--model-path", MODEL)
            server.start()
            try:
                shoal = {c: asyncio.run(_serve_texts(server.base_url, texts, c))
                         for c in levels}
            finally:
                server.stop()
    reference = reference_texts_per_second(texts)
    return {"model": MODEL, "num_texts": len(texts),
            "tokens": [ns.min_tokens, ns.max_tokens], "reference_batch": REFERENCE_BATCH,
            "shoal_texts_per_s": shoal, "reference_texts_per_s": reference,
            "ratio": {c: tps / reference for c, tps in shoal.items()}}


def embeddings_main(ns: argparse.Namespace) -> int:
    result = run(ns)
    text = json.dumps(result, indent=2)
    if ns.output:
        ns.output.write_text(text + "\n")
    print(text)
    return 0
