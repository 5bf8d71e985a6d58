#!/usr/bin/env bash
# Builds Prometheus from its Go module (github.com/prometheus/prometheus, the version go.mod pins;
# without the web UI's assets, which the e2e test does not use: it queries the HTTP API), once,
# into a cache outside the repository keyed by version:
#   ${SHOAL_TOOLS_DIR:-~/.cache/shoal-tools}/prometheus-vX.Y.Z/prometheus
# Prints the directory as its last line. A second run with the binary present does nothing.
set -euo pipefail
cd "$(dirname "$0")"
. ../lib/go-tool.sh
go_tool prometheus github.com/prometheus/prometheus github.com/prometheus/prometheus/cmd/prometheus
