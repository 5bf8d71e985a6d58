#!/usr/bin/env bash
# `helm lint --strict` and `helm template` of helm/shoal with its default values (plus the
# image.repository it requires) and with each helm/shoal/ci/*.yaml; exits non-zero on any error or warning. helm comes from tools/helm/build.sh
# (built once into the tools cache when absent).
set -euo pipefail
cd "$(dirname "$0")/../.."
HELM="$(tools/helm/build.sh | tail -n 1)/helm"
CHART=helm/shoal

check() {  # check LABEL VALUES-ARGS...
  local label=$1 values=("${@:2}")
  echo "== $label" >&2
  "$HELM" lint --strict "$CHART" "${values[@]}"
  "$HELM" template shoal "$CHART" --namespace shoal-system "${values[@]}" >/dev/null
}

# the chart requires image.repository (no registry publishes shoal's image); each ci file names one
check "default values" --set image.repository=registry.example.com/ml/shoal
for file in "$CHART"/ci/*.yaml; do
  check "$file" --values "$file"
done
