#!/usr/bin/env bash
# A local Debian bookworm base image with Python 3.11, for the smoke build (no registry can be
# pulled here): debootstrap a minimal root filesystem, then `docker import` it. Needs root.
# Usage: image/smoke/base-image.sh [TAG]     (does nothing when TAG already exists)
set -euo pipefail

tag=${1:-shoal-smoke-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$tag" >/dev/null 2>&1; then
    echo "base image $tag already exists"
    exit 0
fi

rootfs=$(mktemp -d /tmp/shoal-rootfs.XXXXXX)
cleanup() {
    # debootstrap mounts /proc and /sys inside the target; never delete through a mount
    umount -R "$rootfs/proc" "$rootfs/sys" 2>/dev/null || true
    rm -rf --one-file-system "$rootfs"
}
trap cleanup EXIT

debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$mirror"
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$tag"
echo "built base image $tag"
