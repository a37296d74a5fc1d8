"""docker/wheelhouse.py's choices for the arm64 image, without a network: which of a
wheel's requirements hold on arm64 (pip judges markers by the host's machine, so the
script reads them itself), and whether a torch wheel is a CUDA build."""

from __future__ import annotations

import base64
import ctypes
import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch

from tests.deployment.cluster import load_script

wheelhouse = load_script("wheelhouse")

# Requires-Dist lines of the kinds torch 2.10.0's aarch64 wheel has (its METADATA)
TORCH_METADATA = """\
Metadata-Version: 2.4
Name: torch
Version: 2.10.0
Requires-Dist: filelock
Requires-Dist: typing-extensions>=4.10.0
Requires-Dist: setuptools; python_version >= "3.12"
Requires-Dist: sympy>=1.13.3
Requires-Dist: networkx>=2.5.1
Requires-Dist: jinja2
Requires-Dist: fsspec>=0.8.5
Requires-Dist: cuda-bindings==12.9.4; platform_system == "Linux" and platform_machine == "x86_64"
Requires-Dist: nvidia-cudnn-cu12==9.10.2.21; platform_machine == "x86_64"
Requires-Dist: triton==3.6.0; platform_system == "Linux" and platform_machine == "x86_64"
Requires-Dist: armonly>=1; platform_machine == "aarch64"
Requires-Dist: optree>=0.13.0; extra == "optree"
"""


def _wheel(folder: Path, name: str, files: dict[str, str]) -> Path:
    path = folder / name
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def test_arm64_requirements_are_judged_for_aarch64_and_python_3_11(tmp_path: Path) -> None:
    wheel = _wheel(
        tmp_path,
        "torch-2.10.0-cp311-cp311-manylinux_2_28_aarch64.whl",
        {"torch-2.10.0.dist-info/METADATA": TORCH_METADATA},
    )
    assert wheelhouse.arm64_requirements(wheel) == [
        "filelock",
        "typing-extensions>=4.10.0",
        "sympy>=1.13.3",
        "networkx>=2.5.1",
        "jinja2",
        "fsspec>=0.8.5",
        "armonly>=1",
    ]


def test_a_torch_wheel_with_cuda_libraries_is_told_apart(tmp_path: Path) -> None:
    cpu = _wheel(tmp_path, "cpu.whl", {"torch/lib/libtorch_cpu.so": "", "torch/lib/libc10.so": ""})
    cuda = _wheel(
        tmp_path,
        "cuda.whl",
        {
            "torch/lib/libtorch_cpu.so": "",
            "torch/lib/libtorch_cuda.so": "",
            "x/libtorch_cuda_linalg.so": "",
        },
    )
    assert wheelhouse.cuda_libraries(cpu) == []
    assert wheelhouse.cuda_libraries(cuda) == [
        "torch/lib/libtorch_cuda.so",
        "x/libtorch_cuda_linalg.so",
    ]


def test_the_arm64_tags_are_those_of_bookworms_python() -> None:
    tags = wheelhouse.ARM64_TAGS
    platforms = [tags[i + 1] for i, t in enumerate(tags) if t == "--platform"]
    # glibc 2.36 (bookworm) runs every manylinux_2_X up to 2_36, and manylinux2014 (2_17)
    assert "manylinux_2_36_aarch64" in platforms
    assert "manylinux_2_17_aarch64" in platforms
    assert "manylinux2014_aarch64" in platforms
    assert all(p.endswith("aarch64") for p in platforms)
    assert "manylinux_2_37_aarch64" not in platforms
    assert tags[tags.index("--python-version") + 1] == "3.11"
    assert "--only-binary=:all:" in tags


@pytest.mark.parametrize(("role", "torch"), [("server", "cpu"), ("device", "cuda")])
def test_arm64_is_the_cpu_device_image_only(role: str, torch: str) -> None:
    with pytest.raises(SystemExit, match="arm64 fills the device wheelhouse"):
        wheelhouse.fill(role, torch, "arm64")


def _record_is_true(wheel: Path) -> None:
    """Every RECORD line with a hash names a member of that sha256 and size."""
    with zipfile.ZipFile(wheel) as archive:
        record = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        for line in archive.read(record).decode().splitlines():
            name, digest, size = line.rsplit(",", 2)
            if digest:
                data = archive.read(name)
                expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                assert digest == f"sha256={expected.decode()}", name
                assert int(size) == len(data), name


def _dynamic_symbols(library: bytes, folder: Path) -> str:
    path = folder / "symbols.so"
    path.write_bytes(library)
    listed = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    )
    return listed.stdout


def test_strip_wheel_keeps_what_the_loader_needs(tmp_path: Path) -> None:
    """A real unstripped library (torch's libc10.so, from this venv) in a wheel: smaller
    after, the same dynamic symbols, loadable, RECORD true; the rest unchanged; a second
    pass changes no byte."""
    strip = shutil.which("strip")
    if strip is None or shutil.which("nm") is None:
        pytest.skip("binutils is not installed")
    library = Path(torch.__file__).parent / "lib" / "libc10.so"
    original = library.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(original).digest()).rstrip(b"=")
    record = f"fake/lib/libc10.so,sha256={digest.decode()},{len(original)}\nfake/a.py,,\n"
    wheel = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake/lib/libc10.so", original)
        archive.writestr("fake/a.py", "x = 1\n")
        archive.writestr("fake-1.0.dist-info/RECORD", record + "fake-1.0.dist-info/RECORD,,\n")
    _record_is_true(wheel)
    saved = wheelhouse.strip_wheel(wheel, strip)
    with zipfile.ZipFile(wheel) as archive:
        stripped = archive.read("fake/lib/libc10.so")
        assert archive.read("fake/a.py") == b"x = 1\n"
    assert saved == len(original) - len(stripped) > 0
    assert _dynamic_symbols(stripped, tmp_path) == _dynamic_symbols(original, tmp_path)
    _record_is_true(wheel)
    loaded = tmp_path / "load" / "libc10.so"
    loaded.parent.mkdir()
    loaded.write_bytes(stripped)
    ctypes.CDLL(str(loaded))  # the dynamic loader takes it
    before = wheel.read_bytes()
    assert wheelhouse.strip_wheel(wheel, strip) == 0
    assert wheel.read_bytes() == before
