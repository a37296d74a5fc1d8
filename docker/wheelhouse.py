"""Fill the images' wheelhouses on the host, so that both images build offline.

    python docker/wheelhouse.py [--only server|device] [--torch cpu|cuda] [--arch arm64]

Downloads the pinned versions of ``constraints.txt`` into ``docker/wheelhouse/server`` and
``docker/wheelhouse/device`` and writes ``requirements.lock`` beside them: every wheel as
``name==version --hash=sha256:...``, so the images install with ``pip --require-hashes
--no-index`` exactly what was downloaded here (pip checked the index's hashes while
downloading).

The device's torch is the CPU build by default (``--torch cpu``, an image of 1.66 GB):
torch's CPU wheel index (download.pytorch.org/whl/cpu) where it answers, else a CPU wheel
for this Python in one of pip's find-links folders (``pip config``, ``PIP_FIND_LINKS``;
this machine keeps torch 2.13.0+cpu there, offline), which may be another version than
``constraints.txt`` pins: the lock says which. ``--torch cuda`` fills
``docker/wheelhouse/device-cuda`` with the pinned CUDA build instead (about 3 GB of wheels
with its NVIDIA libraries, a 6.8 GB image), for ``docker build --build-arg
WHEELS=device-cuda``. ``--arch arm64`` fills ``docker/wheelhouse/device-arm64`` for the
arm64 device image (Raspberry Pi class), from any host: aarch64 wheels for Python 3.11
(Debian bookworm's), binary only, with ``ARM64_TORCH``, the newest torch whose aarch64
wheel on PyPI is a CPU build (from 2.11 on it is a CUDA build of 420 MB and more, which
needs NVIDIA's libraries to import). Existing wheels are kept, so a second call only
downloads what changed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
HOUSE = Path(__file__).resolve().parent / "wheelhouse"
TORCH = "torch==2.14.1"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SERVER = ["flwr==1.42.0", "numpy", "scipy", "scikit-learn", "matplotlib"]
DEVICE = ["flwr==1.42.0", "flwr-datasets", "mnist1d", "numpy", "scipy", "scikit-learn"]
# torch 2.10.0's aarch64 wheel: 146 MB, libtorch_cpu with OpenBLAS and Arm Compute Library
ARM64_TORCH = "torch==2.10.0"
# what the arm64 image's Python (bookworm: CPython 3.11, glibc 2.36) installs
ARM64_TAGS = [
    *(x for v in range(36, 16, -1) for x in ("--platform", f"manylinux_2_{v}_aarch64")),
    *("--platform", "manylinux2014_aarch64", "--python-version", "3.11", "--implementation", "cp"),
    *("--abi", "cp311", "--abi", "abi3", "--abi", "none", "--only-binary=:all:"),
]
# wheels whose shared libraries keep their static symbol tables (torch's libtorch_cpu.so:
# 89 MB of 434 MB); the device images take them stripped
STRIPPED = ("torch", "pyarrow")
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-.*\.whl$")


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    return subprocess.run([*command, *args], capture_output=True, text=True, check=False)


def _strip_program(machine: str) -> str | None:
    """binutils' strip for ``machine``'s ELF files (binutils-aarch64-linux-gnu for
    aarch64 on another machine), or None where it is not installed."""
    native = platform.machine() == machine
    return shutil.which("strip" if native else f"{machine}-linux-gnu-strip")


def strip_wheel(wheel: Path, strip: str) -> int:
    """Repack ``wheel`` with the static symbol tables and debug sections of its shared
    libraries removed (``strip --strip-unneeded``: code, data and the dynamic symbols
    that the loader needs stay as they are), RECORD updated. Deterministic: the same
    wheel gives the same bytes, and a stripped wheel is left as it is. Returns the bytes
    saved."""
    with zipfile.ZipFile(wheel) as archive:
        members = [(info, archive.read(info)) for info in archive.infolist()]
    changed: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for info, data in members:
            if not re.search(r"\.so(\.[\d.]+)?$", info.filename) or data[:4] != b"\x7fELF":
                continue
            path = Path(scratch) / "lib.so"
            path.write_bytes(data)
            subprocess.run([strip, "--strip-unneeded", str(path)], check=True)
            if len(stripped := path.read_bytes()) < len(data):
                changed[info.filename] = stripped
    if not changed:
        return 0
    saved = sum(len(d) for i, d in members if i.filename in changed)
    saved -= sum(len(d) for d in changed.values())
    record, listing = next(
        (i.filename, d) for i, d in members if i.filename.endswith(".dist-info/RECORD")
    )
    rows = []
    for line in listing.decode().splitlines():
        name = line.split(",")[0]
        if name in changed:
            digest = base64.urlsafe_b64encode(hashlib.sha256(changed[name]).digest())
            line = f"{name},sha256={digest.rstrip(b'=').decode()},{len(changed[name])}"
        rows.append(line)
    changed[record] = ("\n".join(rows) + "\n").encode()
    part = wheel.with_suffix(".part")
    with zipfile.ZipFile(part, "w") as archive:
        for info, data in members:
            archive.writestr(
                info, changed.get(info.filename, data), compress_type=info.compress_type
            )
    part.replace(wheel)
    return saved


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


def _without_torch(constraints: Path, scratch: str) -> Path:
    """``constraints`` without its torch and torchvision pins."""
    unpinned = Path(scratch) / "constraints.txt"
    unpinned.write_text(
        "".join(
            line
            for line in constraints.read_text().splitlines(keepends=True)
            if not re.match(r"torch(vision)?==", line)
        )
    )
    return unpinned


def cuda_libraries(wheel: Path) -> list[str]:
    """The CUDA libraries of torch a wheel holds (none in a CPU build)."""
    with zipfile.ZipFile(wheel) as archive:
        return [n for n in archive.namelist() if re.search(r"/libtorch_cuda[^/]*\.so", n)]


def arm64_requirements(wheel: Path) -> list[str]:
    """What a wheel requires on the arm64 image (pip judges markers by the host's machine)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    target = {"platform_machine": "aarch64", "platform_system": "Linux",
              "sys_platform": "linux", "python_version": "3.11", "extra": ""}  # fmt: skip
    found = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist: "):
            requirement = Requirement(line.removeprefix("Requires-Dist: "))
            if requirement.marker is None or requirement.marker.evaluate(target):
                found.append(f"{requirement.name}{requirement.specifier}")
    return found


