"""llama.cpp as the benchmark's peer: GGUF conversion (cached, atomic) and `llama-server`'s
command line. The real binaries are exercised by `make bench`, which builds them first."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from shoal.bench import llama_cpp
from shoal.bench.suite_runs import display_argv

FAKE_QUANTIZE = """#!/bin/sh
# llama-quantize --allow-requantize SRC OUT TYPE: records its arguments, writes OUT
echo "$@" >> "$(dirname "$0")/calls"
[ "$4" = "BROKEN" ] && exit 3
printf 'GGUF %s' "$4" > "$3"
"""


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    out = tmp_path / "bin"
    out.mkdir()
    (out / "llama-quantize").write_text(FAKE_QUANTIZE)
    (out / "llama-quantize").chmod(0o755)
    return out


def test_conversion_runs_once_per_type_and_is_cached(bin_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    cache = tmp_path / "cache"
    f32 = llama_cpp.converted_gguf(bin_dir, "F32", source, cache)
    assert f32 == cache / "SmolLM2-135M-Instruct.F32.gguf"
    assert f32.read_text() == "GGUF F32"
    assert llama_cpp.converted_gguf(bin_dir, "F32", source, cache) == f32
    q8 = llama_cpp.converted_gguf(bin_dir, "Q8_0", source, cache)
    assert q8.read_text() == "GGUF Q8_0"
    calls = (bin_dir / "calls").read_text().splitlines()
    assert calls == [f"--allow-requantize {source} {f32}.partial F32",
                     f"--allow-requantize {source} {q8}.partial Q8_0"]


def test_a_failed_conversion_leaves_no_gguf_behind(bin_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "m.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    with pytest.raises(ValueError):
        llama_cpp.converted_gguf(bin_dir, "Q2_K", source, tmp_path)
    monkeypatch.setattr(llama_cpp, "GGUF_TYPES", ("BROKEN",))
    with pytest.raises(subprocess.CalledProcessError):
        llama_cpp.converted_gguf(bin_dir, "BROKEN", source, tmp_path / "cache")
    assert not (tmp_path / "cache" / "m.BROKEN.gguf").exists()


def test_source_is_the_embedded_models_gguf() -> None:
    assert llama_cpp.source_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert llama_cpp.source_gguf().exists()


def test_slot_context_holds_prompt_output_and_margin() -> None:
    assert llama_cpp.slot_context(192) == 256
    assert llama_cpp.slot_context(193) == 512
    assert llama_cpp.slot_context(544) == 768


def test_server_has_one_slot_per_request_in_flight_and_continuous_batching() -> None:
    argv = llama_cpp.server_argv(Path("/b"), Path("/m.gguf"), 8123, 32, 1, 2, 544)
    assert argv[0] == "/b/llama-server"
    opt = {a: b for a, b in zip(argv, argv[1:])}
    assert opt["-m"] == "/m.gguf" and opt["--host"] == "127.0.0.1" and opt["--port"] == "8123"
    assert opt["-np"] == "32" and opt["-c"] == str(32 * 768)
    assert opt["-t"] == "1" and opt["-tb"] == "2"
    assert "--cont-batching" in argv and "--no-repack" not in argv
    assert llama_cpp.server_argv(Path("/b"), Path("/m.gguf"), 1, 1, 1, 1, 10,
                                 repack=False)[-1] == "--no-repack"


def test_commands_are_shown_as_typed() -> None:
    argv = llama_cpp.server_argv(Path("/b"), Path("/m.gguf"), 1, 1, 1, 1, 10)
    assert display_argv(argv)[:3] == ["llama-server", "-m", "/m.gguf"]
    assert display_argv(["/v/bin/python3", "-m", "shoal", "serve"]) == ["shoal", "serve"]
    assert display_argv(["/v/bin/python", "-m", "shoal.bench.hf_generate", "--seed", "0"]) == \
        ["python", "-m", "shoal.bench.hf_generate", "--seed", "0"]
