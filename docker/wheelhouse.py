"""Fill the images' wheelhouses on the host, so that both images build offline.

    python docker/wheelhouse.py [--only server|device] [--torch cpu|cuda]

Downloads the pinned versions of ``constraints.txt`` into ``docker/wheelhouse/server`` and
``docker/wheelhouse/device`` and writes ``requirements.lock`` beside them: every wheel as
``name==version --hash=sha256:...``, so the images install with ``pip --require-hashes
--no-index`` exactly what was downloaded here (pip checked the index's hashes while
downloading).

The device's torch is the CPU build by default (``--torch cpu``, an image of about 1.2 GB):
torch's CPU wheel index (download.pytorch.org/whl/cpu) where it answers, else a CPU wheel
for this Python in one of pip's find-links folders (``pip config``, ``PIP_FIND_LINKS``;
this machine keeps torch 2.13.0+cpu there, offline), which may be another version than
``constraints.txt`` pins: the lock says which. ``--torch cuda`` fills
``docker/wheelhouse/device-cuda`` with the pinned CUDA build instead (about 3 GB of wheels
with its NVIDIA libraries, a 6.8 GB image), for ``docker build --build-arg
WHEELS=device-cuda``. Existing wheels are kept, so a second call only downloads what
changed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOUSE = Path(__file__).resolve().parent / "wheelhouse"
TORCH = "torch==2.14.1"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SERVER = ["flwr==1.42.0", "numpy", "scipy", "scikit-learn", "matplotlib"]
DEVICE = ["flwr==1.42.0", "flwr-datasets", "mnist1d", "numpy", "scipy", "scikit-learn"]
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-.*\.whl$")


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    return subprocess.run([*command, *args], capture_output=True, text=True, check=False)


def lock(folder: Path) -> Path:
    """Write ``folder/requirements.lock``: every wheel pinned, with its sha256."""
    lines = []
    for wheel in sorted(folder.glob("*.whl")):
        found = WHEEL.match(wheel.name)
        if found is None:
            raise SystemExit(f"cannot read a name and version from {wheel.name}")
        with wheel.open("rb") as handle:  # streamed: the torch and CUDA wheels are ~1 GB each
            digest = hashlib.file_digest(handle, "sha256").hexdigest()
        name = found["name"].replace("_", "-").lower()
        lines.append(f"{name}=={found['version']} --hash=sha256:{digest}")
    if not lines:
        raise SystemExit(f"{folder} holds no wheels")
    names = [line.split("==")[0] for line in lines]
    doubles = sorted({n for n in names if names.count(n) > 1})
    if doubles:
        raise SystemExit(
            f"{folder} holds two versions of {', '.join(doubles)}: remove the folder and rerun"
        )
    path = folder / "requirements.lock"
    path.write_text("\n".join(lines) + "\n")
    return path


def find_links() -> list[Path]:
    """pip's local find-links folders: ``PIP_FIND_LINKS`` and ``pip config``'s ``find-links``."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    )
    for line in listed.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            found += value.strip().strip("'\"").split()
    local = [p.removeprefix("file://") for p in found if p.startswith(("/", "file://"))]
    return [Path(p) for p in dict.fromkeys(local)]


def _version(wheel: Path) -> tuple[int, ...]:
    """torch-2.13.0+cpu-...whl -> (2, 13, 0)"""
    return tuple(int(x) for x in re.findall(r"\d+", wheel.name.split("-")[1].split("+")[0]))


def local_cpu_torch(folders: list[Path]) -> Path | None:
    """The newest torch CPU wheel for this interpreter and machine in ``folders``."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = sysconfig.get_platform().split("-")[-1]
    wheels = [
        wheel
        for folder in folders
        if folder.is_dir()
        for wheel in folder.glob(f"torch-*+cpu-{tag}-{tag}-*{machine}.whl")
    ]
    return max(wheels, key=_version, default=None)


def _cpu_torch(folder: Path) -> tuple[list[str], str]:
    """What pip download needs for the CPU torch (arguments) and where it came from."""
    # --isolated: only that index (a pip configuration may add find-links of its own)
    cpu = _pip("--isolated", "--timeout", "10", "--retries", "0", "--no-deps",
               "--index-url", CPU_INDEX, "-d", str(folder), f"{TORCH}+cpu")  # fmt: skip
    if cpu.returncode == 0 and list(folder.glob("torch-*+cpu-*.whl")):
        return ["--find-links", str(folder), f"{TORCH}+cpu"], "download.pytorch.org"
    local = local_cpu_torch(find_links())
    if local is not None:
        return [str(local)], str(local)
    raise SystemExit(
        f"no CPU build of torch: {CPU_INDEX} does not answer and no torch-*+cpu wheel for "
        "this Python is in pip's find-links folders. Put one there (pip download "
        f"--index-url {CPU_INDEX} torch on a connected machine), or fill the CUDA "
        "wheelhouse with --torch cuda and build with --build-arg WHEELS=device-cuda"
    )


def fill(role: str, torch: str = "cpu") -> Path:
    """Download the wheels of ``role`` (server or device) and lock them."""
    folder = HOUSE / (role if role == "server" or torch == "cpu" else f"{role}-{torch}")
    folder.mkdir(parents=True, exist_ok=True)
    constraints = ROOT / "constraints.txt"
    packages = list(SERVER if role == "server" else DEVICE)
    with tempfile.TemporaryDirectory() as scratch:
        if role == "device" and torch == "cpu":
            extra, source = _cpu_torch(folder)
            sys.stdout.write(f"torch: the CPU build, from {source}\n")
            packages += extra
            # the CPU wheel may be another version than constraints.txt pins
            unpinned = Path(scratch) / "constraints.txt"
            unpinned.write_text(
                "".join(
                    line
                    for line in constraints.read_text().splitlines(keepends=True)
                    if not re.match(r"torch(vision)?==", line)
                )
            )
            constraints = unpinned
        elif role == "device":
            sys.stdout.write("torch: the pinned CUDA build of constraints.txt\n")
            packages.append(TORCH)
        result = _pip("-c", str(constraints), "-d", str(folder), *packages)
    if result.returncode != 0:
        raise SystemExit(f"pip download for the {role} image failed:\n{result.stderr[-3000:]}")
    path = lock(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.whl")) / 2**20
    sys.stdout.write(
        f"{folder.name}: {len(path.read_text().splitlines())} wheels, {size:.0f} MiB\n"
    )
    return path


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["server", "device"])
    parser.add_argument(
        "--torch", choices=["cpu", "cuda"], default="cpu",
        help="the device's torch: the CPU build (default) or the pinned CUDA build",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for role in [args.only] if args.only else ["server", "device"]:
        fill(role, args.torch)


if __name__ == "__main__":
    main()
