"""llama.cpp's `llama-server` as the benchmark's peer (AGPL: run as a separate program, never
linked or shipped; `tools/llama-cpp/build.sh` builds it into a cache outside the repository).

It gets the same weights as shoal: the embedded model's GGUF requantized with `llama-quantize
--allow-requantize` to F32 (what shoal serves: the GGUF's weights dequantized to float32) and to
Q8_0 (the peer of `--quantization w8a16`), cached next to the llama.cpp build."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from shoal import model_store

GGUF_TYPES = ("F32", "Q8_0")
SLOT_MARGIN = 64        # tokens per slot beyond prompt + output: llama.cpp tokenizes the text
SLOT_ROUND = 256


def tools_dir() -> Path:
    return Path(os.environ.get("SHOAL_TOOLS_DIR", Path.home() / ".cache" / "shoal-tools"))


def source_gguf(model: str = model_store.DEFAULT_MODEL) -> Path:
    embedded = model_store.EMBEDDED_MODELS[model]
    return model_store.package_dir(embedded) / embedded.gguf_file


def converted_gguf(bin_dir: Path, gguf_type: str, source: Path, cache: Path) -> Path:
    """`source` requantized to `gguf_type`, converted once into `cache`."""
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {gguf_type!r}; expected one of {GGUF_TYPES}")
    stem = source.name.removesuffix(".gguf").rsplit(".", 1)[0]
    out = cache / f"{stem}.{gguf_type}.gguf"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source),
                    str(partial), gguf_type], check=True, capture_output=True)
    partial.rename(out)
    return out


def slot_context(max_tokens: int) -> int:
    """Context per parallel slot for requests of up to `max_tokens` prompt + output tokens."""
    need = max_tokens + SLOT_MARGIN
    return -(-need // SLOT_ROUND) * SLOT_ROUND


def server_argv(bin_dir: Path, gguf: Path, port: int, parallel: int, threads: int,
                threads_batch: int, max_tokens: int, repack: bool = True) -> list[str]:
    """`llama-server` with continuous batching and one slot per request in flight; `-c` is the
    whole KV cache, split evenly between the slots; `-t` threads generate, `-tb` process
    prompts; `repack` False: `--no-repack`, its weights left as the GGUF holds them."""
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "-np", str(parallel),
            "-c", str(parallel * slot_context(max_tokens)), "-t", str(threads),
            "-tb", str(threads_batch), "--cont-batching", "--no-webui",
            "--alias", model_store.DEFAULT_MODEL, *([] if repack else ["--no-repack"])]
