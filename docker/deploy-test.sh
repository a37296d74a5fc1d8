#!/usr/bin/env bash
# make deploy-test: the deployment for real, on a fresh Debian machine (as root).
# Installs what it needs (docker.io, docker-compose, mmdebstrap, iptables, ethtool,
# qemu-user-static, binutils for both architectures), saves the host's state
# (docker/hoststate.py), runs the bad-network test in network namespaces
# (tests/deployment/test_network.py), starts a Docker daemon if none answers, builds the
# base image from Debian's packages where Docker Hub is out of reach, fills the
# wheelhouses on the host, builds the server image and both device images (amd64 with
# torch's CPU build; arm64 under emulation, from an arm64 base made with mmdebstrap),
# runs tests/deployment/test_docker.py (its mixed federation runs one device on the arm64
# image), stops the daemon it started, puts the host back as found (the emulation's
# binfmt handler too) and checks that it is, and writes
# results/deploy-test/summary.json. An amd64 host is assumed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DOCKER=/usr/bin/docker
work="$(mktemp -d /tmp/fedpers-deploy.XXXXXX)"
out=results/deploy-test
started_daemon=""
host_status=0
cleanup() {
    local rc=$?  # non-zero where a step failed under set -e
    if [[ -n "$started_daemon" ]]; then
        kill "$started_daemon" 2>/dev/null || true
        for _ in $(seq 30); do kill -0 "$started_daemon" 2>/dev/null || break; sleep 1; done
        # dockerd leaves its tables and chains, a DROP FORWARD policy, sysctls and links
        # behind: put back what docker/hoststate.py saved before it started
        $PY docker/hoststate.py restore "$work/host" || true
        echo "stopped the Docker daemon this test started (pid $started_daemon)"
    fi
    if [[ -f "$work/host/hoststate.json" ]]; then
        if $PY docker/hoststate.py compare "$work/host"; then
            echo true > "$work/host/as-found"
        else
            echo false > "$work/host/as-found"
            # a daemon that was running before may change the host by itself
            [[ -n "$started_daemon" ]] && host_status=1
        fi
        write_summary || true
    fi
    rm -rf "$work"
    exit $(( rc ? rc : status ? status : host_status ))
}
status=0
# results/deploy-test/summary.json: the figures the tests recorded, the images, the stages
write_summary() {
    mkdir -p "$out"
    $PY - "$work" "$out/summary.json" <<'PYTHON'
import json, sys
from pathlib import Path
work, target = Path(sys.argv[1]), Path(sys.argv[2])
found = json.loads((work / "summary.json").read_text()) if (work / "summary.json").exists() else {}
images = {}
for line in (work / "images.txt").read_text().splitlines() if (work / "images.txt").exists() else []:
    name, arch, size = line.split()
    images.setdefault(name, {})[arch] = int(size)
stages = (work / "stages.txt").read_text().split() if (work / "stages.txt").exists() else []
summary = {
    "round_seconds": found.pop("round_seconds", None),
    "image_bytes": images,
    "arm64_round_seconds": found.pop("arm64_round_seconds", None),
    "device_peak_memory_mb": found.pop("device_peak_memory_mb", None),
    "netem_round_seconds": found.pop("netem_round_seconds", None),
    **found,
    "tests": (work / "tests.txt").read_text().strip() if (work / "tests.txt").exists() else "",
    "stage_seconds": dict(zip(stages[::2], map(int, stages[1::2]))),
    "host_left_as_found": (work / "host" / "as-found").read_text().strip() == "true"
    if (work / "host" / "as-found").exists() else None,
}
if (work / "arm64.txt").exists():
    summary["arm64"] = (work / "arm64.txt").read_text()
elif summary["arm64_round_seconds"] is None:
    summary.setdefault("arm64", "no mixed-federation round: see the Docker tests' outcome")
target.write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PYTHON
}
trap cleanup EXIT
t0=$(date +%s)

