"""A prefill/decode pair of real servers behind a real `shoal router`, on free ports, and what
the PD tests read back from them (/server_info, /metrics)."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from shoal.ports import free_port
from tests.support.server import (
    STARTUP_TIMEOUT_S,
    RunningServer,
    kill_tree,
    start_server,
    wait_healthy,
)
from tests.support.wait import wait_until

CONCURRENCY = 4  # the prefill's queue stays well inside --disaggregation-timeout
# every PD server of the tests: a small pool, chunks small enough that long prompts take several
PD_FLAGS = ("--max-total-tokens", "8192", "--chunked-prefill-size", "64", "--enable-metrics",
            "--disaggregation-timeout", "30")


@dataclass
class RunningRouter:
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc.pid)
            self.proc.wait()


def start_router(tmp_dir: Path, *flags: str) -> RunningRouter:
    port = free_port()
    log_path = tmp_dir / f"router-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shoal", "router", "--port", str(port),
                                 "--health-check-interval", "0.5", *flags],
                                stdout=log, stderr=subprocess.STDOUT)
    router = RunningRouter(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_until(lambda: _router_healthy(router), STARTUP_TIMEOUT_S, "the router is healthy",
                   interval=0.5)
    except BaseException:
        router.stop()
        raise
    return router


def _router_healthy(router: RunningRouter) -> bool:
    if router.proc.poll() is not None:
        raise RuntimeError(f"router exited with {router.proc.returncode}:\n{router.log()}")
    try:
        return httpx.get(router.base_url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class PDServers:
    prefill: RunningServer
    decode: RunningServer
    router: RunningRouter
    bootstrap_port: int

    def stop(self) -> None:
        self.router.stop()
        self.prefill.stop()
        self.decode.stop()


def start_pd(tmp_dir: Path, *flags: str, decode_flags: tuple[str, ...] = (),
             router_flags: tuple[str, ...] = ()) -> PDServers:
    """A prefill and a decode server (started side by side) and a router pairing them."""
    bootstrap = free_port()
    prefill = start_server(tmp_dir, "--disaggregation-mode", "prefill",
                           "--disaggregation-bootstrap-port", str(bootstrap), *flags, wait=False)
    decode = start_server(tmp_dir, "--disaggregation-mode", "decode", *flags, *decode_flags,
                          wait=False)
    try:
        wait_healthy(prefill, 2 * STARTUP_TIMEOUT_S)  # two servers load side by side
        wait_healthy(decode, 2 * STARTUP_TIMEOUT_S)
        router = start_router(tmp_dir, "--prefill", prefill.base_url, "--decode",
                              decode.base_url, *router_flags)
    except BaseException:  # a failed start (or a test timeout) leaves nothing running
        prefill.stop()
        decode.stop()
        raise
    return PDServers(prefill, decode, router, bootstrap)


def generate_all(base_url: str, prompts: list[list[int]],
                 sampling: dict[str, Any]) -> list[list[int]]:
    """Each prompt's output ids from /generate, CONCURRENCY at a time; a sampling value that is
    a function gets the prompt's index."""
    async def run() -> list[list[int]]:
        semaphore = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            async def one(i: int, ids: list[int]) -> list[int]:
                params = {k: (v(i) if callable(v) else v) for k, v in sampling.items()}
                async with semaphore:
                    r = await client.post("/generate", json={"input_ids": ids,
                                                             "sampling_params": params})
                assert r.status_code == 200, r.text
                return r.json()["output_ids"]
            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    return asyncio.run(run())


def scheduler_info(base_url: str) -> dict[str, int]:
    return httpx.get(base_url + "/server_info", timeout=30).json()["scheduler"]


def idle_and_whole(base_url: str) -> dict[str, int] | None:
    """The scheduler's numbers when nothing runs, waits or transfers and every KV slot is free or
    cached (unlocked); None otherwise."""
    info = scheduler_info(base_url)
    queues = ("num_running_reqs", "num_waiting_reqs", "num_bootstrap_reqs", "num_prealloc_reqs",
              "num_transferring_reqs")
    whole = (info["num_free_slots"] + info["num_cached_slots"] == info["num_total_slots"]
             and info["num_evictable_slots"] == info["num_cached_slots"])
    return info if whole and not any(info.get(q, 0) for q in queues) else None


def wait_idle_and_whole(*base_urls: str, timeout: float = 60) -> None:
    for url in base_urls:
        wait_until(lambda url=url: idle_and_whole(url), timeout,
                   f"{url}: idle, every KV slot free or cached", interval=0.5)


def kv_transfer_counters(base_url: str) -> dict[str, float]:
    """`shoal:kv_transfer_*` samples of the server's /metrics, by name and labels."""
    found = {}
    for line in httpx.get(base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("shoal:kv_transfer"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def bytes_per_token(model_path: str) -> int:
    """K and V of one token in every layer, float32, from the model's config.json."""
    config: dict[str, Any] = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4


def tiny_llama(target: Path, model_path: str, num_kv_heads: int = 1) -> None:
    """A random-weight Llama with the default model's tokenizer (another model, same words): 4
    query heads sharing `num_kv_heads` KV heads, 2 layers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=num_kv_heads,
                                  max_position_embeddings=512)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_path) / name).exists():
            shutil.copy(Path(model_path) / name, target / name)