def _arm64_torch(folder: Path) -> list[str]:
    """Download ARM64_TORCH alone; what it requires on arm64."""
    result = _pip("--no-deps", *ARM64_TAGS, "-d", str(folder), ARM64_TORCH)
    wheels = list(folder.glob(f"torch-{ARM64_TORCH.split('==')[1]}-*aarch64.whl"))
    if result.returncode != 0 or not wheels:
        raise SystemExit(f"pip download {ARM64_TORCH} for aarch64 failed:\n{result.stderr[-3000:]}")
    return arm64_requirements(wheels[0])


def fill(role: str, torch: str = "cpu", arch: str = "amd64") -> Path:
    """Download the wheels of ``role`` (server or device) for ``arch`` and lock them."""
    if arch == "arm64" and (role, torch) != ("device", "cpu"):
        raise SystemExit("--arch arm64 fills the device wheelhouse with torch's CPU build only")
    # server, device (amd64, torch's CPU build), device-cuda, device-arm64
    folder = HOUSE / (
        role if role == "server" else {"cuda": "device-cuda"}.get(torch, f"device-{arch}")
    ).removesuffix("-amd64")
    folder.mkdir(parents=True, exist_ok=True)
    constraints = ROOT / "constraints.txt"
    packages = list(SERVER if role == "server" else DEVICE)
    with tempfile.TemporaryDirectory() as scratch:
        if arch == "arm64":
            sys.stdout.write(f"torch: {ARM64_TORCH} for aarch64, from the package index\n")
            packages += [*_arm64_torch(folder), *ARM64_TAGS]
            constraints = _without_torch(constraints, scratch)
        elif role == "device" and torch == "cpu":
            extra, source = _cpu_torch(folder)
            sys.stdout.write(f"torch: the CPU build, from {source}\n")
            packages += extra
            # the CPU wheel may be another version than constraints.txt pins
            constraints = _without_torch(constraints, scratch)
        elif role == "device":
            sys.stdout.write("torch: the pinned CUDA build of constraints.txt\n")
            packages.append(TORCH)
        result = _pip("-c", str(constraints), "-d", str(folder), *packages)
    if result.returncode != 0:
        raise SystemExit(f"pip download for the {role} image failed:\n{result.stderr[-3000:]}")
    for wheel in folder.glob("torch-*.whl") if torch == "cpu" else []:
        if cuda_libraries(wheel):
            raise SystemExit(
                f"{wheel.name} is a CUDA build ({', '.join(cuda_libraries(wheel)[:3])}): "
                f"remove it and name a CPU build (ARM64_TORCH in {Path(__file__).name})"
            )
    if role == "device" and torch == "cpu":
        _strip(folder, "aarch64" if arch == "arm64" else "x86_64")
    path = lock(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.whl")) / 2**20
    sys.stdout.write(
        f"{folder.name}: {len(path.read_text().splitlines())} wheels, {size:.0f} MiB\n"
    )
    return path


def _strip(folder: Path, machine: str) -> None:
    """Strip the shared libraries of STRIPPED's wheels in ``folder`` (a device image
    needs no static symbols: torch 94 MiB and pyarrow 34 MiB less on amd64)."""
    strip = _strip_program(machine)
    if strip is None:
        package = "binutils" if platform.machine() == machine else f"binutils-{machine}-linux-gnu"
        sys.stdout.write(f"not stripping the libraries: no strip for {machine} ({package})\n")
        return
    for wheel in sorted(w for name in STRIPPED for w in folder.glob(f"{name}-*.whl")):
        saved = strip_wheel(wheel, strip)
        sys.stdout.write(f"{wheel.name}: libraries stripped, {saved / 2**20:.0f} MiB less\n")


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["server", "device"])
    parser.add_argument(
        "--torch", choices=["cpu", "cuda"], default="cpu",
        help="the device's torch: the CPU build (default) or the pinned CUDA build",
    )  # fmt: skip
    parser.add_argument(
        "--arch", choices=["amd64", "arm64"], default="amd64",
        help="arm64: the device wheelhouse for the arm64 image (device-arm64), from any host",
    )  # fmt: skip
    args = parser.parse_args(argv)
    default = ["device"] if args.arch == "arm64" else ["server", "device"]
    for role in [args.only] if args.only else default:
        fill(role, args.torch, args.arch)


if __name__ == "__main__":
    main()
