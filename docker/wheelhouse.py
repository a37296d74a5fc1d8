"""Fill the images' wheelhouses on the host, so that both images build offline.

    python docker/wheelhouse.py [--only server|device]

Downloads the pinned versions of ``constraints.txt`` into ``docker/wheelhouse/server`` and
``docker/wheelhouse/device`` and writes ``requirements.lock`` beside them: every wheel as
``name==version --hash=sha256:...``, so the images install with ``pip --require-hashes
--no-index`` exactly what was downloaded here (pip checked the index's hashes while
downloading). The device's torch is the CPU build (download.pytorch.org/whl/cpu) where
that index answers, else the pinned build of ``constraints.txt`` (a CUDA build, which
also runs on the CPU, about 3 GB of wheels with its NVIDIA libraries). Existing wheels
are kept, so a second call only downloads what changed.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
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


def fill(role: str) -> Path:
    """Download the wheels of ``role`` (server or device) and lock them."""
    folder = HOUSE / role
    folder.mkdir(parents=True, exist_ok=True)
    constraints = ["-c", str(ROOT / "constraints.txt")]
    packages = list(SERVER if role == "server" else DEVICE)
    if role == "device":
        # --isolated: only that index (a pip configuration may add find-links of its own)
        cpu = _pip("--isolated", "--timeout", "10", "--retries", "0", "--no-deps",
                   "--index-url", CPU_INDEX, "-d", str(folder), f"{TORCH}+cpu")  # fmt: skip
        if cpu.returncode == 0 and list(folder.glob("torch-*+cpu-*.whl")):
            sys.stdout.write("torch: the CPU build from download.pytorch.org\n")
            packages += ["--find-links", str(folder), f"{TORCH}+cpu"]
        else:
            sys.stdout.write("torch: CPU index unreachable; the pinned build of constraints.txt\n")
            packages.append(TORCH)
    result = _pip(*constraints, "-d", str(folder), *packages)
    if result.returncode != 0:
        raise SystemExit(f"pip download for the {role} image failed:\n{result.stderr[-3000:]}")
    path = lock(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.whl")) / 2**20
    sys.stdout.write(f"{role}: {len(path.read_text().splitlines())} wheels, {size:.0f} MiB\n")
    return path


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["server", "device"])
    args = parser.parse_args(argv)
    for role in [args.only] if args.only else ["server", "device"]:
        fill(role)


if __name__ == "__main__":
    main()
