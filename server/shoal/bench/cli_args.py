"""Flags of `shoal bench serving` and `shoal bench forward`, kept free of heavy imports so that
building the `shoal` parser stays fast."""

from __future__ import annotations

import argparse
import math

BACKENDS = ("auto", "shoal", "transformers", "openai")
WARMUP_OUTPUT_LEN = 4


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:30000",
                        help="server root, without /v1")
    parser.add_argument("--model", default=None,
                        help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--tokenizer", default=None,
                        help="local tokenizer folder used to size prompts (default: --model "
                             "when it is a folder, else the embedded default model)")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="how to ask for fixed-length outputs: shoal sends ignore_eos "
                             "(SGLang/vLLM too), transformers a generation_config with EOS off, "
                             "openai neither; auto: the first one the warmup request is "
                             "accepted with")
    parser.add_argument("--dataset", default="random",
                        choices=("random", "shared-prefix", "tenants", "repeat"),
                        help="repeat: each prompt asks to repeat a text of --input-len random "
                             "words")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128,
                        help="prompt tokens per request (random dataset; the text to repeat: "
                             "repeat dataset)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="output tokens per request (max_tokens, EOS ignored)")
    parser.add_argument("--prefix-len", type=int, default=1024,
                        help="shared prefix tokens (shared-prefix dataset; each tenant's "
                             "system prompt: tenants dataset)")
    parser.add_argument("--suffix-len", type=int, default=32,
                        help="unique suffix tokens per request (shared-prefix, tenants)")
    parser.add_argument("--num-tenants", type=int, default=8,
                        help="tenants, each with its own system prompt (tenants dataset)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight (default: unlimited)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second, Poisson arrivals (default: inf, all at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-requests", type=int, default=1,
                        help=f"untimed {WARMUP_OUTPUT_LEN}-token requests sent first")
    parser.add_argument("--request-timeout", type=float, default=1800.0,
                        help="seconds a request may wait for its next bytes")
    parser.add_argument("--extra-request-body", default=None,
                        help="JSON object merged into every request body")
    parser.add_argument("--output-file", default=None,
                        help="write the config and all metrics as JSON here")
    parser.add_argument("--disable-progress", action="store_true")


def add_forward_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", default=None,
                        help="model folder (default: the embedded default model)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="requests B, prefilled together and decoded as one batch")
    parser.add_argument("--input-len", type=int, default=256, help="prompt tokens of each")
    parser.add_argument("--output-len", type=int, default=32,
                        help="output tokens of each: the first from prefill, then N - 1 "
                             "decode steps")
    parser.add_argument("--prefill-tokens", type=int, default=None,
                        help="new tokens a prefill forward takes at most (default: the "
                             "scheduler's chunked-prefill size on the device)")
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="decode steps of the untimed warmup pass (0: no warmup)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--quantization", default="none", choices=("none", "w8a16"),
                        help="as `shoal serve --quantization`")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads of every forward (default: the scheduler's for "
                             "one rank: on CPU every core)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-file", default=None, help="write the result as JSON here")
