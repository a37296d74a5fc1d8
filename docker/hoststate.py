"""What a Docker daemon changes on the host, saved before and put back after.

    python docker/hoststate.py save DIR      # before starting dockerd
    python docker/hoststate.py restore DIR   # after stopping it
    python docker/hoststate.py compare DIR   # exit 1, naming each difference

A Docker daemon started for a test changes the host beyond its own files: it creates
iptables tables and chains and sets the FORWARD policy to DROP, turns on IP forwarding
and bridge netfilter, makes the docker0 bridge and veths, mounts its data root and
network namespaces, and (for emulated images) may register binfmt_misc handlers. On a
machine where no iptables table existed before, restoring the saved rules restores
nothing, so ``restore`` deletes every table that did not exist before, rather than
flushing it (a flushed table keeps Docker's DROP policy). It then writes the saved
sysctls back, deletes the links Docker names (docker0, br-*, veth*) that were not there
before, unmounts what appeared under Docker's folders, and removes binfmt handlers that
were not registered before (docker/emulation.sh registers one for arm64 images), and
unmounts binfmt_misc where it was not mounted. ``compare`` checks the result: the
firewall's rules (without counters), the sysctls, the links, the mounts and the binfmt
handlers.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

SYSCTLS = [
    "net.ipv4.ip_forward",
    "net.ipv6.conf.all.forwarding",
    "net.bridge.bridge-nf-call-iptables",
    "net.bridge.bridge-nf-call-ip6tables",
    "net.bridge.bridge-nf-call-arptables",
]
DOCKER_LINK = re.compile(r"^(docker0|docker_gwbridge|br-[0-9a-f]{12}|veth[0-9a-f]+)$")
DOCKER_MOUNT = ("/var/lib/docker", "/run/docker", "/var/run/docker")
BINFMT = Path("/proc/sys/fs/binfmt_misc")


def _out(*command: str) -> str:
    if shutil.which(command[0]) is None:
        return ""
    done = subprocess.run(list(command), capture_output=True, text=True, check=False)
    return done.stdout


def _sysctl_path(name: str) -> Path:
    return Path("/proc/sys") / name.replace(".", "/")


def firewall() -> dict[str, str]:
    """Each iptables family's tables as iptables-save prints them, without counters."""
    saved = {}
    for family in ("iptables", "ip6tables"):
        text = _out(f"{family}-save")
        lines = [
            re.sub(r" \[\d+:\d+\]$", "", line)
            for line in text.splitlines()
            if line and not line.startswith("#")
        ]
        saved[family] = "\n".join(lines) + ("\n" if lines else "")
    return saved


def tables(saved: str) -> list[str]:
    return re.findall(r"^\*(\S+)", saved, flags=re.MULTILINE)


