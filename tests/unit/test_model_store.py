"""`shoal model prepare PATH.gguf`: a local GGUF file becomes a safetensors folder in the cache,
once per version of the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shoal import cli, model_store


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors |= load_file(file)
    return tensors


def test_a_local_gguf_file_is_converted_once(tmp_path: Path, model_path: str,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The default model's own GGUF, as a user's local file, gives the weights the embedded
    model's preparation gives; a second prepare reuses the folder."""
    default = model_store.lookup(model_store.DEFAULT_MODEL)
    gguf = tmp_path / "smol.gguf"
    gguf.symlink_to(model_store.package_dir(default) / default.gguf_file)
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["model", "prepare", str(gguf)])
    assert exited.value.code == 0
    folder = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert folder == tmp_path / "cache" / "models" / "gguf" / "smol"
    ours, embedded = _weights(folder), _weights(Path(model_path))
    assert ours.keys() == embedded.keys()
    for name, tensor in embedded.items():
        torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0)
    assert (folder / "tokenizer.json").exists()

    def no_second_conversion(*_: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(model_store, "_convert_gguf", no_second_conversion)
    assert model_store.prepare(str(gguf)) == folder


def test_a_missing_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(model_store.ModelNotAvailable, match="no GGUF file"):
        model_store.prepare(str(tmp_path / "absent.gguf"))
