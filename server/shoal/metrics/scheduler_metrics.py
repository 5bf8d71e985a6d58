"""Scheduler gauges, and the periodic one-line log of the scheduler's state."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

LOG_INTERVAL_S = 5.0


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The scheduler's numbers at one moment: the log line, the gauges and /server_info's
    `scheduler` (all integers, so the api receives them as they are)."""

    num_total_slots: int       # KV slots of the pool
    num_free_slots: int
    num_cached_slots: int      # owned by the prefix cache, locked or not
    num_evictable_slots: int   # of those, unlocked
    num_running_reqs: int
    num_waiting_reqs: int
    num_retracted_reqs: int    # since start
    num_prompt_tokens: int     # of admitted requests, since start
    num_prefix_hit_tokens: int  # of those, served from the prefix cache
    num_generated_tokens: int  # output tokens, since start
    num_forward_steps: int
    num_verify_steps: int = 0     # speculative decoding: request-steps that verified proposals
    num_verified_tokens: int = 0  # tokens they yielded: accepted proposals + the target's own

    @property
    def token_usage(self) -> float:
        """Share of KV slots held by requests or by cache entries that cannot be evicted."""
        available = self.num_free_slots + self.num_evictable_slots
        return (self.num_total_slots - available) / self.num_total_slots

    @property
    def cache_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / max(self.num_prompt_tokens, 1)


def accept_length(verify_steps: int, verified_tokens: int) -> float:
    """Mean tokens a verify step yields (SGLang's accept length: accepted proposals + 1); 0
    without verify steps."""
    return verified_tokens / verify_steps if verify_steps else 0.0


class SchedulerStats:
    """Every LOG_INTERVAL_S of activity: one log line (like SGLang's "Decode batch" line) and,
    with --enable-metrics, the gauges."""

    def __init__(self, enable_metrics: bool) -> None:
        self.gauges = _Gauges() if enable_metrics else None
        self._last_time = time.monotonic()
        self._last_generated = 0
        self._last_verify = (0, 0)  # num_verify_steps, num_verified_tokens at the last report

    def due(self, now: float) -> bool:
        return now - self._last_time >= LOG_INTERVAL_S

    def report(self, snapshot: SchedulerSnapshot, now: float) -> None:
        elapsed = max(now - self._last_time, 1e-9)
        throughput = (snapshot.num_generated_tokens - self._last_generated) / elapsed
        self._last_time, self._last_generated = now, snapshot.num_generated_tokens
        steps, tokens = self._last_verify
        accept = accept_length(snapshot.num_verify_steps - steps,
                               snapshot.num_verified_tokens - tokens)
        self._last_verify = (snapshot.num_verify_steps, snapshot.num_verified_tokens)
        logger.info("Decode batch. #running-req: %d, #queue-req: %d, token usage: %.2f, "
                    "gen throughput (token/s): %.2f, cache hit rate: %.2f%%, #retracted: %d%s",
                    snapshot.num_running_reqs, snapshot.num_waiting_reqs, snapshot.token_usage,
                    throughput, 100 * snapshot.cache_hit_rate, snapshot.num_retracted_reqs,
                    f", accept len: {accept:.2f}" if accept else "")
        if self.gauges is not None:
            self.gauges.set(snapshot, throughput, accept)


class _Gauges:
    def __init__(self) -> None:
        from prometheus_client import Gauge

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"shoal:{name}", doc, multiprocess_mode="mostrecent")

        self.running = gauge("num_running_reqs", "Requests holding KV cache")
        self.queued = gauge("num_queue_reqs", "Requests waiting for admission")
        self.token_usage = gauge("token_usage", "Share of KV slots in use")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the prefix cache")
        self.gen_throughput = gauge("gen_throughput", "Output tokens per second, recent")
        self.retracted = gauge("num_retracted_reqs", "Requests retracted since start")
        self.accept_length = gauge("spec_accept_length",
                                   "Speculative decoding: mean tokens per verify step, recent")

    def set(self, snapshot: SchedulerSnapshot, throughput: float, accept: float) -> None:
        self.running.set(snapshot.num_running_reqs)
        self.queued.set(snapshot.num_waiting_reqs)
        self.token_usage.set(snapshot.token_usage)
        self.cache_hit_rate.set(snapshot.cache_hit_rate)
        self.gen_throughput.set(throughput)
        self.retracted.set(snapshot.num_retracted_reqs)
        self.accept_length.set(accept)
