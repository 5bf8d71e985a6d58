#!/usr/bin/env bash
# Make sure a Docker engine answers. When none does and this is root, start Debian's dockerd
# (installing docker.io and debootstrap first if they are missing) with no bridge and no iptables
# rules: containers run with --network host or none, and nothing but loopback is ever used.
set -euo pipefail

if docker info >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "no Docker engine answers, and starting one needs root" >&2
    exit 1
fi
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap
fi

log=${DOCKERD_LOG:-/var/log/shoal-smoke-dockerd.log}
echo "starting dockerd (log: $log)"
nohup dockerd --bridge=none --iptables=false --ip-masq=false --ip-forward=false \
    >"$log" 2>&1 &
for _ in $(seq 60); do
    if docker info >/dev/null 2>&1; then
        exit 0
    fi
    sleep 1
done
echo "dockerd did not come up; see $log" >&2
exit 1
