"""docker/hoststate.py puts the host back as a Docker daemon found it, on both kinds of
machine: one where no iptables table existed (a fresh machine: restoring the saved rules
restores nothing, and flushing left Docker's FORWARD DROP in place before) and one with
rules and policies of its own. Each case runs in a fresh network namespace, which has its
own firewall, forwarding sysctls and links, and makes the changes dockerd makes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deployment.cluster import PROJECT

pytestmark = [pytest.mark.netns, pytest.mark.xdist_group("netns")]
SCRIPT = PROJECT / "docker" / "hoststate.py"
# What dockerd 20.10 does to a host's network on start (seen with iptables-save here).
DOCKERD = [
    "iptables -N DOCKER",
    "iptables -N DOCKER-USER",
    "iptables -N DOCKER-ISOLATION-STAGE-1",
    "iptables -P FORWARD DROP",
    "iptables -A FORWARD -j DOCKER-USER",
    "iptables -A FORWARD -j DOCKER-ISOLATION-STAGE-1",
    "iptables -t nat -N DOCKER",
    "iptables -t nat -A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER",
    "iptables -t nat -A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE",
    "sysctl -qw net.ipv4.ip_forward=1",
    "ip link add docker0 type bridge",
    "ip link add br-0123456789ab type bridge",
]
OWN_RULES = ["iptables -A INPUT -s 10.9.9.9 -j DROP", "iptables -P OUTPUT DROP"]


@pytest.fixture
def namespace() -> Iterator[str]:
    if os.geteuid() != 0 or shutil.which("iptables") is None:
        pytest.skip("needs root and iptables (make test runs it as root)")
    name = f"fphs{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _in(namespace: str, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", namespace, "sh", "-c", command],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def _state(namespace: str, action: str, folder: Path) -> subprocess.CompletedProcess[str]:
    return _in(namespace, f"{sys.executable} {SCRIPT} {action} {folder}")


@pytest.mark.parametrize("machine", ["fresh", "with-rules"])
def test_restore_leaves_the_host_as_found(namespace: str, machine: str, tmp_path: Path) -> None:
    # a new namespace may inherit forwarding from the host (on where a dockerd runs)
    assert _in(namespace, "sysctl -qw net.ipv4.ip_forward=0").returncode == 0
    for command in OWN_RULES if machine == "with-rules" else []:
        assert _in(namespace, command).returncode == 0
    found = _in(namespace, "iptables-save").stdout
    assert (machine == "fresh") == ("*filter" not in found)  # the two kinds of machine
    assert _state(namespace, "save", tmp_path).returncode == 0
    for command in DOCKERD:
        assert _in(namespace, command).returncode == 0, command
    changed = _state(namespace, "compare", tmp_path)
    assert changed.returncode == 1  # the comparison sees what dockerd did ...
    for seen in ("iptables rules differ", "sysctls", "links", "docker0", "FORWARD DROP"):
        assert seen in changed.stderr
    restored = _state(namespace, "restore", tmp_path)
    assert restored.returncode == 0, restored.stderr
    same = _state(namespace, "compare", tmp_path)
    assert same.returncode == 0, same.stderr  # ... and none of it after restore
    assert _in(namespace, "iptables -S FORWARD").stdout.splitlines()[0] == "-P FORWARD ACCEPT"
    assert _in(namespace, "sysctl -n net.ipv4.ip_forward").stdout.strip() == "0"
    assert "docker0" not in _in(namespace, "ip -o link").stdout
    if machine == "fresh":  # no table is left behind, not even an empty one
        assert _in(namespace, "iptables-save").stdout.strip() == ""
    else:
        rules = _in(namespace, "iptables -S").stdout
        assert "-P OUTPUT DROP" in rules
        assert "-A INPUT -s 10.9.9.9/32 -j DROP" in rules
        assert "DOCKER" not in rules


def test_restore_needs_a_saved_state(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "restore", str(tmp_path / "never-saved")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "hoststate.json is missing" in done.stderr
    assert "save" in done.stderr


# An extension handler no file here has: harmless while it lives (binfmt handlers are the
# kernel's, not a namespace's), and the case's own restore removes it.
HANDLER = ":fedpers-hoststate-test:E::fedpershoststatetest::/bin/false:"


@pytest.mark.parametrize("mounted", [False, True], ids=["unmounted", "mounted"])
def test_restore_removes_binfmt_handlers_and_the_mount(mounted: bool, tmp_path: Path) -> None:
    """What emulated images need (docker/emulation.sh: binfmt_misc mounted, a handler
    registered) is undone: the handler goes, and the mount where there was none. In a
    private mount namespace, so that the host's own binfmt_misc mount is not touched."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (make test runs it as root)")
    if "binfmt_misc" not in Path("/proc/filesystems").read_text():
        pytest.skip("this kernel has no binfmt_misc")
    binfmt, state = "/proc/sys/fs/binfmt_misc", f"{sys.executable} {SCRIPT}"
    script = f"""
        mountpoint -q {binfmt} || mount -t binfmt_misc binfmt_misc {binfmt}
        echo -1 > {binfmt}/fedpers-hoststate-test 2>/dev/null  # left by a killed run
        umount {binfmt} 2>/dev/null || true
        {f"mount -t binfmt_misc binfmt_misc {binfmt}" if mounted else ""}
        {state} save {tmp_path} || exit 11
        mountpoint -q {binfmt} || mount -t binfmt_misc binfmt_misc {binfmt}
        echo '{HANDLER}' > {binfmt}/register || exit 12
        {state} compare {tmp_path} 2> {tmp_path}/changed && exit 13
        {state} restore {tmp_path} || exit 14
        {state} compare {tmp_path} || exit 15
        mountpoint -q {binfmt} && echo mounted-after
        mountpoint -q {binfmt} || mount -t binfmt_misc binfmt_misc {binfmt}
        test -e {binfmt}/fedpers-hoststate-test && echo -1 > {binfmt}/fedpers-hoststate-test \
            && exit 16
        exit 0
    """
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr)
    changed = (tmp_path / "changed").read_text()
    assert "binfmt" in changed
    assert "fedpers-hoststate-test" in changed
    assert ("mounted-after" in done.stdout) == mounted
