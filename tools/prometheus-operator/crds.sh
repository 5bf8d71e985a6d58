#!/usr/bin/env bash
# Prints the folder of prometheus-operator's CRD files (monitoring.coreos.com), from its Go
# module at the version below: downloaded once into the Go module cache, then read from there.
set -euo pipefail
VERSION=v0.79.2
dir=$(go mod download -json "github.com/prometheus-operator/prometheus-operator@${VERSION}" |
      python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
echo "${dir}/example/prometheus-operator-crd"
