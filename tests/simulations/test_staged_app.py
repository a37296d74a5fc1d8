"""``staged_app``: the copy of the app that ``flwr run`` bundles is the bundle Flower
builds from the checkout itself, byte for byte (Flower's own builder on both). For this
checkout the two bundles had the same hash (fedpers.fedpers.0-1-0.642342a1.fab, 66
files) when the copy was introduced; building from the checkout walks its .venv (12 s),
so that is not repeated here."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from fedpers.simulations.launch import staged_app

# Flower's builder matches with pathspec's deprecated 'gitwildmatch' (one warning a file).
pytestmark = pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")

PYPROJECT = """[project]
name = "tiny"
version = "1.0.0"

[tool.flwr.app]
publisher = "me"
fab-include = ["pkg/**/*.py", "conf/*.toml", "*.md"]

[tool.flwr.app.components]
serverapp = "pkg.server:app"
clientapp = "pkg.client:app"
"""


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_copy_bundles_as_the_project_does(tmp_path: Path) -> None:
    project = tmp_path / "project"
    _write(
        project,
        {
            "pyproject.toml": PYPROJECT,
            ".gitignore": "/build/\npkg/secret.py\n",
            "pkg/__init__.py": "",
            "pkg/server.py": "app = 1\n",
            "pkg/deep/er/client.py": "app = 2\n",
            "pkg/secret.py": "ignored by .gitignore\n",
            "pkg/__pycache__/server.py": "Flower leaves caches out\n",
            "conf/a.toml": "x = 1\n",
            "conf/nested/b.toml": "not matched by conf/*.toml\n",
            "README.md": "# matched by *.md at any depth\n",
            "docs/guide.md": "also matched\n",
            ".venv/lib/site.py": "never entered\n",
            "build/lib/pkg/server.py": "ignored folder\n",
            "tests/test_x.py": "not included\n",
        },
    )
    staged = staged_app(project, tmp_path / "staged")
    assert build_fab_from_disk(staged) == build_fab_from_disk(project)
    copied = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    assert ".venv/lib/site.py" not in copied
    assert "build/lib/pkg/server.py" not in copied
    assert {"pkg/deep/er/client.py", "docs/guide.md", "conf/a.toml"} <= set(copied)
    # staged again over an older copy: nothing of the old one is left
    (project / "pkg" / "server.py").unlink()
    staged = staged_app(project, tmp_path / "staged")
    assert not (staged / "pkg" / "server.py").exists()
