#!/usr/bin/env bash
# Build the images' base from Debian's packages, for machines that cannot pull
# python:3.11-slim from Docker Hub:
#     docker/base-image.sh [NAME] [ARCH]   (default fedpers-base:bookworm, this machine's)
# then build with --build-arg BASE=NAME. Python 3.11 (bookworm's), pip, venv, CA
# certificates and nginx-light (the Fleet proxy); about a minute, ~250 MB.
# ARCH arm64 on an amd64 machine builds the arm64 base under emulation (about 5 minutes):
# it needs qemu-user-static's aarch64 handler registered in binfmt_misc with the F flag
# (docker/emulation.sh does that, and says how to undo it).
# Needs mmdebstrap (apt-get install mmdebstrap) and a running Docker daemon.
set -euo pipefail
DOCKER="${DOCKER:-$( [[ -x /usr/bin/docker ]] && echo /usr/bin/docker || echo docker)}"
name="${1:-fedpers-base:bookworm}"
arch="${2:-$(dpkg --print-architecture)}"
if $DOCKER image inspect "$name" >/dev/null 2>&1; then
    echo "base image $name already exists"
    exit 0
fi
if [[ "$arch" != "$(dpkg --print-architecture)" && "$arch" == arm64 ]] \
    && ! grep -qs '^flags: .*F' /proc/sys/fs/binfmt_misc/qemu-aarch64; then
    echo "an arm64 base on $(dpkg --print-architecture) needs the qemu-aarch64 binfmt handler:" \
        "run docker/emulation.sh register first" >&2
    exit 2
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mmdebstrap --quiet --variant=minbase --arch="$arch" \
    --include=python3,python3-venv,python3-pip,ca-certificates,nginx-light \
    --customize-hook='chroot "$1" apt-get clean' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/*' \
    bookworm "$work/base.tar"
# a build from scratch, not docker import: 20.10's import records the daemon's
# architecture whatever --platform says, and an arm64 build FROM it would not match
printf '%s\n' 'FROM scratch' 'ADD base.tar /' 'ENV LANG=C.UTF-8' 'CMD ["python3"]' \
    > "$work/Dockerfile"
DOCKER_BUILDKIT=1 $DOCKER build -q --platform "linux/$arch" -t "$name" "$work" >/dev/null
echo "built $name ($arch) from Debian bookworm:" \
    "$($DOCKER image inspect -f '{{.Architecture}} {{.Size}}' "$name") bytes"
