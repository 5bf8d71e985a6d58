"""Request metrics measured where the client sees them: in the api process."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)


class RequestMetrics:
    def __init__(self) -> None:
        self.prompt_tokens = Counter("shoal:prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = Counter("shoal:generation_tokens",
                                         "Output tokens of finished requests")
        self.time_to_first_token = Histogram("shoal:time_to_first_token_seconds",
                                             "Time to first token", buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = Histogram("shoal:inter_token_latency_seconds",
                                             "Time between output tokens",
                                             buckets=_LATENCY_BUCKETS)
        self.embedding_inputs = Counter("shoal:embedding_inputs",
                                        "Inputs of answered embedding requests")
        self.embedding_tokens = Counter("shoal:embedding_tokens",
                                        "Tokens of answered embedding requests")
        self.embedding_requests = Counter("shoal:embedding_requests",
                                          "Answered embedding requests")
        self.e2e_latency = Histogram("shoal:e2e_request_latency_seconds",
                                     "Request latency, arrival to last token",
                                     buckets=_LATENCY_BUCKETS)

    def on_output(self, created_at: float, last_output_at: float | None, now: float,
                  num_new_tokens: int) -> None:
        """One output chunk of a request arrived (`last_output_at` None: its first)."""
        if last_output_at is None:
            self.time_to_first_token.observe(now - created_at)
        elif num_new_tokens > 0:
            gap = (now - last_output_at) / num_new_tokens
            for _ in range(num_new_tokens):
                self.inter_token_latency.observe(gap)

    def on_embeddings(self, num_inputs: int, num_tokens: int) -> None:
        self.embedding_requests.inc()
        self.embedding_inputs.inc(num_inputs)
        self.embedding_tokens.inc(num_tokens)

    def on_finish(self, created_at: float, now: float, prompt_tokens: int,
                  completion_tokens: int) -> None:
        self.e2e_latency.observe(now - created_at)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)


def render_metrics() -> bytes:
    """Every process's metrics, from the multiprocess directory."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    return generate_latest(registry)
