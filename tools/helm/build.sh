#!/usr/bin/env bash
# Builds helm from its Go module (helm.sh/helm/v3, the version go.mod pins), once, into a cache
# outside the repository keyed by version:  ${SHOAL_TOOLS_DIR:-~/.cache/shoal-tools}/helm-vX.Y.Z/helm
# Prints the directory as its last line. A second run with the binary present does nothing.
set -euo pipefail
cd "$(dirname "$0")"
. ../lib/go-tool.sh
go_tool helm helm.sh/helm/v3 helm.sh/helm/v3/cmd/helm \
  "-X helm.sh/helm/v3/internal/version.version={version}"
