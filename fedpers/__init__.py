"""fedpers: personalized federated learning on Flower.

The project keeps its server code in ``strategies/``, its device code in ``clients/`` and
its experiments in ``simulations/``, three folders beside this package, and imports them
as ``fedpers.strategies``, ``fedpers.clients`` and ``fedpers.simulations``: fedpers
claims no other top-level name. A wheel installs the three folders under ``fedpers/``
(``[tool.setuptools.package-dir]`` of pyproject.toml). In a checkout, in a Flower app
bundle (FAB) and in the Docker images they are siblings of this package, and the finder
below maps exactly those three names there; nothing else beside the package becomes
importable through it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

SUBPACKAGES = ("strategies", "clients", "simulations")


class _SiblingFinder(importlib.abc.MetaPathFinder):
    """Finds ``fedpers.<name>`` for the names of ``SUBPACKAGES`` in ``root/<name>/``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != __name__ or name not in SUBPACKAGES:
            return None
        folder = self.root / name
        init = folder / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[str(folder)]
        )


def _install_finder() -> None:
    here = Path(__file__).resolve().parent
    if all((here / name).is_dir() for name in SUBPACKAGES):
        return  # installed from a wheel: the subpackages are real folders of fedpers
    if not any(isinstance(f, _SiblingFinder) and f.root == here.parent for f in sys.meta_path):
        sys.meta_path.append(_SiblingFinder(here.parent))


_install_finder()
