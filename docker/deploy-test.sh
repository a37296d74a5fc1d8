#!/usr/bin/env bash
# make deploy-test: the Docker deployment for real, on a fresh Debian machine (as root).
# Installs what it needs (docker.io, docker-compose, mmdebstrap), starts a Docker daemon
# if none answers (and stops the one it started at the end), builds the base image from
# Debian's packages where Docker Hub is out of reach, fills the wheelhouse on the host,
# builds both images, runs tests/deployment/test_docker.py, and prints a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
DOCKER=/usr/bin/docker
work="$(mktemp -d /tmp/fedpers-deploy.XXXXXX)"
started_daemon=""
cleanup() {
    if [[ -n "$started_daemon" ]]; then
        kill "$started_daemon" 2>/dev/null || true
        for _ in $(seq 30); do kill -0 "$started_daemon" 2>/dev/null || break; sleep 1; done
        # dockerd leaves its chains, a DROP FORWARD policy and changed sysctls behind
        iptables-restore < "$work/iptables.before" || true
        for table in nat filter; do  # a table that was empty before: empty it again
            # and put its built-in chains' policies back to ACCEPT (a table that did not
            # exist had ACCEPT; flushing leaves Docker's FORWARD DROP in place)
            grep -q "^\*$table" "$work/iptables.before" || {
                iptables -t $table -F; iptables -t $table -X
                for chain in $(iptables -t $table -S | awk '/^-P/ {print $2}'); do
                    iptables -t $table -P "$chain" ACCEPT
                done
            } || true
        done
        sysctl -q -w "net.ipv4.ip_forward=$(cat "$work/ip_forward.before")" || true
        if [[ -s "$work/bridge_nf.before" ]]; then
            sysctl -q -w "net.bridge.bridge-nf-call-iptables=$(cat "$work/bridge_nf.before")" || true
        fi
        [[ -e "$work/docker0.before" ]] || ip link del docker0 2>/dev/null || true
        echo "stopped the Docker daemon this test started (pid $started_daemon); firewall restored"
    fi
    rm -rf "$work"
}
trap cleanup EXIT
t0=$(date +%s)

missing=()
[[ -x $DOCKER ]] || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
command -v iptables >/dev/null || missing+=(iptables)
if (( ${#missing[@]} )); then
    echo "installing ${missing[*]} from Debian's packages"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! $DOCKER info >/dev/null 2>&1; then
    iptables-save > "$work/iptables.before"
    if ip link show docker0 >/dev/null 2>&1; then touch "$work/docker0.before"; fi
    sysctl -n net.ipv4.ip_forward > "$work/ip_forward.before"
    sysctl -n net.bridge.bridge-nf-call-iptables > "$work/bridge_nf.before" 2>/dev/null || true
    dockerd --data-root /var/lib/docker-fedpers >"$work/dockerd.log" 2>&1 &
    started_daemon=$!
    for _ in $(seq 60); do $DOCKER info >/dev/null 2>&1 && break; sleep 1; done
    $DOCKER info >/dev/null 2>&1 || { cat "$work/dockerd.log"; exit 1; }
    echo "started a Docker daemon (pid $started_daemon)"
fi

base="${FEDPERS_BASE:-}"
if [[ -z "$base" ]]; then
    if timeout 60 $DOCKER pull -q python:3.11-slim >/dev/null 2>&1; then
        base=python:3.11-slim
    else
        echo "Docker Hub is out of reach: the base image comes from Debian's packages"
        base=fedpers-base:bookworm
        docker/base-image.sh "$base"
    fi
fi
t1=$(date +%s)
$PY docker/wheelhouse.py
t2=$(date +%s)
for image in server device; do
    s=$(date +%s)
    DOCKER_BUILDKIT=1 $DOCKER build -q -f "docker/Dockerfile.$image" --build-arg "BASE=$base" \
        -t "fedpers-$image:1.42" . >/dev/null
    echo "built fedpers-$image:1.42 in $(( $(date +%s) - s )) s"
done
t3=$(date +%s)

summary="$work/summary.json"
status=0
FEDPERS_DEPLOY_SUMMARY="$summary" $PY -m pytest -p no:cacheprovider -m docker \
    tests/deployment/test_docker.py -v -rA 2>&1 | tee "$work/pytest.log" || status=$?
t4=$(date +%s)

echo
echo "== deploy-test summary =="
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$work/pytest.log" | sed 's/^/  /' || true
grep -E "[0-9]+ (passed|failed)" "$work/pytest.log" | tail -1 | sed 's/^=* */  /; s/ =*$//'
for image in base server device; do
    name="fedpers-$image:1.42"; [[ $image == base ]] && name="$base"
    size=$($DOCKER image inspect -f '{{.Size}}' "$name" 2>/dev/null || echo 0)
    echo "  image $name: $(( size / 1000000 )) MB"
done
[[ -f "$summary" ]] && sed 's/^/  /' "$summary"
echo "  seconds: base+install $(( t1 - t0 )), wheelhouse $(( t2 - t1 )), image builds $(( t3 - t2 )), tests $(( t4 - t3 )), total $(( t4 - t0 ))"
exit $status
