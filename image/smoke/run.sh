#!/usr/bin/env bash
# `make image-smoke`: build the real image on this CPU machine, offline, and run the smoke test
# (tests/e2e/test_image_smoke.py) against it. Prints how long each step took.
#   SMOKE_IMAGE (shoal:smoke), SMOKE_BASE (shoal-smoke-base:bookworm), WHEELHOUSE (build/wheelhouse)
set -euo pipefail
cd "$(dirname "$0")/../.."

image=${SMOKE_IMAGE:-shoal:smoke}
base=${SMOKE_BASE:-shoal-smoke-base:bookworm}
wheelhouse=${WHEELHOUSE:-build/wheelhouse}
started=$SECONDS
timings=()

report() {
    echo "=== timings"
    printf '%s\n' "${timings[@]}"
    printf '%-34s %4ds\n' "total" $((SECONDS - started))
}
trap report EXIT

step() {
    local name=$1 t0=$SECONDS status=0
    shift
    echo "=== $name"
    "$@" || status=$?
    timings+=("$(printf '%-34s %4ds' "$name" $((SECONDS - t0)))")
    return "$status"
}

step "docker engine" image/smoke/dockerd.sh
step "base image (debootstrap + import)" image/smoke/base-image.sh "$base"
step "wheelhouse" image/smoke/wheelhouse.sh "$wheelhouse"
step "docker build --network none" env DOCKER_BUILDKIT=0 docker build --network none \
    --build-arg BASE_IMAGE="$base" --build-arg PIP_INDEX_ARGS=--no-index -t "$image" .
# the previous image and build stage, now untagged (only images built from this Dockerfile)
step "remove superseded images" docker image prune --force \
    --filter label=org.opencontainers.image.title=shoal
step "smoke test" env SHOAL_SMOKE_IMAGE="$image" .venv/bin/pytest -m image_smoke -v \
    tests/e2e/test_image_smoke.py
