"""The servers a `make bench` run starts and stops: `shoal serve`, `transformers serve` and
llama.cpp's `llama-server`, each on a free 127.0.0.1 port, healthy before anything is sent."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from shoal.bench import llama_cpp
from shoal.bench.suite_runs import display_argv
from shoal.cpu_cores import usable_cores
from shoal.ports import free_port

STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    base_url: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **self.env}, start_new_session=True)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during "
                                   f"startup; log: {self.log_path}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {STARTUP_TIMEOUT_S:.0f} s; "
                           f"log: {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL of the session this server leads (its children included)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def command(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(display_argv(self.argv))


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in ".-" else "-" for ch in name)


def shoal_server(log_dir: Path, name: str, *flags: str) -> Server:
    port = free_port()
    return Server(name, [sys.executable, "-m", "shoal", "serve", "--port", str(port), *flags],
                  {}, f"http://127.0.0.1:{port}", log_dir / f"{_slug(name)}.log")


def transformers_server(name: str, model_path: str, threads: int, log_dir: Path) -> Server:
    port = free_port()
    argv = [str(Path(sys.executable).with_name("transformers")), "serve", model_path,
            "--continuous-batching", "--device", "cpu", "--dtype", "float32",
            "--host", "127.0.0.1", "--port", str(port)]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    return Server(name, argv, env, f"http://127.0.0.1:{port}", log_dir / f"{_slug(name)}.log")


def llama_server(name: str, bin_dir: Path, gguf: Path, parallel: int, threads: int,
                 max_tokens: int, log_dir: Path, repack: bool = True) -> Server:
    port = free_port()
    argv = llama_cpp.server_argv(bin_dir, gguf, port, parallel, threads, usable_cores(),
                                 max_tokens, repack)
    return Server(name, argv, {}, f"http://127.0.0.1:{port}", log_dir / f"{_slug(name)}.log")
