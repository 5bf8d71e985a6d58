#!/usr/bin/env bash
# Builds helm from its Go module (helm.sh/helm/v3, the version go.mod pins), once, into a cache
# outside the repository keyed by version:  ${SHOAL_TOOLS_DIR:-~/.cache/shoal-tools}/helm-vX.Y.Z/helm
# Prints the directory as its last line. A second run with the binary present does nothing.
set -euo pipefail
cd "$(dirname "$0")"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
VERSION=$(go list -m -f '{{.Version}}' helm.sh/helm/v3)
OUT=${SHOAL_TOOLS_DIR:-$HOME/.cache/shoal-tools}/helm-$VERSION
if [ -x "$OUT/helm" ]; then echo "$OUT"; exit 0; fi

mkdir -p "$OUT.partial"
start=$(date +%s)
echo "building helm $VERSION with $(go version) into $OUT" >&2
go build -trimpath -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$VERSION" \
  -o "$OUT.partial/helm" helm.sh/helm/v3/cmd/helm
echo "helm: $(( $(date +%s) - start )) s" >&2
rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
echo "$OUT"
