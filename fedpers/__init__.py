"""fedpers: personalized federated learning on Flower.

The project keeps its server code in ``strategies/``, its device code in ``clients/`` and
its experiments in ``simulations/``, three folders beside this package, and imports them
as ``fedpers.strategies``, ``fedpers.clients`` and ``fedpers.simulations``: fedpers
claims no other top-level name. A wheel installs the three folders under ``fedpers/``
(``[tool.setuptools.package-dir]`` of pyproject.toml). In a checkout, in a Flower app
bundle (FAB) and in the Docker images they are siblings of this package, and the finder
below maps exactly those three names there, ahead of any other finder; nothing else
beside the package becomes importable through it.
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
    """Finds ``fedpers.<name>`` for the names of ``SUBPACKAGES`` beside the ``fedpers``
    package being imported from (``path``, its ``__path__``), so that a process that
    meets two copies (a checkout and a FAB) never mixes them."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != __name__ or name not in SUBPACKAGES or not path:
            return None
        folder = Path(path[0]).parent / name
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
    if not any(type(f).__name__ == _SiblingFinder.__name__ for f in sys.meta_path):
        # First, so that the three names resolve beside the fedpers that is imported (a
        # FAB's), not through an editable install's finder that points elsewhere.
        sys.meta_path.insert(0, _SiblingFinder())


_install_finder()
