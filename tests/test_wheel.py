"""fedpers as a library: its wheel installs one top-level name and works outside a checkout.

The wheels of fedpers (by the README's command, in a clean checkout: the tracked files
only) and of the extension example are built here (no network, no build isolation) and
installed without dependencies into a fresh venv, which borrows this
venv's packages through a path file (a wheel install of torch would copy 6 GB). Every
command then runs from a temporary folder, so nothing can come from the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

# On one xdist worker: the module's wheels and venv (12-13 s) were built on both. Not in
# `make check`: building and installing a package is no inner-loop test.
pytestmark = [pytest.mark.package, pytest.mark.xdist_group("wheel")]

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "server_momentum"
TOOLS = ("flwr", "flower-superlink", "flower-superexec", "flwr-serverapp", "flwr-clientapp",
         "flwr-simulation", "flower-supernode", "ray")  # fmt: skip


@dataclass(frozen=True)
class Installed:
    """A venv with the two wheels installed, and a folder outside the checkout."""

    python: Path
    site: Path
    cwd: Path
    built: list[str]  # what the README's command left in dist/

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = f"{self.python.parent}{os.pathsep}{env.get('PATH', '')}"
        env["FEDPERS_WORK_DIR"] = str(self.cwd / "work")
        result = subprocess.run(
            args, cwd=self.cwd, env=env, capture_output=True, text=True, timeout=600
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{args} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result


def readme_build_command() -> str:
    """The README's command that builds the wheel in a checkout (its "Install as a
    library" section), without its comment."""
    section = (ROOT / "README.md").read_text().split("## Install as a library", 1)[1]
    lines = [
        line.split("#", 1)[0].strip()
        for line in section.split("\n## ", 1)[0].splitlines()
        if line.startswith(".venv/bin/pip wheel")
    ]
    assert len(lines) == 1, lines
    return lines[0]


def clean_checkout(dest: Path) -> Path:
    """The checkout's tracked files as they are now, in ``dest`` (what a clone of this
    commit holds, with the working tree's edits: nothing untracked or ignored, no
    build/ or egg-info), with ``.venv`` linked to this venv (what `make install` makes)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    (dest / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    wheels = base / "wheels"
    # fedpers' wheel as the README builds it, in a clean checkout
    checkout = clean_checkout(base / "checkout")
    subprocess.run(["bash", "-c", readme_build_command()], cwd=checkout, check=True)
    shutil.copytree(checkout / "dist", wheels)
    built = sorted(p.name for p in wheels.iterdir())
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    example = base / "example"  # built from a copy: setuptools writes build/ beside it
    shutil.copytree(EXAMPLE, example)
    subprocess.run([*build, "-w", str(wheels), str(example)], check=True)
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip
    # The dependencies: this venv's packages, after the fresh venv's own.
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for tool in TOOLS:  # their console scripts, started by the fresh venv's python
        script = (Path(sys.executable).parent / tool).read_text().splitlines()
        target = env_dir / "bin" / tool
        target.write_text("\n".join([f"#!{python}", *script[1:]]) + "\n")
        target.chmod(0o755)
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*install, *map(str, sorted(wheels.glob("*.whl")))], check=True)
    cwd = base / "elsewhere"
    cwd.mkdir()
    return Installed(python=python, site=site, cwd=cwd, built=built)


def test_the_readmes_build_makes_the_wheel_its_install_line_names(installed: Installed) -> None:
    section = (ROOT / "README.md").read_text().split("## Install as a library", 1)[1]
    assert installed.built == ["fedpers-0.1.0-py3-none-any.whl"]
    assert f"pip install -c constraints.txt dist/{installed.built[0]}" in section


def test_the_wheel_installs_no_top_level_name_but_fedpers(installed: Installed) -> None:
    shown = installed.run(str(installed.python), "-m", "pip", "show", "-f", "fedpers").stdout
    files = [line.strip() for line in shown.split("Files:")[1].splitlines() if line.strip()]
    tops = {Path(f).parts[0] for f in files if not f.startswith("..")}
    assert tops == {"fedpers", "fedpers-0.1.0.dist-info"}, tops
    assert any(f.endswith("bin/fedpers") for f in files)  # the console command
    for package in ("strategies", "clients", "simulations"):  # under fedpers/, as files
        assert not (installed.site / package).exists()
    # every package and module of the checkout is in the wheel, where its name says
    modules = {
        f"fedpers/{p.relative_to(ROOT / 'fedpers')}" for p in (ROOT / "fedpers").rglob("*.py")
    }
    for package in ("strategies", "clients", "simulations"):
        modules |= {f"fedpers/{package}/{p.name}" for p in (ROOT / package).glob("*.py")}
    assert modules - set(files) == set()


def test_import_and_parse_a_configuration_from_elsewhere(installed: Installed) -> None:
    code = (
        "import fedpers, fedpers.strategies.server_app, fedpers.clients.client_app\n"
        "from fedpers.config import load_run_config\n"
        "run = load_run_config({'algorithm': 'fedavgm-example', 'dataset': 'blobs'})\n"
        "print(fedpers.__file__, fedpers.strategies.server_app.__file__, run.model_name)\n"
    )
    out = installed.run(str(installed.python), "-c", code).stdout.split()
    assert all(Path(path).is_relative_to(installed.site) for path in out[:2]), out
    assert out[2] == "blobs-mlp"  # the extension's model: found through its entry point


def test_check_names_a_misspelt_key(installed: Installed) -> None:
    (installed.cwd / "good.toml").write_text('algorithm = "fedavg"\nnum-rounds = 3\n')
    (installed.cwd / "bad.toml").write_text("num-round = 3\n")
    good = installed.run(str(installed.python.parent / "fedpers"), "check", "good.toml")
    assert 'algorithm = "fedavg"' in good.stdout
    bad = installed.run(str(installed.python.parent / "fedpers"), "check", "bad.toml", check=False)
    assert bad.returncode == 1
    assert "did you mean 'num-rounds'" in bad.stderr


@pytest.mark.flower
def test_fedpers_run_from_the_wheel_writes_nothing_into_the_install(installed: Installed) -> None:
    # Prepare: the extension's algorithm on its data set, one seed of a tiny run
    def listing() -> set[Path]:
        return {p for p in (installed.site / "fedpers").rglob("*") if "__pycache__" not in p.parts}

    before = listing()
    (installed.cwd / "tiny.toml").write_text(
        'algorithm = "fedavgm-example"\ndataset = "blobs"\nnum-clients = 4\n'
        "num-rounds = 2\nfraction-train = 0.5\nfinal-rounds = 1\n"
    )
    # Execute
    installed.run(str(installed.python.parent / "fedpers"), "run", "tiny.toml", "--seeds", "1",
                  "--out", "out")  # fmt: skip
    # Assert: two results directories, the summary over seeds, the install untouched
    out = installed.cwd / "out"
    for seed in (0,):
        assert (out / "runs" / f"fedavgm-example-seed{seed}" / "summary.json").is_file()
    assert "final_accuracy" in (out / "summary.json").read_text()
    assert listing() == before
    assert (installed.cwd / "work" / "app" / "pyproject.toml").is_file()  # the generated app
