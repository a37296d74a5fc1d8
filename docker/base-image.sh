#!/usr/bin/env bash
# Build the images' base from Debian's packages, for machines that cannot pull
# python:3.11-slim from Docker Hub:
#     docker/base-image.sh [NAME]        (default fedpers-base:bookworm)
# then build with --build-arg BASE=NAME. Python 3.11 (bookworm's), pip, venv, CA
# certificates and nginx-light (the Fleet proxy); about a minute, ~150 MB.
# Needs mmdebstrap (apt-get install mmdebstrap) and a running Docker daemon.
set -euo pipefail
name="${1:-fedpers-base:bookworm}"
if docker image inspect "$name" >/dev/null 2>&1; then
    echo "base image $name already exists"
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mmdebstrap --quiet --variant=minbase \
    --include=python3,python3-venv,python3-pip,ca-certificates,nginx-light \
    --customize-hook='chroot "$1" apt-get clean' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/*' \
    bookworm "$work/base.tar"
docker import --change 'CMD ["python3"]' --change 'ENV LANG=C.UTF-8' \
    "$work/base.tar" "$name" >/dev/null
echo "built $name from Debian bookworm: $(docker image inspect -f '{{.Size}}' "$name") bytes"
