#!/usr/bin/env bash
# `helm lint --strict` and `helm template` of helm/shoal with its default values and with each
# helm/shoal/ci/*.yaml; exits non-zero on any error or warning. helm comes from tools/helm/build.sh
# (built once into the tools cache when absent).
set -euo pipefail
cd "$(dirname "$0")/../.."
HELM="$(tools/helm/build.sh | tail -n 1)/helm"
CHART=helm/shoal

check() {  # check [values file]
  local label=${1:-default values} values=()
  [ $# -gt 0 ] && values=(--values "$1")
  echo "== $label" >&2
  "$HELM" lint --strict "$CHART" "${values[@]}"
  "$HELM" template shoal "$CHART" --namespace shoal-system "${values[@]}" >/dev/null
}

check
for file in "$CHART"/ci/*.yaml; do
  check "$file"
done
