"""Benchmarks: `shoal bench serving` (any OpenAI-compatible server), `shoal bench forward` (the
bare-forward ceiling), `shoal bench soak` (mixed load, disconnects and aborts, then the leak
checks), `shoal bench embeddings` (an embedding server against transformers) and
`python -m shoal.bench.suite` (the `make bench` driver)."""

from __future__ import annotations

import argparse


def add_bench_commands(commands: argparse._SubParsersAction) -> None:
    """Attach `bench serving|forward|soak|embeddings` to the `shoal` command's subparsers
    (imports stay lazy: `shoal --help` must not load torch)."""
    from shoal.bench.cli_args import add_forward_args, add_serving_args
    from shoal.bench.embeddings import add_embeddings_args
    from shoal.bench.soak import add_soak_args

    bench = commands.add_parser("bench", help="benchmarks: serving client, bare forward")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    add_serving_args(sub.add_parser(
        "serving", help="benchmark an OpenAI-compatible server",
        description="Async streaming /v1/completions benchmark: throughput and TTFT/ITL/TPOT/"
                    "e2e latency, tokens counted from the server's usage."))
    add_forward_args(sub.add_parser(
        "forward", help="the bare forward of a serving workload on shoal's model runner",
        description="Time the prefill of B prompts of L tokens and their N - 1 decode steps "
                    "at batch B, with no server, scheduler or tokenizer in the loop."))
    add_soak_args(sub.add_parser(
        "soak", help="mixed load with disconnects and aborts, then check nothing leaked",
        description="Mixed chat/completions load at a fixed concurrency, a share of the "
                    "streams disconnected or aborted; then the server's RSS, fds, KV pool and "
                    "/health_generate. Exit 1 when anything was lost."))
    add_embeddings_args(sub.add_parser(
        "embeddings", help="texts per second of an embedding server vs transformers",
        description="One text per /v1/embeddings request at each concurrency, against "
                    "transformers' BertModel encoding the same texts in batches of 32, "
                    "measured in the same run."))


def bench_main(ns: argparse.Namespace) -> int:
    if ns.bench_command == "embeddings":
        from shoal.bench.embeddings import embeddings_main

        return embeddings_main(ns)
    if ns.bench_command == "soak":
        from shoal.bench.soak import soak_main

        return soak_main(ns)
    if ns.bench_command == "serving":
        from shoal.bench.serving import serving_main

        return serving_main(ns)
    from shoal.bench.forward import forward_main

    return forward_main(ns)
