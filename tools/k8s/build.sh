#!/usr/bin/env bash
# Builds the test cluster's binaries (kube-apiserver, kube-controller-manager, etcd) from their Go
# modules, once, into a cache outside the repository keyed by version:
#   ${SHOAL_TOOLS_DIR:-~/.cache/shoal-tools}/kubernetes-v$K8S_VERSION/
# Prints the directory as its last line. A second run with the binaries present does nothing.
set -euo pipefail
cd "$(dirname "$0")"
K8S_VERSION=$(GOFLAGS=-mod=mod go list -m -f "{{.Version}}" k8s.io/kubernetes | sed "s/^v//")
OUT=${SHOAL_TOOLS_DIR:-$HOME/.cache/shoal-tools}/kubernetes-v$K8S_VERSION
BINARIES=(kube-apiserver kube-controller-manager etcd)

missing=0
for b in "${BINARIES[@]}"; do [ -x "$OUT/$b" ] || missing=1; done
if [ "$missing" = 0 ]; then echo "$OUT"; exit 0; fi

export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
MINOR=$(echo "$K8S_VERSION" | cut -d. -f2)
STAMP="-X k8s.io/component-base/version.gitVersion=v$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1"
STAMP="$STAMP -X k8s.io/component-base/version.gitMinor=$MINOR -X k8s.io/component-base/version.gitTreeState=clean"
STAMP="$STAMP -X k8s.io/client-go/pkg/version.gitVersion=v$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1"
STAMP="$STAMP -X k8s.io/client-go/pkg/version.gitMinor=$MINOR"
mkdir -p "$OUT.partial"
start=$(date +%s)
echo "building kubernetes v$K8S_VERSION binaries with $(go version) into $OUT" >&2
go build -trimpath -pgo=off -ldflags "-s -w $STAMP" -o "$OUT.partial/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
echo "kube-apiserver + kube-controller-manager: $(( $(date +%s) - start )) s" >&2
start=$(date +%s)
go build -trimpath -ldflags "-s -w" -o "$OUT.partial/etcd" go.etcd.io/etcd/server/v3
echo "etcd: $(( $(date +%s) - start )) s" >&2
rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
echo "$OUT"
