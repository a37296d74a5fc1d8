#!/usr/bin/env bash
# arm64 images on an amd64 machine, under emulation (qemu-user-static, Debian's package):
#     docker/emulation.sh register   # mounts binfmt_misc where it is not, registers qemu-aarch64
#     docker/emulation.sh remove     # unregisters the handler (binfmt_misc stays mounted)
# The handler is registered with Debian's flags OPF: F opens the interpreter now, so that
# containers, which do not see the host's /usr/libexec, can use it. make deploy-test
# undoes both (docker/hoststate.py restore removes handlers and the mount it did not find).
set -euo pipefail
binfmt=/proc/sys/fs/binfmt_misc
case "${1:-}" in
register)
    [[ -f /usr/lib/binfmt.d/qemu-aarch64.conf ]] || {
        echo "no qemu-aarch64 handler: apt-get install qemu-user-static" >&2; exit 2; }
    [[ -e $binfmt/register ]] || mount -t binfmt_misc binfmt_misc "$binfmt"
    [[ -e $binfmt/qemu-aarch64 ]] || cat /usr/lib/binfmt.d/qemu-aarch64.conf > "$binfmt/register"
    grep -q '^flags: .*F' "$binfmt/qemu-aarch64" || {
        echo "qemu-aarch64 is registered without the F flag: containers cannot use it;" \
            "run $0 remove, then $0 register" >&2; exit 2; }
    echo "qemu-aarch64 registered: $(sed -n 's/^interpreter //p' "$binfmt/qemu-aarch64")"
    ;;
remove)
    [[ -e $binfmt/qemu-aarch64 ]] && echo -1 > "$binfmt/qemu-aarch64"
    echo "qemu-aarch64 removed"
    ;;
*)
    echo "usage: $0 register|remove" >&2; exit 2
    ;;
esac
