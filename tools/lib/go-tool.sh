# Sourced by tools/*/build.sh: go_tool NAME MODULE PACKAGE [LDFLAGS] builds PACKAGE at the version
# of MODULE that the calling folder's go.mod pins, once, into a cache outside the repository
# keyed by version (${SHOAL_TOOLS_DIR:-~/.cache/shoal-tools}/NAME-vX.Y.Z/NAME), and prints that
# directory as its last line. With the binary present it does nothing. "{version}" in LDFLAGS
# becomes the version.
go_tool() {
  local name=$1 module=$2 package=$3 ldflags=${4:-}
  export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-mod=mod
  local version out start
  version=$(go list -m -f '{{.Version}}' "$module")
  out=${SHOAL_TOOLS_DIR:-$HOME/.cache/shoal-tools}/$name-$version
  if [ -x "$out/$name" ]; then echo "$out"; return 0; fi
  mkdir -p "$out.partial"
  start=$(date +%s)
  echo "building $name $version with $(go version) into $out" >&2
  go build -trimpath -ldflags "-s -w ${ldflags//\{version\}/$version}" -o "$out.partial/$name" \
    "$package"
  echo "$name: $(( $(date +%s) - start )) s" >&2
  rm -rf "$out" && mv "$out.partial" "$out"
  echo "$out"
}
