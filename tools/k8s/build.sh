#!/usr/bin/env bash
# Builds the test cluster's binaries (kube-apiserver, kube-controller-manager, etcd) from their Go
# modules, once, into a cache outside the repository keyed by version:
#   ${SHOAL_TOOLS_DIR:-~/.cache/shoal-tools}/kubernetes-v$K8S_VERSION/
# Prints the directory as its last line. A run with the binaries of the same build inputs
# (this script, go.mod, go.sum; recorded in build-id) present does nothing; a build prints the
# wall time, CPU time and peak RSS of each step.
#
# One change to upstream: kube-apiserver and kube-controller-manager are built from a copy of the
# k8s.io/kubernetes module (the module cache stays untouched; -modfile points a copy of go.mod at
# it; `go build -overlay` may not replace files in the module cache) whose
# validation.ValidateEndpointIP accepts loopback addresses. The test cluster's pods have
# loopback addresses (each its own 127.N.x.y, see docs/kubernetes.md ("The test cluster")), which the
# API server otherwise refuses in Endpoints and EndpointSlices; nothing else changes.
set -euo pipefail
cd "$(dirname "$0")"
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
K8S_VERSION=$(go list -m -f "{{.Version}}" k8s.io/kubernetes | sed "s/^v//")
OUT=${SHOAL_TOOLS_DIR:-$HOME/.cache/shoal-tools}/kubernetes-v$K8S_VERSION
BINARIES=(kube-apiserver kube-controller-manager etcd)
BUILD_ID=$(cat build.sh go.mod go.sum | sha256sum | cut -c1-16)

missing=0
for b in "${BINARIES[@]}"; do [ -x "$OUT/$b" ] || missing=1; done
if [ "$missing" = 0 ] && [ "$(cat "$OUT/build-id" 2>/dev/null)" = "$BUILD_ID" ]; then
  echo "$OUT"
  exit 0
fi

# the patched module copy: ValidateEndpointIP without its loopback check
go mod download k8s.io/kubernetes
MODULE=$(go list -m -f "{{.Dir}}" k8s.io/kubernetes)
WORK=$OUT.work  # a fixed path: the build cache serves a rebuild from the same copy
trap 'chmod -R u+w "$WORK"; rm -rf "$WORK"' EXIT
rm -rf "$WORK" && mkdir -p "$WORK"
cp -r "$MODULE" "$WORK/kubernetes"
chmod -R u+w "$WORK/kubernetes"
VALIDATION=pkg/apis/core/validation/validation.go
sed '/^func ValidateEndpointIP(/,/^}/{/if ip.IsLoopback() {/,/^\t}/d}' "$MODULE/$VALIDATION" \
  > "$WORK/kubernetes/$VALIDATION"
if cmp -s "$MODULE/$VALIDATION" "$WORK/kubernetes/$VALIDATION"; then
  echo "the loopback-endpoints patch no longer applies to $MODULE/$VALIDATION" >&2
  exit 1
fi
cp go.sum "$WORK/go.sum"
{ cat go.mod; echo "replace k8s.io/kubernetes => $WORK/kubernetes"; } > "$WORK/go.mod"

# timed LABEL COMMAND...: runs COMMAND, then prints its wall and CPU time and peak RSS
timed() {
  local label=$1
  shift
  if [ -x /usr/bin/time ]; then
    /usr/bin/time -f "$label: %e s wall, %U s user + %S s sys CPU, peak RSS %M KiB" "$@"
  else
    local start=$SECONDS
    "$@"
    echo "$label: $((SECONDS - start)) s wall" >&2
  fi
}

MINOR=$(echo "$K8S_VERSION" | cut -d. -f2)
STAMP="-X k8s.io/component-base/version.gitVersion=v$K8S_VERSION -X k8s.io/component-base/version.gitMajor=1"
STAMP="$STAMP -X k8s.io/component-base/version.gitMinor=$MINOR -X k8s.io/component-base/version.gitTreeState=clean"
STAMP="$STAMP -X k8s.io/client-go/pkg/version.gitVersion=v$K8S_VERSION -X k8s.io/client-go/pkg/version.gitMajor=1"
STAMP="$STAMP -X k8s.io/client-go/pkg/version.gitMinor=$MINOR"
mkdir -p "$OUT.partial"
echo "building kubernetes v$K8S_VERSION binaries with $(go version) into $OUT" >&2
timed "kube-apiserver + kube-controller-manager" go build -trimpath -pgo=off \
  -modfile "$WORK/go.mod" -ldflags "-s -w $STAMP" -o "$OUT.partial/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
timed etcd go build -trimpath -ldflags "-s -w" -o "$OUT.partial/etcd" go.etcd.io/etcd/server/v3
echo "$BUILD_ID" > "$OUT.partial/build-id"
rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
echo "$OUT"