missing=()
[[ -x $DOCKER ]] || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v iptables >/dev/null || missing+=(iptables)
command -v ethtool >/dev/null || missing+=(ethtool)  # the user-space link shaper
[[ -f /usr/lib/binfmt.d/qemu-aarch64.conf ]] || missing+=(qemu-user-static)  # arm64
command -v strip >/dev/null || missing+=(binutils)  # the wheelhouse strips libraries
command -v aarch64-linux-gnu-strip >/dev/null || missing+=(binutils-aarch64-linux-gnu)
if (( ${#missing[@]} )); then
    echo "installing ${missing[*]} from Debian's packages"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

$PY docker/hoststate.py save "$work/host"  # before anything here changes the host
summary="$work/summary.json"

# Bad networks, in network namespaces (no Docker): impaired links, a cut link
t_net=$(date +%s)
FEDPERS_DEPLOY_SUMMARY="$summary" $PY -m pytest -p no:cacheprovider -m network \
    tests/deployment/test_network.py -v -rA 2>&1 | tee "$work/network.log" || status=$?
t_network=$(date +%s)
echo "network $(( t_network - t_net ))" >> "$work/stages.txt"

if ! $DOCKER info >/dev/null 2>&1; then
    dockerd --data-root /var/lib/docker-fedpers >"$work/dockerd.log" 2>&1 &
    started_daemon=$!
    for _ in $(seq 60); do $DOCKER info >/dev/null 2>&1 && break; sleep 1; done
    $DOCKER info >/dev/null 2>&1 || { cat "$work/dockerd.log"; exit 1; }
    echo "started a Docker daemon (pid $started_daemon)"
fi

base="${FEDPERS_BASE:-}"
# arm64 under emulation: a machine without binfmt_misc or qemu still runs the rest (the
# mixed-federation test then skips, and the summary says why)
base_arm64="${FEDPERS_BASE_ARM64:-fedpers-base:bookworm-arm64}"
arm64=""
if ! docker/emulation.sh register 2>"$work/arm64.err"; then
    arm64="no arm64 emulation: $(tail -1 "$work/arm64.err")"
elif ! DOCKER=$DOCKER docker/base-image.sh "$base_arm64" arm64 >"$work/arm64.log" 2>&1; then
    arm64="the arm64 base did not build: $(tail -1 "$work/arm64.log")"
fi
if [[ -z "$base" ]]; then
    if timeout 60 $DOCKER pull -q python:3.11-slim >/dev/null 2>&1; then
        base=python:3.11-slim
    else
        echo "Docker Hub is out of reach: the base image comes from Debian's packages"
        base=fedpers-base:bookworm
        DOCKER=$DOCKER docker/base-image.sh "$base"
    fi
fi
t1=$(date +%s)
$PY docker/wheelhouse.py
if [[ -z "$arm64" ]] && ! $PY docker/wheelhouse.py --arch arm64 >"$work/arm64.log" 2>&1; then
    arm64="the arm64 wheelhouse did not fill: $(tail -1 "$work/arm64.log")"
fi
t2=$(date +%s)
for image in server device; do
    s=$(date +%s)
    DOCKER_BUILDKIT=1 $DOCKER build -q -f "docker/Dockerfile.$image" --build-arg "BASE=$base" \
        -t "fedpers-$image:1.42" . >/dev/null
    echo "built fedpers-$image:1.42 in $(( $(date +%s) - s )) s"
done
s=$(date +%s)  # under emulation: pip installs the wheels in arm64 Python
if [[ -z "$arm64" ]]; then
    if DOCKER_BUILDKIT=1 $DOCKER build -q --platform linux/arm64 -f docker/Dockerfile.device \
        --build-arg "BASE=$base_arm64" --build-arg WHEELS=device-arm64 \
        -t fedpers-device:1.42-arm64 . >"$work/arm64.log" 2>&1; then
        echo "built fedpers-device:1.42-arm64 in $(( $(date +%s) - s )) s"
    else
        arm64="the arm64 device image did not build: $(tail -1 "$work/arm64.log")"
    fi
fi
if [[ -n "$arm64" ]]; then
    echo "arm64: $arm64"
    $DOCKER image rm -f fedpers-device:1.42-arm64 >/dev/null 2>&1 || true  # not a stale one
    printf '%s' "$arm64" > "$work/arm64.txt"
fi
t3=$(date +%s)

FEDPERS_DEPLOY_SUMMARY="$summary" $PY -m pytest -p no:cacheprovider -m docker \
    tests/deployment/test_docker.py -v -rA 2>&1 | tee "$work/pytest.log" || status=$?
t4=$(date +%s)

echo
echo "== deploy-test summary =="
cat "$work/network.log" "$work/pytest.log" > "$work/all.log"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$work/all.log" | sed 's/^/  /' || true
grep -E "[0-9]+ (passed|failed|skipped)" "$work/all.log" | sed 's/^=* *//; s/ =*$//' \
    | paste -sd ';' > "$work/tests.txt" || true
# image_bytes: one name per image, a size per architecture
for name in "$base" fedpers-server:1.42 fedpers-device:1.42 "$base_arm64" \
    fedpers-device:1.42-arm64; do
    $DOCKER image inspect -f "${name%-arm64} {{.Architecture}} {{.Size}}" "$name" \
        >> "$work/images.txt" 2>/dev/null || true
done
printf '%s %s\n' wheelhouse $(( t2 - t1 )) images $(( t3 - t2 )) docker-tests $(( t4 - t3 )) \
    total $(( t4 - t0 )) >> "$work/stages.txt"
echo "  seconds: installs $(( t_net - t0 )), network $(( t_network - t_net )), base $(( t1 - t_network )), wheelhouse $(( t2 - t1 )), image builds $(( t3 - t2 )), docker tests $(( t4 - t3 )), total $(( t4 - t0 ))"
echo "  (the summary and whether the host was left as found follow the daemon's stop)"