def binfmt_state() -> dict[str, Any]:
    """Whether binfmt_misc is mounted, and its handlers (read through a short mount if not:
    handlers are the kernel's, and outlive the mount)."""
    mounted = (BINFMT / "register").exists()
    mount = ["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)]
    if not mounted and subprocess.run(mount, capture_output=True, check=False).returncode:
        return {"mounted": False, "handlers": None}  # not root, or no binfmt_misc
    try:
        handlers = sorted(p.name for p in BINFMT.iterdir() if p.name not in ("register", "status"))
    finally:
        if not mounted:
            subprocess.run(["umount", str(BINFMT)], capture_output=True, check=False)
    return {"mounted": mounted, "handlers": handlers}


def snapshot() -> dict[str, Any]:
    """The state this module saves and compares."""
    sysctls = {
        name: _sysctl_path(name).read_text().strip()
        for name in SYSCTLS
        if _sysctl_path(name).exists()
    }
    links = sorted(
        line.split(":")[1].strip().split("@")[0] for line in _out("ip", "-o", "link").splitlines()
    )
    mounts = sorted(
        {line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()}
    )
    binfmt = binfmt_state()
    return {
        "firewall": firewall(),
        "sysctls": sysctls,
        "links": links,
        "mounts": mounts,
        "binfmt": binfmt,
    }


def save(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hoststate.json").write_text(json.dumps(snapshot(), indent=1))


def _load(folder: Path) -> dict[str, Any]:
    path = folder / "hoststate.json"
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `hoststate.py save {folder}` before the change")
    return dict(json.loads(path.read_text()))


def restore(folder: Path) -> list[str]:
    """Put back what ``save`` recorded; the steps that failed, by name."""
    before = _load(folder)
    failed = []

    def run(*command: str, stdin: str | None = None) -> None:
        done = subprocess.run(list(command), input=stdin, capture_output=True, text=True)
        if done.returncode != 0:
            failed.append(f"{' '.join(command)}: {done.stderr.strip()}")

    saved_firewall: dict[str, str] = before["firewall"]
    for family, was in saved_firewall.items():
        if shutil.which(f"{family}-restore") is None:
            continue
        current = firewall()[family]
        if was:
            run(f"{family}-restore", stdin=was)  # replaces each saved table whole
        for table in set(tables(current)) - set(tables(was)):
            # a table that did not exist: delete it (nft), else empty it and ACCEPT
            nft = "ip" if family == "iptables" else "ip6"
            if shutil.which("nft") and "nf_tables" in _out(family, "-V"):
                run("nft", "delete", "table", nft, table)
            else:
                run(family, "-t", table, "-F")
                run(family, "-t", table, "-X")
                for chain in re.findall(r"^:(\S+) (?!-)", current.split(f"*{table}")[1], re.M):
                    run(family, "-t", table, "-P", chain, "ACCEPT")
    sysctls: dict[str, str] = before["sysctls"]
    for name, value in sysctls.items():
        if _sysctl_path(name).exists() and _sysctl_path(name).read_text().strip() != value:
            try:
                _sysctl_path(name).write_text(value)
            except OSError as error:
                failed.append(f"sysctl {name}={value}: {error}")
    left = snapshot()  # after the firewall and sysctls: links, mounts, handlers left
    for link in sorted(set(left["links"]) - set(before["links"])):
        if DOCKER_LINK.match(link):
            run("ip", "link", "del", link)
    for mount in sorted(set(left["mounts"]) - set(before["mounts"]), reverse=True):
        if mount.startswith(DOCKER_MOUNT):
            run("umount", "-l", mount)
    was, now = before["binfmt"], left["binfmt"]
    added = sorted(set(now["handlers"] or []) - set(was["handlers"] or []))
    if added and not now["mounted"]:
        run("mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT))
    for entry in added:
        try:
            (BINFMT / entry).write_text("-1")  # unregisters the handler
        except OSError as error:
            failed.append(f"binfmt {entry}: {error}")
    if not was["mounted"] and (now["mounted"] or added):  # as found: not mounted
        run("umount", str(BINFMT))
    return failed


def compare(folder: Path) -> list[str]:
    """What differs from the saved state, one line each (empty: left as found)."""
    before, now = _load(folder), snapshot()
    found = []
    for family, was in before["firewall"].items():
        is_now = now["firewall"][family]
        if was != is_now:
            found.append(f"{family} rules differ:\n--- before\n{was}--- now\n{is_now}")
    for key in ("sysctls", "links", "mounts", "binfmt"):
        if before[key] != now[key]:
            found.append(f"{key}: before {before[key]}, now {now[key]}")
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["save", "restore", "compare"])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.action == "save":
        save(args.folder)
        return
    problems = restore(args.folder) if args.action == "restore" else compare(args.folder)
    for problem in problems:
        sys.stderr.write(f"{args.action}: {problem}\n")
    if args.action == "compare" and not problems:
        sys.stdout.write("the host is as it was found: firewall, sysctls, links, mounts, binfmt\n")
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
